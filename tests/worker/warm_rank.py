"""One rank of a gloo island taking up its optimizer state, run as its own process by test_warm_start.py.

Usage: warm_rank.py RANK WORLD STORE_FILE CHECKPOINT_FOLDER OUT_FILE
The rank builds trained_model's `trained` model, restores the island's optimizer state from its own
checkpoint in CHECKPOINT_FOLDER or another rank's (`restore_island`), and saves the step it took and the state
to OUT_FILE.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from trained_model import trained

from diloco.worker.island import Island
from diloco.worker.island_checkpoint import checkpoint_path, optimizer_tensors
from diloco.worker.warm_start import restore_island

ISLAND = "island-0"


def main() -> None:
    rank, world, store, folder, out = sys.argv[1:]
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    _, optimizer = trained(0)
    step = restore_island(Island(dist.group.WORLD), optimizer, checkpoint_path(Path(folder), ISLAND, int(rank)))
    torch.save({"step": step, "state": optimizer_tensors(optimizer)}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
