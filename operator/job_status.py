"""The job's status and the decisions that follow from it, computed from the previous status and one
observation of the cluster: per-island accounting, progress per fragment and goodput here; the phase, the
conditions, the failure policy, the stop condition and the TTL each in its module of
`diloco.operator.policies`, which `decide` composes. No I/O and no clock: `now` is an argument.

A finished job (Succeeded or Failed) stays finished: its islands are wound down to zero, then, once no island
pod is left (each pushes its last steps on SIGTERM), its shards; nothing is ever scaled up again, and the
volumes keep the syncers' final checkpoints until the job is deleted.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diloco.api.job import (
    MAX_ISLAND_MESSAGE,
    DiLoCoJobSpec,
    DiLoCoJobStatus,
    FragmentProgress,
    IslandStatus,
    Phase,
    ShardLineage,
    SyncerStatus,
    cut,
)
from diloco.operator.children import Scale
from diloco.operator.events import Event
from diloco.operator.island_accounting import IslandAccount, NodeState, PodObservation, account_island, outdated
from diloco.operator.policies.failure_policy import restart_budget_exhausted
from diloco.operator.policies.island_training import NotTraining, TrainerReport, not_training
from diloco.operator.policies.job_conditions import update_conditions
from diloco.operator.policies.model_export import export_due, export_status
from diloco.operator.policies.phase import next_phase, readiness
from diloco.operator.policies.rolling_update import finish_rolls, islands_free_to_update
from diloco.operator.policies.stop_condition import slowest_fragment, stop_reached
from diloco.operator.policies.syncer_state import follow, loss_event, loss_message, new_states, regressions
from diloco.operator.policies.ttl_after_finished import deletion_due
from diloco.operator.remote_islands import remote_islands

MAX_GOODPUT_GAP = datetime.timedelta(minutes=2)
"""A longer gap between two observations is the operator being away: it is counted neither way."""
GOODPUT_DIGITS, LOSS_DIGITS = 3, 4
"""Decimals status.goodput and status.loss keep: `kubectl get dilocojobs` prints them as the status holds
them, and more say nothing (the pod-seconds goodput comes from are kept whole)."""


@dataclass(frozen=True)
class FragmentReport:
    """One fragment as its shard's Status RPC reported it."""

    fragment: int
    version: int
    tokens: int
    last_merge_unix: float


REFUSING_CODES = ("UNAUTHENTICATED", "PERMISSION_DENIED")
"""Status codes of a shard that answers but refuses the job's token: it serves no island either."""


@dataclass(frozen=True)
class ShardObservation:
    """One syncer shard: whether its Deployment has a ready pod, and its Status reply (None: unreachable,
    with `error`, `CODE: details`, saying why when the call was made)."""

    shard: int
    ready: bool
    fragments: tuple[FragmentReport, ...] | None = None
    live_islands: frozenset[str] = frozenset()
    error: str | None = None
    accepts: frozenset[str] = frozenset()
    """Fingerprints of the tokens the shard accepts now, as its Status reply said (`tokens.fingerprint`)."""
    lineage: int = 0
    """The id of the shard's state, as its Status reply said (0: not known)."""

    @property
    def refuses(self) -> bool:
        return self.error is not None and self.error.split(":", 1)[0] in REFUSING_CODES

    @property
    def serving(self) -> bool:
        """Ready, and not refusing the job's token: the kubelet's probe alone cannot tell (it sends none)."""
        return self.ready and not self.refuses

    @property
    def problem(self) -> str | None:
        """Why the operator's Status call failed, for the conditions; None when it did not."""
        if self.error is None:
            return None
        return f"syncer shard {self.shard} {'refuses the operator' if self.refuses else 'unreachable'}: {self.error}"


@dataclass(frozen=True)
class Observation:
    """Everything one pass saw."""

    pods: Mapping[str, Sequence[PodObservation]] = field(default_factory=dict)
    nodes: Mapping[str, NodeState] = field(default_factory=dict)
    update_revisions: Mapping[str, str] = field(default_factory=dict)
    shards: Sequence[ShardObservation] = ()
    trainers: Mapping[str, TrainerReport] = field(default_factory=dict)
    """What each island's rank-0 trainer serves on its metrics port, by island (those that answered)."""
    workloads: Mapping[str, str] = field(default_factory=dict)
    """The UID of each island's StatefulSet, by island; an island missing has none."""
    shard_pods: int = 0
    """Syncer shard pods that exist, terminating ones included."""
    export_job: Mapping[str, Any] | None = None
    """The batch Job exporting the model (spec.export), as last seen; None while there is none."""
    endpoints: Sequence[str] = ()
    """Where each shard is reached from outside the cluster (`exposure.endpoints`)."""


@dataclass(frozen=True)
class Decision:
    """The new status, the replicas to apply, the events to post, and whether the job is to be deleted."""

    status: DiLoCoJobStatus
    scale: Scale
    events: tuple[Event, ...]
    delete: bool


def merge_fragments(
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


def accumulate_pod_seconds(previous: DiLoCoJobStatus, now: datetime.datetime) -> tuple[float, float]:
    """Ready and desired island pod-seconds, with the interval since the last pass added at the counts seen
    then (only while training: goodput is their ratio)."""
    ready, desired = previous.ready_pod_seconds, previous.desired_pod_seconds
    if previous.last_observed is None or previous.phase not in (Phase.RUNNING, Phase.DEGRADED):
        return ready, desired
    gap = now - previous.last_observed
    if datetime.timedelta(0) < gap <= MAX_GOODPUT_GAP:
        seconds = gap.total_seconds()
        ready += seconds * sum(min(i.ready, i.desired) for i in previous.islands)
        desired += seconds * sum(i.desired for i in previous.islands)
    return ready, desired


def mean_loss(islands: Sequence[IslandStatus]) -> float | None:
    """The mean of the islands' last reported training losses, to LOSS_DIGITS decimals; None before any island
    reported one."""
    losses = [i.loss for i in islands if i.loss is not None]
    return round(sum(losses) / len(losses), LOSS_DIGITS) if losses else None


def _account_islands(
    spec: DiLoCoJobSpec, previous: DiLoCoJobStatus, observed: Observation, now: datetime.datetime
) -> list[IslandAccount]:
    """Each spec island's pods folded into its status; a suspended or finished job winds its islands down."""
    active = not previous.phase.finished and not spec.suspend
    before = {i.name: i for i in previous.islands}
    free = islands_free_to_update(
        previous.islands,
        [
            island.name
            for island in spec.islands
            if outdated(observed.pods.get(island.name, ()), observed.update_revisions.get(island.name))
        ],
        spec.update_strategy.max_unavailable,
    )
    return [
        account_island(
            before.get(island.name),
            island,
            observed.pods.get(island.name, ()),
            observed.nodes,
            observed.update_revisions.get(island.name),
            active,
            spec.failure_policy.backoff_seconds,
            now,
            observed.workloads.get(island.name),
            may_update=island.name in free,
        )
        for island in spec.islands
    ]


def _with_syncs_and_losses(
    islands: Sequence[IslandStatus], observed: Observation, now: datetime.datetime
) -> list[IslandStatus]:
    """The islands with their last sync (now, for those a shard reports live) and last reported loss."""
    live = frozenset[str]().union(*(s.live_islands for s in observed.shards))
    losses = {name: report.loss for name, report in observed.trainers.items() if report.loss is not None}
    return [
        i.model_copy(update={"last_sync": now if i.name in live else i.last_sync, "loss": losses.get(i.name, i.loss)})
        for i in islands
    ]


def _judge_training(
    spec: DiLoCoJobSpec,
    islands: Sequence[IslandStatus],
    previous: Sequence[IslandStatus],
    observed: Observation,
    state_lost_at: datetime.datetime | None,
    now: datetime.datetime,
) -> tuple[list[IslandStatus], dict[str, NotTraining], list[Event]]:
    """Each island with why it does not train (`island_training`), that in full by island, and a Warning Event
    for each island that stops training or stops for another reason."""
    before = {i.name: i.reason for i in previous}
    judged: list[IslandStatus] = []
    why: dict[str, NotTraining] = {}
    events: list[Event] = []
    for island in islands:
        found = not_training(
            island,
            observed.pods.get(island.name, ()),
            observed.trainers.get(island.name),
            spec.training,
            state_lost_at,
            now,
        )
        if found is not None:
            why[island.name] = found
            if before.get(island.name) != found.reason:
                events.append(Event("Warning", found.reason, f"island {island.name}: {found.message}"))
        said = {"reason": found.reason, "message": cut(found.message, MAX_ISLAND_MESSAGE)} if found else {}
        judged.append(island.model_copy(update={"reason": None, "message": None, **said}))
    return judged, why, events


def _syncer_status(
    spec: DiLoCoJobSpec,
    observed: Observation,
    last_state_loss: datetime.datetime | None,
    lineages: Sequence[ShardLineage],
) -> SyncerStatus:
    return SyncerStatus(
        shards=spec.syncer.shards,
        ready=sum(1 for s in observed.shards if s.serving),
        reachable=sum(1 for s in observed.shards if s.fragments is not None),
        last_state_loss=last_state_loss,
        lineages=list(lineages),
        endpoints=list(observed.endpoints),
    )


def decide(
    spec: DiLoCoJobSpec,
    generation: int | None,
    previous: DiLoCoJobStatus,
    observed: Observation,
    now: datetime.datetime,
    *,
    job: str,
) -> Decision:
    """One reconcile pass worth of decisions (see the module docstring) for the job named `job`."""
    accounts = _account_islands(spec, previous, observed, now)
    islands, rolled = finish_rolls(_with_syncs_and_losses([a.status for a in accounts], observed, now))
    fragments = merge_fragments(previous.fragments, observed.shards, spec.syncer.shards)
    reported = {s.shard: f"{s.lineage:016x}" if s.lineage else None for s in observed.shards if s.fragments is not None}
    lost = regressions(previous.fragments, fragments, new_states(previous.syncer.lineages, reported))
    lineages = follow(previous.syncer.lineages, reported, lost, fragments)
    progress = slowest_fragment(fragments, spec.training.fragments, lineages)
    carried_steps = max((s.carried_outer_steps for s in lineages), default=0)
    carried_tokens = max((s.carried_tokens for s in lineages), default=0)
    last_state_loss = now if lost else previous.syncer.last_state_loss
    islands, why, stopped = _judge_training(spec, islands, previous.islands, observed, last_state_loss, now)
    syncer = _syncer_status(spec, observed, last_state_loss, lineages)
    ready = readiness(
        islands,
        [s.shard for s in observed.shards if not s.ready],
        syncer.ready == spec.syncer.shards,
        [p for s in observed.shards if (p := s.problem)],
        refused=any(s.refuses for s in observed.shards),
        not_training={name: found.message for name, found in why.items()},
    )
    change = next_phase(
        previous,
        ready,
        failure=restart_budget_exhausted(
            islands,
            spec.failure_policy.restart_budget,
            {a.status.name: a.failure for a in accounts if a.failure is not None},
        ),
        success=stop_reached(spec.stop_condition, progress),
        suspend=spec.suspend,
        now=now,
    )
    outer_step, tokens = progress or (carried_steps, carried_tokens)
    ready_seconds, desired_seconds = accumulate_pod_seconds(previous, now)
    status = DiLoCoJobStatus(
        phase=change.phase,
        observed_generation=generation,
        conditions=update_conditions(
            previous.conditions,
            change.phase,
            ready.detail,
            now,
            generation,
            ready.degraded_reason,
            ready.unanswered,
            change.outcome,
            loss_message(lost) if lost else None,
        ),
        islands_ready=ready.islands_ready,
        islands=islands,
        remote_islands=remote_islands(
            spec, previous.remote_islands, (name for s in observed.shards for name in s.live_islands), now
        ),
        syncer=syncer,
        fragments=fragments,
        outer_step=outer_step,
        tokens=tokens,
        carried_outer_steps=carried_steps,
        carried_tokens=carried_tokens,
        loss=mean_loss(islands),
        goodput=round(ready_seconds / desired_seconds, GOODPUT_DIGITS) if desired_seconds else previous.goodput,
        ready_pod_seconds=ready_seconds,
        desired_pod_seconds=desired_seconds,
        last_observed=now,
        start_time=change.start_time,
        completion_time=change.completion_time,
        export=export_status(spec, job, change.phase, observed.export_job, previous.export, now),
    )
    finished = change.phase.finished
    island_pods_left = any(observed.pods.get(island.name) for island in spec.islands)
    syncers = 0 if finished and not island_pods_left else 1
    scale = Scale(
        islands={a.status.name: (0 if finished else a.replicas) for a in accounts},
        syncers=syncers,
        export=export_due(
            spec,
            change.phase,
            shards_stopped=syncers == 0 and not observed.shard_pods,
            started=observed.export_job is not None,
        ),
    )
    deletion = deletion_due(status, spec.ttl_seconds_after_finished, now)
    events = (
        *(e for a in accounts for e in a.events),
        *rolled,
        *([loss_event(lost)] if lost else []),
        *stopped,
        *change.events,
        *([deletion] if deletion else []),
    )
    return Decision(status=status, scale=scale, events=events, delete=deletion is not None)
