"""The islands of other clusters in a job's status, decided without I/O: a job whose shards serve islands
it does not run (another cluster's job names them in spec.remoteSyncers) lists each island its shards
report live that is not in its own spec, with the last time a shard did, in `status.remoteIslands`.

An island is known by the name it joins the shards with (its island name there), so the jobs sharing shards
give their islands distinct names. One no shard has reported for REMOTE_ISLAND_RETENTION leaves the list:
islands come and go with their clusters, and the status keeps a bounded record of them.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence

from diloco.api.job import MAX_ISLANDS, DiLoCoJobSpec, RemoteIsland

REMOTE_ISLAND_RETENTION = datetime.timedelta(hours=1)


def remote_islands(
    spec: DiLoCoJobSpec, previous: Sequence[RemoteIsland], live: Iterable[str], now: datetime.datetime
) -> list[RemoteIsland]:
    """The previous record, with every live island not in the spec synced `now` and those not seen within
    REMOTE_ISLAND_RETENTION dropped; by name, at most MAX_ISLANDS (the most recently seen)."""
    own = {island.name for island in spec.islands}
    kept = {r.name: r for r in previous if r.name not in own and now - r.last_sync <= REMOTE_ISLAND_RETENTION}
    kept |= {name: RemoteIsland(name=name, last_sync=now) for name in live if name not in own}
    recent = sorted(kept.values(), key=lambda r: r.last_sync, reverse=True)[:MAX_ISLANDS]
    return sorted(recent, key=lambda r: r.name)
