"""`diloco run`: the embedded default. Trains the tiny GPT preset on the embedded corpus with syncer shards
and several islands as processes on loopback, shows progress, prints a summary and writes a loss-curve
PNG. Options make islands slower (mixed hardware), inject failures, and run the baselines (`ddp`:
all-reduce every step; `sync-diloco`: a barrier at every sync) on the same machine and failure trace.

`diloco run [options] -- COMMAND ARGS...` runs a loop of one's own (one that trains through
`Learner.from_env`) as every island's worker instead, with the environment the operator gives an island's
pods, the same failures, summary and export; its loss is the one the loop reports.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from diloco.core.config import Encoding, Mode, OuterOptimizerConfig, Precision, TrainingConfig
from diloco.core.rules import QUORUM_WITHIN_ISLANDS
from diloco.local.failure_trace import FailureEvent, load_trace, random_trace, save_trace, syncer_target, worker_target
from diloco.local.goodput import Account, account
from diloco.local.launcher import IslandCannotStart, JobResult, LocalJob, RunPlan, check_gpus
from diloco.local.netns import check_available
from diloco.local.wan import Link
from diloco.progress import DoneEvent, EvalEvent, ProgressEvent, ProgressFollower, StepEvent, read_events
from diloco.settings import DEFAULT_CORPUS_BYTES
from diloco.worker.curves import TrainingCurves


@dataclass(frozen=True)
class ModeSummary:
    mode: str
    started_at: float  # unix time the workers were first launched: the trace's time zero
    wall_seconds: float
    final_loss: float
    goodput: float
    tokens_trained: int
    restarts: int  # restarts of islands' processes (each re-forms every rank of its island)
    kills: int
    comm_bytes: float
    comm_bytes_per_token: float
    merges: int  # merges applied by the syncers (0 for ddp)
    islands_per_merge: float  # mean island contributions per merge: M for a barrier, fewer when decoupled
    timed_out: bool
    tokens_per_second: float = 0.0  # all workers together, while stepping
    tokens_per_second_per_island: float = 0.0
    tokens_per_second_per_accelerator: float = 0.0  # per worker process: one accelerator each
    mfu: float | None = None  # model FLOPs utilisation (None: no accelerator peak known, e.g. on CPU)
    islands_loss: float = math.nan  # DiLoCo: the mean held-out loss of the islands' own models at their end
    train_loss_start: float = math.nan  # the training loss the islands reported, over the run's first steps
    train_loss_end: float = math.nan  # ... and over its last
    round_steps: dict[str, float] = field(default_factory=dict)  # per island: mean inner steps per round
    losses: dict[str, float] = field(default_factory=dict)  # where the rest of the allocated time went, as shares
    rejected: dict[str, float] = field(default_factory=dict)  # calls the syncers refused, by reason
    outliers: float = 0.0  # contributions the syncers left out of merges
    hostile: dict[str, dict] = field(default_factory=dict)  # per misbehaving island (--hostile-islands): its calls


def round_steps(events: list[ProgressEvent]) -> dict[str, float]:
    """Each island's mean inner steps per round over its processes: H, fewer on a slow speed-aware island."""
    rounds: Counter[str] = Counter()
    steps: Counter[str] = Counter()
    for e in events:
        if isinstance(e, DoneEvent) and e.source.rank == 0 and e.learner is not None:
            rounds[e.source.island] += e.learner.rounds_begun
            steps[e.source.island] += e.learner.round_inner_steps
    return {island: steps[island] / rounds[island] for island in sorted(rounds) if rounds[island]}


def islands_final_loss(events: list[ProgressEvent]) -> float:
    """The mean held-out loss of the islands' own final models (each island's rank 0 evaluates its model as
    it ends), beside which the global model is judged: merging must lose nothing the islands learned."""
    finals = {e.source.island: e.loss for e in events if isinstance(e, DoneEvent) and e.source.rank == 0}
    return sum(finals.values()) / len(finals) if finals else math.nan


def ddp_comm_bytes(parameters: int, workers: int, steps_executed_per_worker: float) -> float:
    """Bytes a ring all-reduce of float32 gradients moves, sent and received, over every worker and step."""
    if workers < 2:
        return 0.0
    per_step = 2 * 2 * (workers - 1) / workers * parameters * 4
    return per_step * steps_executed_per_worker * workers


class ProgressReader:
    """Follows the progress files for the bar: the latest step of each worker slot, and the latest loss."""

    def __init__(self, folder: Path, curves: TrainingCurves) -> None:
        self.events = ProgressFollower(folder)
        self.curves = curves
        self.steps: dict[tuple[str, int], int] = {}
        self.eval_loss = math.nan
        self.train_loss = math.nan  # what a loop of one's own reports: it has no held-out evaluation

    def poll(self) -> int:
        events = self.events.poll()
        self.curves.write(events)
        for event in events:
            if isinstance(event, StepEvent):
                self.steps[event.source.slot] = event.step
                self.train_loss = event.loss
            elif isinstance(event, EvalEvent):
                self.eval_loss = event.loss
        return sum(self.steps.values())

    @property
    def loss(self) -> float:
        return self.eval_loss if math.isfinite(self.eval_loss) else self.train_loss

    @property
    def postfix(self) -> dict[str, str]:
        """What the bar shows beside the steps: the latest held-out loss, the training loss until the first
        evaluation, and nothing before the first step (rather than `loss=nan` while the workers start)."""
        return {"loss": f"{self.loss:.3f}"} if math.isfinite(self.loss) else {}


def mode_config(mode: str, config: TrainingConfig, islands: int) -> TrainingConfig:
    """The configuration a mode trains with. `sync-diloco` is a barrier across all islands at every outer
    step: K = M, so a shard merges a fragment only once every island alive has pushed it (each island
    blocks on that merge), where decoupled DiLoCo merges with the K it is given and never blocks."""
    return config.model_copy(update={"quorum": islands}) if mode == Mode.SYNC_DILOCO else config


def run_mode(plan: RunPlan, quiet: bool = False) -> tuple[ModeSummary, Account, JobResult]:
    job = LocalJob(plan)
    curves = TrainingCurves(plan.out / "tensorboard", _learning_rate(plan) if plan.built_in else None)
    reader = ProgressReader(plan.out / "progress", curves)
    with tqdm(total=plan.total_steps, desc=f"{plan.mode:>11}", unit="step", disable=quiet, mininterval=1.0) as bar:

        def tick() -> None:
            done = reader.poll()
            # The postfix first: the update below redraws the bar when it is due, with the postfix it has then.
            bar.set_postfix(reader.postfix, refresh=False)
            bar.update(max(0, done - bar.n))

        result = job.run(on_tick=tick)
        reader.poll()  # the events since the last tick, for the curves
    curves.write_final(result.global_eval_loss)
    curves.close()
    events = read_events(plan.out / "progress") + read_events(plan.out / "merges")
    workers = len(plan.honest) * plan.ranks_per_island
    acct = account(
        events,
        mode=plan.mode,
        slots=workers,
        fragments=plan.config.fragments,
        started_at=result.started_at,
        tokens_per_eval_step=workers * plan.batch_size * _context(plan.model) if plan.built_in else 0,
    )
    if plan.mode == Mode.DDP:
        finals = [e.loss for e in events if isinstance(e, DoneEvent) and e.source.rank == 0]  # rank 0 evaluates
        final = finals[-1] if finals else math.nan
        comm = ddp_comm_bytes(_parameters(plan.model), workers, acct.steps_executed / workers)
    else:
        final = result.global_eval_loss if result.global_eval_loss is not None else math.nan
        comm = result.syncer_bytes
    summary = ModeSummary(
        mode=plan.mode,
        started_at=result.started_at,
        wall_seconds=result.finished_at - result.started_at,
        final_loss=final,
        goodput=acct.goodput,
        tokens_trained=acct.tokens_trained,
        restarts=sum(result.worker_starts.values()) - len(result.worker_starts),
        kills=result.kills,
        comm_bytes=comm,
        comm_bytes_per_token=comm / acct.tokens_trained if acct.tokens_trained else math.nan,
        merges=round(result.merges),
        islands_per_merge=result.merged_contributions / result.merges if result.merges else math.nan,
        timed_out=result.timed_out,
        tokens_per_second=acct.tokens_per_second,
        tokens_per_second_per_island=acct.tokens_per_second / len(plan.honest),
        tokens_per_second_per_accelerator=acct.tokens_per_second / workers,
        mfu=acct.mfu,
        round_steps=round_steps(events),
        losses=acct.losses.shares(acct.allocated_seconds),
        islands_loss=islands_final_loss(events) if plan.mode != Mode.DDP else math.nan,
        train_loss_start=acct.train_curve[0][1] if acct.train_curve else math.nan,
        train_loss_end=acct.train_curve[-1][1] if acct.train_curve else math.nan,
        rejected=result.rejected,
        outliers=result.outliers,
        hostile=result.hostile,
    )
    return summary, acct, result


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _learning_rate(plan: RunPlan) -> Callable[[int], float]:
    """The built-in trainer's inner learning rate at a step (its schedule, computed from the configuration)."""
    from diloco.worker.trainer import learning_rate

    return lambda step: learning_rate(step, plan.config.inner)


def _context(model: str) -> int:
    from diloco.worker.language_model import ModelSpec

    return ModelSpec.parse(model).context


def _parameters(model: str) -> int:
    from diloco.worker.language_model import ModelSpec, build

    return build(ModelSpec.parse(model), 0, device="meta").num_parameters()


def _model_name(model: str) -> str:
    """A run's model as its first line names it."""
    from diloco.worker.language_model import ModelSpec

    spec = ModelSpec.parse(model)
    return f"the {spec.preset} preset" if spec.preset else f"a {spec.name} model ({model})"


def print_summary(summaries: list[ModeSummary]) -> None:
    print()
    header = (
        f"{'mode':>12} {'wall s':>7} {'eval loss':>9} {'goodput':>8} {'tokens':>10} {'kills':>5} "
        f"{'restarts':>8} {'comm B/token':>12} {'merges':>6} {'islands/merge':>13} {'tokens/s':>9} "
        f"{'per island':>10} {'MFU':>5}"
    )
    print(header)
    for s in summaries:
        mfu = f"{s.mfu:>5.1%}" if s.mfu is not None else f"{'-':>5}"
        final = f"{s.final_loss:>9.3f}" if math.isfinite(s.final_loss) else f"{'-':>9}"  # a command's: its own
        print(
            f"{s.mode:>12} {s.wall_seconds:>7.1f} {final} {s.goodput:>8.2f} {s.tokens_trained:>10} "
            f"{s.kills:>5} {s.restarts:>8} {s.comm_bytes_per_token:>12.1f} {s.merges:>6} "
            f"{s.islands_per_merge:>13.2f} {s.tokens_per_second:>9.0f} {s.tokens_per_second_per_island:>10.0f} {mfu}"
            + ("  (timed out)" if s.timed_out else "")
        )
    for s in summaries:
        rest = ", ".join(f"{name.replace('_', ' ')} {share:.3f}" for name, share in s.losses.items())
        print(f"{s.mode} allocated time not in the model: {rest}")
    for s in summaries:
        if math.isfinite(s.train_loss_start):
            print(
                f"{s.mode} training loss the islands reported: {s.train_loss_start:.3f} over the first steps, "
                f"{s.train_loss_end:.3f} over the last"
            )
    for s in summaries:
        if math.isfinite(s.islands_loss):
            print(
                f"{s.mode} global model {s.final_loss:.3f} vs the islands' own (mean) {s.islands_loss:.3f}: "
                f"{s.final_loss - s.islands_loss:+.3f}"
            )
    for s in summaries:
        for name, report in s.hostile.items():
            calls = ", ".join(f"{call} x{n}" for call, n in sorted(report.get("calls", {}).items()))
            print(f"{s.mode} {name}: {report.get('rounds', 0)} rounds, {report.get('ids_used', 0)} island ids; {calls}")
        if s.hostile:
            refused = ", ".join(f"{reason} {n:.0f}" for reason, n in sorted(s.rejected.items())) or "none"
            print(f"{s.mode} the shards refused: {refused}; left out {s.outliers:.0f} contributions as outliers")
    for s in summaries:
        if s.round_steps:
            steps = ", ".join(f"{island} {n:.1f}" for island, n in s.round_steps.items())
            print(f"{s.mode} mean inner steps per round: {steps}")
    by_mode = {s.mode: s for s in summaries}
    if Mode.DILOCO in by_mode and len(by_mode) > 1:
        ours = by_mode[Mode.DILOCO]
        print()
        for other in summaries:
            if other.mode == Mode.DILOCO:
                continue
            comm = other.comm_bytes_per_token / ours.comm_bytes_per_token if ours.comm_bytes_per_token else math.nan
            good = ours.goodput / other.goodput if other.goodput else math.inf
            held_out = math.isfinite(ours.final_loss) and math.isfinite(other.final_loss)
            loss = (
                f"eval loss ratio {ours.final_loss / other.final_loss:.3f}"
                if held_out  # else a loop of one's own: the training loss it reports
                else f"training loss ratio {ours.train_loss_end / other.train_loss_end:.3f}"
            )
            print(f"diloco vs {other.mode}: {loss}, goodput ratio {good:.2f}, communication {comm:.0f}x less per token")


def plot_curves(path: Path, accounts: list[Account], summaries: list[ModeSummary]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    held_out = any(acct.eval_curve for acct in accounts)
    for acct, summary in zip(accounts, summaries):
        if not held_out and acct.train_curve:  # a loop of one's own: the loss it reports is all the run sees
            xs, ys = zip(*acct.train_curve)
            ax.plot(xs, ys, marker="o", markersize=3, label=f"{acct.mode} (training loss the islands reported)")
        if acct.eval_curve:
            xs, ys = zip(*acct.eval_curve)
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=f"{acct.mode} (during training)")
            if math.isfinite(summary.final_loss):
                ax.scatter(
                    [xs[-1]],
                    [summary.final_loss],
                    color=line.get_color(),
                    marker="*",
                    s=120,
                    zorder=3,
                    label=f"{acct.mode} final model: {summary.final_loss:.3f}",
                )
    ax.set_xlabel("tokens trained (all workers)")
    ax.set_ylabel("held-out loss (nats/token)" if held_out else "training loss (the loop's own)")
    ax.set_title("diloco run: held-out loss" if held_out else "diloco run: training loss")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def per_island(option: str, text: str, minimum: float) -> tuple[float, ...]:
    """A comma-separated value per island (islands beyond the list take the default)."""
    try:
        values = tuple(float(x) for x in text.split(",")) if text else ()
    except ValueError:
        raise ValueError(f"{option} takes comma-separated numbers, one per island, got {text!r}") from None
    if any(not math.isfinite(v) or v < minimum for v in values):
        raise ValueError(f"{option} values must be at least {minimum:g}, got {text!r}")
    return values


def build_trace(args: argparse.Namespace, workers: list[str]) -> list[FailureEvent]:
    """The given trace, checked against this job's processes, or a random one made from the options."""
    if args.trace:
        trace = load_trace(args.trace)
        processes = set(workers) | {syncer_target(shard) for shard in range(args.shards)}
        for event in trace:
            if event.target not in processes:
                raise ValueError(
                    f"{args.trace}: {event.target} (at {event.at:g} s) is not a process of this job; a run "
                    f"replays worker:island-<i>/<rank> and syncer:<shard> targets "
                    f"({args.islands} islands x {args.ranks_per_island} ranks, {args.shards} shard(s))"
                )
        return trace
    syncer_kills = [(float(at), 0) for at in args.kill_syncer_at]
    return random_trace(
        seed=args.seed,
        duration=args.fail_until,
        mean_interval=args.kill_every,
        workers=workers,
        downtime=args.restart_after,
        syncer_kills=syncer_kills,
    )


DDP_NEEDS_THE_TRAINER = (
    "ddp is not run for a command: data-parallel all-reduces gradients at every step inside the trainer, which "
    "a loop of one's own does not do"
)


def run_command(args: argparse.Namespace) -> tuple[str, ...]:
    """The command after `--` that every island runs, checked against the options that need the built-in
    trainer (empty: the built-in trainer)."""
    command = tuple(args.command[1:] if args.command[:1] == ["--"] else args.command)
    if command and args.mode == Mode.DDP:
        raise ValueError(f"--mode ddp: {DDP_NEEDS_THE_TRAINER}; run it as diloco or sync-diloco")
    if command and args.equal_time:
        raise ValueError("--equal-time sets the built-in trainer's steps; a command counts its own")
    return command


def modes_to_run(mode: str, compare: bool, command: tuple[str, ...]) -> list[str]:
    """`mode`, then with `compare` the other modes on the same trace: every one for the built-in trainer,
    the DiLoCo ones for a command (`DDP_NEEDS_THE_TRAINER`)."""
    others = [m.value for m in Mode if m != mode and not (command and m == Mode.DDP)]
    return [mode] + (others if compare else [])


def run(args: argparse.Namespace) -> int:
    args.model = args.model or args.init_from or "tiny"  # a checkpoint folder holds its configuration
    honest = args.islands - args.hostile_islands
    workers = [worker_target(f"island-{i}", r) for i in range(honest) for r in range(args.ranks_per_island)]
    try:
        command = run_command(args)
        if not 0 <= args.hostile_islands < args.islands:
            raise ValueError(f"--hostile-islands must leave at least one of the {args.islands} islands, got {honest}")
        if args.hostile_islands and args.mode == Mode.DDP:
            raise ValueError("--hostile-islands: ddp has no syncers to misbehave against")
        config = TrainingConfig(
            inner_steps=args.inner_steps,
            fragments=args.fragments,
            overlap_steps=args.overlap_steps,
            encoding=args.encoding,
            top_k_fraction=args.top_k_fraction,
            quorum=args.quorum,
            grace_seconds=args.grace_seconds,
            speed_aware=args.speed_aware,
            outer=OuterOptimizerConfig(lr=args.outer_lr, momentum=args.outer_momentum),
        )
        slowdowns = per_island("--slowdown", args.slowdown, minimum=1.0)
        jitters = per_island("--jitter", args.jitter, minimum=0.0)
        QUORUM_WITHIN_ISLANDS.check(
            {"quorum": "--quorum", "islands": "--islands"}, quorum=config.quorum, islands=args.islands
        )
        if args.reference_step_seconds is not None and args.reference_step_seconds <= 0:
            raise ValueError(f"--reference-step-seconds must be positive, got {args.reference_step_seconds}")
        trace = build_trace(args, workers)
        link = Link(mbps=args.link_mbps, rtt_ms=args.rtt_ms)
        slowest = link.min_transfer_mbps(config) if args.min_transfer_mbps is None else args.min_transfer_mbps
        config = config.updated(min_transfer_mbps=slowest)
        if link.shaped:
            check_available()
        modes = modes_to_run(args.mode, args.compare, command)
        gpus = visible_gpus() if args.device.startswith("cuda") else 0
        check_gpus(args.device, modes, len(workers), gpus)
    except (OSError, ValueError) as error:
        print(f"diloco run: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    save_trace(args.out / "trace.json", trace)
    worker = f"`{shlex.join(command)}`" if command else f"{args.steps} steps of {_model_name(args.model)}"
    print(
        f"diloco run: {args.islands} islands x {args.ranks_per_island} ranks, {args.shards} syncer shard(s), "
        f"{worker}; H={config.inner_steps} P={config.fragments} "
        f"tau={config.overlap_steps} {config.encoding.value}; {len(trace)} injected failures; out: {args.out}"
        + (
            f"; each island behind a link of {link.describe()}, its syncs given the time of their bytes at "
            f"{config.min_transfer_mbps:.4g} Mbit/s"
            if link.shaped
            else ""
        )
    )
    if command and args.compare:
        print(f"diloco run: {DDP_NEEDS_THE_TRAINER}; comparing with {', '.join(modes[1:])} alone")
    summaries, accounts, models = [], [], []
    for mode in modes:
        plan = RunPlan(
            mode=mode,
            config=mode_config(mode, config, args.islands),
            out=args.out / mode,
            islands=args.islands,
            ranks_per_island=args.ranks_per_island,
            shards=args.shards,
            steps=args.steps,
            batch_size=args.batch_size,
            model=args.model,
            tokenizer=args.tokenizer,
            init_from=args.init_from,
            command=command,
            data=args.data,
            seed=args.seed,
            eval_every=args.eval_every,
            checkpoint_every=args.checkpoint_every,
            slowdowns=slowdowns,
            jitters=jitters,
            reference_step_seconds=args.reference_step_seconds,
            equal_time=args.equal_time,
            trace=tuple(trace),
            threads=args.threads,
            timeout=args.timeout,
            device=args.device,
            precision=args.precision,
            max_data_bytes=args.max_data_bytes,
            gpus=gpus,
            link=link,
            hostile_islands=args.hostile_islands,
        )
        try:
            summary, acct, result = run_mode(plan, quiet=args.quiet)
        except IslandCannotStart as error:
            print(f"diloco run: {error}", file=sys.stderr)
            return 1
        if result.export_error:
            print(
                f"diloco run: {mode}: no model to export ({result.export_error}); does the command train through "
                "Learner.from_env?"
            )
        summaries.append(summary)
        accounts.append(acct)
        models += [result.model_dir] if result.model_dir else []
    print_summary(summaries)
    if models and not args.quiet and not command:
        print_sample(models[0], args.data)
    plot_curves(args.out / "loss.png", accounts, summaries)
    (args.out / "summary.json").write_text(json.dumps([asdict(s) for s in summaries], indent=1))
    print(f"\nloss curve: {args.out / 'loss.png'}   summary: {args.out / 'summary.json'}")
    return 0 if not any(s.timed_out for s in summaries) else 1


SAMPLE_TOKENS = 160
CORPUS_PROMPT = "def "
"""Where a sample of a model trained on the embedded corpus (Python source) starts."""


def print_sample(model_dir: Path, data: str | None) -> None:
    """A few lines the final global model writes, so that a run ends showing what was trained."""
    from diloco.export.sample import continue_text

    text = continue_text(model_dir, CORPUS_PROMPT if data is None else "", SAMPLE_TOKENS)
    print(f"\nthe global model writes (diloco sample {model_dir}):\n{text}")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="train on this machine: syncers and islands as local processes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] [-- COMMAND ARGS...]",
    )
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.DILOCO.value)
    p.add_argument("--compare", action="store_true", help="also run the other modes on the same failure trace")
    p.add_argument("--islands", type=int, default=4)
    p.add_argument(
        "--ranks-per-island",
        type=int,
        default=1,
        help="ranks per island, the local ranks of its one process as a pod's accelerators are (gloo inside)",
    )
    p.add_argument("--shards", type=int, default=1, help="syncer shards")
    p.add_argument("--steps", type=int, default=200, help="inner steps per worker (the built-in trainer's)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--model",
        "--preset",
        help="a preset (tiny, small, medium, large, xl) or a transformers config.json (or inline JSON); "
        "default: --init-from's configuration, else tiny",
    )
    p.add_argument("--tokenizer", help="a tokenizer.json (default: the preset's: bytes, or its BPE)")
    p.add_argument("--init-from", help="a Hugging Face checkpoint folder to start from (continued pretraining)")
    p.add_argument(
        "--data", help="a token or text file, or a folder of shards (.bin/.npy/.txt/.jsonl/.parquet); default: stdlib"
    )
    p.add_argument(
        "--max-data-bytes", type=int, default=DEFAULT_CORPUS_BYTES, help="read at most this much of the data (bytes)"
    )
    job = TrainingConfig()
    p.add_argument(
        "--inner-steps",
        type=int,
        default=20,
        help=f"H (a job's default, {job.inner_steps}, is scaled down to suit a run of minutes)",
    )
    p.add_argument("--fragments", type=int, default=2, help=f"P (a job's default: {job.fragments})")
    p.add_argument("--overlap-steps", type=int, default=2, help=f"tau (a job's default: {job.overlap_steps})")
    p.add_argument("--encoding", default=job.encoding.value, choices=[e.value for e in Encoding])
    p.add_argument(
        "--top-k-fraction", type=float, default=job.top_k_fraction, help="share of values the sparse encoding sends"
    )
    p.add_argument("--quorum", type=int, default=job.quorum, help="K")
    p.add_argument("--outer-lr", type=float, default=job.outer.lr, help="the outer optimizer's learning rate")
    p.add_argument(
        "--outer-momentum", type=float, default=job.outer.momentum, help="the outer optimizer's Nesterov momentum"
    )
    p.add_argument(
        "--grace-seconds",
        type=float,
        default=job.grace_seconds,
        help="the most seconds a shard waits for more contributions once the quorum is reached (unset: 0.8 of the "
        "pushes' slack)",
    )
    p.add_argument(
        "--speed-aware",
        action=argparse.BooleanOptionalAction,
        default=job.speed_aware,
        help="islands slower than the fastest run fewer inner steps per round, at the fastest's cadence",
    )
    p.add_argument("--slowdown", default="", help="per-island slowdown factors, e.g. 1,1,3,1")
    p.add_argument(
        "--jitter",
        default="",
        help="per-island step jitter, e.g. 0,0,0,0.3: each step of island 3 lasts a random 0 to 60%% longer",
    )
    p.add_argument(
        "--equal-time",
        action="store_true",
        help="decoupled islands faster than the slowest take proportionally more steps than --steps, so all train "
        "for the slowest's time, as a job's islands do until it ends (the barrier modes keep --steps)",
    )
    p.add_argument(
        "--reference-step-seconds",
        type=float,
        help="emulate a device whose step takes this long: an island's every step then lasts its slowdown times "
        "this, however many islands share the machine's cores (unset: a slowdown scales each step's own time)",
    )
    p.add_argument("--kill-every", type=float, default=0.0, help="mean seconds between kill -9 of a random worker")
    p.add_argument("--restart-after", type=float, default=5.0, help="seconds a killed worker stays down")
    p.add_argument("--fail-until", type=float, default=60.0, help="inject worker kills until this many seconds")
    p.add_argument("--kill-syncer-at", type=float, nargs="*", default=[], help="kill -9 shard 0 at these seconds")
    p.add_argument("--trace", type=Path, help="a failure trace JSON file (overrides the random one)")
    p.add_argument(
        "--link-mbps",
        type=float,
        help="put each island behind a link of this many Mbit/s each way (network namespaces and tc tbf: root)",
    )
    p.add_argument(
        "--rtt-ms", type=float, default=0.0, help="round trip each island's link adds to its exchanges (root)"
    )
    p.add_argument(
        "--min-transfer-mbps",
        type=float,
        help="the slowest rate a sync's bytes must cross at: each push and pull may take a minute plus its bytes "
        f"at this rate (default: a job's, {job.min_transfer_mbps}, or what TCP keeps of --link-mbps over the "
        "fragments if lower)",
    )
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="inner steps between a worker's checkpoints (an island's optimizer state; ddp: everything)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    p.add_argument("--device", default="cpu", help="every worker's device (cuda: islands share the GPU as processes)")
    p.add_argument(
        "--precision",
        choices=[p.value for p in Precision],
        default=Precision.AUTO.value,
        help="auto (bf16 autocast on accelerators that have it), bf16 or fp32",
    )
    p.add_argument(
        "--hostile-islands",
        type=int,
        default=0,
        help="replace the last this many islands by misbehaving clients with the job's token, for the whole run: "
        "huge and Inf deltas, absurd step times and inner steps, thousands of island ids (diloco.local.hostile)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="give up a mode after this many seconds")
    p.add_argument("--out", type=Path, default=Path("out/run"))
    p.add_argument("--quiet", action="store_true", help="no progress bar, no sample of the final model")
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="after --: a loop of one's own (through Learner.from_env) as every island's worker, e.g. -- python "
        "train.py; the built-in trainer's options (--steps, --batch-size, --preset, --data, --max-data-bytes, "
        "--eval-every, --precision) then do not apply",
    )
    p.set_defaults(func=run)
