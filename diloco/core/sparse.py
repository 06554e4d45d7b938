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
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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


ALIGN_BLOCKS = 8
"""Blocks a chunk of a sparse tensor starts on a multiple of: there every bit string starts on a whole byte,
so chunks are encoded and decoded apart and their bytes laid side by side."""


def _pack(values: np.ndarray, width: int) -> np.ndarray:
    """Unsigned integers below 2**width as a bit string, `width` bits each, low bits first."""
    bits = (values[:, None] >> np.arange(width, dtype=values.dtype)) & 1
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")


def _unpack(raw: np.ndarray, count: int, width: int) -> np.ndarray:
    """The first `count` integers of a bit string from `_pack`, as int64."""
    bits = np.unpackbits(raw, bitorder="little", count=count * width).reshape(count, width).astype(np.int64)
    return bits @ (1 << np.arange(width, dtype=np.int64))


def _entries(numel: int, block_size: int, top_k: int, block: int) -> int:
    """Kept values before block `block` (at most the number of blocks)."""
    return kept(min(numel, block * block_size), block_size, top_k)


class _Layout:
    """Where blocks [first, stop) of a tensor of `numel` elements lie in its encoded bytes; `first` is a multiple
    of ALIGN_BLOCKS (or 0), so each of their bit strings starts on a byte."""

    def __init__(self, numel: int, block_size: int, top_k: int, first: int, stop: int) -> None:
        nblocks = math.ceil(numel / block_size)
        if first % ALIGN_BLOCKS or not 0 <= first <= stop <= nblocks:
            raise ValueError(f"blocks {first}..{stop} of {nblocks} do not start on a multiple of {ALIGN_BLOCKS}")
        width = index_bits(block_size)
        total = kept(numel, block_size, top_k)
        self.first, self.stop, self.width = first, stop, width
        self.begin, self.end = _entries(numel, block_size, top_k, first), _entries(numel, block_size, top_k, stop)
        values_at = _SCALE_BYTES * nblocks
        index_at = values_at + math.ceil(total * VALUE_BITS / 8)
        self.scales = slice(_SCALE_BYTES * first, _SCALE_BYTES * stop)
        self.values = slice(values_at + self.begin * VALUE_BITS // 8, values_at + math.ceil(self.end * VALUE_BITS / 8))
        self.indices = slice(index_at + self.begin * width // 8, index_at + math.ceil(self.end * width / 8))

    @property
    def count(self) -> int:
        return self.end - self.begin


def _chunk_blocks(start: int, length: int, block_size: int) -> tuple[int, int]:
    """The blocks that elements [start, start + length) cover; `start` must begin a block."""
    if start % block_size:
        raise ValueError(f"a chunk must start on a block: {start} is not a multiple of {block_size}")
    return start // block_size, math.ceil((start + length) / block_size)


def encode_into(flat: torch.Tensor, out: torch.Tensor, start: int, numel: int, block_size: int, top_k: int) -> None:
    """Encode `flat`, elements [start, start + len(flat)) of a flat float32 tensor of `numel` elements, into its
    place in `out` (uint8, the whole tensor's `nbytes`). Selection and quantisation run on `flat`'s device,
    packing on the host. Raises EncodingError when a value is NaN or Inf, like the dense encodings."""
    check(block_size, top_k)
    first, stop = _chunk_blocks(start, flat.numel(), block_size)
    nblocks = stop - first
    if not nblocks:
        return
    layout = _Layout(numel, block_size, top_k, first, stop)
    padded = nblocks * block_size
    magnitude = torch.nn.functional.pad(flat.abs(), (0, padded - flat.numel()), value=-1.0)
    index = magnitude.view(nblocks, block_size).topk(top_k, dim=1, sorted=False).indices.sort(dim=1).values
    position = index + torch.arange(nblocks, device=flat.device).unsqueeze(1) * block_size
    chosen = (position < flat.numel()).view(-1)  # drops the padding a short tail block picked
    values = torch.nn.functional.pad(flat, (0, padded - flat.numel()))[position]
    scales = values.abs().amax(dim=1) / 2
    if not bool(torch.isfinite(scales).all()):
        raise EncodingError("cannot encode NaN or Inf values")
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
    levels = torch.floor(values / divisor).clamp_(-2, 1).add_(2).to(torch.uint8).view(-1)[chosen]
    kept_index = index.view(-1)[chosen].cpu().numpy()
    array = out.numpy()
    array[layout.scales] = scales.cpu().numpy().astype("<f4").view(np.uint8)
    array[layout.values] = _pack(levels.cpu().numpy(), VALUE_BITS)
    array[layout.indices] = _pack(kept_index.astype(np.int64), layout.width)


def encode(flat: torch.Tensor, block_size: int, top_k: int) -> bytes:
    """Encode a flat float32 tensor (`encode_into` over the whole of it)."""
    out = torch.empty(nbytes(flat.numel(), block_size, top_k), dtype=torch.uint8)
    encode_into(flat, out, 0, flat.numel(), block_size, top_k)
    return out.numpy().tobytes()


def _kept_values(raw: np.ndarray, layout: _Layout, block_size: int, top_k: int, numel: int) -> tuple[torch.Tensor, ...]:
    """The kept values of the layout's blocks: their block (from its first), index within it and 2-bit level."""
    per_block = torch.full((layout.stop - layout.first,), top_k, dtype=torch.int64)
    if layout.stop * block_size > numel and per_block.numel():
        per_block[-1] = min(top_k, numel - (layout.stop - 1) * block_size)
    block = torch.arange(per_block.numel()).repeat_interleave(per_block)
    index = torch.from_numpy(_unpack(raw[layout.indices], layout.count, layout.width))
    levels = torch.from_numpy(_unpack(raw[layout.values], layout.count, VALUE_BITS))
    return block, index, levels


_CHECK_BLOCKS = ALIGN_BLOCKS * 8192
"""Blocks whose indices are checked at a time: bounds the temporary memory of a check whatever the tensor."""


def validate(raw: torch.Tensor, numel: int, block_size: int, top_k: int) -> float:
    """Check `nbytes(numel, …)` bytes (a uint8 tensor) as `decode` does, without decoding them: refuses a
    negative or non-finite scale, any index that is repeated, unordered or outside its block, and a value that
    would not be finite. Returns a bound on the decoded values' magnitude."""
    check(block_size, top_k)
    nblocks = math.ceil(numel / block_size)
    array = raw.numpy()
    scales = torch.from_numpy(array[: _SCALE_BYTES * nblocks].view("<f4").astype(np.float32))
    if not bool(torch.isfinite(scales).all()):
        raise EncodingError("NaN or Inf scale")
    if bool((scales < 0).any()):
        raise EncodingError("negative scale")
    for first in range(0, nblocks, _CHECK_BLOCKS):
        layout = _Layout(numel, block_size, top_k, first, min(nblocks, first + _CHECK_BLOCKS))
        block, index, _ = _kept_values(array, layout, block_size, top_k, numel)
        _check_indices(index, block, numel - first * block_size, block_size)
    magnitude = (_LEVELS - 1) / 2 * float(scales.max()) if nblocks else 0.0
    if magnitude > _FLOAT32_MAX:  # a level of ±1.5 would overflow: decode to see whether any does
        out = torch.empty(numel, dtype=torch.float32)
        accumulate(out, raw, 0, numel, block_size, top_k, 1.0, first=True)
        if not bool(torch.isfinite(out).all()):
            raise EncodingError("NaN or Inf value")
        magnitude = float(out.abs().max())
    return magnitude


def accumulate(
    out: torch.Tensor,
    raw: torch.Tensor,
    start: int,
    numel: int,
    block_size: int,
    top_k: int,
    weight: float,
    first: bool,
) -> None:
    """`out` (float32) = (`first`) or += `weight` × the decoded elements [start, start + len(out)) of the
    validated bytes `raw` of a tensor of `numel` elements; `start` a multiple of ALIGN_BLOCKS blocks."""
    first_block, stop = _chunk_blocks(start, out.numel(), block_size)
    layout = _Layout(numel, block_size, top_k, first_block, stop)
    array = raw.numpy()
    scales = torch.from_numpy(array[layout.scales].view("<f4").astype(np.float32))
    block, index, levels = _kept_values(array, layout, block_size, top_k, numel)
    values = (levels.to(torch.float32) - (_LEVELS - 1) / 2) * scales[block]
    if weight != 1.0:
        values.mul_(weight)
    if first:
        out.zero_()
    out.index_add_(0, block * block_size + index, values)


def decode(raw: torch.Tensor, numel: int, block_size: int, top_k: int) -> torch.Tensor:
    """Decode `nbytes(numel, …)` bytes (a uint8 tensor) into a flat float32 tensor, refusing what `validate`
    refuses."""
    validate(raw, numel, block_size, top_k)
    out = torch.empty(numel, dtype=torch.float32)
    accumulate(out, raw, 0, numel, block_size, top_k, 1.0, first=True)
    return out


def _check_indices(index: torch.Tensor, block: torch.Tensor, numel: int, block_size: int) -> None:
    """Every index lies inside its block (the tail block is shorter) and rises strictly within it."""
    limit = torch.clamp(numel - block * block_size, max=block_size)
    if bool((index >= limit).any()):
        raise EncodingError("index beyond its block")
    same_block = block[1:] == block[:-1]
    if bool((same_block & (index[1:] <= index[:-1])).any()):
        raise EncodingError("indices repeated or out of order within a block")
