"""One rank of a two-rank gloo island, run as its own process by test_island.py.

Usage: island_rank.py RANK WORLD STORE_FILE SYNCER CONFIG_JSON STEPS OUT_FILE
Each rank starts from its own random init and reports different token counts; it saves its parameters
right after start() and after training, its stats, and how many references to the process group its closed
learner still holds, to OUT_FILE.
"""

from __future__ import annotations

import dataclasses
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from learner_harness import BATCH, FAST_BACKOFF, TOKEN, flat_params, tiny_model
from torch import nn

from diloco.core.config import TrainingConfig
from diloco.settings import load_security
from diloco.transport.tls import Role
from diloco.worker.learner import Learner

RANK_TOKENS = (16, 1)


def main() -> None:
    rank, world, store, syncer, config_json, steps, out = sys.argv[1:]
    rank, world, steps = int(rank), int(world), int(steps)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    model = tiny_model(seed=100 + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    held_before = sys.getrefcount(dist.group.WORLD)
    learner = Learner(
        model,
        optimizer,
        TrainingConfig.from_json(config_json),
        syncers=[syncer],
        token=TOKEN,
        security=load_security(Role.CLIENT),
        island_id="island-0",
        process_group=dist.group.WORLD,
        backoff=FAST_BACKOFF,
        retry_for=20.0,
        sync_timeout=10.0,
        close_timeout=2.0,
    )
    learner.start()
    after_start = flat_params(model)
    data = torch.Generator().manual_seed(2000 + rank)
    teacher = torch.randn(8, 4, generator=torch.Generator().manual_seed(2000))
    for _ in range(steps):
        x = torch.randn(BATCH, 8, generator=data)
        nn.functional.mse_loss(model(x), x @ teacher).backward()
        learner.all_reduce_gradients()
        learner.report(tokens=RANK_TOKENS[rank])
        optimizer.step()
        optimizer.zero_grad()
        learner.wait_for_syncs(30.0)
    learner.close()
    held_after = sys.getrefcount(dist.group.WORLD)
    dist.destroy_process_group()
    torch.save(
        {
            "after_start": after_start,
            "final": flat_params(model),
            "stats": dataclasses.asdict(learner.stats),
            "group_references_kept": held_after - held_before,
        },
        out,
    )


if __name__ == "__main__":
    main()
