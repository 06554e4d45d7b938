"""The built-in trainer's AdamW: torch's arithmetic, without importing torch._dynamo at a worker's start."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from diloco.worker.adamw import AdamW


def test_it_steps_exactly_as_torchs_adamw():
    torch.manual_seed(0)
    ours = nn.Linear(6, 3)
    theirs = nn.Linear(6, 3)
    theirs.load_state_dict(ours.state_dict())
    optimizers = [
        AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1),
        torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1),
    ]
    for _ in range(4):
        batch = torch.randn(5, 6)
        for model, optimizer in zip((ours, theirs), optimizers):
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    assert all(p.grad is None for p in ours.parameters())


@pytest.mark.process
def test_a_worker_builds_and_trains_its_model_without_importing_dynamo():
    """Importing torch._dynamo costs over a second of CPU at every worker start (sympy, inductor, FSDP)."""
    program = """
import sys, torch
from diloco.core.config import TrainingConfig
from diloco.worker.model import build_model
from diloco.worker.trainer import inner_optimizer
model = build_model("tiny", 0)
optimizer = inner_optimizer(model, TrainingConfig().inner)
tokens = torch.randint(0, 256, (2, 16))
model(tokens, tokens)[1].backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
optimizer.step()
optimizer.zero_grad()
print("torch._dynamo" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True, cwd="/")
    assert result.stdout.strip() == "False"
