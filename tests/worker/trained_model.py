"""A small model and its AdamW after a few steps, the same in every process: what the island-checkpoint
tests save, restore and compare, and what warm_rank.py (a process without the tests' path helpers) builds."""

from __future__ import annotations

import torch
from torch import nn

from diloco.worker.adamw import AdamW


def trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    optimizer = AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer
