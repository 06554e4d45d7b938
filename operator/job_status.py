"""The job's status and the decisions that follow from it, computed from the previous status and one
observation of the cluster: phase, conditions, per-island accounting, progress per fragment, goodput, the
stop condition, the restart budget, suspension and the TTL. No I/O and no clock: `now` is an argument.

A finished job (Succeeded or Failed) stays finished: its islands and shards are wound down to zero and
nothing is ever scaled up again; the volumes keep the syncers' final checkpoints until the job is deleted.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from diloco.api.conditions import ConditionType, Message, Reason
from diloco.api.job import (
    Condition,
    DiLoCoJobSpec,
    DiLoCoJobStatus,
    FragmentProgress,
    IslandStatus,
    Phase,
    StopCondition,
    SyncerStatus,
)
from diloco.operator.children import Scale
from diloco.operator.events import Event
from diloco.operator.island_accounting import IslandAccount, NodeState, PodObservation, account_island

MAX_DETAIL_PARTS = 8
"""Islands and shards named in a Degraded message at most: with hundreds of islands, the rest are counted."""
MAX_GOODPUT_GAP = datetime.timedelta(minutes=2)
"""A longer gap between two observations is the operator being away: it is counted neither way."""


@dataclass(frozen=True)
class FragmentReport:
    """One fragment as its shard's Status RPC reported it."""

    fragment: int
    version: int
    tokens: int
    last_merge_unix: float


@dataclass(frozen=True)
class ShardObservation:
    """One syncer shard: whether its Deployment has a ready pod, and its Status reply (None: unreachable)."""

    shard: int
    ready: bool
    fragments: tuple[FragmentReport, ...] | None = None
    live_islands: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Observation:
    """Everything one pass saw."""

    pods: Mapping[str, Sequence[PodObservation]] = field(default_factory=dict)
    nodes: Mapping[str, NodeState] = field(default_factory=dict)
    update_revisions: Mapping[str, str] = field(default_factory=dict)
    shards: Sequence[ShardObservation] = ()
    losses: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """The new status, the replicas to apply, the events to post, and whether the job is to be deleted."""

    status: DiLoCoJobStatus
    scale: Scale
    events: tuple[Event, ...]
    delete: bool


def stop_reached(stop: StopCondition, fragments: Sequence[FragmentProgress], num_fragments: int) -> str | None:
    """Why the job is done (a message), or None. Every fragment must have reached the bound: the slowest
    fragment is where the model is."""
    if len(fragments) < num_fragments:
        return None
    step, tokens = min(f.version for f in fragments), min(f.tokens for f in fragments)
    if stop.outer_steps is not None and step >= stop.outer_steps:
        return f"every fragment reached {step} outer steps (stopCondition.outerSteps {stop.outer_steps})"
    if stop.tokens is not None and tokens >= stop.tokens:
        return f"every fragment merged {tokens} tokens (stopCondition.tokens {stop.tokens})"
    return None


def exhausted_islands(islands: Sequence[IslandStatus], budget: int) -> list[str]:
    """Islands whose failures exceed the restart budget."""
    return [i.name for i in islands if i.restarts > budget]


def ttl_expires_at(status: DiLoCoJobStatus, ttl_seconds: int | None) -> datetime.datetime | None:
    """When a finished job is to be deleted, or None (not finished, or no TTL)."""
    if ttl_seconds is None or not status.phase.finished or status.completion_time is None:
        return None
    return status.completion_time + datetime.timedelta(seconds=ttl_seconds)


def set_condition(
    conditions: Sequence[Condition],
    kind: str,
    true: bool,
    reason: str,
    message: str,
    now: datetime.datetime,
    generation: int | None,
) -> list[Condition]:
    """`conditions` with `kind` set; its lastTransitionTime moves only when its status changes."""
    status = "True" if true else "False"
    old = next((c for c in conditions if c.type == kind), None)
    since = old.last_transition_time if old is not None and old.status == status else now
    new = Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )
    return [new if c.type == kind else c for c in conditions] if old else [*conditions, new]


def _merge_fragments(
    previous: Sequence[FragmentProgress], shards: Sequence[ShardObservation], num_shards: int
) -> list[FragmentProgress]:
    """Latest report per fragment; an unreachable shard's fragments keep their last known progress."""
    by_id = {f.fragment: f for f in previous}
    for shard in shards:
        for report in shard.fragments or ():
            by_id[report.fragment] = FragmentProgress(
                fragment=report.fragment,
                shard=report.fragment % num_shards,
                version=report.version,
                tokens=report.tokens,
                last_merge=(
                    datetime.datetime.fromtimestamp(report.last_merge_unix, datetime.UTC)
                    if report.last_merge_unix
                    else None
                ),
            )
    return [by_id[k] for k in sorted(by_id)]


def _goodput(previous: DiLoCoJobStatus, now: datetime.datetime) -> tuple[float, float]:
    """Pod-seconds accumulated over the interval since the last pass, at the counts seen then."""
    ready, desired = previous.ready_pod_seconds, previous.desired_pod_seconds
    if previous.last_observed is None or previous.phase not in (Phase.RUNNING, Phase.DEGRADED):
        return ready, desired
    gap = now - previous.last_observed
    if datetime.timedelta(0) < gap <= MAX_GOODPUT_GAP:
        seconds = gap.total_seconds()
        ready += seconds * sum(min(i.ready, i.desired) for i in previous.islands)
        desired += seconds * sum(i.desired for i in previous.islands)
    return ready, desired


def _degraded_detail(accounts: Sequence[IslandAccount], shards: Sequence[ShardObservation]) -> str:
    parts = [
        f"island {a.status.name}: {a.status.ready}/{a.status.desired} pods ready"
        + (f" (re-forming: {a.status.reform.reason})" if a.status.reform else "")
        for a in accounts
        if a.status.ready < a.status.desired or a.status.reform
    ]
    parts += [f"syncer shard {s.shard} not ready" for s in shards if not s.ready]
    if len(parts) > MAX_DETAIL_PARTS:
        parts = [*parts[:MAX_DETAIL_PARTS], f"and {len(parts) - MAX_DETAIL_PARTS} more"]
    return "; ".join(parts)


def decide(
    spec: DiLoCoJobSpec,
    generation: int | None,
    previous: DiLoCoJobStatus,
    observed: Observation,
    now: datetime.datetime,
) -> Decision:
    """One reconcile pass worth of decisions (see the module docstring)."""
    finished_before = previous.phase.finished
    active = not finished_before and not spec.suspend
    prev_islands = {i.name: i for i in previous.islands}
    accounts = [
        account_island(
            prev_islands.get(island.name),
            island,
            observed.pods.get(island.name, ()),
            observed.nodes,
            observed.update_revisions.get(island.name),
            active,
            spec.failure_policy.backoff_seconds,
            now,
        )
        for island in spec.islands
    ]
    events = [e for a in accounts for e in a.events]
    live = frozenset().union(*(s.live_islands for s in observed.shards))
    islands = [
        a.status.model_copy(
            update={
                "last_sync": now if a.status.name in live else a.status.last_sync,
                "loss": observed.losses.get(a.status.name, a.status.loss),
            }
        )
        for a in accounts
    ]
    fragments = _merge_fragments(previous.fragments, observed.shards, spec.syncer.shards)
    complete_view = len(fragments) >= spec.training.fragments
    outer_step = min((f.version for f in fragments), default=0) if complete_view else 0
    tokens = min((f.tokens for f in fragments), default=0) if complete_view else 0
    syncer = SyncerStatus(
        shards=spec.syncer.shards,
        ready=sum(1 for s in observed.shards if s.ready),
        reachable=sum(1 for s in observed.shards if s.fragments is not None),
    )
    whole = [a for a in accounts if a.status.desired and a.status.ready >= a.status.desired and not a.status.reform]
    syncers_ready = syncer.ready == spec.syncer.shards

    phase, completion, start = previous.phase, previous.completion_time, previous.start_time
    if not finished_before:
        exhausted = exhausted_islands(islands, spec.failure_policy.restart_budget)
        done = stop_reached(spec.stop_condition, fragments, spec.training.fragments)
        if exhausted:
            phase, completion = Phase.FAILED, now
            events.append(
                Event(
                    "Warning",
                    Reason.RESTART_BUDGET_EXHAUSTED,
                    f"islands {exhausted} exceeded failurePolicy.restartBudget "
                    f"{spec.failure_policy.restart_budget}: the job failed",
                )
            )
        elif done:
            phase, completion = Phase.SUCCEEDED, now
            events.append(Event("Normal", Reason.STOP_CONDITION_REACHED, done))
        elif spec.suspend:
            phase = Phase.SUSPENDED
        else:
            if start is None and syncers_ready and whole:
                start = now
            if syncers_ready and len(whole) == len(accounts):
                phase = Phase.RUNNING
            else:
                phase = Phase.DEGRADED if start is not None else Phase.PENDING
        if (
            phase is not previous.phase
            and phase in (Phase.RUNNING, Phase.DEGRADED)
            and previous.phase is not Phase.SUSPENDED
        ):
            events.append(
                Event(
                    "Normal",
                    Reason.RUNNING,
                    f"phase {previous.phase.value} -> Running: {Message.ALL_READY}",
                )
                if phase is Phase.RUNNING
                else Event(
                    "Warning",
                    Reason.DEGRADED,
                    f"phase {previous.phase.value} -> Degraded: {_degraded_detail(accounts, observed.shards)}",
                )
            )
        if phase is Phase.SUSPENDED and previous.phase is not Phase.SUSPENDED:
            events.append(Event("Normal", Reason.SUSPENDED, Message.SUSPENDED))
        if previous.phase is Phase.SUSPENDED and phase is not Phase.SUSPENDED:
            events.append(Event("Normal", Reason.RESUMED, Message.RESUMED))
    finished = phase.finished

    ready_seconds, desired_seconds = _goodput(previous, now)
    losses = [i.loss for i in islands if i.loss is not None]
    detail = _degraded_detail(accounts, observed.shards)
    conditions = list(previous.conditions)
    for kind, true, reason, message in (
        (
            ConditionType.READY,
            phase is Phase.RUNNING,
            phase.value,
            Message.ALL_READY if phase is Phase.RUNNING else detail or f"phase {phase.value}",
        ),
        (
            ConditionType.DEGRADED,
            phase is Phase.DEGRADED,
            Reason.PARTIALLY_READY if phase is Phase.DEGRADED else phase.value,
            detail if phase is Phase.DEGRADED else "",
        ),
        (
            ConditionType.SUSPENDED,
            phase is Phase.SUSPENDED,
            Reason.SUSPENDED if phase is Phase.SUSPENDED else Reason.NOT_SUSPENDED,
            "",
        ),
        (
            ConditionType.COMPLETE,
            phase is Phase.SUCCEEDED,
            Reason.STOP_CONDITION_REACHED if phase is Phase.SUCCEEDED else phase.value,
            "",
        ),
        (
            ConditionType.FAILED,
            phase is Phase.FAILED,
            Reason.RESTART_BUDGET_EXHAUSTED if phase is Phase.FAILED else phase.value,
            "",
        ),
    ):
        conditions = set_condition(conditions, kind, true, reason, message, now, generation)

    status = DiLoCoJobStatus(
        phase=phase,
        observed_generation=generation,
        conditions=conditions,
        islands_ready=f"{len(whole)}/{sum(1 for a in accounts if a.status.desired)}",
        islands=islands,
        syncer=syncer,
        fragments=fragments,
        outer_step=outer_step,
        tokens=tokens,
        loss=sum(losses) / len(losses) if losses else None,
        goodput=ready_seconds / desired_seconds if desired_seconds else previous.goodput,
        ready_pod_seconds=ready_seconds,
        desired_pod_seconds=desired_seconds,
        last_observed=now,
        start_time=start,
        completion_time=completion,
    )
    scale = Scale(
        islands={a.status.name: (0 if finished else a.replicas) for a in accounts},
        syncers=0 if finished else 1,
    )
    expires = ttl_expires_at(status, spec.ttl_seconds_after_finished)
    delete = expires is not None and now >= expires
    if delete:
        events.append(
            Event(
                "Normal",
                Reason.TTL_EXPIRED,
                f"deleting the job ttlSecondsAfterFinished={spec.ttl_seconds_after_finished}s after "
                f"it {phase.value.lower()}",
            )
        )
    return Decision(status=status, scale=scale, events=tuple(events), delete=delete)
