"""Properties of the wire readers under arbitrary input (hypothesis): whatever a peer sends, a reader answers
with the tensors that were framed or with a `WireError`, never another exception, and never holds tensors
larger than the bytes sent allow. On failure hypothesis prints the falsifying example and the
`@reproduce_failure` blob; `pytest --hypothesis-seed=N` replays a run's seed."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.core.encoding import Encoding, decoded
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.wire import (
    MAX_STREAM_BYTES,
    WireError,
    data_message,
    fragment_messages,
    parse_fragment_chunk,
    parse_push_chunk,
    push_messages,
    read_fragment_stream,
    read_push_stream,
    tensor_payloads,
)

pytestmark = pytest.mark.fuzz

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_CHUNK = 64  # small chunks, so a few hundred bytes make streams of many messages
DECODED_PER_BYTE = 8  # the most float32 bytes one dense wire byte decodes to (int4: two values per byte)

encodings = st.sampled_from(  # encoding, block size, top_k
    [
        (Encoding.FP32, 0, 0),
        (Encoding.BF16, 0, 0),
        (Encoding.INT8, 4, 0),
        (Encoding.INT4, 4, 0),
        (Encoding.SPARSE, 4, 1),
    ]
)
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3)
finite = st.floats(-(2.0**126), 2.0**126, width=32)  # finite in every encoding, bfloat16 included


@st.composite
def named_tensors(draw) -> list[tuple[str, torch.Tensor]]:
    named = []
    for i in range(draw(st.integers(0, 3))):
        shape = draw(shapes)
        values = draw(st.lists(finite, min_size=math.prod(shape), max_size=math.prod(shape)))
        named.append((f"t{i}", torch.tensor(values, dtype=torch.float32).reshape(shape)))
    return named


def hostile_payload() -> st.SearchStrategy[pb.TensorPayload]:
    """Tensor descriptions as a hostile peer may write them: any shape, dtype, encoding, block and length."""
    return st.builds(
        pb.TensorPayload,
        name=st.text(max_size=8),
        shape=st.lists(st.one_of(st.integers(-3, 8), st.integers(0, 2**62)), max_size=3),
        dtype=st.integers(0, 4),
        encoding=st.integers(0, 5),
        block_size=st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)),
        top_k=st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)),
        byte_length=st.one_of(st.integers(0, 256), st.integers(0, 2**64 - 1)),
    )


def _framed(named, encoding, block_size, top_k, push: bool) -> list[bytes]:
    payloads, blobs = tensor_payloads(named, encoding, block_size, top_k)
    if push:
        return list(push_messages(pb.PushHeader(island_id="a"), payloads, blobs, MAX_CHUNK))
    return list(fragment_messages(1, pb.FragmentVersion(), payloads, blobs, MAX_CHUNK))


def _read(messages: list[bytes], push: bool, **limits):
    """Header and float32 tensors, a push's decoded from what its reader keeps."""
    if not push:
        return read_fragment_stream([parse_fragment_chunk(raw) for raw in messages], max_chunk=MAX_CHUNK, **limits)
    header, kept = read_push_stream([parse_push_chunk(raw) for raw in messages], max_chunk=MAX_CHUNK, **limits)
    return header, [(payload, decoded(values)) for payload, values in kept]


def _assert_bounded_by_what_was_sent(messages: list[bytes], decoded, limit: int = MAX_STREAM_BYTES) -> None:
    """Dense tensors hold at most DECODED_PER_BYTE bytes per byte sent; sparse ones, which decode to far more
    than they send, stay within the reader's limit."""
    sent = sum(len(raw) for raw in messages)
    held = sum(values.numel() * values.element_size() for _, values in decoded)
    if any(payload.encoding == pb.SPARSE for payload, _ in decoded):
        assert held <= limit, f"{held} bytes of tensors beyond the limit of {limit}"
    else:
        assert held <= DECODED_PER_BYTE * sent, f"{held} bytes of tensors from {sent} bytes sent"


@FUZZ
@given(raw=st.binary(max_size=300), push=st.booleans())
def test_any_bytes_parse_to_a_part(raw, push):
    """The deserializer never raises: bytes that are no chunk become Undecodable, which a reader refuses."""
    (parse_push_chunk if push else parse_fragment_chunk)(raw)


@FUZZ
@given(messages=st.lists(st.binary(max_size=120), max_size=6), push=st.booleans())
def test_any_messages_are_read_or_refused(messages, push):
    try:
        decoded = _read(messages, push)[1]
    except WireError:
        return
    _assert_bounded_by_what_was_sent(messages, decoded)


@FUZZ
@given(tensors=st.lists(hostile_payload(), max_size=3), data=st.lists(st.binary(max_size=80), max_size=4))
def test_any_header_with_any_data_is_read_or_refused(tensors, data):
    """Descriptions that lie about sizes, blocks or encodings, followed by well-framed data: the reader
    checks every declared length before buffering, so it refuses without holding what was declared."""
    messages = [pb.FragmentChunk(header=pb.FragmentHeader(tensors=tensors)).SerializeToString()]
    offset = 0
    for piece in data:
        messages.append(data_message([piece], offset))
        offset += len(piece)
    for limits in ({"max_total_bytes": 1 << 20}, {}):  # as a shard reads a seed or push, as an island a pull
        try:
            decoded = _read(messages, push=False, **limits)[1]
        except WireError:
            continue
        _assert_bounded_by_what_was_sent(messages, decoded, **({"limit": limits["max_total_bytes"]} if limits else {}))


@FUZZ
@given(
    named=named_tensors(),
    coding=encodings,
    push=st.booleans(),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=3),
)
def test_damaged_data_messages_are_refused(named, coding, push, edits):
    """A valid stream with bytes of its data messages changed anywhere (tag, length, data, offset, CRC):
    refused, never read as other values. (The header is checked by its lengths and encodings, not a CRC.)"""
    messages = _framed(named, *coding, push)
    if len(messages) == 1:
        return
    flat = bytearray(b"".join(messages[1:]))
    for position, xor in edits:
        flat[position % len(flat)] ^= xor
    damaged, start = [messages[0]], 0
    for raw in messages[1:]:
        damaged.append(bytes(flat[start : start + len(raw)]))
        start += len(raw)
    try:
        _, decoded = _read(damaged, push)
    except WireError:
        return
    _, intact = _read(messages, push)
    _assert_bounded_by_what_was_sent(damaged, decoded)
    assert [values.shape for _, values in decoded] == [values.shape for _, values in intact]
    for (_, got), (_, want) in zip(decoded, intact, strict=True):
        assert torch.equal(got, want), "damaged data was read as other values"


@FUZZ
@given(named=named_tensors(), coding=encodings, push=st.booleans(), data=st.data())
def test_reordered_or_dropped_chunks_are_refused(named, coding, push, data):
    messages = _framed(named, *coding, push)
    body = messages[1:]
    order = data.draw(st.lists(st.sampled_from(range(len(body))), max_size=len(body) + 1)) if body else []
    if order == list(range(len(body))):
        return
    with pytest.raises(WireError) as error:
        _read([messages[0], *(body[i] for i in order)], push)
    assert error.value.code.name == "INVALID_ARGUMENT"
