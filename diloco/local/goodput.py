"""What a run did, from its workers' progress events: goodput, tokens, restarts and loss curves.

Goodput is the share of allocated worker time spent on steps that ended in the final model:
- DiLoCo (decoupled or synchronous): a step's compute counts for each fragment whose later push, from the
  same process, was merged (a fraction 1/P per fragment): the process heard the merge, or a shard recorded
  the push in one, as a shard does for a push it took from a process killed before the merge. Steps lost
  with a killed process, or pushed but never merged, count nothing, and neither does time blocked waiting
  on a sync. (A push is rank 0's: another rank of the island counts its steps by the merges it heard and
  those of the pushes of the rank 0 beside it, `island_leaders`.)
- Data-parallel: a step counts when it is the last execution of that step number on its rank; executions
  rolled back to a checkpoint after a failure are wasted.
A slot (one worker position) is allocated from the job's start until its last process finishes, so startup,
downtime after a kill and waiting all count against goodput. `Losses` says where the rest of that time went.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from diloco.core.config import Mode
from diloco.progress import (
    EvalEvent,
    MergeEvent,
    ProgressEvent,
    PushEvent,
    RoundEvent,
    Source,
    StartEvent,
    StepEvent,
)


@dataclass(frozen=True)
class Losses:
    """Where the allocated slot-seconds that were not useful went, summed over the slots."""

    first_start: float  # from the job's start to each slot's first step (the whole run, for a silent slot)
    restarting: float  # from a process's last event to its successor's first step: down after a kill, then starting
    lost_steps: float  # compute of executed steps that did not count (not carried by a merged push; rolled back)
    blocked: float  # within steps, waiting on a sync
    other: float  # the rest: between steps (held-out evaluations among it), and after each slot's last step

    def shares(self, allocated_seconds: float) -> dict[str, float]:
        """Each as a share of the allocated slot-seconds (goodput's denominator)."""
        return {name: value / allocated_seconds if allocated_seconds else 0.0 for name, value in asdict(self).items()}


@dataclass(frozen=True)
class Account:
    mode: str
    slots: int
    allocated_seconds: float
    useful_seconds: float
    steps_executed: int
    tokens_trained: int
    process_starts: int
    losses: Losses  # where the allocated time that was not useful went
    eval_curve: list[tuple[int, float]] = field(default_factory=list)
    train_curve: list[tuple[int, float]] = field(default_factory=list)  # the training loss the workers reported
    tokens_per_second: float = 0.0  # all workers together, while stepping
    mfu: float | None = None  # mean over workers; None when a worker's accelerator peak is unknown

    @property
    def goodput(self) -> float:
        return self.useful_seconds / self.allocated_seconds if self.allocated_seconds else 0.0


def diloco_useful_seconds(events: Sequence[ProgressEvent], fragments: int) -> float:
    """Compute time of steps whose progress reached the global model, per the module's rule; `events` are
    the workers' and the shards' (their merges)."""
    merged_pushes = {(e.fragment, *push) for e in events if isinstance(e, MergeEvent) for push in e.pushes}
    steps: dict[int, list[StepEvent]] = defaultdict(list)
    merged_upto: dict[int, dict[int, int]] = defaultdict(dict)
    for e in events:
        if isinstance(e, StepEvent):
            steps[e.source.pid].append(e)
        elif (isinstance(e, RoundEvent) and e.merged) or (
            isinstance(e, PushEvent)
            and (e.fragment, e.source.island, e.incarnation, e.base_version, e.sequence) in merged_pushes
        ):
            latest = merged_upto[e.source.pid]
            latest[e.fragment] = max(latest.get(e.fragment, 0), e.began_at)
    useful = 0.0
    leaders = island_leaders(e for e in events if not isinstance(e, MergeEvent))
    for pid, records in steps.items():
        heard, leader = merged_upto[pid], merged_upto[leaders.get(pid, pid)]
        reached = sorted(max(heard.get(f, 0), leader.get(f, 0)) for f in heard.keys() | leader.keys())
        for step in records:
            share = sum(1 for upto in reached if upto >= step.step) / fragments
            useful += share * step.compute_seconds
    return useful


def island_leaders(events: Iterable[ProgressEvent]) -> dict[int, int]:
    """For each process of a rank other than 0, the rank-0 process of its island that lived alongside it
    longest: the one whose pushes carried its steps (the ranks of an island step in lockstep and re-form
    together), so a push merged after both were killed counts for both; `events` are the workers' own."""
    lives: dict[int, tuple[Source, float, float]] = {}
    for e in events:
        source, first, last = lives.get(e.source.pid, (e.source, e.t, e.t))
        lives[e.source.pid] = (source, min(first, e.t), max(last, e.t))
    leaders = [(source, first, last) for source, first, last in lives.values() if source.rank == 0]
    found = {}
    for pid, (source, first, last) in lives.items():
        if source.rank == 0:
            continue
        overlaps = [
            (min(last, end) - max(first, begin), leader.pid)
            for leader, begin, end in leaders
            if leader.island == source.island and min(last, end) >= max(first, begin)
        ]
        if overlaps:
            found[pid] = max(overlaps)[1]
    return found


def ddp_useful_seconds(events: Sequence[ProgressEvent]) -> float:
    """Compute time of the last execution of every step number on every rank (the surviving lineage)."""
    last: dict[tuple[tuple[str, int], int], StepEvent] = {}
    for e in events:
        if isinstance(e, StepEvent):
            key = (e.source.slot, e.step)
            if key not in last or e.t >= last[key].t:
                last[key] = e
    return sum(e.compute_seconds for e in last.values())


def starts(events: Iterable[ProgressEvent], started_at: float) -> tuple[float, float]:
    """Seconds from the job's start to each slot's first step, and from each process's last event to its
    successor's first step in the same slot (a process that never stepped starts nothing: its time runs on to
    the next one's first step), summed over the slots; `events` are the workers' own."""
    processes: dict[tuple[str, int], dict[int, list[ProgressEvent]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        processes[e.source.slot][e.source.pid].append(e)
    first = restarting = 0.0
    for by_pid in processes.values():
        ended, stepped = started_at, False
        for records in sorted(by_pid.values(), key=lambda r: min(e.t for e in r)):
            steps = [e for e in records if isinstance(e, StepEvent)]
            if steps:
                began = min(e.t - e.seconds for e in steps)
                if stepped:
                    restarting += began - ended
                else:
                    first += began - ended
                stepped = True
                ended = max(e.t for e in records)
        if not stepped:
            first += max(e.t for records in by_pid.values() for e in records) - started_at
    return first, restarting


def eval_curve(events: Iterable[ProgressEvent], tokens_per_eval_step: int) -> list[tuple[int, float]]:
    """Mean held-out loss over the islands that evaluated at each step, against the tokens trained by then
    across all islands (`tokens_per_eval_step` = tokens per step summed over every worker)."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for e in events:
        if isinstance(e, EvalEvent):
            by_step[e.step].append(e.loss)
    return [(step * tokens_per_eval_step, sum(v) / len(v)) for step, v in sorted(by_step.items())]


TRAIN_CURVE_POINTS = 20


def train_curve(events: Iterable[ProgressEvent], points: int = TRAIN_CURVE_POINTS) -> list[tuple[int, float]]:
    """The training loss the workers reported, as up to `points` points: the steps of every worker in the
    order they ended, cut into equal runs, each the tokens trained by its end and its steps' mean loss. For
    a loop of one's own this is the only loss the run sees; its first and last points say whether it fell."""
    steps = sorted((e for e in events if isinstance(e, StepEvent) and math.isfinite(e.loss)), key=lambda e: e.t)
    runs = min(points, len(steps))
    curve = []
    tokens = 0
    for run in range(runs):
        chosen = steps[run * len(steps) // runs : (run + 1) * len(steps) // runs]
        tokens += sum(e.tokens for e in chosen)
        curve.append((tokens, sum(e.loss for e in chosen) / len(chosen)))
    return curve


def throughput(events: Iterable[ProgressEvent]) -> tuple[float, float | None]:
    """Tokens per second of all workers together while they step (each slot's tokens over its steps' wall
    time, summed), and their mean model FLOPs utilisation from what each slot's last start reported."""
    tokens: dict[tuple[str, int], int] = defaultdict(int)
    seconds: dict[tuple[str, int], float] = defaultdict(float)
    starts: dict[tuple[str, int], StartEvent] = {}
    for e in events:
        if isinstance(e, StepEvent):
            tokens[e.source.slot] += e.tokens
            seconds[e.source.slot] += e.seconds
        elif isinstance(e, StartEvent):
            starts[e.source.slot] = e
    rates = {slot: tokens[slot] / seconds[slot] for slot in tokens if seconds[slot] > 0}
    utilisations = [
        rate * starts[slot].flops_per_token / peak
        for slot, rate in rates.items()
        if slot in starts and (peak := starts[slot].peak_flops)
    ]
    mfu = sum(utilisations) / len(utilisations) if rates and len(utilisations) == len(rates) else None
    return sum(rates.values()), mfu


def account(
    events: Sequence[ProgressEvent],
    *,
    mode: str,
    slots: int,
    fragments: int,
    started_at: float,
    tokens_per_eval_step: int,
) -> Account:
    """Everything the run summary and the goodput benchmark need, from the events alone (the workers', and
    the shards' merges, which take no worker slot)."""
    ends: dict[tuple[str, int], float] = {}
    pids = set()
    for e in events:
        if isinstance(e, MergeEvent):
            continue
        ends[e.source.slot] = max(ends.get(e.source.slot, started_at), e.t)
        pids.add(e.source.pid)
    job_end = max(ends.values(), default=started_at)
    silent_slots = max(0, slots - len(ends))  # never reported anything: allocated all along all the same
    allocated = sum(end - started_at for end in ends.values()) + silent_slots * (job_end - started_at)
    steps = [e for e in events if isinstance(e, StepEvent)]
    useful = ddp_useful_seconds(events) if mode == Mode.DDP else diloco_useful_seconds(events, fragments)
    tokens_per_second, mfu = throughput(events)
    first_start, restarting = starts((e for e in events if not isinstance(e, MergeEvent)), started_at)
    first_start += silent_slots * (job_end - started_at)
    blocked = sum(e.sync_seconds for e in steps)
    lost_steps = sum(e.compute_seconds for e in steps) - useful
    other = allocated - useful - first_start - restarting - lost_steps - blocked
    return Account(
        mode=mode,
        slots=slots,
        allocated_seconds=allocated,
        useful_seconds=useful,
        steps_executed=len(steps),
        tokens_trained=sum(e.tokens for e in steps),
        process_starts=len(pids),
        eval_curve=eval_curve(events, tokens_per_eval_step),
        train_curve=train_curve(events),
        tokens_per_second=tokens_per_second,
        mfu=mfu,
        losses=Losses(first_start, restarting, lost_steps, blocked, other),
    )
