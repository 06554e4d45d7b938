"""Where a (re)started island takes up training: at the job's step, with warm inner-optimizer state.

An island killed and replaced used to start over at step 0 with fresh AdamW moments: it trained its whole
step count again (in `diloco run`, one kill added 10% to the run's tokens and ended it 18 s late), re-ran its
learning-rate warmup, and took the large first steps of a cold Adam. Now its ranks load the optimizer state
they last checkpointed (`diloco.worker.island_checkpoint`), and the island resumes at the job's step as the
shards count it: the tokens merged into the global model, spread over the islands that took part, in this
island's steps. The steps it resumes past were trained by the job already; those after its last merged
push, which the kill lost, it trains again.

The ranks of an island are data-parallel replicas whose optimizer states are identical, so one checkpoint
serves them all: the island takes the newest any rank holds, and that rank sends it to the others (a rank
whose pod came back on a fresh volume, or that was stopped before the others saved, trains warm too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.transport.v1 import syncer_pb2 as pb
from diloco.worker import island_checkpoint
from diloco.worker.island import Island


def job_step(statuses: Sequence[pb.StatusReply], tokens_per_step: int) -> int:
    """The inner step the job has reached for an island that trains `tokens_per_step` tokens a step: the
    most tokens any fragment has merged, per island the shards know (live, or left after finishing). The
    islands of a job train alike, so this is the step each has had counted, on average."""
    if tokens_per_step < 1:
        raise ValueError(f"tokens per step must be positive, got {tokens_per_step}")
    merged = max((f.tokens_merged for status in statuses for f in status.fragments), default=0)
    islands = {name for status in statuses for name in (*status.live_islands, *status.left_islands)}
    return merged // (tokens_per_step * max(1, len(islands)))


@dataclass(frozen=True)
class Source:
    """The rank whose checkpoint an island resumes from, and that checkpoint's step."""

    rank: int
    step: int


def newest_checkpoint(steps: Sequence[int | None]) -> Source | None:
    """Which rank serves the island's optimizer state, from the step each rank's checkpoint holds (None: it
    has none usable): the newest, the lowest rank among equals; None when no rank has one."""
    held = [(step, rank) for rank, step in enumerate(steps) if step is not None]
    if not held:
        return None
    step, rank = max(held, key=lambda pair: (pair[0], -pair[1]))
    return Source(rank, step)


def restore_island(island: Island, optimizer: torch.optim.Optimizer, checkpoint: Path | None) -> int | None:
    """On every rank of the island: loads this rank's checkpoint, then gives every rank the newest state any
    of them loaded, sent by the rank that holds it; returns that state's step, or None when the island
    trains cold (no rank had a checkpoint, or one could not take the state: all ranks then start alike)."""
    mine = island_checkpoint.load(checkpoint, optimizer) if checkpoint is not None else None
    steps = island.gather(-1 if mine is None else mine)
    source = newest_checkpoint([None if step < 0 else step for step in steps])
    if source is None:
        return None
    taken = all(step == source.step for step in steps) or _receive(island, optimizer, source)
    if island.any(not taken):
        optimizer.state.clear()
        return None
    return source.step


def _receive(island: Island, optimizer: torch.optim.Optimizer, source: Source) -> bool:
    """`source`'s optimizer state on every rank: its names, shapes and dtypes, then the tensors, in buckets;
    whether this rank's optimizer took it."""
    sending = island.rank == source.rank
    named = island_checkpoint.optimizer_tensors(optimizer) if sending else {}
    layout = island.broadcast_object([(name, t.shape, t.dtype) for name, t in named.items()], source.rank)
    received = named or {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in layout}
    island.broadcast_tensors(list(received.values()), source.rank)
    return sending or island_checkpoint.restore_optimizer(optimizer, received)


def resume_at(
    island: Island,
    restored: int | None,
    statuses: Callable[[], Sequence[pb.StatusReply]],
    tokens_per_step: int | None,
) -> int:
    """The step a decoupled island resumes at, the same on every rank: the later of the job's step, from the
    shards' `statuses` (asked on rank 0 alone) for an island whose steps train `tokens_per_step` tokens
    (None: not known, so not counted), and its checkpoint's (`restored`, as `restore_island` returned it)."""
    counted = job_step(statuses(), tokens_per_step) if island.is_leader and tokens_per_step else 0
    return int(island.broadcast(torch.tensor([max(counted, restored or 0)])).item())
