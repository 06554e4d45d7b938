"""Tensors to and from the chunked gRPC streams of the Syncer contract, with no channels or servers.

gRPC caps message sizes, so a fragment travels as one header (names, shapes, dtypes, encodings, byte
lengths) followed by data messages of at most `MAX_CHUNK_BYTES`. Both the worker (pushing deltas, seeding)
and the syncer (serving pulls, receiving pushes and seeds) build and read streams here, so the two sides
cannot drift apart. Readers treat the peer as untrusted: every declared length is checked against what the
encoding implies before data is buffered, and every refusal is a `WireError` carrying the gRPC status code
that the contract prescribes.
"""

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import grpc
import torch

from diloco.encoding import EncodingError, decode, encode, encoded_nbytes
from diloco.v1 import syncer_pb2 as pb

MAX_CHUNK_BYTES = 4 * 1024 * 1024

_DTYPES = {torch.float32: pb.FLOAT32, torch.bfloat16: pb.BFLOAT16, torch.float16: pb.FLOAT16}
_QUANTISED = (pb.INT8, pb.INT4)

_Header = pb.FragmentHeader | pb.PushHeader
_Chunk = TypeVar("_Chunk", pb.FragmentChunk, pb.PushChunk)


class WireError(Exception):
    """A malformed or oversize stream, with the status code the server aborts the call with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def _invalid(message: str) -> WireError:
    return WireError(grpc.StatusCode.INVALID_ARGUMENT, message)


def tensor_payloads(
    named: Sequence[tuple[str, torch.Tensor]], encoding: int, block_size: int
) -> tuple[list[pb.TensorPayload], list[bytes]]:
    """Describe and encode tensors for a header: one TensorPayload and one byte string per tensor, in order."""
    payload_block = block_size if encoding in _QUANTISED else 0
    payloads, blobs = [], []
    for name, tensor in named:
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; the wire carries float32, bfloat16 or float16")
        blob = encode(tensor, encoding, block_size)
        payloads.append(
            pb.TensorPayload(
                name=name,
                shape=list(tensor.shape),
                dtype=_DTYPES[tensor.dtype],
                encoding=encoding,
                block_size=payload_block,
                byte_length=len(blob),
            )
        )
        blobs.append(blob)
    return payloads, blobs


def split(blobs: Iterable[bytes], max_chunk: int = MAX_CHUNK_BYTES) -> Iterator[bytes]:
    """The concatenation of `blobs` in pieces of at most `max_chunk` bytes; pieces may span blob boundaries.

    Slices memoryviews, so each byte is copied once, into the piece that carries it.
    """
    if max_chunk <= 0:
        raise ValueError(f"max_chunk must be positive, got {max_chunk}")
    parts: list[memoryview] = []
    size = 0
    for blob in blobs:
        view = memoryview(blob)
        offset = 0
        while offset < len(view):
            take = min(max_chunk - size, len(view) - offset)
            parts.append(view[offset : offset + take])
            size += take
            offset += take
            if size == max_chunk:
                yield b"".join(parts)
                parts, size = [], 0
    if size:
        yield b"".join(parts)


def _chunks(chunk_type: type[_Chunk], header: _Header, blobs: list[bytes], max_chunk: int) -> Iterator[_Chunk]:
    yield chunk_type(header=header)
    for piece in split(blobs, max_chunk):
        yield chunk_type(data=piece)


def fragment_chunks(
    fragment_id: int,
    version: pb.FragmentVersion,
    payloads: Sequence[pb.TensorPayload],
    blobs: Sequence[bytes],
    max_chunk: int = MAX_CHUNK_BYTES,
) -> Iterator[pb.FragmentChunk]:
    """The messages of a Seed request or a Pull reply: a FragmentHeader, then the data.

    Takes bytes encoded once by `tensor_payloads`, so a retried call or many pulls of one version re-send
    them without encoding again.
    """
    header = pb.FragmentHeader(fragment_id=fragment_id, version=version, tensors=payloads)
    return _chunks(pb.FragmentChunk, header, list(blobs), max_chunk)


def push_chunks(
    header: pb.PushHeader,
    payloads: Sequence[pb.TensorPayload],
    blobs: Sequence[bytes],
    max_chunk: int = MAX_CHUNK_BYTES,
) -> Iterator[pb.PushChunk]:
    """The messages of a PushDelta request: a copy of `header` with its tensors filled in, then the data."""
    filled = pb.PushHeader()
    filled.CopyFrom(header)
    del filled.tensors[:]
    filled.tensors.extend(payloads)
    return _chunks(pb.PushChunk, filled, list(blobs), max_chunk)


def _declared_total(payloads: Iterable[pb.TensorPayload]) -> int:
    """Check every payload description and return the stream size they add up to."""
    total = 0
    for p in payloads:
        if any(d < 0 for d in p.shape):
            raise _invalid(f"tensor {p.name!r}: negative dimension in shape {list(p.shape)}")
        if p.dtype not in _DTYPES.values():
            raise _invalid(f"tensor {p.name!r}: unknown dtype {p.dtype}")
        try:
            expected = encoded_nbytes(math.prod(p.shape), p.encoding, p.block_size)
        except EncodingError as e:
            raise _invalid(f"tensor {p.name!r}: {e}") from None
        if p.byte_length != expected:
            raise _invalid(
                f"tensor {p.name!r}: byte_length {p.byte_length} does not match the {expected} bytes"
                " its shape and encoding imply"
            )
        total += expected
    return total


def _read_stream(
    chunks: Iterable[_Chunk], max_chunk: int, max_total_bytes: int | None
) -> tuple[_Header, list[tuple[pb.TensorPayload, torch.Tensor]]]:
    it = iter(chunks)
    first = next(it, None)
    if first is None:
        raise _invalid("empty stream: expected a header")
    if first.WhichOneof("part") != "header":
        raise _invalid("first message is not a header")
    header = first.header
    total = _declared_total(header.tensors)
    if max_total_bytes is not None and total > max_total_bytes:
        raise WireError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"header declares {total} bytes, more than the limit of {max_total_bytes}",
        )
    # Grown as data arrives rather than allocated from the header, so memory follows what was really sent.
    buf = bytearray()
    for chunk in it:
        part = chunk.WhichOneof("part")
        if part == "header":
            raise _invalid("header after the first message")
        if part != "data":
            raise _invalid("message with neither header nor data")
        if len(chunk.data) > max_chunk:
            raise WireError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"data message of {len(chunk.data)} bytes exceeds the chunk limit of {max_chunk}",
            )
        if len(buf) + len(chunk.data) > total:
            raise _invalid(f"trailing bytes: more data than the {total} bytes the header declares")
        buf += chunk.data
    if len(buf) != total:
        raise _invalid(f"truncated stream: got {len(buf)} of {total} bytes")
    view = memoryview(buf)
    tensors = []
    offset = 0
    for p in header.tensors:
        try:
            values = decode(view[offset : offset + p.byte_length], p.shape, p.encoding, p.block_size)
        except EncodingError as e:
            raise _invalid(f"tensor {p.name!r}: {e}") from None
        tensors.append((p, values))
        offset += p.byte_length
    return header, tensors


def read_fragment_stream(
    chunks: Iterable[pb.FragmentChunk], *, max_chunk: int = MAX_CHUNK_BYTES, max_total_bytes: int | None = None
) -> tuple[pb.FragmentHeader, list[tuple[pb.TensorPayload, torch.Tensor]]]:
    """Read a Seed request or Pull reply into its header and float32 tensors; raises WireError if malformed."""
    return _read_stream(chunks, max_chunk, max_total_bytes)


def read_push_stream(
    chunks: Iterable[pb.PushChunk], *, max_chunk: int = MAX_CHUNK_BYTES, max_total_bytes: int | None = None
) -> tuple[pb.PushHeader, list[tuple[pb.TensorPayload, torch.Tensor]]]:
    """Read a PushDelta request into its header and float32 tensors; raises WireError if malformed."""
    return _read_stream(chunks, max_chunk, max_total_bytes)
