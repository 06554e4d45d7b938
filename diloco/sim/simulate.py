"""`diloco simulate`: goodput, uptime and link bandwidth of a training job at datacenter scale, per policy.

Sizes a job before paying for it: N chips in M islands under per-chip interruptions, replayed through
non-elastic and elastic data-parallel, synchronous DiLoCo and Decoupled DiLoCo (`diloco.sim.engine`), plus
the bandwidth each scheme needs to keep compute busy (`diloco.sim.bandwidth`). With no arguments it reproduces
the published Decoupled DiLoCo scenarios and writes a table, a PNG and a short report under out/simulate/.
The model's assumptions: docs/simulator.md.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from diloco.core.config import Encoding
from diloco.core.encoding import bits_per_value
from diloco.local.failure_trace import load_trace, save_trace
from diloco.logs import setup_logging
from diloco.sim import bandwidth
from diloco.sim.engine import (
    SIM_TRAINING,
    MergeWait,
    Policy,
    PolicyResult,
    SimConfig,
    SimResult,
    sample_failures,
    simulate,
)

log = logging.getLogger("diloco.sim.simulate")

DEFAULT_CHIPS = (150_000, 300_000, 600_000, 900_000, 1_200_000, 1_800_000, 2_400_000)
DEFAULT_ISLANDS = (8, 16)
DEFAULT_MODEL_PARAMS = (1e9, 1e10, 1e11)

# Decoupled DiLoCo (arXiv 2604.21428), one-year per-chip MTBI: goodput in percent by (chips, islands).
PUBLISHED: dict[tuple[int, int], dict[Policy, float]] = {
    (1_200_000, 8): {Policy.DP: 27, Policy.ELASTIC_DP: 58, Policy.DECOUPLED_DILOCO: 88},
    (2_400_000, 8): {Policy.DP: 18, Policy.ELASTIC_DP: 40, Policy.DECOUPLED_DILOCO: 80},
    (2_400_000, 16): {Policy.DECOUPLED_DILOCO: 86},
}
_DP_POLICIES = (Policy.DP, Policy.ELASTIC_DP)


@dataclass(frozen=True)
class Point:
    """One policy at one fleet size and learner count."""

    chips: int
    islands: int
    result: PolicyResult

    @property
    def line(self) -> str:
        return line_label(self.result.policy, self.islands)


def line_label(policy: Policy, islands: int) -> str:
    """Data-parallel lines do not depend on M; DiLoCo lines are one per learner count."""
    return policy.label if policy in _DP_POLICIES else f"{policy.label} M={islands}"


def sweep(
    base: SimConfig,
    chips: Sequence[int],
    islands: Sequence[int],
    trace_path: str | None = None,
    jobs: int = 1,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[Point], dict[int, float]]:
    """Every requested policy at every fleet size, on `jobs` processes; also the seconds each fleet size took.

    Data-parallel policies run only at the first M, since M does not change them.
    """
    trace = tuple(load_trace(trace_path)) if trace_path else None
    configs = []  # the costliest (most islands) first, so parallel workers finish together
    for index, m in sorted(enumerate(islands), key=lambda pair: -pair[1]):
        policies = tuple(p for p in base.policies if index == 0 or p not in _DP_POLICIES)
        for n in chips if policies else ():
            configs.append(replace(base, chips=n, islands=m, policies=policies, trace=trace))
    points: list[Point] = []
    seconds: dict[int, float] = {}

    def collect(result: SimResult, elapsed: float) -> None:
        config = result.config
        points.extend(Point(config.chips, config.islands, r) for r in result.policies)
        seconds[config.chips] = seconds.get(config.chips, 0.0) + elapsed
        log.debug("simulated", extra={"chips": config.chips, "islands": config.islands, "seconds": elapsed})
        if progress is not None:
            progress(sum(len(r.runs) for r in result.policies))

    if jobs <= 1:
        for config in configs:
            collect(*_timed_simulate(config))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for future in as_completed([pool.submit(_timed_simulate, c) for c in configs]):
                collect(*future.result())
    points.sort(key=lambda p: (p.chips, p.islands, list(Policy).index(p.result.policy)))
    return points, seconds


def _timed_simulate(config: SimConfig) -> tuple[SimResult, float]:
    started = time.perf_counter()
    result = simulate(config)
    return result, time.perf_counter() - started


def runs_in(base: SimConfig, chips: Sequence[int], islands: Sequence[int], traced: bool) -> int:
    """How many (seed, policy) runs `sweep` will make, for the progress bar."""
    samples = 1 if traced else len(base.seeds)
    dp = sum(1 for p in base.policies if p in _DP_POLICIES)
    diloco = len(base.policies) - dp
    return samples * len(chips) * (dp + diloco * len(islands))


def _pct(value: float, spread: float | None = None) -> str:
    return f"{100 * value:.1f}" if spread is None else f"{100 * value:.1f} ± {100 * spread:.1f}"


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def metric_table(points: Sequence[Point], metric: str) -> str:
    """Chips down, one column per policy line; `metric` is "goodput" or "uptime" (percent, mean ± std)."""
    lines = list(dict.fromkeys(p.line for p in points))
    chips = sorted({p.chips for p in points})
    cell = {(p.chips, p.line): p.result for p in points}
    rows = []
    for n in chips:
        row = [f"{n:,}"]
        for line in lines:
            r = cell.get((n, line))
            row.append("-" if r is None else _pct(getattr(r, metric), getattr(r, f"{metric}_std")))
        rows.append(row)
    return _markdown(["chips", *lines], rows)


@dataclass(frozen=True)
class Comparison:
    """A published figure beside what this simulator gives for the same scenario."""

    chips: int
    islands: int
    line: str
    published: float
    ours: PolicyResult

    @property
    def scenario(self) -> str:
        return f"{self.chips / 1e6:g}M chips, M={self.islands}"


def published_comparison(points: Sequence[Point]) -> list[Comparison]:
    """Every published figure this sweep covers (data-parallel points stand for any M)."""
    found = []
    for (n, m), figures in PUBLISHED.items():
        for policy, published in figures.items():
            for p in points:
                if p.chips == n and p.result.policy is policy and (p.islands == m or policy in _DP_POLICIES):
                    found.append(Comparison(n, m, line_label(policy, m), published, p.result))
                    break
    return found


def published_table(rows: Sequence[Comparison]) -> str:
    body = [
        [
            c.scenario,
            c.line,
            f"{c.published:g}",
            _pct(c.ours.goodput, c.ours.goodput_std),
            f"{100 * c.ours.goodput - c.published:+.1f}",
        ]
        for c in rows
    ]
    return _markdown(["scenario", "policy", "published goodput %", "ours %", "ours − published"], body)


def bandwidth_table(
    params_list: Sequence[float],
    step_s: float | None,
    config: SimConfig,
    utilisation: float,
    link_mbps: float,
    sites: int,
) -> str:
    """One row per scheme: Gbit/s per site needed for `utilisation`, then the utilisation `link_mbps` gives
    (the knob `diloco run --link-mbps` shapes its islands' links with)."""
    link_gbps = link_mbps / 1000
    schemes = [bandwidth.data_parallel(), bandwidth.diloco(100), bandwidth.streaming_diloco(100, 4, 5)]
    training = config.training
    simulated = bandwidth.streaming_diloco(
        training.inner_steps,
        training.fragments,
        training.overlap_steps,
        bits_per_value(training.encoding, training.block_size, training.top_k),
    )
    if simulated not in schemes:
        schemes.append(simulated)
    steps = [step_s if step_s is not None else bandwidth.step_seconds(params) for params in params_list]
    sizes = [f"{params / 1e9:g}B ({step:.3g} s/step)" for params, step in zip(params_list, steps)]
    rows = []
    for scheme in schemes:
        need = [bandwidth.required_gbps(scheme, n, step, utilisation, sites) for n, step in zip(params_list, steps)]
        got = [bandwidth.utilisation_at(scheme, n, step, link_gbps, sites) for n, step in zip(params_list, steps)]
        rows.append([scheme.name, *(f"{g:.3g}" for g in need), " / ".join(_pct(u) for u in got)])
    header = [
        "scheme",
        *(f"Gbit/s for {100 * utilisation:g}%: {size}" for size in sizes),
        f"utilisation % at {link_gbps:g} Gbit/s",
    ]
    return _markdown(header, rows)


def plot(points: Sequence[Point], path: Path, title: str, with_published: bool) -> None:
    """Goodput against chip count, one line per policy, published figures as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {}
    for line in dict.fromkeys(p.line for p in points):
        mine = sorted((p for p in points if p.line == line), key=lambda p: p.chips)
        handle = ax.errorbar(
            [p.chips / 1e6 for p in mine],
            [100 * p.result.goodput for p in mine],
            yerr=[100 * p.result.goodput_std for p in mine],
            marker="o",
            markersize=3,
            capsize=2,
            label=line,
        )
        colours[line] = handle.lines[0].get_color()
    for index, c in enumerate(published_comparison(points) if with_published else []):
        ax.plot(
            [c.chips / 1e6],
            [c.published],
            "x",
            color=colours[c.line],
            markersize=9,
            mew=2,
            label="published (arXiv 2604.21428)" if index == 0 else None,
        )
    ax.set_xlabel("chips (millions)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_csv(points: Sequence[Point], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["chips", "islands", "policy", "goodput", "goodput_std", "uptime", "uptime_std", "runs"])
        for p in points:
            r = p.result
            writer.writerow(
                [
                    p.chips,
                    p.islands,
                    r.policy.value,
                    f"{r.goodput:.5f}",
                    f"{r.goodput_std:.5f}",
                    f"{r.uptime:.5f}",
                    f"{r.uptime_std:.5f}",
                    len(r.runs),
                ]
            )


def reproduces_published(config: SimConfig, trace_path: str | None) -> bool:
    """The published figures assume sampled failures at a one-year per-chip MTBI."""
    return trace_path is None and config.mtbi_years == 1


def settings_line(config: SimConfig, trace_path: str | None) -> str:
    training = config.training
    failures = (
        f"trace {trace_path}"
        if trace_path
        else (f"per-chip MTBI {config.mtbi_years:g} year(s), seeds {', '.join(map(str, config.seeds))}")
    )
    return (
        f"{failures}; horizon {config.horizon_hours:g} h; step {', '.join(f'{s:g}' for s in config.step_seconds)} s; "
        f"replacement ready after {config.reschedule_seconds:g} s; full restart {config.restart_seconds:g} s; re-form "
        f"{config.reform_seconds:g} s; checkpoint every {config.checkpoint_steps} step(s); a failure takes out "
        f"{config.failure_chips} chips (elastic); DiLoCo H={training.inner_steps}, P={training.fragments}, "
        f"tau={training.overlap_steps}, K={training.quorum}, "
        + ("grace from slack" if training.grace_seconds is None else f"grace {training.grace_seconds:g} s")
        + ("; a learner waits for a merge only a round after its push" if config.merge_wait is MergeWait.ROUND else "")
        + (f"; merge reaches islands after {config.sync_latency_seconds:g} s" if config.sync_latency_seconds else "")
        + (
            ""
            if config.instant_failure_detection
            else f"; a down learner counts as live for {training.island_timeout_seconds:g} s"
        )
        + (f"; start-up {config.startup_seconds:g} s" if config.startup_seconds else "")
        + ("; failures during a recovery start it over" if config.interrupt_recovery else "")
    )


def report(
    config: SimConfig,
    trace_path: str | None,
    points: Sequence[Point],
    bandwidth_md: str,
    seconds: float,
    largest: tuple[int, float],
) -> str:
    """The markdown a user reads: what was simulated, the figures, and what they rest on."""
    parts = [
        "# Goodput and bandwidth at scale (`diloco simulate`)",
        "",
        f"Settings: {settings_line(config, trace_path)}.",
        "",
        "Goodput is the share of wall-clock chip time spent on steps that end in the model; uptime is the "
        "share of chip time in groups that are up (training or waiting at a barrier). Mean ± standard "
        "deviation over the seeds. The assumptions behind every number, and which of them were chosen to "
        "match the published figures, are in docs/simulator.md.",
        "",
    ]
    comparison = published_comparison(points) if reproduces_published(config, trace_path) else []
    if comparison:
        parts += ["## Published scenarios", "", published_table(comparison), ""]
    parts += [
        "## Goodput (%) against fleet size",
        "",
        metric_table(points, "goodput"),
        "",
        "![goodput against chips](goodput.png)",
        "",
        "## Uptime (%)",
        "",
        metric_table(points, "uptime"),
        "",
        "## Bandwidth between sites",
        "",
        "Per site, ring all-reduce between sites. Without --step-seconds the step time follows from compute "
        "(6 × parameters × 2M tokens at 2·10^17 FLOP/s per site): it then grows with the model as fast as "
        "the payload does, so the Gbit/s per site do not depend on model size.",
        "",
        bandwidth_md,
        "",
        assumptions_md(),
        "",
        "## Reading it",
        "",
        "- Non-elastic data-parallel stops every chip for every interruption; its goodput falls as "
        "1/(1 + N·cost/MTBI): doubling the fleet halves the time between stalls.",
        "- Elastic data-parallel only pauses to re-form, but still pauses everyone, twice per failure.",
        "- Decoupled DiLoCo stops one learner in M: its loss per failure is 1/M of the fleet's, and no merge "
        "waits for a dead learner. Synchronous DiLoCo has the same per-learner loss but every learner waits "
        "at each outer step for the slowest, so a failure anywhere still stalls everyone.",
        "- More islands help Decoupled DiLoCo (each failure idles a smaller share) at the price of more "
        "syncer traffic; the bandwidth table shows what the sync schedule costs on the link.",
        "",
        f"Simulated in {seconds:.1f} s of wall-clock time on this machine; the largest fleet ({largest[0]:,} "
        f"chips, every policy and seed) took {largest[1]:.1f} s of compute.",
        "",
    ]
    return "\n".join(parts)


def assumptions_md() -> str:
    """Which defaults were chosen to match the published figures, and what the figures actually pin down."""
    d = SimConfig()
    gap = 1 / d.fleet_rate  # seconds between interruptions of the default 1.2M-chip fleet
    figures = PUBLISHED[(d.chips, d.islands)]

    def cost(policy: Policy, interval: float) -> float:
        return interval * (100 / figures[policy] - 1)

    step = d.step_seconds[0]
    h = d.training.inner_steps
    learner_cost = d.reschedule_seconds + d.reform_seconds + h / 2 * step
    long_h_cost = d.reschedule_seconds + d.reform_seconds + 50 * step
    return "\n".join(
        [
            "## Assumptions chosen to match the published figures",
            "",
            f"At a one-year MTBI, {d.chips / 1e6:g}M chips see an interruption every {gap:.1f} s. Each published "
            "figure pins one number, the chip time an interruption costs, through goodput ≈ 1 / (1 + cost / "
            f"interval): {figures[Policy.DP]}% for data-parallel means ≈ {cost(Policy.DP, gap):.0f} s of the whole "
            f"fleet, {figures[Policy.ELASTIC_DP]}% for elastic data-parallel ≈ {cost(Policy.ELASTIC_DP, gap):.0f} s "
            f"of the whole fleet, {figures[Policy.DECOUPLED_DILOCO]}% for Decoupled DiLoCo with {d.islands} islands "
            f"≈ {cost(Policy.DECOUPLED_DILOCO, d.islands * gap):.0f} s of one island. The defaults split these "
            "totals as follows; the split is our choice, only the totals are constrained.",
            "",
            f"- data-parallel: replacement {d.reschedule_seconds:g} s + full job restart {d.restart_seconds:g} s + "
            "half a step rolled back (checkpoint every step, in memory) ≈ "
            f"{d.reschedule_seconds + d.restart_seconds + step / 2:g} s;",
            f"- elastic data-parallel: two re-forms of {d.reform_seconds:g} s (without the failed replica, then "
            f"with its replacement), each losing half a step ≈ {2 * (d.reform_seconds + step / 2):g} s;",
            f"- Decoupled DiLoCo: replacement {d.reschedule_seconds:g} s + re-form {d.reform_seconds:g} s + each "
            f"fragment's progress since its last push (H/2 = {h / 2:g} steps of {step:g} s) ≈ {learner_cost:g} s, "
            f"on the failed learner only. H = {h} is short for DiLoCo: with H = 100 the rollback alone "
            f"would cost ≈ {50 * step:g} s and Decoupled DiLoCo would land below "
            f"{100 / (1 + long_h_cost / (d.islands * gap)):.0f}% at {d.chips / 1e6:g}M chips.",
            "- Interruptions strike running hardware only: a group already down absorbs them. If failures during "
            "a recovery extended it instead, non-elastic data-parallel would keep only e^(−N·cost/MTBI) ≈ "
            f"{100 * math.exp(-(d.reschedule_seconds + d.restart_seconds) / gap):.0f}%, far below the published "
            f"{figures[Policy.DP]}%.",
        ]
    )


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(float(v)) for v in text.split(",") if v.strip())


def _policies(text: str) -> tuple[Policy, ...]:
    try:
        return tuple(Policy(v.strip()) for v in text.split(",") if v.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}; choose from {', '.join(p.value for p in Policy)}") from None


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The base configuration; chips and islands are set per point of the sweep."""
    timeout = args.island_timeout_seconds
    training = SIM_TRAINING.updated(
        inner_steps=args.inner_steps,
        fragments=args.fragments,
        overlap_steps=args.overlap_steps,
        quorum=args.quorum,
        grace_seconds=args.grace_seconds,
        encoding=args.encoding,
        top_k_fraction=args.top_k_fraction,
        speed_aware=args.speed_aware,
        **({} if timeout is None else {"island_timeout_seconds": timeout}),
    )
    return SimConfig(
        chips=max(args.chips),
        islands=args.islands[0],
        mtbi_years=args.mtbi_years,
        horizon_hours=args.horizon_hours,
        seeds=tuple(range(args.seeds)),
        policies=args.policies,
        step_seconds=args.step_seconds or (1.0,),
        failure_chips=args.failure_chips,
        reschedule_seconds=args.reschedule_seconds,
        restart_seconds=args.restart_seconds,
        reform_seconds=args.reform_seconds,
        checkpoint_steps=args.checkpoint_steps,
        training=training,
        merge_wait=MergeWait(args.merge_wait),
        instant_failure_detection=timeout is None,
        startup_seconds=args.startup_seconds,
        interrupt_recovery=args.interrupt_recovery,
        sync_latency_seconds=args.sync_latency_seconds,
    )


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level or os.environ.get("DILOCO_LOG_LEVEL") or "WARNING")
    try:
        base = config_from_args(args)
        bandwidth_md = bandwidth_table(
            args.model_params,
            args.step_seconds[0] if args.step_seconds else None,
            base,
            args.utilisation,
            args.link_mbps,
            args.sites,
        )
    except ValueError as error:
        print(f"diloco simulate: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log.info("simulating", extra={"chips": list(args.chips), "islands": list(args.islands), "out": str(out)})

    total = runs_in(base, args.chips, args.islands, traced=args.trace is not None)
    bar = tqdm(
        total=total, desc="simulate", unit="run", file=sys.stderr, disable=args.no_progress or not sys.stderr.isatty()
    )
    started = time.perf_counter()
    try:
        points, per_fleet = sweep(base, args.chips, args.islands, args.trace, args.jobs, bar.update)
    except (OSError, ValueError) as error:
        print(f"diloco simulate: {error}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    largest = max(args.chips)

    if args.save_trace and not args.trace:
        save_trace(args.save_trace, sample_failures(replace(base, chips=largest), base.seeds[0]).events())

    comparison = published_comparison(points) if reproduces_published(base, args.trace) else []

    write_csv(points, out / "goodput.csv")
    failures = f"trace {Path(args.trace).name}" if args.trace else f"per-chip MTBI {base.mtbi_years:g} year(s)"
    title = f"Goodput under interruptions: {failures}, {base.horizon_hours:g} h simulated"
    plot(points, out / "goodput.png", title, bool(comparison))
    text = report(base, args.trace, points, bandwidth_md, seconds, (largest, per_fleet[largest]))
    (out / "report.md").write_text(text)

    if comparison:
        print("Published scenarios (goodput %):\n" + published_table(comparison) + "\n")
    print("Goodput (%) against fleet size:\n" + metric_table(points, "goodput") + "\n")
    print("Bandwidth between sites:\n" + bandwidth_md + "\n")
    print(
        f"{len(points)} points in {seconds:.1f} s on {args.jobs} process(es); {largest:,} chips took "
        f"{per_fleet[largest]:.1f} s of compute; "
        f"wrote {out / 'report.md'}, {out / 'goodput.png'}, {out / 'goodput.csv'}"
    )
    log.info("done", extra={"seconds": seconds, "points": len(points)})
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    d = SimConfig()
    parser = subparsers.add_parser(
        "simulate",
        help="goodput and bandwidth of a job at datacenter scale, per failure policy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fleet = parser.add_argument_group("fleet and failures")
    add = fleet.add_argument
    add("--chips", type=_ints, default=DEFAULT_CHIPS, help="chip counts, comma-separated")
    add("--islands", type=_ints, default=DEFAULT_ISLANDS, help="island counts M, comma-separated")
    add("--mtbi-years", type=float, default=d.mtbi_years, help="mean time between interruptions of one chip")
    add(
        "--trace",
        help="failure trace (JSON, as `diloco run` writes and replays; chip:<n>, learner:<i> or "
        "worker:island-<i>/<rank> targets) to replay instead of sampling",
    )
    add("--save-trace", help="write the sampled failures of the largest fleet (first seed) as a trace (chip targets)")
    add("--seeds", type=int, default=len(d.seeds), help="independent failure samples per point")
    add("--horizon-hours", type=float, default=d.horizon_hours, help="simulated wall-clock time")
    add(
        "--failure-chips",
        type=int,
        default=d.failure_chips,
        help="chips one interruption takes out of an elastic job (the model replica it belongs to)",
    )
    add("--reschedule-seconds", type=float, default=d.reschedule_seconds, help="seconds until a replacement is ready")
    add(
        "--restart-seconds",
        type=float,
        default=d.restart_seconds,
        help="seconds for a full restart of a non-elastic job",
    )
    add(
        "--reform-seconds",
        type=float,
        default=d.reform_seconds,
        help="seconds to re-form a group after a membership change",
    )
    add(
        "--startup-seconds",
        type=float,
        default=d.startup_seconds,
        help="seconds every group spends starting before step one",
    )
    add(
        "--interrupt-recovery",
        action="store_true",
        help="an interruption of a group that is down or restarting starts its recovery over (default: absorbed)",
    )
    policy = parser.add_argument_group("policies")
    add = policy.add_argument
    add(
        "--policies",
        type=_policies,
        default=d.policies,
        help=f"comma-separated, from {', '.join(p.value for p in Policy)}",
    )
    add(
        "--step-seconds",
        type=_floats,
        default=None,
        help="step time per hardware generation, dealt to islands round-robin (default 1); the first one is "
        "also the bandwidth table's step time, which otherwise follows from compute",
    )
    add("--checkpoint-steps", type=int, default=d.checkpoint_steps, help="data-parallel checkpoint interval")
    job = d.training
    add("--inner-steps", type=int, default=job.inner_steps, help="H: inner steps between two pushes of a fragment")
    add("--fragments", type=int, default=job.fragments, help="P: fragments, pushed staggered by H/P steps")
    add("--overlap-steps", type=int, default=job.overlap_steps, help="tau: steps a push may stay unmerged")
    add(
        "--merge-wait",
        default=d.merge_wait.value,
        choices=[w.value for w in MergeWait],
        help="overlap: a learner waits for its push's merge after tau steps; round: only a round later, when the "
        "fragment is due again (diloco run's decoupled worker)",
    )
    add("--encoding", default=job.encoding.value, choices=[e.value for e in Encoding], help="of outer gradients")
    add("--top-k-fraction", type=float, default=job.top_k_fraction, help="share of values the sparse encoding sends")
    add("--quorum", type=int, default=job.quorum, help="K: pushes a merge waits for (capped by live islands)")
    add(
        "--grace-seconds",
        type=float,
        default=job.grace_seconds,
        help="the most seconds a merge waits for more once K are in (unset: 0.8 of the pushes' slack)",
    )
    add(
        "--speed-aware",
        action=argparse.BooleanOptionalAction,
        default=job.speed_aware,
        help="decoupled learners of a slower generation run fewer inner steps per round, at the fastest's cadence",
    )
    add(
        "--sync-latency-seconds",
        type=float,
        default=d.sync_latency_seconds,
        help="seconds from a merge until the islands that pushed have its result",
    )
    add(
        "--island-timeout-seconds",
        type=float,
        default=None,
        help="seconds the syncer still counts a learner that went down as live (quorum cap, grace window); "
        "by default it learns of a failure at once",
    )
    bw = parser.add_argument_group("bandwidth")
    add = bw.add_argument
    add("--model-params", type=_floats, default=DEFAULT_MODEL_PARAMS, help="model sizes, comma-separated")
    add("--link-mbps", type=float, default=5000.0, help="link speed per site (Mbit/s) to report utilisation at")
    add("--utilisation", type=float, default=0.95, help="target compute utilisation")
    add("--sites", type=int, default=2, help="sites (datacenters) exchanging over the link")
    parser.add_argument("--out", default="out/simulate", help="directory for report.md, goodput.png, goodput.csv")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes to simulate on")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--log-level", help="log level (default WARNING, or DILOCO_LOG_LEVEL)")
    parser.set_defaults(func=run)
