"""Training benchmarks of `diloco run`, each printing ours beside its baseline measured in the same run, and
their ratio, and writing a PNG under out/bench/. Every mode is launched by `diloco run` itself (the same
processes, trace and accounting as `diloco run --compare`), so what is measured is what users run.

  loss       held-out loss of the exported model at equal tokens: decoupled DiLoCo vs `sync-diloco` and `ddp`
             (4 islands), over seeds, quiet and with one island's steps jittered, beside the islands' own
             models and the islands per merge; then decoupled DiLoCo with sparse outer gradients beside int4
             (the job's default encoding). Targets: ours <= 1.01 x sync-diloco (means of the seeds), quiet
             and jittered; the global model no worse than the islands' own; >= 3.8 of 4 islands per merge,
             quiet; sparse <= 1.01 x int4's loss, with its bytes per token beside int4's and ddp's.
  step-time  training-step time of decoupled DiLoCo with syncing on vs off (off: H beyond the run, so no
             fragment ever falls due), in alternating repeats so a change of machine load hits both.
             Target: time(off) / time(on) >= 0.95.
  goodput    goodput under one seeded failure trace (kill -9 of workers, restart after a delay) for
             decoupled DiLoCo vs `sync-diloco` (a K = M barrier) vs `ddp` (restart from checkpoint), and the
             final loss of decoupled DiLoCo under the kills beside a run without them.
             Targets: ours >= 0.85 and >= 2 x each synchronous baseline; the loss within 1% of the run
             without kills.

On an accelerator (`--device cuda --preset medium`, precision auto = bf16) the islands share the GPUs as
processes. NCCL refuses two ranks on one GPU, so where there are fewer GPUs than islands the `ddp` baseline
runs as one process at the islands' global batch (islands x batch size): the same update a data-parallel
all-reduce of the islands' mean gradients computes, on the same tokens.

Usage: python bench/training.py {loss,step-time,goodput} [--islands N] [--steps N] [--device cuda] ...
Exit status 1 when a target is missed (the figures are printed either way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import figures

from diloco.cli import main as diloco_main
from diloco.core.config import TrainingConfig
from diloco.progress import StepEvent, read_events
from diloco.settings import DEFAULT_CORPUS_BYTES


def diloco_run(out: Path, *options: str, timeouts_ok: bool = False) -> list[dict]:
    """`diloco run` with these options; the summaries it wrote, one per mode (`timeouts_ok`: also when a mode
    ran out of its --timeout, which its summary then says)."""
    argv = ["run", "--quiet", "--out", str(out), *options]
    print(f"  diloco {' '.join(argv)}", flush=True)
    status = diloco_main(argv)
    if status != 0 and not (timeouts_ok and status == 1):
        raise SystemExit(f"diloco run failed or timed out: see {out}")
    return json.loads((out / "summary.json").read_text())


def shape(args: argparse.Namespace, seed: int | None = None) -> list[str]:
    return [
        "--islands",
        str(args.islands),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--inner-steps",
        str(args.inner_steps),
        "--fragments",
        str(args.fragments),
        "--seed",
        str(args.seed if seed is None else seed),
        "--preset",
        args.preset,
        "--device",
        args.device,
        "--precision",
        args.precision,
        "--max-data-bytes",
        str(args.max_data_bytes),
        *(["--reference-step-seconds", str(args.reference_step_seconds)] if args.reference_step_seconds else []),
    ]


def ddp_shares_a_device(args: argparse.Namespace) -> bool:
    """Whether the data-parallel baseline's ranks would have to share a GPU (which NCCL refuses)."""
    if not args.device.startswith("cuda"):
        return False
    import torch

    return torch.cuda.device_count() < args.islands


def compare_at_equal_tokens(
    args: argparse.Namespace, out: Path, *options: str, seed: int | None = None
) -> dict[str, dict]:
    """Every mode's summary on the same tokens: one `diloco run --compare`, or, where ddp's ranks would share
    a GPU, each DiLoCo mode on its own and ddp as one process at the global batch (see the module's doc)."""
    timeouts_ok = bool(args.mode_timeout)
    if timeouts_ok:
        options = (*options, "--timeout", str(args.mode_timeout))
    if not ddp_shares_a_device(args):
        summaries = diloco_run(out, "--compare", *options, *shape(args, seed), timeouts_ok=timeouts_ok)
        return {s["mode"]: s for s in summaries}
    ddp_shape = shape(args, seed)
    ddp_shape[ddp_shape.index("--islands") + 1] = "1"
    ddp_shape[ddp_shape.index("--batch-size") + 1] = str(args.islands * args.batch_size)
    (ddp,) = diloco_run(out / "ddp", "--mode", "ddp", *options, *ddp_shape, timeouts_ok=timeouts_ok)
    summaries = {"ddp": ddp}
    for mode in ("diloco", "sync-diloco"):
        (summaries[mode],) = diloco_run(
            out / mode, "--mode", mode, *options, *shape(args, seed), timeouts_ok=timeouts_ok
        )
    return summaries


def bar_chart(
    path: Path, title: str, ylabel: str, values: dict[str, float], line: tuple[float, str] | None = None
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    bars = ax.bar(
        list(values), list(values.values()), color=["tab:blue", "tab:orange", "tab:green", "tab:red"][: len(values)]
    )
    ax.bar_label(bars, fmt="%.3f", fontsize=8)
    if line is not None:
        ax.axhline(line[0], color="black", linestyle="--", linewidth=1, label=line[1])
        ax.legend(fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    figures.save(fig, path)


def verdict(passed: bool, what: str) -> bool:
    print(f"{'PASS' if passed else 'MISS'}: {what}")
    return passed


CONDITIONS = ("quiet", "jitter")
"""Each seed runs quiet, then with one island's steps jittered (--jitter): what the islands learn must not
depend on how their pushes happen to fall in time. --conditions picks fewer where a run's time is short (a
lease of an accelerator)."""


def jitter_option(args: argparse.Namespace) -> list[str]:
    """--jitter with the last island's steps jittered by args.jitter, the others steady."""
    return ["--jitter", ",".join(["0"] * (args.islands - 1) + [str(args.jitter)])]


def spread(values: list[float]) -> str:
    """Mean and range of a few runs."""
    return f"{statistics.mean(values):.4f} [{min(values):.4f}, {max(values):.4f}]"


def bench_loss(args: argparse.Namespace) -> bool:
    """Held-out loss of the exported model at equal tokens, over seeds, quiet and with jitter."""
    runs: dict[str, dict[str, list[dict]]] = {c: {} for c in args.conditions}
    for seed in args.seeds:
        for condition in args.conditions:
            options = ["--eval-every", str(args.eval_every), *(jitter_option(args) if condition == "jitter" else [])]
            out = args.out / "loss" / f"{condition}-seed{seed}"
            summaries = compare_at_equal_tokens(args, out, *options, seed=seed)
            for mode, summary in summaries.items():
                runs[condition].setdefault(mode, []).append(summary)
    tokens = runs[args.conditions[0]]["diloco"][0]["tokens_trained"]
    print(
        f"\nheld-out loss of the final model after {tokens} tokens per mode ({args.islands} islands, {args.preset} "
        f"preset on {args.device}, seeds {', '.join(map(str, args.seeds))}; jitter: island {args.islands - 1}'s "
        f"steps a random 0 to {2 * args.jitter:.0%} longer); mean [min, max]:"
    )
    met = []
    for condition in args.conditions:
        by_mode = runs[condition]
        loss = {mode: [s["final_loss"] for s in summaries] for mode, summaries in by_mode.items()}
        ours = by_mode["diloco"]
        per_merge = [s["islands_per_merge"] for s in ours]
        local = [s["islands_loss"] for s in ours]
        gap = [s["final_loss"] - s["islands_loss"] for s in ours]
        print(f"  {condition}:")
        for mode in ("diloco", "sync-diloco", "ddp"):
            print(f"    {mode:>11}: {spread(loss[mode])}; {throughput(by_mode[mode])}")
        print(
            f"    diloco islands per merge {spread(per_merge)} of {args.islands}; islands' own models "
            f"{spread(local)}; global minus islands' own {spread(gap)}"
        )
        vs_sync = statistics.mean(loss["diloco"]) / statistics.mean(loss["sync-diloco"])
        vs_ddp = statistics.mean(loss["diloco"]) / statistics.mean(loss["ddp"])
        print(f"    ratios of the means: diloco / sync-diloco {vs_sync:.4f}, diloco / ddp {vs_ddp:.4f}")
        met.append(verdict(vs_sync <= 1.01, f"{condition}: diloco / sync-diloco = {vs_sync:.4f} <= 1.01"))
        met.append(verdict(max(gap) <= 0, f"{condition}: the global model <= the islands' own in every run"))
        if condition == "quiet":
            met.append(verdict(min(per_merge) >= 3.8 * args.islands / 4, "quiet: islands per merge >= 3.8 of 4"))
    errorbar_chart(args.png_dir / "loss_vs_baselines.png", runs, args)
    if args.sparse:
        met.append(sparse_against_int4(args, runs["quiet"]["diloco"][0], runs["quiet"]["ddp"][0]))
    return all(met)


def throughput(summaries: list[dict]) -> str:
    """A mode's speed over its runs: tokens per second per island, MFU and wall time (and any run that ran out
    of its --mode-timeout, whose loss is then not at equal tokens)."""
    island = statistics.mean(s["tokens_per_second_per_island"] for s in summaries)
    mfus = [s["mfu"] for s in summaries if s["mfu"] is not None]
    wall = statistics.mean(s["wall_seconds"] for s in summaries)
    timed_out = sum(s["timed_out"] for s in summaries)
    return (
        f"{island:,.0f} tokens/s per island, MFU {format_mfu(statistics.mean(mfus) if mfus else None)}, "
        f"wall {wall:.0f} s" + (f", {timed_out} run(s) TIMED OUT" if timed_out else "")
    )


def sparse_against_int4(args: argparse.Namespace, int4: dict, ddp: dict) -> bool:
    """The sparse encoding beside int4 (quiet, the first seed): loss and bytes per token."""
    (sparse,) = diloco_run(
        args.out / "loss-sparse",
        "--encoding",
        "sparse",
        "--top-k-fraction",
        str(args.top_k_fraction),
        "--eval-every",
        str(args.eval_every),
        *shape(args, args.seeds[0]),
    )
    vs_int4 = sparse["final_loss"] / int4["final_loss"]
    print(
        f"sparse (top {args.top_k_fraction:.2%} of each block at 2 bits, error feedback): eval loss "
        f"{sparse['final_loss']:.4f}, ratio {vs_int4:.3f} to int4 (target <= 1.01); bytes per token: sparse "
        f"{sparse['comm_bytes_per_token']:.2f}, int4 {int4['comm_bytes_per_token']:.2f} "
        f"({int4['comm_bytes_per_token'] / sparse['comm_bytes_per_token']:.1f}x), ddp "
        f"{ddp['comm_bytes_per_token']:.0f} ({ddp['comm_bytes_per_token'] / sparse['comm_bytes_per_token']:.0f}x)"
    )
    return verdict(vs_int4 <= 1.01, f"sparse / int4 = {vs_int4:.3f} <= 1.01")


def errorbar_chart(path: Path, runs: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> None:
    """Per mode and condition, the mean final loss with the seeds' range as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ("diloco", "sync-diloco", "ddp")
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.38
    for k, condition in enumerate(runs):
        means, lows, highs = [], [], []
        for mode in modes:
            losses = [s["final_loss"] for s in runs[condition][mode]]
            mean = statistics.mean(losses)
            means.append(mean)
            lows.append(mean - min(losses))
            highs.append(max(losses) - mean)
        xs = [i + (k - 0.5) * width for i in range(len(modes))]
        bars = ax.bar(xs, means, width, yerr=[lows, highs], capsize=3, label=condition)
        ax.bar_label(bars, fmt="%.3f", fontsize=7, padding=6)
    ax.set_xticks(range(len(modes)), modes)
    low = min(min(s["final_loss"] for s in summaries) for c in runs.values() for summaries in c.values())
    ax.set_ylim(low * 0.97, None)
    ax.set_ylabel("held-out loss of the final model (nats/token)")
    ax.set_title(f"equal tokens, {args.islands} islands, seeds {', '.join(map(str, args.seeds))}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    figures.save(fig, path)


def format_mfu(mfu: float | None) -> str:
    return f"{mfu:.1%}" if mfu is not None else "n/a (no accelerator peak known)"


def step_seconds(out: Path) -> list[float]:
    """Every training step's wall time in a run (sync work on the training thread included)."""
    return [e.seconds for e in read_events(out / "diloco" / "progress") if isinstance(e, StepEvent)]


def bench_step_time(args: argparse.Namespace) -> bool:
    times: dict[str, list[float]] = {"on": [], "off": []}
    rates: dict[str, list[dict]] = {"on": [], "off": []}
    for repeat in range(args.repeats):
        for setting in ("off", "on"):
            h = args.steps + 1 if setting == "off" else args.inner_steps
            options = [*shape(args), "--eval-every", str(10**9)]
            options[options.index("--inner-steps") + 1] = str(h)
            if setting == "off":
                options[options.index("--fragments") + 1] = "1"
            rates[setting] += diloco_run(args.out / "step-time" / f"{setting}-{repeat}", *options)
            times[setting] += step_seconds(args.out / "step-time" / f"{setting}-{repeat}")
    on, off = statistics.mean(times["on"]), statistics.mean(times["off"])
    ratio = off / on
    print(
        f"\nmean training-step time over {len(times['on'])} steps each ({args.islands} islands, H={args.inner_steps}, "
        f"P={args.fragments}, {args.repeats} alternating repeats):"
    )
    print(
        f"step time: syncing on {on * 1000:.1f} ms, off {off * 1000:.1f} ms, "
        f"ratio off/on {ratio:.3f} (target >= 0.95); "
        f"medians {statistics.median(times['on']) * 1000:.1f} / {statistics.median(times['off']) * 1000:.1f} ms"
    )
    for setting, summaries in rates.items():
        island = statistics.mean(s["tokens_per_second_per_island"] for s in summaries)
        accelerator = statistics.mean(s["tokens_per_second_per_accelerator"] for s in summaries)
        mfus = [s["mfu"] for s in summaries if s["mfu"] is not None]
        print(
            f"syncing {setting}: {island:.0f} tokens/s per island, {accelerator:.0f} per accelerator, MFU "
            f"{format_mfu(statistics.mean(mfus) if mfus else None)} ({args.preset} preset on {args.device})"
        )
    bar_chart(
        args.png_dir / "step_time.png",
        "training-step time, syncing on vs off",
        "mean step time (ms)",
        {"syncing off": off * 1000, "syncing on": on * 1000},
    )
    return verdict(ratio >= 0.95, f"off/on = {ratio:.3f} >= 0.95")


def bench_goodput(args: argparse.Namespace) -> bool:
    summaries = {
        s["mode"]: s
        for s in diloco_run(
            args.out / "goodput",
            "--compare",
            "--eval-every",
            str(10**9),
            "--kill-every",
            str(args.kill_every),
            "--restart-after",
            str(args.restart_after),
            "--fail-until",
            str(args.fail_until),
            *shape(args),
        )
    }
    ours, sync, ddp = summaries["diloco"], summaries["sync-diloco"], summaries["ddp"]
    (calm,) = diloco_run(args.out / "goodput-no-kills", "--eval-every", str(10**9), *shape(args))
    print(
        f"\ngoodput on one failure trace ({ours['kills']} kills, restart after {args.restart_after:g} s, "
        f"{args.islands} islands):"
    )
    for s in (ours, sync, ddp):
        print(
            f"  {s['mode']:>11}: goodput {s['goodput']:.3f}, wall {s['wall_seconds']:.0f} s, eval loss "
            f"{s['final_loss']:.3f}, restarts {s['restarts']}"
        )
    print(
        f"goodput: ours {ours['goodput']:.3f} (target >= 0.85), sync-diloco {sync['goodput']:.3f} "
        f"(ratio {ours['goodput'] / sync['goodput']:.2f}), ddp {ddp['goodput']:.3f} "
        f"(ratio {ours['goodput'] / ddp['goodput']:.2f}) (targets >= 2)"
    )
    bar_chart(
        args.png_dir / "goodput.png",
        f"goodput under one failure trace ({ours['kills']} kills)",
        "goodput",
        {s["mode"]: s["goodput"] for s in (ours, sync, ddp)},
        (0.85, "target 0.85"),
    )
    kept = ours["final_loss"] / calm["final_loss"]
    print(
        f"the final model under kills: {ours['final_loss']:.4f}, without: {calm['final_loss']:.4f}, ratio "
        f"{kept:.4f} (target <= 1.01)"
    )
    met = [
        verdict(ours["goodput"] >= 0.85, f"ours {ours['goodput']:.3f} >= 0.85"),
        verdict(kept <= 1.01, f"final loss under kills / without = {kept:.4f} <= 1.01"),
        verdict(ours["goodput"] >= 2 * sync["goodput"], f"ours >= 2 x sync-diloco ({sync['goodput']:.3f})"),
        verdict(ours["goodput"] >= 2 * ddp["goodput"], f"ours >= 2 x ddp ({ddp['goodput']:.3f})"),
    ]
    return all(met)


BENCHES = {"loss": bench_loss, "step-time": bench_step_time, "goodput": bench_goodput}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", choices=BENCHES)
    p.add_argument("--islands", type=int, default=4)
    p.add_argument("--steps", type=int, default=200, help="inner steps per worker")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--inner-steps", type=int, default=20, help="H")
    p.add_argument("--fragments", type=int, default=2, help="P")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument(
        "--top-k-fraction", type=float, default=TrainingConfig().top_k_fraction, help="loss: of the sparse run"
    )
    p.add_argument("--seed", type=int, default=0, help="step-time and goodput: the seed")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="loss: the seeds")
    p.add_argument("--jitter", type=float, default=0.3, help="loss: one island's steps a random 0 to 2 x this longer")
    p.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS), help="loss: which to run")
    p.add_argument(
        "--mode-timeout", type=float, help="loss: give up a mode after this many seconds and report what it reached"
    )
    p.add_argument(
        "--sparse", action=argparse.BooleanOptionalAction, default=True, help="loss: the sparse encoding beside int4"
    )
    p.add_argument(
        "--reference-step-seconds",
        type=float,
        help="islands emulate devices whose step takes this long (diloco.worker.slowdown), so that sharing this "
        "machine's cores does not set them apart",
    )
    p.add_argument("--preset", default="tiny", help="model preset (medium: GPT-2 small's shape, for an accelerator)")
    p.add_argument("--device", default="cpu", help="cuda: the islands share the machine's GPUs as processes")
    p.add_argument("--precision", default="auto", help="auto (bf16 on accelerators), bf16 or fp32")
    p.add_argument("--max-data-bytes", type=int, default=DEFAULT_CORPUS_BYTES, help="of the embedded corpus")
    p.add_argument("--repeats", type=int, default=2, help="step-time: alternating off/on repeats")
    p.add_argument("--kill-every", type=float, default=10.0, help="goodput: mean seconds between kill -9s")
    p.add_argument("--restart-after", type=float, default=3.0, help="goodput: seconds a killed worker stays down")
    p.add_argument("--fail-until", type=float, default=60.0, help="goodput: kills until this many seconds")
    p.add_argument("--out", type=Path, default=Path("out/bench/training"), help="the runs")
    p.add_argument("--png-dir", type=Path, default=Path("out/bench"))
    args = p.parse_args()
    started = time.perf_counter()
    passed = BENCHES[args.bench](args)
    print(f"({time.perf_counter() - started:.0f} s; runs under {args.out}, plot under {args.png_dir})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
