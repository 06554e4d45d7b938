"""Mixed hardware: four islands of different speeds, and the wall-clock time each mode takes to reach one
held-out loss. Decoupled DiLoCo with a fixed H, decoupled DiLoCo with speed-aware islands (the default), the
synchronous-DiLoCo baseline (a barrier at every sync) and the `ddp` baseline (an all-reduce every step) train
with the same `--slowdown` factors (an island with factor 3 takes three times as long per step, as older
hardware does), each launched by `diloco run` as users run it, for the same wall time: the slowest island's
`--steps`. A job's islands train until the job ends, so a decoupled island three times faster takes three
times the steps in that time (`diloco run --equal-time`); in the baselines every island takes `--steps`, as
their barrier holds each to the slowest's pace.

The islands share this machine's cores, so each emulates a device whose step takes `--reference-step-seconds`
times its factor (`diloco.worker.slowdown`): a slow island is then as slow in every mode, whether the others
compute beside it or wait at a barrier. A step whose compute outlasts that is an overrun, counted per mode: a
mode with many was bound by the machine, not by its slowest island, and its ratio says little.

A mode's loss at a moment is the lowest of the islands' latest held-out losses (each island's own model,
measured every `--eval-every` steps): the best model the job holds then (in the baselines every island holds
the same one, give or take a round). Time counts from the first island's start of training, so the start-up
of processes, alike in every mode, does not dilute the ratios. The target is `--target`, or else the highest
of the modes' lowest losses, so that every mode reaches it. Prints, per speed profile, each mode's time to the
target beside ours (speed-aware) and the ratios, and writes a plot of loss against wall time per mode.

  Targets on 1,1,1,3: speed-aware decoupled reaches the loss >= 1.5x sooner than sync-diloco, >= 2x sooner
  than ddp.

Both profiles, four modes each, take about 8 minutes at the defaults on 2 CPU cores with little else
running; the load average is printed at the start and the end, since every time here depends on it. A mode
that runs out of `--timeout` keeps the curve it has (its time to the target may then be infinite).

Usage: python bench/mixed_hardware.py [--profiles 1,1,1,3 1,1,2,2] [--steps N] [--target LOSS] ...
Exit status 1 when a target is missed (the figures are printed either way).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import figures
import training

from diloco.progress import EvalEvent, StartEvent, StepEvent, read_events
from diloco.settings import DEFAULT_CORPUS_BYTES

OURS = "speed-aware"
MODES = ("fixed-h", OURS, "sync-diloco", "ddp")
"""Decoupled with a fixed H, decoupled speed-aware, then the two baselines."""
COLORS = dict(zip(MODES, ("tab:blue", "tab:orange", "tab:green", "tab:red")))

Curve = list[tuple[float, float]]
"""(seconds since the first island started training, the lowest of the islands' latest held-out losses)."""


def curve(progress: Path) -> Curve:
    """The mode's loss over wall time: at each island's evaluation, the lowest of every island's latest."""
    events = read_events(progress)
    started = min(e.t for e in events if isinstance(e, StartEvent))
    latest: dict[str, float] = {}
    points = []
    for e in sorted((e for e in events if isinstance(e, EvalEvent)), key=lambda e: e.t):
        latest[e.source.island] = e.loss
        points.append((e.t - started, min(latest.values())))
    return points


def time_to(points: Curve, target: float) -> float:
    """The first time the curve is at or below `target` (inf when it never is)."""
    return next((t for t, loss in points if loss <= target), math.inf)


def shape(args: argparse.Namespace, slowdown: str) -> list[str]:
    """The training benchmarks' run shape, one island per speed factor, each at its factor."""
    islands = argparse.Namespace(**{**vars(args), "islands": len(slowdown.split(","))})
    options = ["--slowdown", slowdown, "--equal-time", "--eval-every", str(args.eval_every)]
    options += ["--timeout", str(args.timeout)]
    return [*training.shape(islands), *options]


def overruns(progress: Path) -> float:
    """The share of the mode's steps whose compute outlasted the emulated device's step."""
    steps = [e for e in read_events(progress) if isinstance(e, StepEvent)]
    return sum(e.overran for e in steps) / max(1, len(steps))


def run_profile(args: argparse.Namespace, slowdown: str) -> tuple[dict[str, Curve], dict[str, dict]]:
    """Every mode on one speed profile: the curves and `diloco run`'s summaries (with each mode's share of
    overrun steps), by mode."""
    out = args.out / slowdown.replace(",", "-")
    compared = training.diloco_run(out / "compare", "--compare", *shape(args, slowdown), timeouts_ok=True)
    summaries = {s["mode"]: s for s in compared}
    summaries[OURS] = summaries.pop("diloco")
    (summaries["fixed-h"],) = training.diloco_run(
        out / "fixed-h", "--no-speed-aware", *shape(args, slowdown), timeouts_ok=True
    )
    folders = {OURS: out / "compare" / "diloco", "fixed-h": out / "fixed-h" / "diloco"}
    folders |= {mode: out / "compare" / mode for mode in ("sync-diloco", "ddp")}
    curves = {mode: curve(folders[mode] / "progress") for mode in MODES}
    for mode in MODES:
        summaries[mode]["overruns"] = overruns(folders[mode] / "progress")
    return curves, summaries


def target_loss(curves: dict[str, Curve]) -> float:
    """The highest of the modes' lowest losses: one every mode reaches."""
    return max(min((loss for _, loss in points), default=math.inf) for points in curves.values())


def report(slowdown: str, curves: dict[str, Curve], summaries: dict[str, dict], target: float) -> dict[str, float]:
    """Prints each mode's time to the target beside ours; returns the ratios baseline time / ours."""
    times = {mode: time_to(curves[mode], target) for mode in MODES}
    ours = times[OURS]
    print(f"\nspeed factors {slowdown}: wall seconds to a held-out loss of {target:.3f}")
    ratios = {}
    for mode in MODES:
        s = summaries[mode]
        ratio = times[mode] / ours if math.isfinite(ours) else math.nan
        ratios[mode] = ratio
        steps = s.get("round_steps") or {}
        paced = f", steps per round {'/'.join(f'{n:.1f}' for n in steps.values())}" if steps else ""
        print(
            f"  {mode:>11}: {times[mode]:7.1f} s  ({ratio:.2f}x ours; run {s['wall_seconds']:.0f} s, final loss "
            f"{s['final_loss']:.3f}, islands/merge {s['islands_per_merge']:.2f}{paced}, overrun steps "
            f"{s['overruns']:.0%})"
        )
    return ratios


def plot(path: Path, results: Sequence[tuple[str, dict[str, Curve], float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (slowdown, curves, target) in zip(axes[0], results):
        for mode in MODES:
            if curves[mode]:
                ax.plot(*zip(*curves[mode]), label=mode, marker=".", linewidth=1, color=COLORS[mode])
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:.3f}")
        ax.set_title(f"speed factors {slowdown}", fontsize=10)
        ax.set_xlabel("wall seconds")
        ax.set_ylabel("held-out loss (lowest of the islands' latest)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figures.save(fig, path)


def load_average() -> str:
    """The machine's 1, 5 and 15-minute load averages."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profiles", nargs="+", default=["1,1,1,3", "1,1,2,2"], help="per-island slowdown factors")
    p.add_argument("--steps", type=int, default=36, help="inner steps of the slowest island")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=6, help="H")
    p.add_argument("--fragments", type=int, default=2, help="P")
    p.add_argument("--eval-every", type=int, default=6)
    p.add_argument(
        "--reference-step-seconds", type=float, default=0.5, help="the emulated full-speed device's step time"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu", help="cuda: the islands share the machine's GPUs as processes")
    p.add_argument("--precision", default="auto", help="auto (bf16 on accelerators), bf16 or fp32")
    p.add_argument("--max-data-bytes", type=int, default=DEFAULT_CORPUS_BYTES, help="of the embedded corpus")
    p.add_argument("--target", type=float, help="held-out loss to reach (default: one every mode reaches)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up a mode after this many seconds")
    p.add_argument("--out", type=Path, default=Path("out/bench/mixed_hardware"), help="the runs")
    p.add_argument("--png", type=Path, default=Path("out/bench/mixed_hardware.png"))
    args = p.parse_args()
    started = time.perf_counter()
    print(f"mixed_hardware: load average {load_average()} on {os.cpu_count()} cores at the start", flush=True)
    results, met = [], []
    for slowdown in args.profiles:
        curves, summaries = run_profile(args, slowdown)
        target = args.target if args.target is not None else target_loss(curves)
        ratios = report(slowdown, curves, summaries, target)
        results.append((slowdown, curves, target))
        if slowdown == "1,1,1,3":
            met += [
                training.verdict(
                    ratios["sync-diloco"] >= 1.5, f"sync-diloco / ours = {ratios['sync-diloco']:.2f} >= 1.5"
                ),
                training.verdict(ratios["ddp"] >= 2, f"ddp / ours = {ratios['ddp']:.2f} >= 2"),
            ]
    plot(args.png, results)
    print(
        f"({time.perf_counter() - started:.0f} s, load average {load_average()} at the end; runs under {args.out}, "
        f"plot {args.png})"
    )
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
