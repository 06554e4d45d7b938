"""Shared by the worker tests and the island rank script: a tiny model, its task, and fast client settings."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from diloco.core.config import TrainingConfig
from diloco.transport.client import Backoff
from diloco.worker.learner import Learner

TOKEN = "worker-test-token"
FAST_BACKOFF = Backoff(initial=0.02, maximum=0.2)
BATCH = 16


def make_config(**overrides: object) -> TrainingConfig:
    """H=4, P=2, τ=1, no grace window, fp32 unless a test asks otherwise."""
    settings: dict[str, object] = {
        "inner_steps": 4,
        "fragments": 2,
        "overlap_steps": 1,
        "grace_seconds": 0.0,
        "encoding": "fp32",
    }
    settings.update(overrides)
    return TrainingConfig(**settings)


def tiny_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class SingleIsland:
    """One single-process island: a tiny model, AdamW, its own regression task, and a learner."""

    def __init__(self, learner_for: Callable[[nn.Module, torch.optim.Optimizer], Learner], seed: int) -> None:
        self.model = tiny_model(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.learner = learner_for(self.model, self.optimizer)
        self.data = torch.Generator().manual_seed(1000 + seed)
        self.teacher = torch.randn(8, 4, generator=self.data)
        self.losses: list[float] = []

    def train(self, steps: int, wait: bool = True) -> None:
        """`steps` inner steps; with `wait`, each step's round is answered before the next step, so the
        sequence of syncs is the same on every run."""
        for _ in range(steps):
            x = torch.randn(BATCH, 8, generator=self.data)
            loss = nn.functional.mse_loss(self.model(x), x @ self.teacher)
            loss.backward()
            self.losses.append(float(loss.detach()))
            self.learner.report(tokens=BATCH)
            self.optimizer.step()
            self.optimizer.zero_grad()
            if wait:
                assert self.learner.wait_for_syncs(30.0)
