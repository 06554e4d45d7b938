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

import numpy as np
import torch

from diloco.core import sparse
from diloco.core.config import MAX_BLOCK_SIZE

# Re-exported: the training knob names the encodings defined here, and says which values are refused.
from diloco.core.config import Encoding as Encoding
from diloco.core.config import EncodingError as EncodingError

_QMAX = {Encoding.INT8: 127, Encoding.INT4: 7}
_TINY = torch.finfo(torch.float32).tiny
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
    """Per-row max |x| without materialising |x| (one fused pass; NaN propagates)."""
    lo, hi = torch.aminmax(blocks, dim=1)
    return torch.maximum(hi, -lo)


def _flat32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).to(torch.float32)


def _all_finite(tensor: torch.Tensor) -> bool:
    """True when no element is NaN or Inf; a finite sum proves it in one cheap pass, else check exactly."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's memory on the host, without a copy when it already lives there."""
    return tensor.cpu().numpy().data


def encode(tensor: torch.Tensor, encoding: Encoding, block_size: int, top_k: int = 0) -> bytes:
    """Encode a tensor of any shape as flat bytes; runs on the tensor's device and moves only the result.

    Raises EncodingError when the values are not finite (including bf16 overflow): the syncer refuses them
    anyway, and the sender learns why before any byte is sent.
    """
    _check(encoding, block_size, top_k)
    if encoding is Encoding.SPARSE:
        return sparse.encode(_flat32(tensor), block_size, top_k)
    if encoding in (Encoding.FP32, Encoding.BF16):
        dtype = torch.float32 if encoding is Encoding.FP32 else torch.bfloat16
        flat = tensor.detach().reshape(-1).to(dtype)
        if not _all_finite(flat):
            raise EncodingError("cannot encode NaN or Inf values (or values beyond the encoding's range)")
        return _host_bytes(flat.view(torch.int16) if encoding is Encoding.BF16 else flat).tobytes()
    qmax = _QMAX[encoding]
    numel = tensor.numel()
    blocks = _blocks(_flat32(tensor), block_size)
    scales = _absmax(blocks) / qmax
    if not _all_finite(scales):
        raise EncodingError("cannot encode NaN or Inf values")
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
    q = torch.div(blocks, divisor).round_().clamp_(-qmax, qmax).to(torch.int8).view(-1)
    if encoding is Encoding.INT8:
        values = q[:numel]
    else:
        nibbles = q.view(torch.uint8) & 0x0F
        values = (nibbles[0::2] | (nibbles[1::2] << 4))[: (numel + 1) // 2]
    return b"".join((_host_bytes(scales), _host_bytes(values)))


def _int4_values(packed: torch.Tensor) -> torch.Tensor:
    """Unpack two's-complement nibbles (low nibble first) into int8, sign-extended by arithmetic shifts."""
    values = torch.empty(2 * packed.numel(), dtype=torch.int8)
    values[0::2] = (packed << 4).view(torch.int8) >> 4
    values[1::2] = packed.view(torch.int8) >> 4
    return values


def _dequantised(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """`q` times its block's scale, as float32 of q's length: whole blocks as rows, the ragged tail apart, so
    nothing is padded to a whole block (a block may be far larger than the tensor)."""
    out = q.to(torch.float32)
    whole = q.numel() // block_size
    head = whole * block_size
    out[:head].view(whole, block_size).mul_(scales[:whole].unsqueeze(1))
    out[head:].mul_(scales[whole:])
    return out


def decode(
    data: bytes | bytearray | memoryview | torch.Tensor,
    shape: Sequence[int],
    encoding: Encoding,
    block_size: int,
    top_k: int = 0,
) -> torch.Tensor:
    """Decode bytes from `encode` into a float32 tensor of `shape`, refusing anything malformed.

    Bytes are copied once up front, so the result never aliases them and they may be a reused receive
    buffer. A uint8 tensor is taken over instead (the result may alias it): the reader of a stream hands
    over the buffer it assembled, sparing a copy of every received byte.
    """
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise EncodingError(f"negative dimension in shape {list(shape)}")
    if math.prod(max(d, 1) for d in shape) >= 2**63:
        # An empty tensor's other dimensions still make its strides, which must fit in 64 bits.
        raise EncodingError(f"shape {list(shape)} has dimensions beyond what a tensor can index")
    numel = math.prod(shape)
    expected = encoded_nbytes(numel, encoding, block_size, top_k)
    if len(data) != expected:
        raise EncodingError(f"expected {expected} bytes for {numel} elements, got {len(data)}")
    if isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.storage_offset() % _SCALE_BYTES == 0:
        raw = data.reshape(-1)
    else:
        raw = torch.empty(expected, dtype=torch.uint8)
        raw.numpy()[:] = np.frombuffer(data.numpy() if isinstance(data, torch.Tensor) else data, dtype=np.uint8)
    if encoding is Encoding.SPARSE:
        out = sparse.decode(raw, numel, block_size, top_k)
    elif encoding is Encoding.FP32:
        out = raw.view(torch.float32)
    elif encoding is Encoding.BF16:
        out = raw.view(torch.bfloat16).to(torch.float32)
    else:
        nblocks = math.ceil(numel / block_size)
        split = _SCALE_BYTES * nblocks
        scales = raw[:split].view(torch.float32)
        if not _all_finite(scales):
            raise EncodingError("NaN or Inf scale")
        q = raw[split:].view(torch.int8) if encoding is Encoding.INT8 else _int4_values(raw[split:])
        out = _dequantised(q[:numel], scales, block_size)
    if not _all_finite(out):
        raise EncodingError("NaN or Inf value")
    return out.view(shape)


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
