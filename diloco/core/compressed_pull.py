"""Compressed pulls: a shard serves a fragment as the difference to what the island already holds.

An island pulls every fragment once per sync, and in float32 that pull is eight times its int4 push. After
the first pull the island holds values the shard served it, so the shard can send `new − held` in the
job's encoding instead. Both sides then compute `held + decode(encode(new − held))` with the same float32
operations, so they agree bit for bit on what the island holds, and the shard records that value as the
island's reference: the next difference starts from it, which carries each pull's quantisation error into
the next one (error feedback) instead of letting errors pile up over many pulls.

The pure arithmetic lives here, shared by the client and the server so that the two cannot drift apart;
a digest of the held values guards the agreement at run time (a mismatch makes the shard send full values).
The shard makes a reply in one pass (`difference`) and sends it to every island that holds the same values.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from diloco.core.encoding import Encoded, Encoding, accumulate, alignment, encode_into, encoded_nbytes
from diloco.core.merge import CHUNK

DIGEST_LEAF_BYTES = 1 << 22
"""Bytes of a tensor hashed apart (its last leaf may be shorter): a shard hashes a large fragment's leaves on all
its cores."""


def _leaf_digest(leaf: memoryview) -> bytes:
    return hashlib.sha256(leaf).digest()


def values_digest(
    values: Sequence[torch.Tensor],
    map_leaves: Callable[[Callable[[memoryview], bytes], Iterable[memoryview]], Iterable[bytes]] = map,
) -> int:
    """A 64-bit digest of float32 tensors' bytes, tensor after tensor: how an island names the values it holds
    (strong enough that values that differ are never taken for each other). SHA-256 (in hardware on servers
    of either architecture) of the SHA-256 digests of each tensor's leaves of DIGEST_LEAF_BYTES, which
    `map_leaves` (an executor's `map`) may hash at once: every side gets the same digest however it maps."""
    leaves: list[memoryview] = []
    for value in values:
        if value.dtype != torch.float32:
            raise ValueError(f"held values must be float32, got {value.dtype}")
        data = value.detach().cpu().contiguous().reshape(-1).numpy().data.cast("B")
        leaves.extend(data[at : at + DIGEST_LEAF_BYTES] for at in range(0, len(data), DIGEST_LEAF_BYTES))
    digest = hashlib.sha256()
    for leaf in map_leaves(_leaf_digest, leaves):
        digest.update(leaf)
    return int.from_bytes(digest.digest()[:8], "little")


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


@dataclass(frozen=True)
class Difference:
    """A compressed pull's reply and its effect: the encoded difference per tensor, and what an island that held
    the base values holds once it applies it (what the shard records as that island's reference)."""

    blobs: list[bytes]
    held: list[torch.Tensor]


def difference(
    newest: Sequence[torch.Tensor],
    held: Sequence[torch.Tensor],
    encoding: Encoding,
    block_size: int,
    top_k: int = 0,
    chunk: int = CHUNK,
) -> Difference:
    """encode(newest − held) and held + decode(that), in one pass of about `chunk` elements at a time (the
    difference, its bytes and the values they give are made while each chunk is in cache): the shard's side of
    the agreement, bit for bit what the island computes from the same bytes (`apply_delta` of their decoded
    values), since decoding and adding act on each element alone."""
    if len(newest) != len(held):
        raise ValueError(f"{len(newest)} newest tensors for {len(held)} held tensors")
    blobs, after = [], []
    for new, old in zip(newest, held):
        if new.shape != old.shape:
            raise ValueError(f"newest values of shape {list(new.shape)} for held values of {list(old.shape)}")
        flat_new, flat_old = new.detach().reshape(-1), old.detach().reshape(-1)
        numel = flat_new.numel()
        out = torch.empty(encoded_nbytes(numel, encoding, block_size, top_k), dtype=torch.uint8)
        # Our own encoder's bytes, read back chunk by chunk as they are written: no check needed, no bound known.
        sent = Encoded(out, (numel,), encoding, block_size, top_k, magnitude=math.inf)
        values = torch.empty(numel, dtype=torch.float32)
        align = alignment(encoding, block_size)
        size = max(1, chunk // align) * align
        scratch = torch.empty(min(size, numel), dtype=torch.float32)
        for start in range(0, numel, size):
            stop = min(numel, start + size)
            part = torch.sub(flat_new[start:stop], flat_old[start:stop], out=scratch[: stop - start])
            encode_into(part, out, start, numel, encoding, block_size, top_k)
            accumulate(part, sent, start, first=True)
            torch.add(flat_old[start:stop], part, out=values[start:stop])
        blobs.append(out.numpy().tobytes())
        after.append(values.view(new.shape))
    return Difference(blobs, after)
