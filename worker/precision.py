"""Mixed precision for the built-in trainer: bf16 autocast over fp32 master weights.

Only the forward and backward arithmetic changes: parameters, gradients, the AdamW state and everything the
learner snapshots and pushes stay float32 (the outer delta θ_base − θ is a small difference of large values,
which bf16 would round away), and the loss is computed in float32 from the logits.
"""

from __future__ import annotations

import contextlib

import torch

from diloco.core.config import Precision


def resolve_precision(precision: Precision | str, device: torch.device) -> Precision:
    """AUTO as what `device` does best: bf16 on an accelerator that supports it, else fp32. An explicit bf16
    on a device without bf16 support is refused rather than silently emulated."""
    chosen = Precision(precision)
    bf16_native = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if chosen == Precision.AUTO:
        return Precision.BF16 if bf16_native else Precision.FP32
    if chosen == Precision.BF16 and device.type == "cuda" and not bf16_native:
        raise ValueError(f"precision bf16: {torch.cuda.get_device_name(device)} has no bf16 arithmetic; use fp32")
    return chosen


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The context a forward pass runs in (the backward pass follows the forward's casts)."""
    if precision == Precision.BF16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
