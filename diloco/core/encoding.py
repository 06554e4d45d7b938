"""Tensor encodings for the wire: fp32, bf16, int8/int4 with one float32 scale per block, and sparse.

Outer gradients are what islands send most often, so shrinking them is the main lever on network
traffic. Quantisation is symmetric per block so that one outlier only coarsens its own block, and every
encoding has a fixed byte length given the element count, which lets a receiver validate a declared length
before it buffers anything. All layouts are little-endian; quantised layouts put the scales first, then the
values. The sparse encoding (`diloco.core.sparse`) keeps each block's `top_k` largest values at 2 bits with
their indices; `top_k` means nothing to the others. The wire contract names each `Encoding` by a protobuf
value; `diloco.transport.codes` maps between the two.
"""

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from diloco.core import sparse
from diloco.core.config import MAX_BLOCK_SIZE

# Re-exported: the training knob names the encodings defined here, and says which values are refused.
from diloco.core.config import Encoding as Encoding
from diloco.core.config import EncodingError as EncodingError

_QMAX = {Encoding.INT8: 127, Encoding.INT4: 7}
_TINY = torch.finfo(torch.float32).tiny
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_SCALE_BYTES = 4

if sys.byteorder != "little":
    raise ImportError("diloco.core.encoding reads and writes tensor memory directly and needs a little-endian host")


def _check(encoding: Encoding, block_size: int, top_k: int) -> None:
    if encoding is Encoding.SPARSE:
        sparse.check(block_size, top_k)
    elif encoding in _QMAX:
        if not 0 < block_size <= MAX_BLOCK_SIZE:
            raise EncodingError(f"block_size must be in 1..{MAX_BLOCK_SIZE} for {encoding.name}, got {block_size}")
        if encoding is Encoding.INT4 and block_size % 2:
            # Even blocks keep the padded value array even, so nibbles pair up without a second pad.
            raise EncodingError(f"block_size must be even for INT4, got {block_size}")


def encoded_nbytes(numel: int, encoding: Encoding, block_size: int, top_k: int = 0) -> int:
    """Exact byte length of an encoded tensor, so a receiver can check a declared length up front."""
    _check(encoding, block_size, top_k)
    if encoding is Encoding.SPARSE:
        return sparse.nbytes(numel, block_size, top_k)
    if encoding is Encoding.FP32:
        return 4 * numel
    if encoding is Encoding.BF16:
        return 2 * numel
    scales = _SCALE_BYTES * math.ceil(numel / block_size)
    return scales + (numel if encoding is Encoding.INT8 else (numel + 1) // 2)


def bits_per_value(encoding: Encoding, block_size: int, top_k: int = 0) -> float:
    """Mean wire bits per element of a large tensor (scales included), for the bandwidth model."""
    if encoding is Encoding.SPARSE:
        return sparse.bits_per_value(block_size, top_k)
    if encoding in _QMAX:
        return 8 * encoded_nbytes(block_size, encoding, block_size) / block_size
    return 8 * encoded_nbytes(1, encoding, block_size)


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flat float32 tensor as (nblocks, block_size) rows; zero padding (copied) only for a ragged tail."""
    nblocks = math.ceil(flat.numel() / block_size)
    pad = nblocks * block_size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(nblocks, block_size)


def _absmax(blocks: torch.Tensor) -> torch.Tensor:
    """Per-row max |x| without materialising |x| (NaN propagates). amax and amin apart: torch's aminmax along a
    dimension of short rows is several times slower than both."""
    return torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())


def _flat32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).to(torch.float32)


def _all_finite(tensor: torch.Tensor) -> bool:
    """True when no element is NaN or Inf; a finite sum proves it in one cheap pass, else check exactly."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def alignment(encoding: Encoding, block_size: int) -> int:
    """Elements a chunk of a tensor (`encode_into`, `accumulate`) must start on a multiple of: a whole block,
    for the sparse encoding a run of blocks whose bit strings start on a byte."""
    if encoding is Encoding.SPARSE:
        return sparse.ALIGN_BLOCKS * block_size
    return block_size if encoding in _QMAX else 1


def _split(encoding: Encoding, numel: int, block_size: int) -> int:
    """Where a quantised tensor's values start in its bytes, after one scale per block."""
    return _SCALE_BYTES * math.ceil(numel / block_size)


def _int4_packed(q: torch.Tensor) -> torch.Tensor:
    """Pack int8 values in -8..7 (an even number) two to a byte, low nibble first, in 16-bit lanes."""
    pairs = q.view(torch.int16)
    return ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).to(torch.uint8)


def encode_into(
    flat: torch.Tensor, out: torch.Tensor, start: int, numel: int, encoding: Encoding, block_size: int, top_k: int = 0
) -> None:
    """Encode `flat`, elements [start, start + len(flat)) of a flat tensor of `numel` elements, into their place
    in `out` (uint8 on the host, the whole tensor's `encoded_nbytes`); `start` a multiple of `alignment`. Runs on
    `flat`'s device and moves only the result. Blocks are encoded apart, so chunk by chunk gives the bytes that
    one call over the whole tensor gives. Raises EncodingError when a value is not finite (bf16 overflow too)."""
    _check(encoding, block_size, top_k)
    if start % alignment(encoding, block_size):
        raise ValueError(f"a chunk of {encoding.name} must start on a multiple of {alignment(encoding, block_size)}")
    if encoding is Encoding.SPARSE:
        sparse.encode_into(flat.detach().to(torch.float32), out, start, numel, block_size, top_k)
        return
    if encoding in (Encoding.FP32, Encoding.BF16):
        dtype = torch.float32 if encoding is Encoding.FP32 else torch.bfloat16
        values = flat.detach().to(dtype)
        if not _all_finite(values):
            raise EncodingError("cannot encode NaN or Inf values (or values beyond the encoding's range)")
        size = values.element_size()
        out[size * start : size * (start + values.numel())].view(dtype).copy_(values)
        return
    qmax = _QMAX[encoding]
    blocks = _blocks(_flat32(flat), block_size)
    scales = _absmax(blocks) / qmax
    if not _all_finite(scales):
        raise EncodingError("cannot encode NaN or Inf values")
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
    q = torch.div(blocks, divisor).round_().clamp_(-qmax, qmax).to(torch.int8).view(-1)
    first = start // block_size
    out[_SCALE_BYTES * first : _SCALE_BYTES * (first + scales.numel())].view(torch.float32).copy_(scales)
    split = _split(encoding, numel, block_size)
    if encoding is Encoding.INT8:
        out[split + start : split + start + flat.numel()].view(torch.int8).copy_(q[: flat.numel()])
    else:
        packed = _int4_packed(q)[: (flat.numel() + 1) // 2]
        out[split + start // 2 : split + start // 2 + packed.numel()].copy_(packed)


def encode(tensor: torch.Tensor, encoding: Encoding, block_size: int, top_k: int = 0) -> bytes:
    """Encode a tensor of any shape as flat bytes; runs on the tensor's device and moves only the result.

    Raises EncodingError when the values are not finite (including bf16 overflow): the syncer refuses them
    anyway, and the sender learns why before any byte is sent.
    """
    flat = tensor.detach().reshape(-1)
    out = torch.empty(encoded_nbytes(flat.numel(), encoding, block_size, top_k), dtype=torch.uint8)
    encode_into(flat, out, 0, flat.numel(), encoding, block_size, top_k)
    return out.numpy().tobytes()


def _int4_values(packed: torch.Tensor) -> torch.Tensor:
    """Unpack two's-complement nibbles (low nibble first) into int8, in 16-bit lanes: a byte's two nibbles are
    spread to the two bytes of its lane, then each is sign-extended as (v ^ 8) - 8."""
    lanes = packed.to(torch.int16)
    spread = lanes << 4  # in place from here on: fresh temporaries cost more than the arithmetic
    spread |= lanes
    spread &= 0x0F0F
    spread ^= 0x0808
    values = spread.view(torch.int8)
    values -= 8
    return values


@dataclass(frozen=True)
class Encoded:
    """An encoded tensor checked as `decode` checks it, but not decoded: what a shard keeps of a pending push
    (int4: 1/7.5 of float32), to decode blockwise into one accumulator when it merges (`accumulate`).
    `magnitude` bounds every decoded value's absolute value, so a merge can prove that it stays finite."""

    data: torch.Tensor  # uint8, exactly `encoded_nbytes` of the shape; 4-byte aligned
    shape: tuple[int, ...]
    encoding: Encoding
    block_size: int
    top_k: int
    magnitude: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _checked_shape(shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise EncodingError(f"negative dimension in shape {list(dims)}")
    if math.prod(max(d, 1) for d in dims) >= 2**63:
        # An empty tensor's other dimensions still make its strides, which must fit in 64 bits.
        raise EncodingError(f"shape {list(dims)} has dimensions beyond what a tensor can index")
    return dims


def _raw(data: bytes | bytearray | memoryview | torch.Tensor, expected: int, numel: int) -> torch.Tensor:
    """The bytes as a 4-byte aligned uint8 tensor: a uint8 tensor taken over when aligned, else one copy."""
    if len(data) != expected:
        raise EncodingError(f"expected {expected} bytes for {numel} elements, got {len(data)}")
    if isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.storage_offset() % _SCALE_BYTES == 0:
        return data.reshape(-1)
    raw = torch.empty(expected, dtype=torch.uint8)
    raw.numpy()[:] = np.frombuffer(data.numpy() if isinstance(data, torch.Tensor) else data, dtype=np.uint8)
    return raw


def _float_magnitude(values: torch.Tensor) -> float:
    """max |x| of fp32 or bf16 values, refusing NaN and Inf (aminmax propagates NaN)."""
    if not values.numel():
        return 0.0
    lo, hi = torch.aminmax(values)
    magnitude = max(float(hi), -float(lo))
    if not math.isfinite(magnitude):
        raise EncodingError("NaN or Inf value")
    return magnitude


def validated(
    data: bytes | bytearray | memoryview | torch.Tensor,
    shape: Sequence[int],
    encoding: Encoding,
    block_size: int,
    top_k: int = 0,
) -> Encoded:
    """Check bytes from `encode` as `decode` does, refusing the same things, without decoding them to float32.

    Bytes are copied once up front, so the result never aliases them and they may be a reused receive
    buffer. A uint8 tensor is taken over instead (the result may alias it): the reader of a stream hands
    over the buffer it assembled, sparing a copy of every received byte.
    """
    dims = _checked_shape(shape)
    numel = math.prod(dims)
    raw = _raw(data, encoded_nbytes(numel, encoding, block_size, top_k), numel)
    if encoding is Encoding.SPARSE:
        magnitude = sparse.validate(raw, numel, block_size, top_k)
    elif encoding in (Encoding.FP32, Encoding.BF16):
        magnitude = _float_magnitude(raw.view(torch.float32 if encoding is Encoding.FP32 else torch.bfloat16))
    else:
        scales = raw[: _split(encoding, numel, block_size)].view(torch.float32)
        if not _all_finite(scales):
            raise EncodingError("NaN or Inf scale")
        # A hostile value may be -8 (int4) or -128 (int8), one step beyond what the encoder writes.
        magnitude = (_QMAX[encoding] + 1) * float(scales.abs().max()) if scales.numel() else 0.0
    encoded = Encoded(raw, dims, encoding, block_size, top_k, magnitude)
    if magnitude > _FLOAT32_MAX and encoding in _QMAX:  # scaling may overflow: decode to see whether it does
        encoded = replace(encoded, magnitude=_float_magnitude(decoded(encoded)))
    return encoded


def accumulate(out: torch.Tensor, source: Encoded, start: int, weight: float = 1.0, first: bool = False) -> None:
    """`out` (flat float32) = (`first`) or += `weight` × the decoded elements [start, start + len(out)) of
    `source`; `start` a multiple of `alignment`. With `first` and weight 1 this is `decode`, bit for bit, so a
    merge or a compressed pull may decode a tensor chunk by chunk, each chunk while it is in cache."""
    length = out.numel()
    if start % alignment(source.encoding, source.block_size) or start + length > source.numel:
        raise ValueError(f"elements {start}..{start + length} are no chunk of {source.numel} elements")
    raw, encoding, block_size = source.data, source.encoding, source.block_size
    if encoding is Encoding.SPARSE:
        sparse.accumulate(out, raw, start, source.numel, block_size, source.top_k, weight, first)
        return
    if encoding in (Encoding.FP32, Encoding.BF16):
        values = raw.view(torch.float32 if encoding is Encoding.FP32 else torch.bfloat16)[start : start + length]
        if not first:
            out.add_(values, alpha=weight)
            return
        out.copy_(values)
        if weight != 1.0:
            out.mul_(weight)
        return
    split = _split(encoding, source.numel, block_size)
    if encoding is Encoding.INT8:
        q = raw[split + start : split + start + length].view(torch.int8)
    else:
        q = _int4_values(raw[split + start // 2 : split + (start + length + 1) // 2])[:length]
    first_block = start // block_size
    scales = raw[_SCALE_BYTES * first_block : _split(encoding, start + length, block_size)].view(torch.float32)
    if weight != 1.0:
        scales = scales * weight
    # Converted first: an operation on int8 and float32 at once takes a slow elementwise casting path.
    values = out if first else torch.empty_like(out)
    values.copy_(q)
    whole = length // block_size
    head = whole * block_size
    for part, scaled, scale in (
        (out[:head].view(whole, block_size), values[:head].view(whole, block_size), scales[:whole].unsqueeze(1)),
        (out[head:], values[head:], scales[whole:]),
    ):
        if first:
            part.mul_(scale)
        else:
            part.addcmul_(scaled, scale)


def decoded(source: Encoded) -> torch.Tensor:
    """The float32 values of a validated tensor (fp32 aliases its bytes)."""
    if source.encoding is Encoding.FP32:
        return source.data.view(torch.float32).view(source.shape)
    out = torch.empty(source.numel, dtype=torch.float32)
    accumulate(out, source, 0, first=True)
    return out.view(source.shape)


def decode(
    data: bytes | bytearray | memoryview | torch.Tensor,
    shape: Sequence[int],
    encoding: Encoding,
    block_size: int,
    top_k: int = 0,
) -> torch.Tensor:
    """Decode bytes from `encode` into a float32 tensor of `shape`, refusing anything malformed (`validated`)."""
    return decoded(validated(data, shape, encoding, block_size, top_k))


def error_bound(tensor: torch.Tensor, encoding: Encoding, block_size: int, top_k: int = 0) -> torch.Tensor:
    """Per-element absolute error that a round trip through `encoding` may introduce, for tests and checks.

    Includes a small slack for float32 rounding in the scale arithmetic and for subnormals. SPARSE drops
    values, so its bound is the block's largest magnitude (a dropped value is off by itself).
    """
    _check(encoding, block_size, top_k)
    flat = _flat32(tensor)
    if encoding is Encoding.FP32:
        return torch.zeros(tensor.shape, dtype=torch.float32, device=flat.device)
    if encoding is Encoding.BF16:
        return (flat.abs() * 2.0**-8 + _TINY).view(tensor.shape)
    absmax = _absmax(_blocks(flat, block_size))
    if encoding is Encoding.SPARSE:
        return (absmax * (1 + 2.0**-20) + _TINY).repeat_interleave(block_size)[: flat.numel()].view(tensor.shape)
    per_block = absmax / (2 * _QMAX[encoding]) + absmax * 2.0**-20 + _TINY
    return per_block.repeat_interleave(block_size)[: flat.numel()].view(tensor.shape)
