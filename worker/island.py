"""The ranks of one island kept in step with torch.distributed (gloo on CPU, nccl on GPU).

Only the island's rank 0 talks to the syncers; the other ranks learn what it did through the collectives
here. Every collective is called at the same point of the same step on every rank, so callers must decide
whether to call one from state that all ranks share. A single-process island (no group) turns every call
into a no-op or an identity, so the learner has one code path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

GRADIENT_BUCKET_ELEMENTS = 16 * 1024 * 1024


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

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrites `tensors` in place with the leader's values, in one collective (float32 on the wire,
        which holds bf16 and fp16 values exactly)."""
        if not self.distributed or not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float32) for t in tensors])
        dist.broadcast(flat, self._leader, group=self.group)
        if not self.is_leader:
            _unflatten_into(flat, tensors)

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
        bucket: list[torch.Tensor] = []
        elements = 0
        for param in params:
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            bucket.append(param.grad)
            elements += param.numel()
            if elements >= GRADIENT_BUCKET_ELEMENTS:
                self._average(bucket)
                bucket, elements = [], 0
        if bucket:
            self._average(bucket)

    def _average(self, grads: Sequence[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1).to(self.device, torch.float32) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.size
        _unflatten_into(flat, grads)


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            count = tensor.numel()
            tensor.copy_(flat[offset : offset + count].view_as(tensor))
            offset += count
