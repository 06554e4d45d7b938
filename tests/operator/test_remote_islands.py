"""Islands of other clusters in a job's status: those its shards report live that its spec does not have,
kept with their last sync for a bounded time."""

from __future__ import annotations

import datetime

from diloco.api.job import MAX_ISLANDS, DiLoCoJobSpec, RemoteIsland
from diloco.operator.remote_islands import REMOTE_ISLAND_RETENTION, remote_islands

NOW = datetime.datetime(2026, 11, 24, tzinfo=datetime.UTC)
SPEC = DiLoCoJobSpec.model_validate({"image": "img", "islands": [{"name": "a"}, {"name": "b"}]})


def test_live_islands_not_in_the_spec_are_listed_synced_now():
    assert remote_islands(SPEC, [], ["a", "far-2", "far-1"], NOW) == [
        RemoteIsland(name="far-1", last_sync=NOW),
        RemoteIsland(name="far-2", last_sync=NOW),
    ]


def test_an_island_gone_quiet_keeps_its_last_sync_until_the_retention_has_passed():
    seen = [RemoteIsland(name="far-1", last_sync=NOW)]
    later = NOW + REMOTE_ISLAND_RETENTION
    assert remote_islands(SPEC, seen, [], later) == seen
    assert remote_islands(SPEC, seen, [], later + datetime.timedelta(seconds=1)) == []
    assert remote_islands(SPEC, seen, ["far-1"], later + datetime.timedelta(seconds=1)) == [
        RemoteIsland(name="far-1", last_sync=later + datetime.timedelta(seconds=1))
    ]


def test_an_island_added_to_the_spec_leaves_the_remote_list():
    assert remote_islands(SPEC, [RemoteIsland(name="a", last_sync=NOW)], ["a"], NOW) == []


def test_the_list_is_bounded_keeping_the_most_recently_seen():
    old = [RemoteIsland(name=f"old-{i}", last_sync=NOW - datetime.timedelta(minutes=1)) for i in range(MAX_ISLANDS)]
    kept = remote_islands(SPEC, old, ["new"], NOW)
    assert len(kept) == MAX_ISLANDS and RemoteIsland(name="new", last_sync=NOW) in kept
