"""Specification of the chunked tensor streams: round trips, chunk bounds, and every refusal with its code."""

import math
import zlib

import grpc
import pytest
import torch

from diloco.core.encoding import Encoded, Encoding, decoded, encode, error_bound
from diloco.core.refusal import Refusal
from diloco.transport.codes import encoding_of, wire_encoding
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.wire import (
    MAX_CHUNK_BYTES,
    MAX_STREAM_BYTES,
    Data,
    WireError,
    data_message,
    fragment_messages,
    parse_fragment_chunk,
    parse_push_chunk,
    push_messages,
    read_fragment_stream,
    read_push_stream,
    split,
    tensor_payloads,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
VERSION = pb.FragmentVersion(incarnation=3, version=17)


def fragment_stream(fragment_id, version, named, encoding, block_size, max_chunk=MAX_CHUNK_BYTES):
    """Chunk messages as any protobuf peer would parse the serialized stream."""
    payloads, blobs = tensor_payloads(named, encoding, block_size)
    messages = fragment_messages(fragment_id, version, payloads, blobs, max_chunk)
    return [pb.FragmentChunk.FromString(m) for m in messages]


def push_stream(header, named, encoding, block_size, max_chunk=MAX_CHUNK_BYTES):
    payloads, blobs = tensor_payloads(named, encoding, block_size)
    return [pb.PushChunk.FromString(m) for m in push_messages(header, payloads, blobs, max_chunk)]


def _named(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(50, 33, generator=g)),
        ("layers.0.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("scale", torch.randn((), generator=g)),
        ("layers.1.weight", torch.randn(3, 5, 9, generator=g).to(torch.float16)),
        ("empty", torch.randn(0, 4, generator=g)),
    ]


def _push_header():
    return pb.PushHeader(island_id="island-a", fragment_id=2, base=VERSION, tokens=4096, inner_steps=50, sequence=9)


def _assert_decoded(named, decoded, encoding, block_size):
    assert [p.name for p, _ in decoded] == [name for name, _ in named]
    for (name, tensor), (payload, values) in zip(named, decoded, strict=True):
        assert values.dtype == torch.float32 and values.shape == tensor.shape
        assert list(payload.shape) == list(tensor.shape)
        assert payload.encoding == wire_encoding(encoding)
        err = (values - tensor.float()).abs()
        assert bool((err <= error_bound(tensor, encoding, block_size)).all()), name


def _data_sizes(chunks):
    return [len(c.data) for c in chunks if c.WhichOneof("part") == "data"]


def _fragment_chunks(named=None, encoding=Encoding.INT8, block_size=16, max_chunk=MAX_CHUNK_BYTES):
    return list(fragment_stream(5, VERSION, named or _named(), encoding, block_size, max_chunk))


def _with_payload(chunks, **changes):
    """The stream with the first tensor's description changed, as a hostile or buggy sender could."""
    header = pb.FragmentHeader()
    header.CopyFrom(chunks[0].header)
    for field, value in changes.items():
        if field == "shape":
            del header.tensors[0].shape[:]
            header.tensors[0].shape.extend(value)
        else:
            setattr(header.tensors[0], field, value)
    return [pb.FragmentChunk(header=header), *chunks[1:]]


def _refusal(read, chunks, **kwargs):
    with pytest.raises(WireError) as info:
        read(chunks, **kwargs)
    return info.value


# --- building streams -------------------------------------------------------------------------------------


def test_tensor_payloads_describe_each_tensor():
    named = _named()
    payloads, blobs = tensor_payloads(named, Encoding.INT4, 32)
    assert [p.dtype for p in payloads] == [pb.FLOAT32, pb.BFLOAT16, pb.FLOAT32, pb.FLOAT16, pb.FLOAT32]
    for (name, tensor), p, blob in zip(named, payloads, blobs, strict=True):
        assert p.name == name and list(p.shape) == list(tensor.shape)
        assert p.encoding == pb.INT4 and p.block_size == 32 and p.byte_length == len(blob)
        assert blob == encode(tensor, Encoding.INT4, 32)


@pytest.mark.parametrize("encoding", [Encoding.FP32, Encoding.BF16])
def test_unquantised_payloads_carry_block_size_zero(encoding):
    payloads, _ = tensor_payloads(_named(), encoding, 128)
    assert {p.block_size for p in payloads} == {0}


def test_tensor_payloads_refuse_dtypes_the_wire_cannot_carry():
    with pytest.raises(ValueError, match="dtype"):
        tensor_payloads([("steps", torch.arange(4))], Encoding.FP32, 0)


@pytest.mark.parametrize("max_chunk", [1, 3, 7, 16, 100])
def test_split_cuts_the_concatenation_into_bounded_pieces(max_chunk):
    blobs = [b"abcde", b"", b"f", b"ghijklmnopqrstuvwxyz" * 3, b"0123"]
    pieces = list(split(blobs, max_chunk))
    assert b"".join(pieces) == b"".join(blobs)
    assert all(0 < len(p) <= max_chunk for p in pieces)
    assert all(len(p) == max_chunk for p in pieces[:-1])


def test_split_of_nothing_is_empty():
    assert list(split([b"", b""], 4)) == []


def test_split_refuses_non_positive_chunk():
    with pytest.raises(ValueError, match="max_chunk"):
        list(split([b"abc"], 0))


def test_fragment_stream_is_a_header_then_bounded_data():
    chunks = _fragment_chunks(max_chunk=100)
    assert chunks[0].WhichOneof("part") == "header"
    assert chunks[0].header.fragment_id == 5 and chunks[0].header.version == VERSION
    assert all(c.WhichOneof("part") == "data" for c in chunks[1:])
    sizes = _data_sizes(chunks)
    assert max(sizes) <= 100 and sum(sizes) == sum(p.byte_length for p in chunks[0].header.tensors)


def test_push_stream_copies_the_header_and_fills_its_tensors():
    header = _push_header()
    header.tensors.add(name="stale")
    original = pb.PushHeader()
    original.CopyFrom(header)
    chunks = list(push_stream(header, _named(), Encoding.BF16, 0, max_chunk=64))
    assert header == original
    sent = chunks[0].header
    expected = _push_header()
    expected.tensors.extend(tensor_payloads(_named(), Encoding.BF16, 0)[0])
    assert sent == expected
    assert [p.name for p in sent.tensors] == [name for name, _ in _named()]
    assert max(_data_sizes(chunks)) <= 64


def test_streams_encode_at_call_time():
    named = _named()
    stream = fragment_stream(0, VERSION, named, Encoding.FP32, 0)
    expected = [t.float().clone() for _, t in named]
    for _, tensor in named:
        tensor.add_(1)
    _, decoded = read_fragment_stream(stream)
    assert all(torch.equal(v, e) for (_, v), e in zip(decoded, expected, strict=True))


# --- round trips ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", [Encoding.FP32, Encoding.BF16, Encoding.INT8, Encoding.INT4])
@pytest.mark.parametrize("max_chunk", [MAX_CHUNK_BYTES, 1000, 7])
def test_fragment_round_trip(encoding, max_chunk):
    named = _named()
    chunks = _fragment_chunks(named, encoding, 16, max_chunk)
    assert max(_data_sizes(chunks)) <= max_chunk
    header, decoded = read_fragment_stream(chunks, max_chunk=max_chunk)
    assert header.fragment_id == 5 and header.version == VERSION
    _assert_decoded(named, decoded, encoding, 16)


@pytest.mark.parametrize("encoding", [Encoding.FP32, Encoding.BF16, Encoding.INT8, Encoding.INT4])
def test_push_round_trip(encoding):
    named = _named(seed=1)
    chunks = list(push_stream(_push_header(), named, encoding, 8, max_chunk=50))
    header, kept = read_push_stream(chunks, max_chunk=50)
    assert header.island_id == "island-a" and header.sequence == 9 and header.base == VERSION
    assert all(isinstance(values, Encoded) and values.encoding is encoding for _, values in kept), "kept encoded"
    _assert_decoded(named, [(payload, decoded(values)) for payload, values in kept], encoding, 8)


def test_tensor_larger_than_a_chunk_spans_several_chunks():
    big = torch.randn(MAX_CHUNK_BYTES // 4 + 1000)
    named = [("small", torch.randn(10)), ("big", big), ("tail", torch.randn(3))]
    chunks = _fragment_chunks(named, Encoding.FP32, 0)
    sizes = _data_sizes(chunks)
    assert len(sizes) == 2 and sizes[0] == MAX_CHUNK_BYTES
    _, decoded = read_fragment_stream(chunks)
    assert all(torch.equal(v, t) for (_, v), (_, t) in zip(decoded, named, strict=True))


def test_mixed_encodings_in_one_stream():
    named = _named(seed=2)
    payloads, blobs = [], []
    for (name, tensor), (encoding, block_size) in zip(
        named,
        [(Encoding.INT4, 8), (Encoding.FP32, 0), (Encoding.INT8, 3), (Encoding.BF16, 0), (Encoding.INT4, 2)],
        strict=True,
    ):
        p, b = tensor_payloads([(name, tensor)], encoding, block_size)
        payloads += p
        blobs += b
    header = pb.FragmentHeader(fragment_id=1, version=VERSION, tensors=payloads)
    chunks = [pb.FragmentChunk.FromString(m) for m in fragment_messages(1, VERSION, payloads, blobs, 11)]
    chunks[0] = pb.FragmentChunk(header=header)
    _, decoded = read_fragment_stream(chunks)
    for (name, tensor), (payload, values) in zip(named, decoded, strict=True):
        bound = error_bound(tensor, encoding_of(payload.encoding), payload.block_size)
        assert bool(((values - tensor.float()).abs() <= bound).all()), name


def test_stream_of_empty_tensors_is_just_a_header():
    chunks = _fragment_chunks([("empty", torch.zeros(0))], Encoding.FP32, 0)
    assert len(chunks) == 1
    _, decoded = read_fragment_stream(chunks)
    assert len(decoded) == 1 and decoded[0][1].shape == (0,)


def test_empty_data_messages_are_tolerated():
    chunks = _fragment_chunks(max_chunk=64)
    chunks.insert(2, pb.FragmentChunk.FromString(data_message([], len(chunks[1].data))))
    read_fragment_stream(chunks, max_chunk=64)


def test_reader_accepts_a_generator():
    named = _named()
    _, kept = read_push_stream(iter(push_stream(_push_header(), named, Encoding.INT8, 16)))
    _assert_decoded(named, [(payload, decoded(values)) for payload, values in kept], Encoding.INT8, 16)


# --- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("read", [read_fragment_stream, read_push_stream])
def test_empty_stream_is_refused(read):
    error = _refusal(read, [])
    assert error.code == INVALID and "empty stream" in error.message


def test_stream_must_start_with_a_header():
    chunks = _fragment_chunks()
    error = _refusal(read_fragment_stream, chunks[1:])
    assert error.code == INVALID and "first message is not a header" in error.message
    error = _refusal(read_push_stream, [pb.PushChunk()])
    assert error.code == INVALID and "not a header" in error.message


def test_second_header_is_refused():
    chunks = list(push_stream(_push_header(), _named(), Encoding.FP32, 0, max_chunk=100))
    error = _refusal(read_push_stream, [chunks[0], chunks[1], chunks[0], *chunks[2:]], max_chunk=100)
    assert error.code == INVALID and "header after the first message" in error.message


def test_message_without_a_part_is_refused():
    chunks = _fragment_chunks()
    error = _refusal(read_fragment_stream, [chunks[0], pb.FragmentChunk(), *chunks[1:]])
    assert error.code == INVALID and "neither header nor data" in error.message


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"block_size": 0}, "block_size"),
        ({"byte_length": 1}, "byte_length 1"),
        ({"shape": [50, 34]}, "byte_length"),
        ({"block_size": 32}, "byte_length"),
    ],
)
def test_bad_tensor_descriptions_are_refused(changes, fragment):
    error = _refusal(read_fragment_stream, _with_payload(_fragment_chunks(), **changes))
    assert error.code == INVALID
    assert fragment in error.message and "embed.weight" in error.message


@pytest.mark.parametrize(
    "changes",
    [
        {"shape": [50, -33]},
        {"dtype": pb.DTYPE_UNSPECIFIED},
        {"dtype": 42},
        {"encoding": pb.ENCODING_UNSPECIFIED},
        {"encoding": 9},
    ],
)
def test_tensor_fields_out_of_their_rule_are_refused_naming_the_field(changes):
    error = _refusal(read_fragment_stream, _with_payload(_fragment_chunks(), **changes))
    (field,) = changes
    assert error.code == INVALID
    assert error.field == field and f"FragmentHeader.tensors[0].{field}: must be" in error.message


def test_truncated_stream_is_refused():
    chunks = _fragment_chunks(max_chunk=100)
    declared = sum(p.byte_length for p in chunks[0].header.tensors)
    error = _refusal(read_fragment_stream, chunks[:-1], max_chunk=100)
    assert error.code == INVALID
    assert f"truncated stream: got {declared - len(chunks[-1].data)} of {declared} bytes" in error.message
    error = _refusal(read_fragment_stream, chunks[:1], max_chunk=100)
    assert f"truncated stream: got 0 of {declared} bytes" in error.message


def test_trailing_bytes_are_refused_as_soon_as_they_arrive():
    chunks = _fragment_chunks(max_chunk=100)
    consumed = []

    def stream():
        declared = sum(p.byte_length for p in chunks[0].header.tensors)
        for chunk in [*chunks, pb.FragmentChunk.FromString(data_message([b"x"], declared)), *chunks[1:]]:
            consumed.append(chunk)
            yield chunk

    error = _refusal(read_fragment_stream, stream(), max_chunk=100)
    assert error.code == INVALID and "trailing bytes" in error.message
    assert len(consumed) == len(chunks) + 1


def test_oversize_data_message_is_resource_exhausted():
    chunks = _fragment_chunks(max_chunk=101)
    error = _refusal(read_fragment_stream, chunks, max_chunk=100)
    assert error.code == EXHAUSTED and "101 bytes" in error.message and "chunk limit of 100" in error.message


def test_header_declaring_too_much_is_resource_exhausted_before_any_data():
    """The limit bounds the bytes sent and the float32 bytes they decode to (beyond them, when quantised)."""
    chunks = _fragment_chunks()
    declared = sum(p.byte_length for p in chunks[0].header.tensors)
    decoded = sum(4 * math.prod(p.shape) for p in chunks[0].header.tensors)
    read_fragment_stream(chunks, max_total_bytes=max(declared, decoded))

    def header_only():
        yield chunks[0]
        raise AssertionError("data was read after an oversize header")

    error = _refusal(read_fragment_stream, header_only(), max_total_bytes=max(declared, decoded) - 1)
    assert error.code == EXHAUSTED and f"{declared} bytes that decode to {decoded}" in error.message


@pytest.mark.parametrize("encoding", [Encoding.FP32, Encoding.INT8])
def test_non_finite_values_are_refused(encoding):
    named = [("w", torch.ones(8))]
    good = list(fragment_stream(0, VERSION, named, encoding, 4))
    payload = good[0].header.tensors[0]
    poison = encode(torch.full((8,), 2.0), encoding, 4)
    poison = bytearray(poison)
    poison[:4] = b"\x00\x00\xc0\x7f"  # a float32 NaN, in the first value (FP32) or the first scale (INT8)
    chunks = [good[0], pb.FragmentChunk.FromString(data_message([bytes(poison)], 0))]
    assert payload.byte_length == len(poison)
    error = _refusal(read_fragment_stream, chunks)
    assert error.code == INVALID and "NaN or Inf" in error.message and "'w'" in error.message


def test_wire_error_carries_code_and_message():
    error = WireError(Refusal.INVALID, "bad thing")
    assert error.code == INVALID and error.message == "bad thing"
    assert "bad thing" in str(error)


def test_serialized_data_messages_are_exactly_what_protobuf_writes():
    payloads, blobs = tensor_payloads(_named(), Encoding.INT8, 16)
    messages = list(push_messages(_push_header(), payloads, blobs, max_chunk=300))
    for raw in messages[1:]:
        chunk = pb.PushChunk.FromString(raw)
        assert pb.PushChunk(data=chunk.data, offset=chunk.offset, crc32=chunk.crc32).SerializeToString() == raw


@pytest.mark.parametrize(
    "parse, build",
    [
        (parse_fragment_chunk, lambda p, b: fragment_messages(5, VERSION, p, b, 300)),
        (parse_push_chunk, lambda p, b: push_messages(_push_header(), p, b, 300)),
    ],
)
def test_zero_copy_parts_read_like_messages(parse, build):
    named = _named()
    payloads, blobs = tensor_payloads(named, Encoding.FP32, 0)
    parts = [parse(raw) for raw in build(payloads, blobs)]
    assert all(isinstance(part, Data) and isinstance(part.view, memoryview) for part in parts[1:])
    if parse is parse_fragment_chunk:
        _, tensors = read_fragment_stream(parts, max_chunk=300)
    else:
        _, kept = read_push_stream(parts, max_chunk=300)
        tensors = [(payload, decoded(values)) for payload, values in kept]
    for (_, want), (_, got) in zip(named, tensors):
        assert torch.equal(got, want.to(torch.float32))


@pytest.mark.parametrize("raw", [b"\xff\xff\xff", b"\x12\x05ab", b"\x0a\x03\x0a\x01"])
def test_bytes_that_are_no_chunk_are_refused_as_invalid(raw):
    header = pb.FragmentChunk(header=pb.FragmentHeader(fragment_id=1)).SerializeToString()
    error = _refusal(read_fragment_stream, [parse_fragment_chunk(header), parse_fragment_chunk(raw)])
    assert error.code == INVALID


# --- self-checking framing: a chunk out of place or damaged is refused before its bytes are used ------------


def test_each_data_message_carries_its_offset_and_crc32():
    chunks = _fragment_chunks(max_chunk=100)
    offset = 0
    for chunk in chunks[1:]:
        assert (chunk.offset, chunk.crc32) == (offset, zlib.crc32(chunk.data))
        offset += len(chunk.data)
    assert offset == sum(p.byte_length for p in chunks[0].header.tensors)


OUT_OF_PLACE = {
    "two chunks swapped": lambda c: [c[0], c[2], c[1], *c[3:]],
    "a chunk repeated": lambda c: [*c[:3], c[2], *c[3:]],
    "a chunk lost": lambda c: [*c[:2], *c[3:]],
    "the last chunk first": lambda c: [c[0], c[-1], *c[1:-1]],
}


@pytest.mark.parametrize("case", list(OUT_OF_PLACE))
@pytest.mark.parametrize("stream", ["fragment", "push"])
def test_chunks_out_of_place_are_refused(case, stream):
    if stream == "fragment":
        read, chunks = read_fragment_stream, _fragment_chunks(max_chunk=100)
    else:
        read, chunks = read_push_stream, push_stream(_push_header(), _named(), Encoding.INT8, 16, max_chunk=100)
    error = _refusal(read, OUT_OF_PLACE[case](chunks), max_chunk=100)
    assert error.code == INVALID and "reordered, repeated or lost" in error.message


def test_every_flipped_bit_of_a_chunk_is_refused():
    chunks = _fragment_chunks(max_chunk=100)
    for bit in range(8 * len(chunks[2].data)):
        damaged = bytearray(chunks[2].data)
        damaged[bit // 8] ^= 1 << bit % 8
        forged = pb.FragmentChunk(data=bytes(damaged), offset=chunks[2].offset, crc32=chunks[2].crc32)
        error = _refusal(read_fragment_stream, [*chunks[:2], forged, *chunks[3:]], max_chunk=100)
        assert error.code == INVALID and "CRC-32 mismatch" in error.message, bit


@pytest.mark.parametrize("field", ["offset", "crc32"])
def test_a_damaged_offset_or_checksum_is_refused(field):
    chunks = _fragment_chunks(max_chunk=100)
    setattr(chunks[2], field, getattr(chunks[2], field) ^ 4)
    assert _refusal(read_fragment_stream, chunks, max_chunk=100).code == INVALID


def test_data_without_offset_and_checksum_is_refused():
    """What a peer that predates the framing sends: the data alone. A chunk is never taken unchecked."""
    chunks = _fragment_chunks(max_chunk=100)
    bare = [chunks[0], *(pb.FragmentChunk(data=c.data) for c in chunks[1:])]
    assert _refusal(read_fragment_stream, bare, max_chunk=100).code == INVALID


def test_data_messages_in_any_field_order_read_alike():
    """The zero-copy reader knows the field order protobuf writes; any other order parses through protobuf."""
    raw = data_message([b"abc", b"defg"], 4096)
    reordered = raw[9:] + raw[:9]  # the offset and CRC fields (the last 8 bytes) first, then the data
    assert pb.FragmentChunk.FromString(reordered) == pb.FragmentChunk.FromString(raw)
    for parse in (parse_fragment_chunk, parse_push_chunk):
        fast, slow = parse(raw), parse(reordered)
        assert isinstance(fast, Data) and isinstance(slow, Data)
        assert (bytes(fast.view), fast.offset, fast.crc32) == (bytes(slow.view), slow.offset, slow.crc32)
        assert (bytes(fast.view), fast.offset, fast.crc32) == (b"abcdefg", 4096, zlib.crc32(b"abcdefg"))


def test_a_header_declaring_more_than_any_stream_carries_is_refused_without_a_limit_given():
    """An island reads a pull with no fragment size to hold it to: a reply declaring 4 TiB is still refused
    as oversize before anything is reserved, never an allocation failure."""
    huge = pb.TensorPayload(name="w", shape=[2**40], dtype=pb.FLOAT32, encoding=pb.FP32, byte_length=2**42)
    error = _refusal(read_fragment_stream, [pb.FragmentChunk(header=pb.FragmentHeader(tensors=[huge]))])
    assert error.code == EXHAUSTED and str(MAX_STREAM_BYTES) in error.message
