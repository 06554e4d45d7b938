"""What a shard last served each island of each fragment, so that the island's next pull can be a
difference against it (see `diloco.core.compressed_pull`). No I/O and no lock: the server holds its own.

Memory is bounded: the least recently served references are dropped beyond `max_bytes`, and an island
whose reference is gone (or does not match what it says it holds) simply gets full values. References are
not checkpointed; after a restart every island's first pull is a full one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Reference:
    """Float32 values an island holds at (incarnation, version), named by their digest."""

    incarnation: int
    version: int
    values: tuple[torch.Tensor, ...]
    digest: int

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values)


class References:
    """One reference per (island, fragment), least recently served dropped first beyond `max_bytes`. A reference
    that several islands hold (one reply sent to all of them, or the full values of a version) is counted once,
    as it is held once."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must not be negative, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, int], Reference] = OrderedDict()
        self._holders: dict[int, int] = {}  # id of a kept reference → entries holding it
        self._bytes = 0

    def match(self, island: str, fragment: int, incarnation: int, version: int, digest: int) -> Reference | None:
        """The island's reference if it is exactly what the island says it holds, else None."""
        ref = self._entries.get((island, fragment))
        if ref is None or (ref.incarnation, ref.version, ref.digest) != (incarnation, version, digest):
            return None
        return ref

    def record(self, island: str, fragment: int, ref: Reference) -> None:
        """Takes `ref` as what the island will hold once it applies the reply being sent."""
        key = (island, fragment)
        old = self._entries.pop(key, None)
        if old is not None:
            self._release(old)
        if ref.nbytes > self.max_bytes:
            return
        self._entries[key] = ref
        holders = self._holders.get(id(ref), 0)
        self._holders[id(ref)] = holders + 1
        if not holders:
            self._bytes += ref.nbytes
        while self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._release(dropped)

    def _release(self, ref: Reference) -> None:
        holders = self._holders.pop(id(ref)) - 1
        if holders:
            self._holders[id(ref)] = holders
        else:
            self._bytes -= ref.nbytes

    @property
    def nbytes(self) -> int:
        """The bytes of the references kept, each counted once."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
