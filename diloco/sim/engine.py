"""Discrete-event simulation of a training run under chip interruptions: goodput and uptime per policy.

The fleet's interruptions are one Poisson process (rate = chips / MTBI), generated with numpy in one go, or
a failure trace (`diloco.local.failure_trace`, the format `diloco run` replays too); either way each event strikes a
chip and says how long its replacement takes. Every policy replays the same events:

- `dp`: non-elastic data-parallel. Every chip stops until the replacement is in and the whole job has
  restarted (`reschedule_seconds + restart_seconds`), and rolls back to its last checkpoint.
- `elastic-dp`: the job re-forms without the failed replica (`reform_seconds`, everyone paused, the in-flight step
  lost), trains on with fewer chips, and re-forms again to take the replacement back.
- `sync-diloco` / `decoupled-diloco`: chips are split into M learners. A failure stops only its learner, for
  `reschedule_seconds + reform_seconds`, and the learner restarts from the latest global fragments, losing each
  fragment's progress since that fragment's last push. Merges follow the syncer shard's rules
  (`diloco.core.grace`): once K pushes are pending (K capped by the live learners), the merge waits for the
  other live learners until its window closes: before any pending learner's slack (tau inner steps less the
  sync latency) runs out, so that a merge of waiting costs no learner a wait. A learner that has
  pushed must see that push merged within `overlap_steps` (tau) inner steps (or within the round, with
  `MergeWait.ROUND`) or it waits. Synchronous DiLoCo is the same engine with K = M, never capped, and no
  grace. With `speedAware`, a decoupled learner of a slower generation runs fewer inner steps per round
  (`diloco.core.pace`), tau scaled alike.

Every group first spends `startup_seconds` starting (0 by default). Interruptions strike only hardware that is
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
from diloco.core.grace import adaptive_max, merge_closes, slack_max
from diloco.core.pace import paced_inner_steps
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
    islands: int = 8
    mtbi_years: float = 1.0
    horizon_hours: float = 72.0
    seeds: tuple[int, ...] = (0, 1, 2)
    policies: tuple[Policy, ...] = tuple(Policy)
    step_seconds: tuple[float, ...] = (1.0,)
    failure_chips: int = 256
    reschedule_seconds: float = 10.0
    restart_seconds: float = 55.0
    reform_seconds: float = 9.0
    checkpoint_steps: int = 1
    training: TrainingConfig = SIM_TRAINING
    merge_wait: MergeWait = MergeWait.OVERLAP
    instant_failure_detection: bool = True
    startup_seconds: float = 0.0
    interrupt_recovery: bool = False
    sync_latency_seconds: float = 0.0
    trace: tuple[FailureEvent, ...] | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.chips >= self.islands >= 1, "need chips >= islands >= 1"),
            (self.mtbi_years > 0 and self.horizon_hours > 0, "mtbi_years and horizon_hours must be positive"),
            (len(self.seeds) > 0 or self.trace is not None, "need at least one seed (or a trace)"),
            (len(self.policies) > 0, "need at least one policy"),
            (len(self.step_seconds) > 0 and all(s > 0 for s in self.step_seconds), "step_seconds must be positive"),
            (self.failure_chips >= 1 and self.checkpoint_steps >= 1, "failure_chips, checkpoint_steps >= 1"),
            (
                all(
                    t >= 0
                    for t in (
                        self.reschedule_seconds,
                        self.restart_seconds,
                        self.reform_seconds,
                        self.startup_seconds,
                        self.sync_latency_seconds,
                    )
                ),
                "times must be >= 0",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        QUORUM_WITHIN_ISLANDS.check(quorum=self.training.quorum, islands=self.islands)
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
        return (np.arange(self.islands + 1, dtype=np.int64) * self.chips) // self.islands

    def learner_steps(self) -> list[float]:
        """Step time of each learner: the generations of `step_seconds` are dealt round-robin."""
        return [self.step_seconds[i % len(self.step_seconds)] for i in range(self.islands)]


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
    if index >= config.islands:
        raise ValueError(f"learner {index} is outside 0..{config.islands - 1}")
    return int(config.learner_bounds()[index])


def sample_failures(config: SimConfig, seed: int) -> Failures:
    """The fleet's interruptions over the horizon: a Poisson count, uniform times, uniform chips."""
    rng = np.random.default_rng(seed)
    count = int(rng.poisson(config.fleet_rate * config.horizon_s))
    times = np.sort(rng.uniform(0.0, config.horizon_s, count))
    chips = rng.integers(0, config.chips, count, dtype=np.int64)
    return Failures(times, chips, np.full(count, config.reschedule_seconds))


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
    return _DilocoRun(config, failures, synchronous=policy is Policy.SYNC_DILOCO).run()


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
    up_since = config.startup_seconds
    struck = absorbed = 0
    for t, downtime in zip(failures.times.tolist(), failures.downtimes.tolist()):
        if t < up_since:
            if config.interrupt_recovery:  # the restarting job is struck again: its recovery starts over
                struck += 1
                up_since = t + downtime + config.restart_seconds
            else:
                absorbed += 1
            continue
        struck += 1
        done = math.floor((t - up_since) / step)
        kept_steps += every * (done // every)
        up_time += t - up_since
        up_since = t + downtime + config.restart_seconds
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
    running_since = config.startup_seconds
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
                running_since = when + config.reform_seconds
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
        running_since = max(running_since, t + config.reform_seconds)
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


class _Status(enum.Enum):
    """Where a DiLoCo learner is."""

    RUN = enum.auto()  # training
    BLOCKED = enum.auto()  # up, waiting for the merge of its push
    DOWN = enum.auto()  # failed, or not started yet: down until its RECOVER event


class _Event(enum.IntEnum):
    """What the DiLoCo engine schedules. The values order events that fall at the same time."""

    PUSH = 0  # a learner's next round push is due
    TAU = 1  # tau steps after a push: the learner waits if that push is still unmerged
    RECOVER = 2  # a learner is back up after a failure (or its start-up)
    MERGE = 3  # the grace window is over: merge what is pending
    DELIVER = 4  # a merge's result reaches a learner that pushed to it (after the sync latency)
    EXPIRE = 5  # the syncer stops counting a learner that went silent (the island timeout)


# The members under short names: on Python 3.11 reading a member off its enum class costs ~50 ns, which the
# event loop would pay millions of times per run (it made the engine 1.5x slower).
_RUN, _BLOCKED, _DOWN = _Status.RUN, _Status.BLOCKED, _Status.DOWN
_PUSH, _TAU, _RECOVER = _Event.PUSH, _Event.TAU, _Event.RECOVER
_MERGE, _DELIVER, _EXPIRE = _Event.MERGE, _Event.DELIVER, _Event.EXPIRE


@dataclass(slots=True)
class _Learner:
    """One DiLoCo learner's state, and what it has done so far."""

    step_s: float
    chips: int
    status: _Status = _DOWN  # every learner starts the way it restarts: down until it is up
    phase: float = 0.0  # inner steps since its last round push (or restart)
    since_restart: float = 0.0  # inner steps since it last came up
    last: float = 0.0  # time `phase` was last brought up to date
    up_since: float = 0.0
    epoch: int = 0  # invalidates its scheduled events when its state changes
    awaiting: bool = False  # pushed, and that push not merged yet
    pushes: int = 0  # round pushes so far: a delayed merge reply names the push it answers
    down_since: float = -math.inf  # when it went down: the syncer counts it live `timeout` seconds longer
    steps_run: float = 0.0
    steps_lost: float = 0.0
    up_time: float = 0.0
    base: int = 0  # the merge whose result it trains from: how stale its next push is
    last_push: float = 0.0  # when its last round push reached the syncer

    def advance(self, t: float) -> None:
        """Brings its progress up to time `t`: steps while it trains, nothing while it waits or is down."""
        if self.status is _RUN:
            done = (t - self.last) / self.step_s
            self.phase += done
            self.since_restart += done
            self.steps_run += done
        self.last = t

    def restarted(self, t: float) -> None:
        """Up again at `t`, from the latest global fragments."""
        self.status = _RUN
        self.phase = self.since_restart = 0.0
        self.last = self.up_since = t
        self.epoch += 1

    def block(self) -> None:
        """Waits for the merge of its push."""
        self.status = _BLOCKED
        self.epoch += 1

    def unblock(self, t: float) -> None:
        """Its push is merged: it trains on from `t`."""
        self.status = _RUN
        self.last = t
        self.epoch += 1


class _DilocoRun:
    """M learners and a syncer replaying one failure sequence: failures stop one learner; merges follow the
    quorum and grace rules. Each event of `_Event` has its method; `run` replays them in time order."""

    def __init__(self, config: SimConfig, failures: Failures, synchronous: bool) -> None:
        training = config.training
        self.config = config
        self.failures = failures
        self.synchronous = synchronous
        self.m = config.islands
        self.h, self.fragments = float(training.inner_steps), training.fragments
        self.tau = float(training.overlap_steps) if config.merge_wait is MergeWait.OVERLAP else self.h
        self.quorum = self.m if synchronous else training.quorum
        self.grace = 0.0 if synchronous else adaptive_max(training.grace_seconds)
        self.slack_max = 0.0 if synchronous else slack_max(training.grace_seconds, math.inf)
        self.latency = config.sync_latency_seconds
        self.timeout = 0.0 if config.instant_failure_detection else training.island_timeout_seconds
        sizes = np.diff(config.learner_bounds()).tolist()
        self.learners = [_Learner(step, chips) for step, chips in zip(config.learner_steps(), sizes)]
        fastest = min(config.learner_steps())
        paced = training.speed_aware and not synchronous
        self.round_steps = [
            float(paced_inner_steps(training.inner_steps, training.fragments, step, fastest) if paced else self.h)
            for step in config.learner_steps()
        ]
        self.learner_of = (np.searchsorted(config.learner_bounds(), failures.chips, side="right") - 1).tolist()
        self.pending: set[int] = set()  # learners whose push waits for the next merge
        self.down = self.m  # learners down (all, until their start-up is over)
        self.timer_at: float | None = None  # when the running grace window ends
        self.timer_epoch = 0  # invalidates a grace window's MERGE event once it has merged or moved
        self.quorum_since: float | None = None  # when the pending merge reached its quorum
        self.merges = self.contributors = 0
        self.struck = self.absorbed = 0
        self.heap: list[tuple[float, _Event, int, int]] = []

    # --- the syncer: quorum, grace window, merge ---

    def deliver(self, i: int, t: float) -> None:
        """The merge that took learner i's push in reaches it; if it was waiting for that, it trains on."""
        learner = self.learners[i]
        learner.awaiting = False
        if learner.status is _BLOCKED:
            learner.unblock(t)
            self.schedule(i, t)

    def merge(self, t: float) -> None:
        self.merges += 1
        self.contributors += len(self.pending)
        self.quorum_since = None
        for i in self.pending:
            self.learners[i].base = self.merges
            if self.latency > 0:
                heapq.heappush(self.heap, (t + self.latency, _DELIVER, i, self.learners[i].pushes))
            else:
                self.deliver(i, t)
        self.pending.clear()
        self.timer_at = None
        self.timer_epoch += 1

    def maybe_merge(self, t: float) -> None:
        """Merges once the quorum is in and no live learner that may push before the window closes is still
        to come, or the window is over; else (re)arms the window's end."""
        pending = self.pending
        if not pending:
            return
        learners, timeout = self.learners, self.timeout
        # Live: what the syncer counts, which includes a learner down for less than `timeout`.
        if timeout > 0:
            alive = sum(1 for lr in learners if lr.status is not _DOWN or t < lr.down_since + timeout)
        else:
            alive = self.m - self.down
        needed = self.quorum if self.synchronous else max(1, min(self.quorum, alive))
        if len(pending) < needed:
            self.quorum_since = None
            self._arm(None)
            return
        if self.quorum_since is None:
            self.quorum_since = t
        # Every learner's push says its slack, so the window sized from lateness (for pushes that say none) is never
        # the shard's bound here, nor the island timeout (a learner's slack is shorter).
        pushed = [(learners[i].last_push, self.slack(i)) for i in pending]
        closes = merge_closes(self.quorum_since, self.grace, pushed, self.slack_max)
        if t < closes:
            for i, lr in enumerate(learners):
                if i not in pending and (lr.status is not _DOWN or t < lr.down_since + timeout):
                    self._arm(closes)
                    return
        self.merge(t)

    def slack(self, i: int) -> float:
        """How long after its push learner i can wait for the merge without waiting at all: its tau in steps
        less the sync latency (what its push tells the shard)."""
        learner = self.learners[i]
        return max(0.0, self.tau * self.round_steps[i] / self.h * learner.step_s - self.latency)

    def _arm(self, closes: float | None) -> None:
        """The running window now ends at `closes` (None: none runs); a MERGE event of an earlier end is void."""
        if closes != self.timer_at:
            self.timer_at = closes
            self.timer_epoch += 1
            if closes is not None:
                heapq.heappush(self.heap, (closes, _MERGE, -1, self.timer_epoch))

    def record_push(self, i: int, t: float) -> None:
        """What the shard learns from a push: when it came (its slack, `slack`, follows from the learner)."""
        self.learners[i].last_push = t

    # --- a learner's events ---

    def schedule(self, i: int, t: float) -> None:
        """The learner's next own event: the τ check on its unmerged push, or its next round push."""
        learner, h = self.learners[i], self.round_steps[i]
        if learner.awaiting:
            tau = self.tau * h / self.h
            deadline = t + (tau - learner.phase) * learner.step_s
            if self.timer_at is None or self.timer_at + self.latency > deadline:
                if learner.phase >= tau:
                    learner.block()
                else:
                    heapq.heappush(self.heap, (deadline, _TAU, i, learner.epoch))
                return
        heapq.heappush(self.heap, (t + (h - learner.phase) * learner.step_s, _PUSH, i, learner.epoch))

    def rollback(self, i: int) -> float:
        """Progress lost by restarting from the global fragments: each fragment's steps since its own push."""
        learner, h = self.learners[i], self.round_steps[i]
        a, cap = learner.phase, learner.since_restart
        return sum(min((a - p * h / self.fragments) % h, cap) for p in range(self.fragments)) / self.fragments

    def strike(self, i: int, t: float, downtime: float) -> None:
        """A failure hits learner i: it loses its unpushed progress and is down until it recovers."""
        config, learner = self.config, self.learners[i]
        if learner.status is _DOWN:
            if config.interrupt_recovery:  # its replacement is struck: the recovery starts over
                self.struck += 1
                learner.epoch += 1
                heapq.heappush(self.heap, (t + downtime + config.reform_seconds, _RECOVER, i, learner.epoch))
            else:
                self.absorbed += 1
            return
        self.struck += 1
        learner.advance(t)
        learner.steps_lost += self.rollback(i)
        learner.up_time += t - learner.up_since
        learner.status = _DOWN
        learner.awaiting = False
        learner.epoch += 1
        learner.down_since = t
        self.down += 1
        heapq.heappush(self.heap, (t + downtime + config.reform_seconds, _RECOVER, i, learner.epoch))
        if self.timeout > 0:
            heapq.heappush(self.heap, (t + self.timeout, _EXPIRE, i, 0))
        self.maybe_merge(t)

    def recover(self, i: int, t: float) -> None:
        self.learners[i].restarted(t)
        self.learners[i].base = self.merges  # it pulled the latest global fragments
        self.down -= 1
        self.schedule(i, t)

    def push(self, i: int, t: float) -> None:
        """Learner i pushes its round: the syncer may merge, and it trains on towards its τ check."""
        learner = self.learners[i]
        learner.advance(t)
        learner.phase = 0.0
        self.record_push(i, t)
        self.pending.add(i)
        learner.awaiting = True
        learner.pushes += 1
        self.maybe_merge(t)
        self.schedule(i, t)

    def tau_reached(self, i: int, t: float) -> None:
        """τ steps after its push: if that push is still unmerged, learner i waits for the merge."""
        learner = self.learners[i]
        learner.advance(t)
        if learner.awaiting:
            learner.block()
        else:
            self.schedule(i, t)

    def handle(self, t: float, event: _Event, i: int, tag: int) -> None:
        """One scheduled event. A learner's own events carry its epoch and are dropped once it is stale."""
        if event is _MERGE:
            if tag == self.timer_epoch:
                self.merge(t)
            return
        if event is _DELIVER:
            learner = self.learners[i]
            if learner.awaiting and learner.pushes == tag:
                self.deliver(i, t)
            return
        if event is _EXPIRE:  # the syncer stops counting a silent learner: a merge may be due now
            self.maybe_merge(t)
            return
        if tag != self.learners[i].epoch:
            return
        if event is _RECOVER:
            self.recover(i, t)
        elif event is _PUSH:
            self.push(i, t)
        else:
            self.tau_reached(i, t)

    # --- the run ---

    def run(self) -> RunResult:
        """Replays the failures and the scheduled events in time order up to the horizon."""
        horizon = self.config.horizon_s
        for i in range(self.m):  # every learner starts the way it restarts: down until it is up
            heapq.heappush(self.heap, (self.config.startup_seconds, _RECOVER, i, 0))
        times, downtimes = self.failures.times.tolist(), self.failures.downtimes.tolist()
        next_failure, total = 0, len(times)
        heap = self.heap
        while True:
            t_event = heap[0][0] if heap else math.inf
            t_failure = times[next_failure] if next_failure < total else math.inf
            if min(t_event, t_failure) >= horizon:
                break
            if t_failure <= t_event:
                self.strike(self.learner_of[next_failure], t_failure, downtimes[next_failure])
                next_failure += 1
            else:
                self.handle(*heapq.heappop(heap))
        return self.result(horizon)

    def result(self, horizon: float) -> RunResult:
        for learner in self.learners:
            learner.advance(horizon)
            if learner.status is not _DOWN:
                learner.up_time += horizon - learner.up_since
        total_chip_time = self.config.chips * horizon
        useful = sum(lr.chips * lr.step_s * (lr.steps_run - lr.steps_lost) for lr in self.learners)
        return RunResult(
            goodput=useful / total_chip_time,
            uptime=sum(lr.chips * lr.up_time for lr in self.learners) / total_chip_time,
            failures=self.struck,
            absorbed=self.absorbed,
            merges=self.merges,
            contributors_per_merge=self.contributors / self.merges if self.merges else 0.0,
        )
