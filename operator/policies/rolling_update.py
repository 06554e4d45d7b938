"""spec.updateStrategy: a pod-template change reaches a running job a little at a time, so training never
stops for it. Islands: at most `maxUnavailable` re-form on the new template at once, and an island counts as
rolling until it has come back, every pod ready, and a shard reports it live again; only then does the next
begin. Syncer shards (their own template: image, resources, the knobs they act on) roll one at a time, each
after the previous one serves again; each resumes from its checkpoint (Recreate, the same volume)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from diloco.api.conditions import Reason
from diloco.api.job import IslandStatus
from diloco.operator.drift import contains
from diloco.operator.events import Event


def rolling(island: IslandStatus) -> bool:
    """The island is re-forming for a new template, or back on it but not yet synced again."""
    return (island.reform is not None and island.reform.reason == "Update") or island.rolled_at is not None


def rejoined(island: IslandStatus) -> bool:
    """Back on the new template with every pod ready, and reported live by a shard since it came back."""
    return (
        island.rolled_at is not None
        and island.desired > 0
        and island.ready >= island.desired
        and island.last_sync is not None
        and island.last_sync > island.rolled_at
    )


def islands_free_to_update(
    previous: Sequence[IslandStatus], outdated: Iterable[str], max_unavailable: int
) -> frozenset[str]:
    """Which of the `outdated` islands (pods on an old template, in spec order) may begin re-forming now:
    as many as `max_unavailable` leaves room for beside those still rolling from the last passes."""
    busy = {i.name for i in previous if rolling(i)}
    room = max(0, max_unavailable - len(busy))
    waiting = [name for name in outdated if name not in busy]
    return frozenset(waiting[:room])


def finish_rolls(islands: Sequence[IslandStatus]) -> tuple[list[IslandStatus], list[Event]]:
    """The islands with those that `rejoined` out of the roll (the next may begin on the next pass), and
    an Event for each."""
    done = {i.name for i in islands if rejoined(i)}
    events = [
        Event("Normal", Reason.ISLAND_UPDATED, f"island {name}: ready and synced again on the new pod template")
        for name in sorted(done)
    ]
    return [i.model_copy(update={"rolled_at": None}) if i.name in done else i for i in islands], events


def _template_applied(live: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    return contains(live.get("spec", {}).get("template"), desired["spec"]["template"])


def _available(live: Mapping[str, Any]) -> bool:
    """The Deployment's controller has acted on its latest spec and every replica is updated and ready."""
    spec, status = live.get("spec") or {}, live.get("status") or {}
    replicas = spec.get("replicas", 1)
    return (
        status.get("observedGeneration", 0) >= live["metadata"].get("generation", 0)
        and status.get("updatedReplicas", 0) >= replicas
        and status.get("readyReplicas", 0) >= replicas
        and status.get("replicas", 0) <= replicas
    )


def shards_held_back(desired: Sequence[Mapping[str, Any]], live: Mapping[str, Mapping[str, Any]]) -> frozenset[str]:
    """Names of the shard Deployments in `desired` (in shard order) whose new pod template must wait: one
    shard rolls at a time. A shard is rolling while its live template is the new one but it does not serve
    yet; while one is, every other whose template changed waits; else the first of them goes. A new shard,
    or one being scaled to zero, never waits."""
    changed: list[str] = []
    busy = False
    for obj in desired:
        name = obj["metadata"]["name"]
        current = live.get(name)
        if current is None or obj["spec"]["replicas"] == 0:
            continue
        if not _template_applied(current, obj):
            changed.append(name)
        elif not _available(current):
            busy = True
    return frozenset(changed if busy else changed[1:])
