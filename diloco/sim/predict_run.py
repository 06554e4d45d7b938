"""The failure simulator's prediction of a `diloco run`, from what that run measured about this machine.

`diloco run --compare --trace FILE` trains decoupled DiLoCo, its synchronous baseline and data-parallel on
the same failure trace and measures each one's goodput. This module reads such a run back, measures the
machine's parameters from the workers' progress events (step time, start-up time after a launch and after
a restart, how long each worker slot was allocated), feeds them and the same trace to
`diloco.sim.engine.simulate`, and sets each measured goodput beside its prediction. The mapping, and why
each run mode maps to the simulator configuration it does, is in docs/simulator.md ("Checked against
`diloco run`"); `bench/simulate_vs_run.py` runs it end to end.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from diloco.core.config import Mode, TrainingConfig
from diloco.core.fragments import fragments_due
from diloco.local.failure_trace import FailureEvent, load_trace
from diloco.local.goodput import account
from diloco.progress import DoneEvent, StepEvent, read_events
from diloco.sim.engine import MergeWait, Policy, SimConfig, simulate


@dataclass(frozen=True)
class Measured:
    """One mode of the run: its goodput, and the machine's parameters as that mode saw them."""

    mode: str
    goodput: float
    slots: int
    horizon_s: float  # mean seconds a worker slot was allocated: the period the goodput is over
    wind_down_s: float  # median seconds from a slot's last step to its end (final pushes, evaluation)
    step_s: float  # median compute seconds of a step (time blocked on a sync left out)
    island_step_s: tuple[float, ...]  # the same per island, island-0 first (cores are shared: it varies)
    startup_seconds: float  # median seconds from the job's launch to a worker's first step
    restart_seconds: float  # median seconds from a relaunch after a kill to the first step (start-up if none seen)
    relaunches: int  # relaunched processes that reached a step (what `restart_seconds` is measured on)
    kills: int
    sync_latency_seconds: float  # median over barriers of the shortest wait there: a merge reaching its learners
    blocking_syncs: int  # barriers (steps at which islands blocked on a sync)
    first_slot_end_s: float  # when the first worker slot finished its steps (seconds after launch)
    late_kills: int  # kills at or after that: they find a finished slot, and fall outside the mapping

    @property
    def training_s(self) -> float:
        """The part of a slot's allocation the simulator models: from launch to the last step."""
        return max(self.horizon_s - self.wind_down_s, 1e-9)


@dataclass(frozen=True)
class Prediction:
    """A run mode's measured goodput beside the simulator's, and the configuration that gave it."""

    mode: str
    policy: Policy
    label: str
    measured: Measured
    predicted: float
    config: SimConfig

    @property
    def error(self) -> float:
        return self.predicted - self.measured.goodput


def _median(values: Sequence[float], default: float) -> float:
    return statistics.median(values) if values else default


def measure(
    run_dir: Path,
    mode: str,
    summary: dict,
    trace: Sequence[FailureEvent],
    islands: int,
    ranks: int,
    config: TrainingConfig,
) -> Measured:
    """The parameters of `mode` from `run_dir/<mode>/progress/*.jsonl`, the run's summary and its trace."""
    events = read_events(Path(run_dir) / mode / "progress")
    started = summary["started_at"]
    slots = islands * ranks
    acct = account(
        events, mode=mode, slots=slots, fragments=config.fragments, started_at=started, tokens_per_eval_step=0
    )
    steps = [e for e in events if isinstance(e, StepEvent)]
    compute = [e.compute_seconds for e in steps]
    per_island: dict[str, list[float]] = defaultdict(list)
    for e, seconds in zip(steps, compute):
        per_island[e.source.island].append(seconds)
    step = _median(compute, math.nan)
    # At a barrier (a step where a fragment's sync falls due) every island blocks: the last to arrive only for
    # the merge to reach it (merging, its polling, the pull), the others for the last as well. The simulator's
    # islands step in lockstep, so the mean wait per barrier is what a barrier costs an island there. Other
    # steps' sync seconds are the learner's bookkeeping, never a barrier.
    barriers: dict[int, list[float]] = defaultdict(list)
    for e in steps:
        if e.sync_seconds > 0.0 and fragments_due(e.step, config.inner_steps, config.fragments):
            barriers[e.step].append(e.sync_seconds)
    latencies = [statistics.fmean(waits) for waits in barriers.values()]

    # A process's launch: the job's start, or when the trace last killed its island (data-parallel: anyone)
    # before its first step, plus that kill's downtime. Start-up is the time from launch to its first step.
    first_step: dict[int, StepEvent] = {}
    for e in steps:
        if e.source.pid not in first_step or e.t < first_step[e.source.pid].t:
            first_step[e.source.pid] = e
    initial, relaunch = [], []
    for e in first_step.values():
        began = e.t - e.seconds - started
        hits = [
            k
            for k in trace
            if k.kind == "worker" and k.at < began and (mode == Mode.DDP or k.island == e.source.island)
        ]
        if hits:
            last = max(hits, key=lambda k: k.at)
            relaunch.append(began - (last.at + last.downtime))
        else:
            initial.append(began)
    # A process killed before its first step measures nothing: each kind of start stands in for the other.
    startup = _median(initial, _median(relaunch, math.nan))
    # Wind-down: from a worker's last step to its `done` event, which ends its slot's allocation.
    last_step: dict[int, float] = {}
    for e in steps:
        last_step[e.source.pid] = max(last_step.get(e.source.pid, e.t), e.t)
    wind_down = [
        e.t - last_step[e.source.pid] for e in events if isinstance(e, DoneEvent) and e.source.pid in last_step
    ]
    ends: dict[tuple[str, int], float] = {}
    for event in events:
        ends[event.source.slot] = max(ends.get(event.source.slot, 0.0), event.t - started)
    first_end = min(ends.values(), default=0.0)
    return Measured(
        mode=mode,
        goodput=summary["goodput"],
        slots=slots,
        horizon_s=acct.allocated_seconds / slots,
        wind_down_s=_median(wind_down, 0.0),
        step_s=step,
        island_step_s=tuple(_median(per_island[f"island-{i}"], step) for i in range(islands)),
        startup_seconds=startup,
        restart_seconds=_median(relaunch, startup),
        relaunches=len(relaunch),
        kills=summary["kills"],
        sync_latency_seconds=_median(latencies, 0.0),
        blocking_syncs=len(latencies),
        first_slot_end_s=first_end,
        late_kills=sum(1 for k in trace if k.kind == "worker" and k.at >= first_end),
    )


def sim_config(
    m: Measured, config: TrainingConfig, islands: int, trace: Sequence[FailureEvent], sync_latency_seconds: float
) -> SimConfig:
    """This machine as the simulator sees it: each island a learner of one chip; start-up, each island's
    step time, horizon and merge latency as measured; every failure strikes, even a process that is still
    starting (as `diloco run`'s supervisor does); the run's training configuration (K capped by the islands),
    with its island timeout; and the built-in trainer's data-parallel checkpoint interval. Policies and how
    long a learner waits for a merge are set per mode by `predict`."""
    from diloco.worker.trainer import TrainerSettings  # imports torch: only when predicting

    return SimConfig(
        chips=islands,
        islands=islands,
        horizon_hours=m.training_s / 3600,
        step_seconds=m.island_step_s,
        startup_seconds=m.startup_seconds,
        reform_seconds=m.restart_seconds,
        restart_seconds=m.restart_seconds,
        interrupt_recovery=True,
        checkpoint_steps=TrainerSettings().checkpoint_every,
        training=config.updated(quorum=min(config.quorum, islands)),
        instant_failure_detection=False,
        sync_latency_seconds=sync_latency_seconds,
        trace=tuple(e for e in trace if e.kind == "worker"),
    )


# How each run mode maps onto the simulator, beside its policy (`Policy.of`): (merge wait, label). The
# decoupled worker never waits for a merge (a late reply is mixed at the first step it is in), which the
# engine comes closest to by waiting only a round later; the run's synchronous baseline is a barrier across all
# islands at every sync (K = M), the engine's SYNC_DILOCO.
MAPPING = {
    Mode.DILOCO: (MergeWait.ROUND, "Decoupled DiLoCo (never waits within a round)"),
    Mode.SYNC_DILOCO: (MergeWait.OVERLAP, "synchronous DiLoCo (K = M barrier)"),
    Mode.DDP: (MergeWait.OVERLAP, "non-elastic data-parallel (the trainer's checkpoints)"),
}


def _goodput(m: Measured, config: SimConfig, policy: Policy) -> float:
    """The simulator's goodput over the training time, as a share of the whole allocation (the wind-down
    after the last step is allocated time without steps)."""
    return simulate(config)[policy].goodput * m.training_s / m.horizon_s


def predict(m: Measured, base: SimConfig) -> Prediction:
    policy = Policy.of(m.mode)
    merge_wait, label = MAPPING[Mode(m.mode)]
    config = replace(base, policies=(policy,), merge_wait=merge_wait)
    return Prediction(m.mode, policy, label, m, _goodput(m, config, policy), config)


@dataclass(frozen=True)
class Check:
    run_dir: Path
    predictions: tuple[Prediction, ...]
    tolerance: float

    def by_mode(self) -> dict[str, Prediction]:
        return {p.mode: p for p in self.predictions}

    @property
    def measured_order(self) -> list[str]:
        return [p.mode for p in sorted(self.predictions, key=lambda p: -p.measured.goodput)]

    @property
    def predicted_order(self) -> list[str]:
        return [p.mode for p in sorted(self.predictions, key=lambda p: -p.predicted)]

    @property
    def within_tolerance(self) -> bool:
        return all(abs(p.error) <= self.tolerance for p in self.predictions)

    @property
    def passed(self) -> bool:
        return self.within_tolerance and self.measured_order == self.predicted_order

    @property
    def late_kills(self) -> int:
        """Kills after some slot of some mode had finished: the horizon mapping assumes there are none."""
        return max((p.measured.late_kills for p in self.predictions), default=0)

    def table(self) -> str:
        lines = [f"{'run mode':<12} {'simulator policy':<52} {'measured':>8} {'predicted':>9} {'error':>7}"]
        for p in self.predictions:
            lines.append(f"{p.mode:<12} {p.label:<52} {p.measured.goodput:>8.3f} {p.predicted:>9.3f} {p.error:>+7.3f}")
        return "\n".join(lines)

    def parameters(self) -> str:
        lines = [
            f"{'run mode':<12} {'step s':>7} {'start-up s':>10} {'restart s':>9} {'relaunches':>10} "
            f"{'kills':>5} {'horizon s':>9} {'wind-down s':>11} {'merge latency s':>15}"
        ]
        for p in self.predictions:
            m = p.measured
            latency = f"{m.sync_latency_seconds:.2f} ({m.blocking_syncs})" if m.blocking_syncs else "-"
            lines.append(
                f"{m.mode:<12} {m.step_s:>7.3f} {m.startup_seconds:>10.2f} {m.restart_seconds:>9.2f} "
                f"{m.relaunches:>10} {m.kills:>5} {m.horizon_s:>9.1f} {m.wind_down_s:>11.2f} {latency:>15}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "run": str(self.run_dir),
            "tolerance": self.tolerance,
            "within_tolerance": self.within_tolerance,
            "measured_order": self.measured_order,
            "predicted_order": self.predicted_order,
            "passed": self.passed,
            "late_kills": self.late_kills,
            "modes": [
                {
                    "mode": p.mode,
                    "simulator_policy": p.policy.value,
                    "simulator_label": p.label,
                    "measured_goodput": p.measured.goodput,
                    "predicted_goodput": p.predicted,
                    "error": p.error,
                    "measured": asdict(p.measured),
                    "simulator_config": {k: v for k, v in asdict(p.config).items() if k not in ("trace", "training")}
                    | {"training": p.config.training.model_dump(mode="json"), "policies": [p.policy.value]},
                }
                for p in self.predictions
            ],
        }


def check(run_dir: Path, tolerance: float) -> Check:
    """Reads a finished `diloco run --compare` from `run_dir` and predicts every mode it ran."""
    run_dir = Path(run_dir)
    summaries = {s["mode"]: s for s in json.loads((run_dir / "summary.json").read_text())}
    trace = load_trace(run_dir / "trace.json")
    modes = [mode.value for mode in Mode if mode.value in summaries]
    config = TrainingConfig.from_json((run_dir / modes[0] / "config.json").read_text())
    islands, ranks = _shape(run_dir / modes[0] / "progress")
    measured = {mode: measure(run_dir, mode, summaries[mode], trace, islands, ranks, config) for mode in modes}
    # Only the blocking baseline waits on merges, so only it shows their latency; it is the same syncer for all.
    sync = measured.get(Mode.SYNC_DILOCO.value)
    latency = sync.sync_latency_seconds if sync is not None else 0.0
    predictions = [predict(m, sim_config(m, config, islands, trace, latency)) for m in measured.values()]
    return Check(run_dir, tuple(predictions), tolerance)


def _shape(progress: Path) -> tuple[int, int]:
    """Islands and ranks per island, from the progress files' names (`island-<i>-rank<r>.jsonl`)."""
    ranks: dict[str, set[str]] = defaultdict(set)
    for path in progress.glob("*.jsonl"):
        island, _, rank = path.stem.rpartition("-rank")
        ranks[island].add(rank)
    if not ranks:
        raise ValueError(f"{progress}: no progress files")
    return len(ranks), max(len(r) for r in ranks.values())
