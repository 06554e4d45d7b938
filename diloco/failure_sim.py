"""Discrete-event simulation of a training run under chip interruptions: goodput and uptime per policy.

The fleet's interruptions are one Poisson process (rate = chips / MTBI), generated with numpy in one go, or
a failure trace read from a file; either way each event names a chip and how long its replacement takes, so
the same trace can drive this simulator and a real run. Every policy replays the same events:

- `dp`: non-elastic data-parallel. Every chip stops until the replacement is in and the whole job has
  restarted (`reschedule_s + restart_s`), and rolls back to its last checkpoint.
- `elastic-dp`: the job re-forms without the failed replica (`reform_s`, everyone paused, the in-flight step
  lost), trains on with fewer chips, and re-forms again to take the replacement back.
- `sync-diloco` / `decoupled-diloco`: chips are split into M learners. A failure stops only its learner, for
  `reschedule_s + reform_s`, and the learner restarts from the latest global fragments, losing each
  fragment's progress since that fragment's last push. Merges follow the quorum rule of the syncer: once K
  pushes are pending (K capped by the live learners), wait up to the grace window for the other live
  learners, then merge. A learner that has pushed must see that push merged within `overlap_steps` (tau)
  inner steps or it waits. Synchronous DiLoCo is the same engine with K = M, never capped, and no grace.

Interruptions strike only hardware that is running: an event on a group that is already down (or on a
replica already out) is absorbed and counted. Goodput is the share of wall-clock chip time spent on steps
that end in the model; uptime is the share of chip time in groups that are up (training or waiting).
"""

from __future__ import annotations

import csv
import enum
import heapq
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

import numpy as np

SECONDS_PER_YEAR = 365.25 * 86400


class Policy(str, enum.Enum):
    """How a training run reacts to an interruption."""

    DP = "dp"
    ELASTIC_DP = "elastic-dp"
    SYNC_DILOCO = "sync-diloco"
    DECOUPLED_DILOCO = "decoupled-diloco"

    @property
    def label(self) -> str:
        """The name a reader of the report sees."""
        return _LABELS[self]


_LABELS = {
    Policy.DP: "data-parallel (non-elastic)",
    Policy.ELASTIC_DP: "elastic data-parallel",
    Policy.SYNC_DILOCO: "synchronous DiLoCo",
    Policy.DECOUPLED_DILOCO: "Decoupled DiLoCo",
}


@dataclass(frozen=True)
class FailureEvent:
    """One interruption: when, which chip, and how long until its replacement is ready."""

    time_s: float
    chip: int
    downtime_s: float


@dataclass(frozen=True)
class SimConfig:
    """A training job, its fleet's reliability, and the knobs of every policy (defaults: see docs/simulator.md)."""

    chips: int = 1_200_000
    learners: int = 8
    mtbi_years: float = 1.0
    horizon_hours: float = 72.0
    seeds: tuple[int, ...] = (0, 1, 2)
    policies: tuple[Policy, ...] = tuple(Policy)
    step_seconds: tuple[float, ...] = (1.0,)
    failure_chips: int = 256
    reschedule_s: float = 10.0
    restart_s: float = 55.0
    reform_s: float = 9.0
    checkpoint_steps: int = 1
    sync_steps: int = 16
    fragments: int = 4
    overlap_steps: int = 3
    quorum: int = 1
    grace_s: float = 2.0
    trace: tuple[FailureEvent, ...] | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.chips >= self.learners >= 1, "need chips >= learners >= 1"),
            (self.mtbi_years > 0 and self.horizon_hours > 0, "mtbi_years and horizon_hours must be positive"),
            (len(self.seeds) > 0 or self.trace is not None, "need at least one seed (or a trace)"),
            (len(self.policies) > 0, "need at least one policy"),
            (len(self.step_seconds) > 0 and min(self.step_seconds) > 0, "step_seconds must be positive"),
            (self.failure_chips >= 1 and self.checkpoint_steps >= 1, "failure_chips, checkpoint_steps >= 1"),
            (min(self.reschedule_s, self.restart_s, self.reform_s, self.grace_s) >= 0, "times must be >= 0"),
            (1 <= self.fragments <= self.sync_steps, "need 1 <= fragments <= sync_steps"),
            (0 <= self.overlap_steps <= self.sync_steps, "need 0 <= overlap_steps <= sync_steps"),
            (1 <= self.quorum <= self.learners, "need 1 <= quorum <= learners"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def horizon_s(self) -> float:
        return self.horizon_hours * 3600.0

    @property
    def fleet_rate(self) -> float:
        """Interruptions per second over the whole fleet while everything runs."""
        return self.chips / (self.mtbi_years * SECONDS_PER_YEAR)

    def learner_bounds(self) -> np.ndarray:
        """First chip of each learner, plus the chip count: learners differ in size by at most one chip."""
        return (np.arange(self.learners + 1, dtype=np.int64) * self.chips) // self.learners

    def learner_steps(self) -> list[float]:
        """Step time of each learner: the generations of `step_seconds` are dealt round-robin."""
        return [self.step_seconds[i % len(self.step_seconds)] for i in range(self.learners)]


@dataclass(frozen=True)
class RunResult:
    """One policy on one failure sequence."""

    goodput: float
    uptime: float
    failures: int
    absorbed: int
    seed: int | None = None
    merges: int = 0
    contributors_per_merge: float = 0.0


@dataclass(frozen=True)
class PolicyResult:
    """One policy over all seeds (or the one trace)."""

    policy: Policy
    runs: tuple[RunResult, ...]

    @property
    def goodput(self) -> float:
        return statistics.fmean(r.goodput for r in self.runs)

    @property
    def goodput_std(self) -> float:
        return statistics.stdev(r.goodput for r in self.runs) if len(self.runs) > 1 else 0.0

    @property
    def uptime(self) -> float:
        return statistics.fmean(r.uptime for r in self.runs)

    @property
    def uptime_std(self) -> float:
        return statistics.stdev(r.uptime for r in self.runs) if len(self.runs) > 1 else 0.0


@dataclass(frozen=True)
class SimResult:
    """Every requested policy for one configuration."""

    config: SimConfig
    policies: tuple[PolicyResult, ...]

    def __getitem__(self, policy: Policy | str) -> PolicyResult:
        wanted = Policy(policy)
        for result in self.policies:
            if result.policy is wanted:
                return result
        raise KeyError(wanted.value)


@dataclass(frozen=True)
class Failures:
    """Interruptions as parallel arrays sorted by time: what every policy engine consumes."""

    times: np.ndarray
    chips: np.ndarray
    downtimes: np.ndarray

    def __len__(self) -> int:
        return len(self.times)

    @classmethod
    def from_events(cls, events: Iterable[FailureEvent], horizon_s: float) -> Failures:
        """Sorts a trace by time (stably) and keeps what falls inside the horizon."""
        kept = sorted((e for e in events if 0 <= e.time_s < horizon_s), key=lambda e: e.time_s)
        return cls(
            np.array([e.time_s for e in kept], dtype=np.float64),
            np.array([e.chip for e in kept], dtype=np.int64),
            np.array([e.downtime_s for e in kept], dtype=np.float64),
        )

    def events(self) -> list[FailureEvent]:
        return [FailureEvent(float(t), int(c), float(d)) for t, c, d in zip(self.times, self.chips, self.downtimes)]


def sample_failures(config: SimConfig, seed: int) -> Failures:
    """The fleet's interruptions over the horizon: a Poisson count, uniform times, uniform chips."""
    rng = np.random.default_rng(seed)
    count = int(rng.poisson(config.fleet_rate * config.horizon_s))
    times = np.sort(rng.uniform(0.0, config.horizon_s, count))
    chips = rng.integers(0, config.chips, count, dtype=np.int64)
    return Failures(times, chips, np.full(count, config.reschedule_s))


def load_trace(path: str | Path, config: SimConfig) -> tuple[FailureEvent, ...]:
    """Reads a CSV trace with columns `time_s`, `chip` or `learner`, and optionally `downtime_s`.

    A `learner` row hits that learner's first chip; an empty or missing downtime means `reschedule_s`.
    """
    bounds = config.learner_bounds()
    events = []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        fields = set(reader.fieldnames or ())
        if "time_s" not in fields or not fields & {"chip", "learner"}:
            raise ValueError(f"{path}: a trace needs a time_s column and a chip or learner column")
        for line, row in enumerate(reader, start=2):
            try:
                if row.get("chip") not in (None, ""):
                    chip = int(row["chip"])
                else:
                    learner = int(row["learner"])
                    if not 0 <= learner < config.learners:
                        raise ValueError(f"learner {learner} outside 0..{config.learners - 1}")
                    chip = int(bounds[learner])
                downtime = row.get("downtime_s")
                event = FailureEvent(
                    float(row["time_s"]), chip, float(downtime) if downtime not in (None, "") else config.reschedule_s
                )
            except (TypeError, ValueError) as error:
                raise ValueError(f"{path}:{line}: {error}") from error
            if not 0 <= event.chip < config.chips or event.time_s < 0 or event.downtime_s < 0:
                raise ValueError(f"{path}:{line}: chip outside the fleet or negative time")
            events.append(event)
    return tuple(events)


def save_trace(path: str | Path, events: Iterable[FailureEvent]) -> None:
    """Writes events in the CSV form `load_trace` reads, so a sampled run can be replayed elsewhere."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["time_s", "chip", "downtime_s"])
        for e in events:
            writer.writerow([repr(e.time_s), e.chip, repr(e.downtime_s)])


def simulate(config: SimConfig) -> SimResult:
    """Runs every policy of `config` on the same failures: one sample per seed, or the trace once."""
    if config.trace is not None:
        samples: list[tuple[int | None, Failures]] = [(None, Failures.from_events(config.trace, config.horizon_s))]
    else:
        samples = [(seed, sample_failures(config, seed)) for seed in config.seeds]
    runs: dict[Policy, list[RunResult]] = {policy: [] for policy in config.policies}
    for seed, failures in samples:
        for policy in config.policies:
            result = run_policy(policy, config, failures)
            runs[policy].append(replace(result, seed=seed))
    return SimResult(config, tuple(PolicyResult(policy, tuple(runs[policy])) for policy in config.policies))


def run_policy(policy: Policy, config: SimConfig, failures: Failures) -> RunResult:
    """One policy on one failure sequence."""
    if policy is Policy.DP:
        return _run_dp(config, failures)
    if policy is Policy.ELASTIC_DP:
        return _run_elastic(config, failures)
    return _run_diloco(config, failures, synchronous=policy is Policy.SYNC_DILOCO)


def _work_per_step(config: SimConfig) -> tuple[float, list[float], list[int]]:
    """Lockstep step time (the slowest generation), then each learner's step time and chip count."""
    sizes = np.diff(config.learner_bounds()).tolist()
    steps = config.learner_steps()
    return max(steps), steps, sizes


def _run_dp(config: SimConfig, failures: Failures) -> RunResult:
    """Non-elastic data-parallel: one group of every chip; a failure stops all of it and rolls back."""
    horizon = config.horizon_s
    step, steps, sizes = _work_per_step(config)
    work = sum(c * s for c, s in zip(sizes, steps))
    every = config.checkpoint_steps
    kept_steps = 0
    up_time = 0.0
    up_since = 0.0
    struck = absorbed = 0
    for t, downtime in zip(failures.times.tolist(), failures.downtimes.tolist()):
        if t < up_since:
            absorbed += 1
            continue
        struck += 1
        done = math.floor((t - up_since) / step)
        kept_steps += every * (done // every)
        up_time += t - up_since
        up_since = t + downtime + config.restart_s
    if up_since < horizon:
        kept_steps += math.floor((horizon - up_since) / step)
        up_time += horizon - up_since
    return RunResult(
        goodput=kept_steps * work / (config.chips * horizon),
        uptime=up_time / horizon,
        failures=struck,
        absorbed=absorbed,
    )


def _run_elastic(config: SimConfig, failures: Failures) -> RunResult:
    """Elastic data-parallel: a failed replica leaves and later rejoins; each membership change pauses all."""
    horizon = config.horizon_s
    step, steps, sizes = _work_per_step(config)
    bounds = config.learner_bounds()
    size = config.failure_chips
    active_work = sum(c * s for c, s in zip(sizes, steps))
    active_chips = config.chips
    out: set[int] = set()
    rejoins: list[tuple[float, int]] = []
    running_since = 0.0
    useful = chip_up = 0.0
    struck = absorbed = 0

    def replica(r: int) -> tuple[int, float]:
        first = r * size
        chips = min(size, config.chips - first)
        learner = int(np.searchsorted(bounds, first, side="right")) - 1
        return chips, chips * steps[learner]

    def close(t: float) -> None:
        nonlocal useful, chip_up
        if t > running_since:
            useful += math.floor((t - running_since) / step) * active_work
            chip_up += (t - running_since) * active_chips

    def rejoin_until(t: float) -> None:
        nonlocal active_work, active_chips, running_since
        while rejoins and rejoins[0][0] <= t:
            when, r = heapq.heappop(rejoins)
            if when >= running_since:
                close(when)
                running_since = when + config.reform_s
            chips, work = replica(r)
            out.discard(r)
            active_chips += chips
            active_work += work

    for t, chip, downtime in zip(failures.times.tolist(), failures.chips.tolist(), failures.downtimes.tolist()):
        rejoin_until(t)
        r = chip // size
        if t < running_since or r in out:
            absorbed += 1
            continue
        struck += 1
        close(t)
        running_since = t + config.reform_s
        chips, work = replica(r)
        out.add(r)
        active_chips -= chips
        active_work -= work
        heapq.heappush(rejoins, (t + downtime, r))
    rejoin_until(horizon)
    close(horizon)
    return RunResult(
        goodput=useful / (config.chips * horizon),
        uptime=chip_up / (config.chips * horizon),
        failures=struck,
        absorbed=absorbed,
    )


_RUN, _BLOCKED, _DOWN = 0, 1, 2
_PUSH, _TAU, _RECOVER, _MERGE = 0, 1, 2, 3


def _run_diloco(config: SimConfig, failures: Failures, synchronous: bool) -> RunResult:
    """M learners and a syncer: failures stop one learner; merges follow the quorum and grace rules."""
    horizon = config.horizon_s
    m = config.learners
    sizes = np.diff(config.learner_bounds()).tolist()
    step = config.learner_steps()
    h, tau, fragments = float(config.sync_steps), float(config.overlap_steps), config.fragments
    offsets = [p * h / fragments for p in range(fragments)]
    quorum = m if synchronous else config.quorum
    grace = 0.0 if synchronous else config.grace_s
    learner_of = (np.searchsorted(config.learner_bounds(), failures.chips, side="right") - 1).tolist()

    status = [_RUN] * m
    phase = [0.0] * m  # inner steps since the learner's last round push (or restart)
    since_restart = [0.0] * m
    last = [0.0] * m  # time `phase` was last brought up to date
    up_since = [0.0] * m
    epoch = [0] * m  # invalidates a learner's scheduled events when its state changes
    awaiting = [False] * m  # pushed, and that push not merged yet
    steps_run = [0.0] * m
    steps_lost = [0.0] * m
    up_time = [0.0] * m
    pending: set[int] = set()
    down = 0
    timer_at: float | None = None
    timer_epoch = 0
    merges = contributors = 0
    struck = absorbed = 0
    heap: list[tuple[float, int, int, int]] = []

    def advance(i: int, t: float) -> None:
        if status[i] == _RUN:
            done = (t - last[i]) / step[i]
            phase[i] += done
            since_restart[i] += done
            steps_run[i] += done
        last[i] = t

    def schedule(i: int, t: float) -> None:
        """The learner's next own event: the τ check on its unmerged push, or its next round push."""
        if awaiting[i]:
            deadline = t + (tau - phase[i]) * step[i]
            if timer_at is None or timer_at > deadline:
                if phase[i] >= tau:
                    status[i] = _BLOCKED
                    epoch[i] += 1
                else:
                    heapq.heappush(heap, (deadline, _TAU, i, epoch[i]))
                return
        heapq.heappush(heap, (t + (h - phase[i]) * step[i], _PUSH, i, epoch[i]))

    def merge(t: float) -> None:
        nonlocal timer_at, timer_epoch, merges, contributors
        merges += 1
        contributors += len(pending)
        for j in pending:
            awaiting[j] = False
            if status[j] == _BLOCKED:
                status[j] = _RUN
                last[j] = t
                epoch[j] += 1
                schedule(j, t)
        pending.clear()
        timer_at = None
        timer_epoch += 1

    def maybe_merge(t: float) -> None:
        nonlocal timer_at
        if not pending:
            return
        alive = m - down
        needed = quorum if synchronous else max(1, min(quorum, alive))
        if len(pending) < needed:
            return
        if grace <= 0 or sum(1 for j in pending if status[j] != _DOWN) == alive:
            merge(t)
        elif timer_at is None:
            timer_at = t + grace
            heapq.heappush(heap, (timer_at, _MERGE, -1, timer_epoch))

    def rollback(i: int) -> float:
        """Progress lost by restarting from the global fragments: each fragment's steps since its own push."""
        a, cap = phase[i], since_restart[i]
        return sum(min((a - o) % h, cap) for o in offsets) / fragments

    for i in range(m):
        heapq.heappush(heap, (h * step[i], _PUSH, i, 0))
    times, downtimes = failures.times.tolist(), failures.downtimes.tolist()
    next_failure, total = 0, len(times)
    while True:
        t_event = heap[0][0] if heap else math.inf
        t_failure = times[next_failure] if next_failure < total else math.inf
        if min(t_event, t_failure) >= horizon:
            break
        if t_failure <= t_event:
            t, i = t_failure, learner_of[next_failure]
            downtime = downtimes[next_failure]
            next_failure += 1
            if status[i] == _DOWN:
                absorbed += 1
                continue
            struck += 1
            advance(i, t)
            steps_lost[i] += rollback(i)
            up_time[i] += t - up_since[i]
            status[i] = _DOWN
            awaiting[i] = False
            epoch[i] += 1
            down += 1
            heapq.heappush(heap, (t + downtime + config.reform_s, _RECOVER, i, epoch[i]))
            maybe_merge(t)
            continue
        t, kind, i, tag = heapq.heappop(heap)
        if kind == _MERGE:
            if tag == timer_epoch:
                merge(t)
            continue
        if tag != epoch[i]:
            continue
        if kind == _RECOVER:
            status[i] = _RUN
            down -= 1
            phase[i] = since_restart[i] = 0.0
            last[i] = up_since[i] = t
            epoch[i] += 1
            schedule(i, t)
        elif kind == _PUSH:
            advance(i, t)
            phase[i] = 0.0
            pending.add(i)
            awaiting[i] = True
            maybe_merge(t)
            schedule(i, t)
        else:  # _TAU: its push is still unmerged after tau steps, so it waits for the merge
            advance(i, t)
            if awaiting[i]:
                status[i] = _BLOCKED
                epoch[i] += 1
            else:
                schedule(i, t)

    for i in range(m):
        advance(i, horizon)
        if status[i] != _DOWN:
            up_time[i] += horizon - up_since[i]
    total_chip_time = config.chips * horizon
    useful = sum(c * s * (run - lost) for c, s, run, lost in zip(sizes, step, steps_run, steps_lost))
    return RunResult(
        goodput=useful / total_chip_time,
        uptime=sum(c * u for c, u in zip(sizes, up_time)) / total_chip_time,
        failures=struck,
        absorbed=absorbed,
        merges=merges,
        contributors_per_merge=contributors / merges if merges else 0.0,
    )
