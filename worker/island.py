"""The ranks of one island kept in step with torch.distributed (gloo on CPU, nccl on GPU).

Only the island's rank 0 talks to the syncers; the other ranks learn what it did through the collectives
here. Every collective is called at the same point of the same step on every rank, so callers must decide
whether to call one from state that all ranks share. A single-process island (no group) turns every call
into a no-op or an identity, so the learner has one code path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

BUCKET_ELEMENTS = 16 * 1024 * 1024
"""Elements one collective carries at most (float32: 64 MiB), so a whole model's worth is never copied at once."""

T = TypeVar("T")


class Island:
    """This process's place in its island: rank, size, and the collectives the learner needs."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        if group is None:
            self.rank, self.size = 0, 1
            self.device = torch.device("cpu")
            self._leader = 0
            return
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._leader = dist.get_global_rank(group, 0)
        nccl = dist.get_backend(group) == dist.Backend.NCCL
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def release(self) -> None:
        """Lets go of the process group once this process is done with the island's collectives.

        torch's destroy_process_group() unregisters a group, but its threads run on while anything still holds
        it; a gloo thread that finishes a collective during the interpreter's exit aborts the process there
        ("terminate called without an active exception"), and the pod's launcher takes that for a failed rank.
        The rank and size stay, for what is reported afterwards; the island's collectives are over."""
        self.group = None

    @property
    def is_leader(self) -> bool:
        """Rank 0 of the island: the only rank that talks to the syncers."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The leader's `tensor` on every rank (a copy on the collective's device when it had to move)."""
        if not self.distributed:
            return tensor
        moved = tensor.to(self.device)
        dist.broadcast(moved, self._leader, group=self.group)
        return moved

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], source: int = 0) -> None:
        """Overwrites `tensors` in place with the values of rank `source` (the leader unless named), in
        buckets (float32 on the wire, which holds bf16 and fp16 values exactly)."""
        if not self.distributed:
            return
        sender = dist.get_global_rank(self.group, source)
        for bucket in _buckets(tensors):
            flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float32) for t in bucket])
            dist.broadcast(flat, sender, group=self.group)
            if self.rank != source:
                _unflatten_into(flat, bucket)

    def broadcast_object(self, obj: T, source: int) -> T:
        """Rank `source`'s `obj` (picklable) on every rank; the others pass a placeholder."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, dist.get_global_rank(self.group, source), group=self.group, device=self.device)
        return box[0]

    def gather(self, value: int) -> list[int]:
        """Every rank's `value`, in rank order."""
        if not self.distributed:
            return [value]
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        return [int(t.item()) for t in every]

    def sum(self, value: int) -> int:
        """The sum of `value` over the island's ranks."""
        if not self.distributed:
            return value
        total = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=self.group)
        return int(total.item())

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any of the island's ranks (a collective on every rank)."""
        return self.sum(int(flag)) > 0

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Replaces every gradient by its mean over the island, in float32 buckets.

        A parameter without a gradient on this rank counts as zeros (and gets a zero gradient), so every rank
        reduces the same tensors in the same order whichever parameters its batch happened to touch.
        """
        if not self.distributed:
            return
        grads: list[torch.Tensor] = []
        for param in params:
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        for bucket in _buckets(grads):
            self._average(bucket)

    def _average(self, grads: Sequence[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1).to(self.device, torch.float32) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.size
        _unflatten_into(flat, grads)


def _buckets(tensors: Iterable[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """`tensors` in order, cut into runs of about BUCKET_ELEMENTS elements (a larger tensor alone)."""
    bucket: list[torch.Tensor] = []
    elements = 0
    for tensor in tensors:
        bucket.append(tensor)
        elements += tensor.numel()
        if elements >= BUCKET_ELEMENTS:
            yield bucket
            bucket, elements = [], 0
    if bucket:
        yield bucket


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            count = tensor.numel()
            tensor.copy_(flat[offset : offset + count].view_as(tensor))
            offset += count
