"""Compressed pulls: a shard serves a fragment as the difference to what the island already holds.

An island pulls every fragment once per sync, and in float32 that pull is eight times its int4 push. After
the first pull the island holds values the shard served it, so the shard can send `new − held` in the
job's encoding instead. Both sides then compute `held + decode(encode(new − held))` with the same float32
operations, so they agree bit for bit on what the island holds, and the shard records that value as the
island's reference: the next difference starts from it, which carries each pull's quantisation error into
the next one (error feedback) instead of letting errors pile up over many pulls.

The pure arithmetic lives here, shared by the client and the server so that the two cannot drift apart;
a digest of the held values guards the agreement at run time (a mismatch makes the shard send full values).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from diloco.core.encoding import Encoding, decode


def values_digest(values: Sequence[torch.Tensor]) -> int:
    """A 64-bit BLAKE2b digest of float32 tensors' bytes, tensor after tensor: how an island names the
    values it holds (strong enough that values that differ are never taken for each other)."""
    digest = hashlib.blake2b(digest_size=8)
    for value in values:
        if value.dtype != torch.float32:
            raise ValueError(f"held values must be float32, got {value.dtype}")
        digest.update(value.detach().cpu().contiguous().reshape(-1).numpy().data)
    return int.from_bytes(digest.digest(), "little")


def apply_delta(held: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`held + delta` per tensor, as new float32 tensors: exactly what the shard records for the island."""
    if len(held) != len(deltas):
        raise ValueError(f"a difference of {len(deltas)} tensors for {len(held)} held tensors")
    out = []
    for value, delta in zip(held, deltas):
        if value.shape != delta.shape:
            raise ValueError(f"a difference of shape {list(delta.shape)} for a held tensor of {list(value.shape)}")
        out.append(torch.add(value, delta))
    return out


def held_after(
    held: Sequence[torch.Tensor], blobs: Sequence[bytes], encoding: Encoding, block_size: int, top_k: int = 0
) -> list[torch.Tensor]:
    """What an island holds after applying encoded differences to `held`: the shard's side of the agreement
    (the island decodes the same bytes from the stream and calls `apply_delta`)."""
    if len(blobs) != len(held):
        raise ValueError(f"{len(blobs)} encoded differences for {len(held)} held tensors")
    return apply_delta(held, [decode(blob, h.shape, encoding, block_size, top_k) for blob, h in zip(blobs, held)])
