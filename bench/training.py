"""Training benchmarks of `diloco run`, each printing ours beside its baseline measured in the same run, and
their ratio, and writing a PNG under out/bench/. Every mode is launched by `diloco run` itself (the same
processes, trace and accounting as `diloco run --compare`), so what is measured is what users run.

  loss       held-out loss at equal tokens: decoupled DiLoCo vs `ddp` and `sync-diloco` (4 islands), and
             decoupled DiLoCo with sparse outer gradients beside it (int4 is the job's default encoding).
             Targets: ours <= 1.03 x the ddp loss and <= 1.01 x the sync-diloco loss; sparse <= 1.01 x
             int4's loss, with its bytes per token beside int4's and ddp's.
  step-time  training-step time of decoupled DiLoCo with syncing on vs off (off: H beyond the run, so no
             fragment ever falls due), in alternating repeats so a change of machine load hits both.
             Target: time(off) / time(on) >= 0.95.
  goodput    goodput under one seeded failure trace (kill -9 of workers, restart after a delay) for
             decoupled DiLoCo vs `sync-diloco` (a K = M barrier) vs `ddp` (restart from checkpoint).
             Targets: ours >= 0.85 and >= 2 x each synchronous baseline.

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


def shape(args: argparse.Namespace) -> list[str]:
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
        str(args.seed),
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


def compare_at_equal_tokens(args: argparse.Namespace, out: Path, *options: str) -> dict[str, dict]:
    """Every mode's summary on the same tokens: one `diloco run --compare`, or, where ddp's ranks would share
    a GPU, each DiLoCo mode on its own and ddp as one process at the global batch (see the module's doc)."""
    if not ddp_shares_a_device(args):
        return {s["mode"]: s for s in diloco_run(out, "--compare", *options, *shape(args))}
    ddp_shape = shape(args)
    ddp_shape[ddp_shape.index("--islands") + 1] = "1"
    ddp_shape[ddp_shape.index("--batch-size") + 1] = str(args.islands * args.batch_size)
    (ddp,) = diloco_run(out / "ddp", "--mode", "ddp", *options, *ddp_shape)
    summaries = {"ddp": ddp}
    for mode in ("diloco", "sync-diloco"):
        (summaries[mode],) = diloco_run(out / mode, "--mode", mode, *options, *shape(args))
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


def bench_loss(args: argparse.Namespace) -> bool:
    summaries = compare_at_equal_tokens(args, args.out / "loss", "--eval-every", str(args.eval_every))
    ours, ddp, sync = summaries["diloco"], summaries["ddp"], summaries["sync-diloco"]
    (sparse,) = diloco_run(
        args.out / "loss-sparse",
        "--encoding",
        "sparse",
        "--top-k-fraction",
        str(args.top_k_fraction),
        "--eval-every",
        str(args.eval_every),
        *shape(args),
    )
    print(
        f"\nheld-out loss after {ours['tokens_trained']} tokens per mode ({args.islands} islands, {args.preset} "
        f"preset on {args.device}):"
    )
    for s in (ours, sync, ddp):
        print(
            f"  {s['mode']:>11}: {s['final_loss']:.4f}  ({s['tokens_trained']} tokens, {s['wall_seconds']:.0f} s, "
            f"{s['tokens_per_second']:.0f} tokens/s, MFU {format_mfu(s['mfu'])})"
        )
    vs_ddp = ours["final_loss"] / ddp["final_loss"]
    vs_sync = ours["final_loss"] / sync["final_loss"]
    print(
        f"eval loss: ours {ours['final_loss']:.4f}, ddp {ddp['final_loss']:.4f}, ratio {vs_ddp:.3f} (target <= 1.03); "
        f"sync-diloco {sync['final_loss']:.4f}, ratio {vs_sync:.3f}"
    )
    bar_chart(
        args.png_dir / "loss_vs_baselines.png",
        f"held-out loss at equal tokens, {args.islands} islands",
        "loss (nats/byte)",
        {**{s["mode"]: s["final_loss"] for s in (ours, sync, ddp)}, "diloco sparse": sparse["final_loss"]},
        (1.03 * ddp["final_loss"], "1.03 x ddp"),
    )
    vs_int4 = sparse["final_loss"] / ours["final_loss"]
    print(
        f"sparse (top {args.top_k_fraction:.2%} of each block at 2 bits, error feedback): eval loss "
        f"{sparse['final_loss']:.4f}, ratio {vs_int4:.3f} to int4 (target <= 1.01); bytes per token: sparse "
        f"{sparse['comm_bytes_per_token']:.2f}, int4 {ours['comm_bytes_per_token']:.2f} "
        f"({ours['comm_bytes_per_token'] / sparse['comm_bytes_per_token']:.1f}x), ddp "
        f"{ddp['comm_bytes_per_token']:.0f} ({ddp['comm_bytes_per_token'] / sparse['comm_bytes_per_token']:.0f}x)"
    )
    met = [
        verdict(vs_ddp <= 1.03, f"ours / ddp = {vs_ddp:.3f} <= 1.03"),
        verdict(vs_sync <= 1.01, f"ours / sync-diloco = {vs_sync:.3f} <= 1.01"),
        verdict(vs_int4 <= 1.01, f"sparse / int4 = {vs_int4:.3f} <= 1.01"),
    ]
    return all(met)


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
    met = [
        verdict(ours["goodput"] >= 0.85, f"ours {ours['goodput']:.3f} >= 0.85"),
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
    p.add_argument("--seed", type=int, default=0)
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
