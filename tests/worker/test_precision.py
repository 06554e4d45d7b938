"""Mixed precision: bf16 arithmetic where it is native, fp32 master weights always."""

from __future__ import annotations

import pytest
import torch

from diloco.core.config import Precision
from diloco.worker.model import build_model
from diloco.worker.precision import autocast, resolve_precision

CPU = torch.device("cpu")


def test_auto_is_fp32_on_a_cpu_and_an_explicit_choice_is_kept():
    assert resolve_precision("auto", CPU) == Precision.FP32
    assert resolve_precision(Precision.BF16, CPU) == Precision.BF16
    assert resolve_precision("fp32", CPU) == Precision.FP32


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="fp8"):
        resolve_precision("fp8", CPU)


def test_bf16_autocast_computes_in_bf16_over_fp32_weights_and_fp32_gradients():
    model = build_model("tiny", seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with autocast(Precision.BF16, CPU):
        logits, loss = model(tokens, tokens)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32, "the loss is taken in fp32"
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_fp32_changes_nothing():
    model = build_model("tiny", seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with autocast(Precision.FP32, CPU):
        logits, _ = model(tokens, tokens)
    assert logits.dtype == torch.float32
