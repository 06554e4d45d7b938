"""The job's phase and the Events that announce its changes.

Failed (the restart budget) wins over Succeeded (the stop condition), which wins over Suspended; otherwise the
job is Running with every syncer shard ready and every island training (its pods ready and its syncs merged:
`island_training`), Degraded once it has trained and some are not, and Pending before. A finished job
(Succeeded or Failed) stays finished.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diloco.api.conditions import ISLAND_REASONS, ConditionType, Message, Reason
from diloco.api.job import DiLoCoJobStatus, IslandStatus, Phase
from diloco.operator.events import Event

MAX_DETAIL_PARTS = 8
"""Islands and shards named in a Degraded message at most: with hundreds of islands, the rest are counted."""


@dataclass(frozen=True)
class Readiness:
    """How much of the job is up on this pass, and in words what is not."""

    islands: int
    """Islands in the spec."""
    running_islands: int
    """Islands that should have pods now."""
    whole_islands: int
    """Islands with every pod they should have ready, not re-forming, and training."""
    syncers_ready: bool
    """Every syncer shard has a ready pod."""
    detail: str
    """The islands short of pods and the shards not ready or not answering, for the conditions' messages."""
    degraded_reason: str = Reason.PARTIALLY_READY
    """The Degraded condition's reason, and the Ready condition's while it does not hold: why an island does not
    train (`ISLAND_REASONS`), SyncerRefused when a shard refuses the operator's token, else PartiallyReady."""
    unanswered: str = ""
    """The shards whose Status call failed, with the error: said even while the job is Running."""

    @property
    def islands_ready(self) -> str:
        """`whole/running`, as the status shows it."""
        return f"{self.whole_islands}/{self.running_islands}"

    @property
    def can_train(self) -> bool:
        """Training can start: the syncers and at least one whole island are up."""
        return self.syncers_ready and self.whole_islands > 0

    @property
    def all_ready(self) -> bool:
        return self.syncers_ready and self.whole_islands == self.islands


def is_whole(island: IslandStatus) -> bool:
    """The island has every pod it should have ready, and is not re-forming."""
    return bool(island.desired) and island.ready >= island.desired and not island.reform


def trains(island: IslandStatus) -> bool:
    """The island is whole and trains: nothing keeps its training from the job (`island.reason`)."""
    return is_whole(island) and island.reason is None


def degraded_detail(
    islands: Sequence[IslandStatus],
    unready_shards: Sequence[int],
    shard_problems: Sequence[str] = (),
    not_training: Mapping[str, str] | None = None,
) -> str:
    """The islands that do not train (`not_training`: island -> why, in words) or are short of pods or
    re-forming, the shards not ready and those whose Status call failed (with its error), the first few named."""
    why = not_training or {}
    parts = [
        f"island {i.name}: "
        + (f"{i.reason}: {why.get(i.name) or i.message}; " if i.reason else "")
        + f"{i.ready}/{i.desired} pods ready"
        + (f" (re-forming: {i.reform.reason})" if i.reform else "")
        for i in islands
        if i.ready < i.desired or i.reform or i.reason
    ]
    parts += [f"syncer shard {shard} not ready" for shard in unready_shards]
    parts += shard_problems
    if len(parts) > MAX_DETAIL_PARTS:
        parts = [*parts[:MAX_DETAIL_PARTS], f"and {len(parts) - MAX_DETAIL_PARTS} more"]
    return "; ".join(parts)


def readiness(
    islands: Sequence[IslandStatus],
    unready_shards: Sequence[int],
    syncers_ready: bool,
    shard_problems: Sequence[str] = (),
    refused: bool = False,
    not_training: Mapping[str, str] | None = None,
) -> Readiness:
    """The job's readiness from its islands' statuses and its syncer shards; `refused`: a shard refuses the
    operator's token; `not_training`: why each island with a `reason` does not train, in full."""
    island_reasons = [i.reason for i in islands if i.reason]
    reason = Reason.SYNCER_REFUSED if refused else Reason.PARTIALLY_READY
    if island_reasons:
        reason = min(island_reasons, key=ISLAND_REASONS.index)
    return Readiness(
        islands=len(islands),
        running_islands=sum(1 for i in islands if i.desired),
        whole_islands=sum(1 for i in islands if trains(i)),
        syncers_ready=syncers_ready,
        detail=degraded_detail(islands, unready_shards, shard_problems, not_training),
        degraded_reason=reason,
        unanswered="; ".join(shard_problems[:MAX_DETAIL_PARTS]),
    )


@dataclass(frozen=True)
class PhaseChange:
    """The phase after this pass, the times it sets, the Events that announce the change, and for a finished
    job why it finished (the message of its Complete or Failed condition)."""

    phase: Phase
    start_time: datetime.datetime | None
    completion_time: datetime.datetime | None
    events: tuple[Event, ...] = ()
    outcome: str = ""


def training_phase(previous: DiLoCoJobStatus, ready: Readiness, now: datetime.datetime) -> PhaseChange:
    """Pending, Running or Degraded for a job that neither finishes nor is suspended; training starts the
    first time the syncers and a whole island are up."""
    start = previous.start_time
    if start is None and ready.can_train:
        start = now
    if ready.all_ready:
        phase = Phase.RUNNING
    else:
        phase = Phase.DEGRADED if start is not None else Phase.PENDING
    return PhaseChange(phase, start, previous.completion_time)


def transition_events(previous: Phase, phase: Phase, detail: str) -> tuple[Event, ...]:
    """The Events announcing a move from `previous` to `phase` of a job not finished before: reaching Running
    or Degraded (not when resuming, which says so itself), suspending and resuming."""
    events: list[Event] = []
    if phase is not previous and phase in (Phase.RUNNING, Phase.DEGRADED) and previous is not Phase.SUSPENDED:
        if phase is Phase.RUNNING:
            events.append(Event("Normal", Reason.RUNNING, f"phase {previous.value} -> Running: {Message.ALL_READY}"))
        else:
            events.append(Event("Warning", Reason.DEGRADED, f"phase {previous.value} -> Degraded: {detail}"))
    if phase is Phase.SUSPENDED and previous is not Phase.SUSPENDED:
        events.append(Event("Normal", Reason.SUSPENDED, Message.SUSPENDED))
    if previous is Phase.SUSPENDED and phase is not Phase.SUSPENDED:
        events.append(Event("Normal", Reason.RESUMED, Message.RESUMED))
    return tuple(events)


def next_phase(
    previous: DiLoCoJobStatus,
    ready: Readiness,
    *,
    failure: str | None,
    success: str | None,
    suspend: bool,
    now: datetime.datetime,
) -> PhaseChange:
    """The phase after this pass. `failure` is why the failure policy fails the job and `success` why the stop
    condition is reached (None: not so); both are ignored once the job has finished."""
    if previous.phase.finished:
        return PhaseChange(
            previous.phase, previous.start_time, previous.completion_time, outcome=finished_outcome(previous)
        )
    if failure:
        change = PhaseChange(
            Phase.FAILED,
            previous.start_time,
            now,
            (Event("Warning", Reason.RESTART_BUDGET_EXHAUSTED, failure),),
            outcome=failure,
        )
    elif success:
        change = PhaseChange(
            Phase.SUCCEEDED,
            previous.start_time,
            now,
            (Event("Normal", Reason.STOP_CONDITION_REACHED, success),),
            outcome=success,
        )
    elif suspend:
        change = PhaseChange(Phase.SUSPENDED, previous.start_time, previous.completion_time)
    else:
        change = training_phase(previous, ready, now)
    events = change.events + transition_events(previous.phase, change.phase, ready.detail)
    return PhaseChange(change.phase, change.start_time, change.completion_time, events, change.outcome)


def finished_outcome(previous: DiLoCoJobStatus) -> str:
    """Why a finished job finished, as its Complete or Failed condition said when it did: the words stay
    those of the pass that decided it."""
    kind = ConditionType.FAILED if previous.phase is Phase.FAILED else ConditionType.COMPLETE
    said = next((c.message for c in previous.conditions if c.type == kind and c.message), "")
    return said or f"the job {previous.phase.value.lower()}"
