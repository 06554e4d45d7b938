"""Tensors to and from the chunked gRPC streams of the Syncer contract, with no channels or servers.

gRPC caps message sizes, so a fragment travels as one header (names, shapes, dtypes, encodings, byte
lengths) followed by data messages of at most `MAX_CHUNK_BYTES`, each carrying its offset in the stream and a
CRC-32 of its bytes. Both the worker (pushing deltas, seeding) and the syncer (serving pulls, receiving pushes
and seeds) build and read streams here, so the two sides cannot drift apart. Readers treat the peer as
untrusted: every declared length is checked against what the encoding implies before data is buffered (and
the stream's limit bounds the float32 tensors it decodes to as well as its bytes: a sparse tensor decodes to
far more than it sends), every chunk's offset and checksum before its bytes are used (a reordered, repeated,
lost or damaged chunk would otherwise decode as other values), and every refusal is a `WireError` carrying
its kind of `Refusal` (and so the status code that the contract prescribes).
"""

import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, TypeVar

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError, Message

from diloco.core.encoding import Encoded, Encoding, EncodingError, decoded, encode, encoded_nbytes, validated
from diloco.core.refusal import Refusal
from diloco.transport import fields
from diloco.transport.codes import encoding_of, status_code, wire_encoding
from diloco.transport.fields import MAX_CHUNK_BYTES, MAX_STREAM_BYTES
from diloco.transport.v1 import syncer_pb2 as pb

__all__ = ["MAX_CHUNK_BYTES", "MAX_STREAM_BYTES"]  # the framing's limits, stated with every field's in `fields`


_DTYPES = {torch.float32: pb.FLOAT32, torch.bfloat16: pb.BFLOAT16, torch.float16: pb.FLOAT16}
_BLOCKED = (Encoding.INT8, Encoding.INT4, Encoding.SPARSE)

# The data message's fields, numbered alike in PushChunk and FragmentChunk.
_DATA_TAG = b"\x12"  # field 2 (`data`), length-delimited
_OFFSET_TAG = b"\x18"  # field 3 (`offset`), varint
_CRC_TAG = b"\x25"  # field 4 (`crc32`), fixed32 little-endian

_Header = TypeVar("_Header", pb.FragmentHeader, pb.PushHeader)
_Chunk = TypeVar("_Chunk", pb.FragmentChunk, pb.PushChunk)
_Request = TypeVar("_Request", bound=Message)


class Undecodable:
    """What a deserializer returns for bytes that are no such message (a string field that is not UTF-8, a
    field cut short), so the reader or handler (not gRPC, which would answer INTERNAL, which clients retry)
    refuses the call with INVALID_ARGUMENT."""


class Data(NamedTuple):
    """A data message as read: its bytes (a view, not a copy), where the sender placed them in the stream and
    the CRC-32 it computed of them; the reader checks both before using the bytes."""

    view: memoryview
    offset: int
    crc32: int


Part = pb.FragmentHeader | pb.PushHeader | Data | Undecodable
_PARTS = (pb.FragmentHeader, pb.PushHeader, Data, Undecodable)


class WireError(Exception):
    """A malformed or oversize stream: its kind of refusal, and so the status code a server aborts the call with;
    `field` names the field out of its rule when that is why (`fields`)."""

    def __init__(self, kind: Refusal, message: str, field: str | None = None) -> None:
        super().__init__(f"{status_code(kind).name}: {message}")
        self.kind = kind
        self.message = message
        self.field = field

    @classmethod
    def of_field(cls, error: fields.FieldError) -> "WireError":
        """The refusal of a field out of its rule, naming the field."""
        return cls(error.kind, str(error), error.field)

    @property
    def code(self) -> grpc.StatusCode:
        """The status code the contract prescribes for this refusal."""
        return status_code(self.kind)


def _invalid(message: str) -> WireError:
    return WireError(Refusal.INVALID, message)


def check_fields(message: Message) -> None:
    """`fields.check` at the wire: a field out of its rule as a WireError (INVALID_ARGUMENT) naming it."""
    try:
        fields.check(message)
    except fields.FieldError as error:
        raise WireError.of_field(error) from None


def tensor_payloads(
    named: Sequence[tuple[str, torch.Tensor]], encoding: Encoding, block_size: int, top_k: int = 0
) -> tuple[list[pb.TensorPayload], list[bytes]]:
    """Describe and encode tensors for a header: one TensorPayload and one byte string per tensor, in order.
    `top_k` is for SPARSE only, as `block_size` is for the blocked encodings only."""
    for name, tensor in named:
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; the wire carries float32, bfloat16 or float16")
    blobs = [encode(tensor, encoding, block_size, top_k) for _, tensor in named]
    return payloads_of(named, blobs, encoding, block_size, top_k), blobs


def payloads_of(
    named: Sequence[tuple[str, torch.Tensor]],
    blobs: Sequence[bytes],
    encoding: Encoding,
    block_size: int,
    top_k: int = 0,
) -> list[pb.TensorPayload]:
    """The TensorPayloads of tensors already encoded as `blobs` (one per named tensor, in order)."""
    payload_block = block_size if encoding in _BLOCKED else 0
    payload_top_k = top_k if encoding is Encoding.SPARSE else 0
    return [
        pb.TensorPayload(
            name=name,
            shape=list(tensor.shape),
            dtype=_DTYPES[tensor.dtype],
            encoding=wire_encoding(encoding),
            block_size=payload_block,
            top_k=payload_top_k,
            byte_length=len(blob),
        )
        for (name, tensor), blob in zip(named, blobs, strict=True)
    ]


def _pieces(blobs: Iterable[bytes], max_chunk: int) -> Iterator[list[memoryview]]:
    """The concatenation of `blobs` as runs of views adding up to at most `max_chunk` bytes each."""
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
                yield parts
                parts, size = [], 0
    if size:
        yield parts


def split(blobs: Iterable[bytes], max_chunk: int = MAX_CHUNK_BYTES) -> Iterator[bytes]:
    """The concatenation of `blobs` in pieces of at most `max_chunk` bytes; pieces may span blob boundaries."""
    for parts in _pieces(blobs, max_chunk):
        yield b"".join(parts)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def data_message(parts: Sequence[bytes | memoryview], offset: int) -> bytes:
    """A serialized data message (FragmentChunk or PushChunk alike) carrying the concatenation of `parts` at
    byte `offset` of the stream, with its CRC-32. Written straight from the bytes, exactly as protobuf writes
    the message (fields in number order, zeros left out), sparing the copies that building one costs."""
    size = crc = 0
    for part in parts:
        size += len(part)
        crc = zlib.crc32(part, crc)
    placed = _OFFSET_TAG + _varint(offset) if offset else b""
    checked = _CRC_TAG + crc.to_bytes(4, "little") if crc else b""
    return b"".join((_DATA_TAG, _varint(size), *parts, placed, checked))


def _messages(header: pb.FragmentChunk | pb.PushChunk, blobs: Sequence[bytes], max_chunk: int) -> Iterator[bytes]:
    """Serialized chunk messages: `header` (the chunk that holds the header), then the data."""
    yield header.SerializeToString()
    offset = 0
    for parts in _pieces(blobs, max_chunk):
        yield data_message(parts, offset)
        offset += sum(len(p) for p in parts)


def fragment_messages(
    fragment_id: int,
    version: pb.FragmentVersion,
    payloads: Sequence[pb.TensorPayload],
    blobs: Sequence[bytes],
    max_chunk: int = MAX_CHUNK_BYTES,
    delta_base: pb.FragmentVersion | None = None,
    round_opened_seconds: float = 0.0,
) -> Iterator[bytes]:
    """The serialized FragmentChunk messages of a Seed request or a Pull reply: a header, then the data.

    Takes bytes encoded once by `tensor_payloads`, so a retried call or many pulls of one version re-send
    them without encoding again. With `delta_base`, the tensors are differences to the values of that version.
    """
    header = pb.FragmentHeader(
        fragment_id=fragment_id,
        version=version,
        tensors=payloads,
        delta_base=delta_base,
        round_opened_seconds=round_opened_seconds,
    )
    return _messages(pb.FragmentChunk(header=header), blobs, max_chunk)


def push_messages(
    header: pb.PushHeader,
    payloads: Sequence[pb.TensorPayload],
    blobs: Sequence[bytes],
    max_chunk: int = MAX_CHUNK_BYTES,
) -> Iterator[bytes]:
    """The serialized PushChunk messages of a PushDelta request: `header` with its tensors, then the data."""
    filled = pb.PushHeader()
    filled.CopyFrom(header)
    del filled.tensors[:]
    filled.tensors.extend(payloads)
    return _messages(pb.PushChunk(header=filled), blobs, max_chunk)


def _parser(chunk_type: type[_Chunk]) -> Callable[[bytes], "Part"]:
    def parse(raw: bytes) -> Part:
        if raw[:1] == _DATA_TAG:
            size, start = _read_varint(raw, 1)
            placed = _offset_and_crc(raw, start + size) if size >= 0 else None
            if placed is not None:
                return Data(memoryview(raw)[start : start + size], *placed)
        try:
            chunk = chunk_type.FromString(raw)
        except DecodeError:
            return Undecodable()
        return _part(chunk)

    return parse


def parse_request(message_type: type[_Request]) -> Callable[[bytes], _Request | Undecodable]:
    """gRPC deserializer of a unary request: the message, or `Undecodable` for bytes that are none."""

    def parse(raw: bytes) -> _Request | Undecodable:
        try:
            return message_type.FromString(raw)
        except DecodeError:
            return Undecodable()

    return parse


def _read_varint(raw: bytes, offset: int) -> tuple[int, int]:
    """A protobuf varint at `offset` and the offset after it; (-1, offset) if it runs off the end."""
    value = shift = 0
    for index in range(offset, min(len(raw), offset + 10)):
        value |= (raw[index] & 0x7F) << shift
        if raw[index] < 0x80:
            return value, index + 1
        shift += 7
    return -1, offset


def _offset_and_crc(raw: bytes, at: int) -> tuple[int, int] | None:
    """The offset and CRC-32 fields that end a data message written by `data_message`, from `at` (where its
    payload ends); None if the rest is anything else (protobuf then parses the message)."""
    offset = crc = 0
    if raw[at : at + 1] == _OFFSET_TAG:
        offset, at = _read_varint(raw, at + 1)
        if offset < 0:
            return None
    if raw[at : at + 1] == _CRC_TAG and at + 5 <= len(raw):
        crc = int.from_bytes(raw[at + 1 : at + 5], "little")
        at += 5
    return (offset, crc) if at == len(raw) else None


def _part(chunk: pb.FragmentChunk | pb.PushChunk) -> Part:
    kind = chunk.WhichOneof("part")
    if kind == "header":
        return chunk.header
    if kind == "data":
        return Data(memoryview(chunk.data), chunk.offset, chunk.crc32)
    return Undecodable()


parse_fragment_chunk = _parser(pb.FragmentChunk)
parse_fragment_chunk.__doc__ = "gRPC deserializer of FragmentChunk: a data message becomes `Data`, a view, not a copy."
parse_push_chunk = _parser(pb.PushChunk)
parse_push_chunk.__doc__ = "gRPC deserializer of PushChunk: a data message becomes `Data`, a view, not a copy."


def _declared_total(payloads: Iterable[pb.TensorPayload]) -> int:
    """Check that every payload's byte length is what its shape and encoding imply; the stream size they add
    up to."""
    total = 0
    for p in payloads:  # names, shapes, dtypes and encodings already checked against `fields`
        try:
            expected = encoded_nbytes(math.prod(p.shape), encoding_of(p.encoding), p.block_size, p.top_k)
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
    items: Iterable[Part | pb.FragmentChunk | pb.PushChunk],
    header_type: type[_Header],
    max_chunk: int,
    max_total_bytes: int,
) -> tuple[_Header, list[tuple[pb.TensorPayload, Encoded]]]:
    parts = (item if isinstance(item, _PARTS) else _part(item) for item in items)
    header = next(parts, None)
    if header is None:
        raise _invalid("empty stream: expected a header")
    if not isinstance(header, header_type):
        raise _invalid("first message is not a header")
    check_fields(header)
    total = _declared_total(header.tensors)
    float32_bytes = sum(4 * math.prod(p.shape) for p in header.tensors)
    if max(total, float32_bytes) > max_total_bytes:
        raise WireError(
            Refusal.TOO_LARGE,
            f"header declares {total} bytes that decode to {float32_bytes}, more than the limit of {max_total_bytes}",
        )
    # Uninitialised memory: its pages are committed only as data lands, so a header that lies costs nothing.
    buffer = torch.empty(total, dtype=torch.uint8)
    array = buffer.numpy()
    received = 0
    for part in parts:
        if isinstance(part, (pb.FragmentHeader, pb.PushHeader)):
            raise _invalid("header after the first message")
        if isinstance(part, Undecodable):
            raise _invalid("message with neither header nor data, or not a chunk message at all")
        data = part.view
        if len(data) > max_chunk:
            raise WireError(
                Refusal.TOO_LARGE,
                f"data message of {len(data)} bytes exceeds the chunk limit of {max_chunk}",
            )
        if part.offset != received:
            raise _invalid(
                f"data chunk placed at byte {part.offset} arrived after {received} bytes:"
                " chunks reordered, repeated or lost"
            )
        if received + len(data) > total:
            raise _invalid(f"trailing bytes: more data than the {total} bytes the header declares")
        if zlib.crc32(data) != part.crc32:  # zlib drops the GIL over large buffers, as numpy's copy below does
            raise _invalid(f"data chunk at byte {received}: CRC-32 mismatch, its bytes were damaged")
        # numpy copies without holding the GIL (a memoryview copy holds it), so the server's other calls run on.
        array[received : received + len(data)] = np.frombuffer(data, dtype=np.uint8)
        received += len(data)
    if received != total:
        raise _invalid(f"truncated stream: got {received} of {total} bytes")
    tensors = []
    offset = 0
    for p in header.tensors:
        try:
            values = validated(
                buffer[offset : offset + p.byte_length], p.shape, encoding_of(p.encoding), p.block_size, p.top_k
            )
        except EncodingError as e:
            raise _invalid(f"tensor {p.name!r}: {e}") from None
        tensors.append((p, values))
        offset += p.byte_length
    return header, tensors


def read_fragment_stream(
    chunks: Iterable["Part | pb.FragmentChunk"],
    *,
    max_chunk: int = MAX_CHUNK_BYTES,
    max_total_bytes: int = MAX_STREAM_BYTES,
) -> tuple[pb.FragmentHeader, list[tuple[pb.TensorPayload, torch.Tensor]]]:
    """Read a Seed request or Pull reply (messages, or parts from `parse_fragment_chunk`) into its header
    and float32 tensors; raises WireError if malformed."""
    header, tensors = _read_stream(chunks, pb.FragmentHeader, max_chunk, max_total_bytes)
    return header, [(payload, decoded(values)) for payload, values in tensors]


def read_push_stream(
    chunks: Iterable["Part | pb.PushChunk"],
    *,
    max_chunk: int = MAX_CHUNK_BYTES,
    max_total_bytes: int = MAX_STREAM_BYTES,
) -> tuple[pb.PushHeader, list[tuple[pb.TensorPayload, Encoded]]]:
    """Read a PushDelta request into its header and its tensors, checked but kept as they were sent (a shard
    decodes them only as it merges them); raises WireError if malformed."""
    return _read_stream(chunks, pb.PushHeader, max_chunk, max_total_bytes)
