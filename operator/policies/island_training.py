"""Whether an island trains, and when it does not, why: `Ready` means the islands are training, not only that
their pods are up. An island's pods can all be Ready (each rank joined the shards and steps) while its training
reaches nobody, so beside its pods this looks at what its rank-0 trainer serves on its metrics port
(`diloco.worker.metrics`: when a sync last brought global values back, when a shard last refused its token, its
seconds per inner step and inner steps per round) and at what the shards report.

An island does not train, in this order of telling:
- Unschedulable: a pod of it that the scheduler cannot place (the scheduler's message says why);
- PushesRefused: a shard refused its token after its last sync (a token it holds that the shards no longer
  accept), whether its pods are Ready or not;
- with every pod Ready, SyncerStateLost: a shard lost its state and no merge came back to the island since;
- with every pod Ready, NotSyncing: no merge came back within `sync_bound` of its last sync (as its trainer
  says; as the shards last reported it live when its trainer does not answer) or of its pods all becoming
  Ready: SYNC_BOUND_ROUNDS rounds of its inner steps at its step time (a merge held for late islands closes
  within one), plus the longest adaptive window, and never less
  than MIN_SYNC_BOUND.
An island short of Ready pods is not whole, which the job's conditions say on their own ("k/n pods ready").
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

from diloco.api.conditions import Reason
from diloco.api.job import IslandStatus
from diloco.core.config import TrainingConfig
from diloco.core.grace import adaptive_max
from diloco.operator.island_accounting import PodObservation
from diloco.operator.policies.phase import is_whole

SYNC_BOUND_ROUNDS = 3
"""Rounds an island may go without a merge coming back: one is the schedule, the others its slack (a merge that
waits for a quorum, a shard restarting from its checkpoint, retries)."""
MIN_SYNC_BOUND = datetime.timedelta(minutes=2)
"""The bound on a job of short rounds, and while an island's step time is not known yet."""


@dataclass(frozen=True)
class TrainerReport:
    """What an island's rank-0 trainer serves on its metrics port; None where it serves nothing of it."""

    loss: float | None = None
    last_sync_unix: float = 0.0
    """When a sync last brought global values back (0: none since the process started)."""
    last_refusal_unix: float = 0.0
    """When a shard last refused the island's token (0: never)."""
    step_seconds: float | None = None
    round_steps: int | None = None


@dataclass(frozen=True)
class NotTraining:
    """Why an island does not train: one of `ISLAND_REASONS`, and in words."""

    reason: str
    message: str


def sync_bound(config: TrainingConfig, report: TrainerReport | None) -> datetime.timedelta:
    """How long a ready island may go without a merge coming back (see the module docstring)."""
    if report is None or not report.step_seconds:
        return MIN_SYNC_BOUND
    steps = report.round_steps or config.inner_steps
    seconds = SYNC_BOUND_ROUNDS * steps * report.step_seconds + adaptive_max(config.grace_seconds)
    return max(MIN_SYNC_BOUND, datetime.timedelta(seconds=seconds))


def _unix(at: float) -> datetime.datetime | None:
    return datetime.datetime.fromtimestamp(at, datetime.UTC) if at > 0 else None


def _time(at: datetime.datetime) -> str:
    return at.strftime("%H:%M:%SZ")


def not_training(
    island: IslandStatus,
    pods: Sequence[PodObservation],
    report: TrainerReport | None,
    config: TrainingConfig,
    state_lost_at: datetime.datetime | None,
    now: datetime.datetime,
) -> NotTraining | None:
    """Why `island` (its status this pass, its pods, its rank-0 trainer's report) does not train; None when it
    trains, or when being short of Ready pods says it all."""
    placing = next((p for p in sorted(pods, key=lambda p: p.ordinal) if p.unschedulable), None)
    if placing is not None:
        return NotTraining(Reason.UNSCHEDULABLE, f"pod {placing.name}: {placing.unschedulable}")
    refused, synced = (_unix(report.last_refusal_unix), _unix(report.last_sync_unix)) if report else (None, None)
    if refused is not None and (synced is None or refused > synced):
        return NotTraining(
            Reason.PUSHES_REFUSED,
            f"the syncer shards refuse its token (UNAUTHENTICATED, last at {_time(refused)})",
        )
    if not is_whole(island) or not pods:
        return None
    if report is None:  # its trainer does not answer: the shards' last report of it stands in
        synced = island.last_sync
    if state_lost_at is not None and (synced is None or synced < state_lost_at):
        return NotTraining(Reason.SYNCER_STATE_LOST, f"no merge since a shard lost its state at {_time(state_lost_at)}")
    whole_since = max((p.ready_since for p in pods if p.ready_since is not None), default=None)
    since = max(t for t in (synced, whole_since) if t is not None) if synced or whole_since else None
    bound = sync_bound(config, report)
    if since is not None and now - since > bound:
        return NotTraining(
            Reason.NOT_SYNCING,
            f"no merge for {(now - since).total_seconds():.0f}s (bound {bound.total_seconds():.0f}s)",
        )
    return None
