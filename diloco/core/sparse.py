"""The sparse outer-gradient encoding: per block, the top-k values by magnitude at 2 bits, with their indices.

SparseLoCo's observation is that an outer gradient survives being cut to its largest 1-3% of values at a few
bits each, provided the island carries what was not sent into its next delta (`diloco.worker.error_feedback`).
A tensor is cut into blocks of `block_size` values (the last may be shorter); each block keeps its `top_k`
largest magnitudes (all of a block shorter than that), so the byte length is fixed by the element count and
a receiver checks a declared length before it buffers anything, as for the dense encodings.

Layout, little-endian: one float32 scale per block, then every kept value as 2 bits (four per byte, low bits
first), then every kept index within its block as `index_bits(block_size)` bits (low bits first), blocks in
order and indices strictly increasing within a block, which is the one canonical form: a receiver refuses
repeated, unordered or out-of-block indices. A value's two bits q in 0..3 stand for (q − 1.5) · scale, the
midpoints of four equal steps across [−2·scale, 2·scale] where 2·scale is the block's largest magnitude, so
a kept value is off by at most scale / 2 and is never decoded as zero (unless the block lies in float32's
subnormal range, below 1e-38, where scale / 2 itself rounds to zero).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from diloco.core.config import MAX_BLOCK_SIZE, EncodingError

VALUE_BITS = 2
_LEVELS = 1 << VALUE_BITS
_SCALE_BYTES = 4


def check(block_size: int, top_k: int) -> None:
    """Refuse parameters no encoder uses: a block beyond MAX_BLOCK_SIZE, or k outside 1..block_size."""
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        raise EncodingError(f"block_size must be in 1..{MAX_BLOCK_SIZE} for SPARSE, got {block_size}")
    if not 0 < top_k <= block_size:
        raise EncodingError(f"top_k must be in 1..block_size ({block_size}) for SPARSE, got {top_k}")


def index_bits(block_size: int) -> int:
    """Bits of one index within a block: enough for block_size − 1, and at least one."""
    return max(1, (block_size - 1).bit_length())


def kept(numel: int, block_size: int, top_k: int) -> int:
    """How many values a tensor of `numel` elements keeps: top_k per whole block, at most all of the tail."""
    whole, tail = divmod(numel, block_size)
    return whole * top_k + min(top_k, tail)


def nbytes(numel: int, block_size: int, top_k: int) -> int:
    """Exact byte length of an encoded tensor."""
    check(block_size, top_k)
    count = kept(numel, block_size, top_k)
    scales = _SCALE_BYTES * math.ceil(numel / block_size)
    return scales + math.ceil(count * VALUE_BITS / 8) + math.ceil(count * index_bits(block_size) / 8)


def bits_per_value(block_size: int, top_k: int) -> float:
    """Mean wire bits per element of a large tensor, for the bandwidth model."""
    check(block_size, top_k)
    return (8 * _SCALE_BYTES + top_k * (VALUE_BITS + index_bits(block_size))) / block_size


def _pack(values: np.ndarray, width: int) -> bytes:
    """Unsigned integers below 2**width as a bit string, `width` bits each, low bits first."""
    bits = (values[:, None] >> np.arange(width, dtype=values.dtype)) & 1
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little").tobytes()


def _unpack(raw: np.ndarray, count: int, width: int) -> np.ndarray:
    """The first `count` integers of a bit string from `_pack`, as int64."""
    bits = np.unpackbits(raw, bitorder="little", count=count * width).reshape(count, width).astype(np.int64)
    return bits @ (1 << np.arange(width, dtype=np.int64))


def encode(flat: torch.Tensor, block_size: int, top_k: int) -> bytes:
    """Encode a flat float32 tensor; selection and quantisation run on its device, packing on the host.

    Raises EncodingError when a value is NaN or Inf, like the dense encodings.
    """
    check(block_size, top_k)
    numel = flat.numel()
    nblocks = math.ceil(numel / block_size)
    if not nblocks:
        return b""
    magnitude = torch.nn.functional.pad(flat.abs(), (0, nblocks * block_size - numel), value=-1.0)
    index = magnitude.view(nblocks, block_size).topk(top_k, dim=1, sorted=False).indices.sort(dim=1).values
    position = index + torch.arange(nblocks, device=flat.device).unsqueeze(1) * block_size
    chosen = (position < numel).view(-1)  # drops the padding a short tail block picked
    values = torch.nn.functional.pad(flat, (0, nblocks * block_size - numel))[position]
    scales = values.abs().amax(dim=1) / 2
    if not bool(torch.isfinite(scales).all()):
        raise EncodingError("cannot encode NaN or Inf values")
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
    levels = torch.floor(values / divisor).clamp_(-2, 1).add_(2).to(torch.uint8).view(-1)[chosen]
    kept_index = index.view(-1)[chosen].cpu().numpy()
    return b"".join(
        (
            scales.cpu().numpy().astype("<f4").tobytes(),
            _pack(levels.cpu().numpy(), VALUE_BITS),
            _pack(kept_index.astype(np.int64), index_bits(block_size)),
        )
    )


def decode(raw: torch.Tensor, numel: int, block_size: int, top_k: int) -> torch.Tensor:
    """Decode `nbytes(numel, …)` bytes (a uint8 tensor) into a flat float32 tensor, refusing a negative or
    non-finite scale and any index that is repeated, unordered or outside its block."""
    check(block_size, top_k)
    nblocks = math.ceil(numel / block_size)
    count = kept(numel, block_size, top_k)
    value_bytes = math.ceil(count * VALUE_BITS / 8)
    split = _SCALE_BYTES * nblocks
    array = raw.numpy()
    scales = torch.from_numpy(array[:split].view("<f4").astype(np.float32))
    if not bool(torch.isfinite(scales).all()):
        raise EncodingError("NaN or Inf scale")
    if bool((scales < 0).any()):
        raise EncodingError("negative scale")
    levels = torch.from_numpy(_unpack(array[split : split + value_bytes], count, VALUE_BITS))
    index = torch.from_numpy(_unpack(array[split + value_bytes :], count, index_bits(block_size)))
    block = _blocks_of_kept(numel, block_size, top_k)
    _check_indices(index, block, numel, block_size)
    out = torch.zeros(numel, dtype=torch.float32)
    out[block * block_size + index] = (levels.to(torch.float32) - (_LEVELS - 1) / 2) * scales[block]
    if not bool(torch.isfinite(out).all()):
        raise EncodingError("NaN or Inf value")
    return out


def _blocks_of_kept(numel: int, block_size: int, top_k: int) -> torch.Tensor:
    """The block of every kept value, in order."""
    whole, tail = divmod(numel, block_size)
    per_block = torch.full((whole + bool(tail),), top_k, dtype=torch.int64)
    if tail:
        per_block[-1] = min(top_k, tail)
    return torch.arange(per_block.numel()).repeat_interleave(per_block)


def _check_indices(index: torch.Tensor, block: torch.Tensor, numel: int, block_size: int) -> None:
    """Every index lies inside its block (the tail block is shorter) and rises strictly within it."""
    limit = torch.clamp(numel - block * block_size, max=block_size)
    if bool((index >= limit).any()):
        raise EncodingError("index beyond its block")
    same_block = block[1:] == block[:-1]
    if bool((same_block & (index[1:] <= index[:-1])).any()):
        raise EncodingError("indices repeated or out of order within a block")
