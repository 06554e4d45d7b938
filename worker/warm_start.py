"""Where a (re)started island takes up training: at the job's step, with warm inner-optimizer state.

An island killed and replaced used to start over at step 0 with fresh AdamW moments: it trained its whole
step count again (in `diloco run`, one kill added 10% to the run's tokens and ended it 18 s late), re-ran its
learning-rate warmup, and took the large first steps of a cold Adam. Now its ranks load the optimizer state
they last checkpointed (`diloco.worker.island_checkpoint`; all of them or none, so the island's ranks stay
identical), and the island resumes at the job's step as the shards count it: the tokens merged into the
global model, spread over the islands that took part, in this island's steps. The steps it resumes past
were trained by the job already; those after its last merged push, which the kill lost, it trains again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from diloco.transport.v1 import syncer_pb2 as pb
from diloco.worker import island_checkpoint
from diloco.worker.learner import Learner

log = logging.getLogger("diloco.worker")


def job_step(statuses: Sequence[pb.StatusReply], tokens_per_step: int) -> int:
    """The inner step the job has reached for an island that trains `tokens_per_step` tokens a step: the
    most tokens any fragment has merged, per island the shards know (live, or left after finishing). The
    islands of a job train alike, so this is the step each has had counted, on average."""
    if tokens_per_step < 1:
        raise ValueError(f"tokens per step must be positive, got {tokens_per_step}")
    merged = max((f.tokens_merged for status in statuses for f in status.fragments), default=0)
    islands = {name for status in statuses for name in (*status.live_islands, *status.left_islands)}
    return merged // (tokens_per_step * max(1, len(islands)))


def warm_start(
    learner: Learner, optimizer: torch.optim.Optimizer, checkpoint: Path | None, tokens_per_step: int
) -> tuple[int, bool]:
    """After `learner.start()`, on every rank of the island: restores the optimizer state when every rank
    has the same checkpoint, and resumes the decoupled island at the later of the job's step and its
    checkpoint's (a synchronous island keeps the barrier's step); returns the step it resumes at and whether
    it restored the optimizer state."""
    island = learner.island
    mine = island_checkpoint.load(checkpoint, optimizer) if checkpoint is not None else None
    saved = -1 if mine is None else mine
    leaders = int(island.broadcast(torch.tensor([saved])).item())
    warm = island.sum(int(saved != leaders or saved < 0)) == 0
    if not warm:
        optimizer.state.clear()  # a rank that loaded while another could not trains cold like the rest
    if learner.synchronous:
        step = learner.inner_step
    else:
        counted = job_step(learner.shard_status(), tokens_per_step) if island.is_leader else 0
        step = int(island.broadcast(torch.tensor([max(counted, leaders if warm else 0)])).item())
        learner.resume(step)
    log.info(
        "island resumes",
        extra={"island": learner.island_id, "rank": island.rank, "step": step, "warm": warm, "checkpoint": leaders},
    )
    return step, warm
