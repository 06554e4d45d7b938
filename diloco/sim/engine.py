"""Discrete-event simulation of a training run under chip interruptions: goodput and uptime per policy.

The fleet's interruptions are one Poisson process (rate = chips / MTBI), generated with numpy in one go, or
a failure trace (`diloco.local.failure_trace`, the format `diloco run` replays too); either way each event strikes a
chip and says how long its replacement takes. Every policy replays the same events:

- `dp`: non-elastic data-parallel. Every chip stops until the replacement is in and the whole job has
  restarted (`reschedule_s + restart_s`), and rolls back to its last checkpoint.
- `elastic-dp`: the job re-forms without the failed replica (`reform_s`, everyone paused, the in-flight step
  lost), trains on with fewer chips, and re-forms again to take the replacement back.
- `sync-diloco` / `decoupled-diloco`: chips are split into M learners. A failure stops only its learner, for
  `reschedule_s + reform_s`, and the learner restarts from the latest global fragments, losing each
  fragment's progress since that fragment's last push. Merges follow the quorum rule of the syncer: once K
  pushes are pending (K capped by the live learners), wait up to the grace window for the other live
  learners, then merge. A learner that has pushed must see that push merged within `overlap_steps` (tau)
  inner steps (or within the round, with `MergeWait.ROUND`) or it waits. Synchronous DiLoCo is the same
  engine with K = M, never capped, and no grace.

Every group first spends `startup_s` starting (0 by default). Interruptions strike only hardware that is
running: an event on a group that is already down or restarting (or on a replica already out) is absorbed
and counted, unless `interrupt_recovery` is set, in which case it starts that group's recovery over, as a
supervisor that kills the replacement process too does (`diloco run`). Goodput is the share of wall-clock
chip time spent on steps that end in the model; uptime is the share of chip time in groups that are up
(training or waiting).
"""

from __future__ import annotations

import enum
import heapq
import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from diloco.core.config import Mode, TrainingConfig
from diloco.core.rules import QUORUM_WITHIN_ISLANDS
from diloco.local.failure_trace import FailureEvent, chip_target

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

    @classmethod
    def of(cls, mode: Mode | str) -> Policy:
        """The policy that models a training mode (`diloco run --mode`)."""
        return _POLICY_OF_MODE[Mode(mode)]


_LABELS = {
    Policy.DP: "data-parallel (non-elastic)",
    Policy.ELASTIC_DP: "elastic data-parallel",
    Policy.SYNC_DILOCO: "synchronous DiLoCo",
    Policy.DECOUPLED_DILOCO: "Decoupled DiLoCo",
}
_POLICY_OF_MODE = {Mode.DILOCO: Policy.DECOUPLED_DILOCO, Mode.SYNC_DILOCO: Policy.SYNC_DILOCO, Mode.DDP: Policy.DP}


SIM_TRAINING = TrainingConfig(inner_steps=16, fragments=4, overlap_steps=3)
"""The DiLoCo knobs the simulator defaults to: a job's defaults but for H = 16 and tau = 3, which were chosen to
match the published figures (docs/simulator.md). Change them with `SIM_TRAINING.updated(...)`."""


class MergeWait(str, enum.Enum):
    """How far a learner trains past a push that is not merged yet before it waits for that merge."""

    OVERLAP = "overlap"  # tau steps (training.overlap_steps): the published scenarios' learner
    ROUND = "round"  # a whole round, H steps: `diloco run`'s decoupled worker, which never waits on a reply


@dataclass(frozen=True)
class SimConfig:
    """A training job, its fleet's reliability, and the knobs of every policy (defaults: see docs/simulator.md).

    The DiLoCo knobs are the job's own `TrainingConfig` (H, P, tau, K, grace, island timeout); the rest are the
    fleet, its failures and their costs, and two modelling choices the training knobs do not make:
    `merge_wait`, and whether the syncer learns of a learner's failure at once (`instant_failure_detection`,
    as in the published scenarios) or, as the real syncer does, only once the learner has been silent for
    `training.island_timeout_seconds`.
    """

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
    training: TrainingConfig = SIM_TRAINING
    merge_wait: MergeWait = MergeWait.OVERLAP
    instant_failure_detection: bool = True
    startup_s: float = 0.0
    interrupt_recovery: bool = False
    sync_latency_s: float = 0.0
    trace: tuple[FailureEvent, ...] | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.chips >= self.learners >= 1, "need chips >= learners >= 1"),
            (self.mtbi_years > 0 and self.horizon_hours > 0, "mtbi_years and horizon_hours must be positive"),
            (len(self.seeds) > 0 or self.trace is not None, "need at least one seed (or a trace)"),
            (len(self.policies) > 0, "need at least one policy"),
            (len(self.step_seconds) > 0 and all(s > 0 for s in self.step_seconds), "step_seconds must be positive"),
            (self.failure_chips >= 1 and self.checkpoint_steps >= 1, "failure_chips, checkpoint_steps >= 1"),
            (
                all(
                    t >= 0
                    for t in (
                        self.reschedule_s,
                        self.restart_s,
                        self.reform_s,
                        self.startup_s,
                        self.sync_latency_s,
                    )
                ),
                "times must be >= 0",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        QUORUM_WITHIN_ISLANDS.check(quorum=self.training.quorum, islands=self.learners)
        for number, event in enumerate(self.trace or ()):
            try:
                chip_of(event, self)
            except ValueError as error:
                raise ValueError(f"trace event {number} ({event.target} at {event.at:g} s): {error}") from None

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
    def from_events(cls, events: Iterable[FailureEvent], config: SimConfig) -> Failures:
        """A trace's events inside the horizon, sorted by time (stably), each resolved to the chip it strikes."""
        kept = sorted((e for e in events if e.at < config.horizon_s), key=lambda e: e.at)
        return cls(
            np.array([e.at for e in kept], dtype=np.float64),
            np.array([chip_of(e, config) for e in kept], dtype=np.int64),
            np.array([e.downtime for e in kept], dtype=np.float64),
        )

    def events(self) -> list[FailureEvent]:
        """As a trace: one `chip:<n>` event per interruption."""
        return [
            FailureEvent(float(t), chip_target(int(c)), float(d))
            for t, c, d in zip(self.times, self.chips, self.downtimes)
        ]


_NUMBERED = re.compile(r".*?(\d+)")


def chip_of(event: FailureEvent, config: SimConfig) -> int:
    """The chip an event strikes. `chip:<n>` is that chip; `learner:<i>` is learner i's first chip, and so is
    `worker:<island>/<rank>` when the island's name ends in i (`island-2`, as `diloco run` names islands):
    the whole island is the learner that fails. Syncer failures are not modelled, so they are refused."""
    kind, index = event.kind, event.index
    if kind == "chip":
        if index >= config.chips:
            raise ValueError(f"chip {index} is outside the fleet of {config.chips}")
        return index
    if kind == "worker":
        numbered = _NUMBERED.fullmatch(event.island)
        if numbered is None:
            raise ValueError(f"island {event.island!r} has no number to map it to a learner (island-<i>)")
        index = int(numbered.group(1))
    elif kind != "learner":
        raise ValueError("the simulator does not model syncer failures; leave them out of its trace")
    if index >= config.learners:
        raise ValueError(f"learner {index} is outside 0..{config.learners - 1}")
    return int(config.learner_bounds()[index])


def sample_failures(config: SimConfig, seed: int) -> Failures:
    """The fleet's interruptions over the horizon: a Poisson count, uniform times, uniform chips."""
    rng = np.random.default_rng(seed)
    count = int(rng.poisson(config.fleet_rate * config.horizon_s))
    times = np.sort(rng.uniform(0.0, config.horizon_s, count))
    chips = rng.integers(0, config.chips, count, dtype=np.int64)
    return Failures(times, chips, np.full(count, config.reschedule_s))


def simulate(config: SimConfig) -> SimResult:
    """Runs every policy of `config` on the same failures: one sample per seed, or the trace once."""
    if config.trace is not None:
        samples: list[tuple[int | None, Failures]] = [(None, Failures.from_events(config.trace, config))]
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
    up_since = config.startup_s
    struck = absorbed = 0
    for t, downtime in zip(failures.times.tolist(), failures.downtimes.tolist()):
        if t < up_since:
            if config.interrupt_recovery:  # the restarting job is struck again: its recovery starts over
                struck += 1
                up_since = t + downtime + config.restart_s
            else:
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
    out: dict[int, float] = {}  # replicas out, and when each rejoins
    rejoins: list[tuple[float, int]] = []
    running_since = config.startup_s
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
            if out.get(r) != when:  # superseded: the replacement was struck too and rejoins later
                continue
            if when >= running_since:
                close(when)
                running_since = when + config.reform_s
            chips, work = replica(r)
            del out[r]
            active_chips += chips
            active_work += work

    for t, chip, downtime in zip(failures.times.tolist(), failures.chips.tolist(), failures.downtimes.tolist()):
        rejoin_until(t)
        r = chip // size
        if (t < running_since or r in out) and not config.interrupt_recovery:
            absorbed += 1
            continue
        struck += 1
        if r in out:  # its replacement is struck before it rejoined: it rejoins `downtime` from now
            out[r] = t + downtime
            heapq.heappush(rejoins, (t + downtime, r))
            continue
        close(t)
        running_since = max(running_since, t + config.reform_s)
        chips, work = replica(r)
        out[r] = t + downtime
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
_PUSH, _TAU, _RECOVER, _MERGE, _DELIVER, _EXPIRE = 0, 1, 2, 3, 4, 5


def _run_diloco(config: SimConfig, failures: Failures, synchronous: bool) -> RunResult:
    """M learners and a syncer: failures stop one learner; merges follow the quorum and grace rules."""
    horizon = config.horizon_s
    m = config.learners
    sizes = np.diff(config.learner_bounds()).tolist()
    step = config.learner_steps()
    training = config.training
    h, fragments = float(training.inner_steps), training.fragments
    tau = float(training.overlap_steps) if config.merge_wait is MergeWait.OVERLAP else h
    offsets = [p * h / fragments for p in range(fragments)]
    quorum = m if synchronous else training.quorum
    grace = 0.0 if synchronous else training.grace_seconds
    latency = config.sync_latency_s
    timeout = 0.0 if config.instant_failure_detection else training.island_timeout_seconds
    learner_of = (np.searchsorted(config.learner_bounds(), failures.chips, side="right") - 1).tolist()

    status = [_RUN] * m
    phase = [0.0] * m  # inner steps since the learner's last round push (or restart)
    since_restart = [0.0] * m
    last = [0.0] * m  # time `phase` was last brought up to date
    up_since = [0.0] * m
    epoch = [0] * m  # invalidates a learner's scheduled events when its state changes
    awaiting = [False] * m  # pushed, and that push not merged yet
    pushes = [0] * m  # round pushes so far: a delayed merge reply names the push it answers
    down_since = [-math.inf] * m  # when it went down: the syncer counts it live `timeout` seconds longer
    steps_run = [0.0] * m
    steps_lost = [0.0] * m
    up_time = [0.0] * m
    pending: set[int] = set()
    down = m  # learners down (all, until their start-up is over)
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
            if timer_at is None or timer_at + latency > deadline:
                if phase[i] >= tau:
                    status[i] = _BLOCKED
                    epoch[i] += 1
                else:
                    heapq.heappush(heap, (deadline, _TAU, i, epoch[i]))
                return
        heapq.heappush(heap, (t + (h - phase[i]) * step[i], _PUSH, i, epoch[i]))

    def deliver(j: int, t: float) -> None:
        """The merge that took learner j's push in reaches it; if it was waiting for that, it trains on."""
        awaiting[j] = False
        if status[j] == _BLOCKED:
            status[j] = _RUN
            last[j] = t
            epoch[j] += 1
            schedule(j, t)

    def merge(t: float) -> None:
        nonlocal timer_at, timer_epoch, merges, contributors
        merges += 1
        contributors += len(pending)
        for j in pending:
            if latency > 0:
                heapq.heappush(heap, (t + latency, _DELIVER, j, pushes[j]))
            else:
                deliver(j, t)
        pending.clear()
        timer_at = None
        timer_epoch += 1

    def maybe_merge(t: float) -> None:
        nonlocal timer_at
        if not pending:
            return
        # Live: what the syncer counts, which includes a learner down for less than `timeout`.
        live = [j for j in range(m) if status[j] != _DOWN or t < down_since[j] + timeout] if timeout > 0 else None
        alive = m - down if live is None else len(live)
        needed = quorum if synchronous else max(1, min(quorum, alive))
        if len(pending) < needed:
            return
        if grace <= 0 or (
            sum(1 for j in pending if status[j] != _DOWN) == alive if live is None else pending.issuperset(live)
        ):
            merge(t)
        elif timer_at is None:
            timer_at = t + grace
            heapq.heappush(heap, (timer_at, _MERGE, -1, timer_epoch))

    def rollback(i: int) -> float:
        """Progress lost by restarting from the global fragments: each fragment's steps since its own push."""
        a, cap = phase[i], since_restart[i]
        return sum(min((a - o) % h, cap) for o in offsets) / fragments

    for i in range(m):  # every learner starts the way it restarts: down until it is up
        status[i] = _DOWN
        heapq.heappush(heap, (config.startup_s, _RECOVER, i, epoch[i]))
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
                if config.interrupt_recovery:  # its replacement is struck: the recovery starts over
                    struck += 1
                    epoch[i] += 1
                    heapq.heappush(heap, (t + downtime + config.reform_s, _RECOVER, i, epoch[i]))
                else:
                    absorbed += 1
                continue
            struck += 1
            advance(i, t)
            steps_lost[i] += rollback(i)
            up_time[i] += t - up_since[i]
            status[i] = _DOWN
            awaiting[i] = False
            epoch[i] += 1
            down_since[i] = t
            down += 1
            heapq.heappush(heap, (t + downtime + config.reform_s, _RECOVER, i, epoch[i]))
            if timeout > 0:
                heapq.heappush(heap, (t + timeout, _EXPIRE, i, 0))
            maybe_merge(t)
            continue
        t, kind, i, tag = heapq.heappop(heap)
        if kind == _MERGE:
            if tag == timer_epoch:
                merge(t)
            continue
        if kind == _DELIVER:
            if awaiting[i] and pushes[i] == tag:
                deliver(i, t)
            continue
        if kind == _EXPIRE:  # the syncer stops counting a silent learner: a merge may be due now
            maybe_merge(t)
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
            pushes[i] += 1
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
