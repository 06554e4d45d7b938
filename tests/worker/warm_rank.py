"""One rank of a gloo island taking up its optimizer state, run as its own process by test_warm_start.py.

Usage: warm_rank.py RANK WORLD STORE_FILE CHECKPOINT_FOLDER OUT_FILE
The rank builds the model of `optimizer_after`, restores the island's optimizer state from its own checkpoint
in CHECKPOINT_FOLDER or another rank's (`restore_island`), and saves the step it took and the state to OUT_FILE.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from diloco.worker.adamw import AdamW
from diloco.worker.island import Island
from diloco.worker.island_checkpoint import checkpoint_path, optimizer_tensors
from diloco.worker.warm_start import restore_island

ISLAND = "island-0"


def optimizer_after(steps: int) -> torch.optim.Optimizer:
    """AdamW over the same small model on every rank, after `steps` steps of the same batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    optimizer = AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def main() -> None:
    rank, world, store, folder, out = sys.argv[1:]
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    optimizer = optimizer_after(0)
    step = restore_island(Island(dist.group.WORLD), optimizer, checkpoint_path(Path(folder), ISLAND, int(rank)))
    torch.save({"step": step, "state": optimizer_tensors(optimizer)}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
