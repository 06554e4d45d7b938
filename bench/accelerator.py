"""Throughput of the built-in trainer on one accelerator: tokens per second, model FLOPs utilisation and peak
memory of each preset in bf16 (autocast over fp32 master weights), beside the same model in fp32 measured in
the same run, and their ratio. One process, no syncers: what one island's rank does between syncs.

Usage: python bench/accelerator.py [--presets medium,xl] [--batch-size 16] [--steps 40]
Writes out/bench/accelerator.png. Needs CUDA; exits 2 without it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import figures
import torch

from diloco.core.config import Mode, TrainingConfig
from diloco.transport.tls import PLAINTEXT
from diloco.worker.trainer import Trainer, TrainerSettings

CHECKPOINTED = {"xl"}  # presets whose activations only fit with recomputation at the benchmark's batch


@dataclass(frozen=True)
class Measured:
    preset: str
    precision: str
    tokens_per_second: float
    mfu: float | None
    peak_gib: float


def measure(preset: str, precision: str, args: argparse.Namespace) -> Measured:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    settings = TrainerSettings(
        mode=Mode.DDP.value,
        model=preset,
        batch_size=args.batch_size,
        steps=args.steps,
        eval_every=10**9,
        eval_windows=args.batch_size,
        device="cuda",
        precision=precision,
        activation_checkpointing=preset in CHECKPOINTED,
    )
    trainer = Trainer(settings, TrainingConfig(), island="bench", syncers=[], token="", security=PLAINTEXT)
    try:
        trainer.run()
    finally:
        trainer.close()
    rate = trainer.rate  # over the last 20 steps: warm-up is behind
    measured = Measured(preset, precision, rate.tokens_per_second, rate.mfu, torch.cuda.max_memory_allocated() / 2**30)
    del trainer
    return measured


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="medium,xl")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--png", type=Path, default=Path("out/bench/accelerator.png"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/accelerator.py needs a CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, batch {args.batch_size} x context, {args.steps} steps per measurement")
    rows = []
    for preset in args.presets.split(","):
        bf16, fp32 = measure(preset, "bf16", args), measure(preset, "fp32", args)
        rows.append((bf16, fp32))
        for m in (bf16, fp32):
            mfu = f"{m.mfu:.1%}" if m.mfu is not None else "n/a"
            print(
                f"  {m.preset:>7} {m.precision}: {m.tokens_per_second:>9.0f} tokens/s, MFU {mfu:>6}, "
                f"peak memory {m.peak_gib:.1f} GiB" + (" (activation checkpointing)" if preset in CHECKPOINTED else "")
            )
        print(f"  {preset:>7} bf16 / fp32 throughput: {bf16.tokens_per_second / fp32.tokens_per_second:.2f}x")
    plot(args.png, rows)
    return 0


def plot(path: Path, rows: list[tuple[Measured, Measured]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    names = [bf16.preset for bf16, _ in rows]
    xs = range(len(rows))
    for offset, index, label in ((-0.2, 0, "bf16"), (0.2, 1, "fp32 (baseline)")):
        values = [100 * (row[index].mfu or 0.0) for row in rows]
        bars = ax.bar([x + offset for x in xs], values, width=0.4, label=label)
        ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("MFU (% of dense bf16 peak)")
    ax.set_title(f"built-in trainer on {torch.cuda.get_device_name()}", fontsize=10)
    ax.legend(fontsize=8)
    figures.save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
