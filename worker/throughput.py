"""Throughput in the open: tokens per second of a rank and of its island, and model FLOPs utilisation (MFU),
the share of the accelerator's peak that the model's own arithmetic uses.

MFU follows PaLM's definition: the FLOPs the model needs per token (`GPT.flops_per_token`, recomputation not
counted) times tokens per second, over the accelerator's dense bf16 peak. The peaks of common accelerators
are below; any other device states its peak with `DILOCO_PEAK_TFLOPS` (or `--peak-tflops`), and without one
MFU is not reported rather than guessed (a CPU has no meaningful single peak).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM; the PCIe card matches the more specific name above first
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
}
"""Dense bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets, by a substring of the device name
(first match wins, so more specific names come first)."""


def peak_flops(device_name: str, override_tflops: float | None = None) -> float | None:
    """The peak FLOP/s MFU divides by: the override when given, else the table's entry for `device_name`."""
    if override_tflops:
        return override_tflops * 1e12
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12
    return None


@dataclass(frozen=True)
class Rate:
    """Throughput over the last steps: of this rank (one accelerator), of its island, and the MFU."""

    tokens_per_second: float
    island_tokens_per_second: float
    mfu: float | None


class ThroughputMeter:
    """Tokens and wall seconds of the last `window` steps of one rank; every rank of an island takes the same
    steps, so the island's rate is the rank's times the island's size."""

    def __init__(self, flops_per_token: float, peak: float | None, island_size: int, window: int = 20) -> None:
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.island_size = island_size
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def record(self, tokens: int, seconds: float) -> Rate:
        """Adds one step and returns the rate over the window, this step included."""
        self._steps.append((tokens, seconds))
        return self.rate()

    def rate(self) -> Rate:
        seconds = sum(s for _, s in self._steps)
        per_rank = sum(t for t, _ in self._steps) / seconds if seconds > 0 else 0.0
        mfu = per_rank * self.flops_per_token / self.peak if self.peak else None
        return Rate(per_rank, per_rank * self.island_size, mfu)
