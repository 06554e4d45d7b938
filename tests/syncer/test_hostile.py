"""Hostile and broken callers against a real shard: every refusal carries the status code of the contract
(protos/diloco/v1/syncer.proto) and leaves the shard exactly as it was — versions, pending contributions,
live islands and the values it serves — and a later merge uses only the valid deltas."""

from __future__ import annotations

import math
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import pytest
import torch
from support import TEST_PKI
from syncer_harness import (
    TOKEN,
    ReferenceFragment,
    config_for,
    framed,
    make_client,
    open_channel,
    random_values,
    wait_until,
)

from diloco.core.encoding import Encoding, encoded_nbytes
from diloco.syncer.server import SyncerServer
from diloco.transport import tls, wire
from diloco.transport.client import SyncerClient
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.v1 import syncer_pb2_grpc

pytestmark = pytest.mark.process

AUTH = (("authorization", f"Bearer {TOKEN}"),)
MiB = 1024 * 1024
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
BASE_VERSION = 2  # fragment 0 after the two merges of the scene


@dataclass
class Scene:
    """A shard with history: fragment 0 merged twice and holding a's pending push, fragment 1 holding c's
    pending push, fragment 2 never seeded; islands a, b, c live; quorum 2, max staleness 1, a long grace."""

    server: SyncerServer
    stub: syncer_pb2_grpc.SyncerStub
    observer: SyncerClient
    incarnation: int
    reference: ReferenceFragment  # fragment 0 as it must be after its merges
    pending: dict[str, tuple[list[tuple[str, torch.Tensor]], int]]  # fragment 0's valid pending deltas
    islands: dict[str, SyncerClient]

    def base(self, version: int = BASE_VERSION) -> pb.FragmentVersion:
        return pb.FragmentVersion(incarnation=self.incarnation, version=version)


@pytest.fixture
def scene(start_server) -> Scene:
    config = config_for(fragments=3, quorum=2, grace_seconds=30.0, max_staleness=1, block_size=32)
    server = start_server(config, seed=False)
    islands = {name: make_client(server.port, name) for name in "abc"}
    observer = make_client(server.port)  # no island id: reading never marks anyone live
    seeds = {p: random_values(p) for p in (0, 1)}
    for p, values in seeds.items():
        assert observer.seed(p, values).accepted
    for client in islands.values():
        client.join(3)
    incarnation = observer.pull(0)[0].incarnation
    reference = ReferenceFragment(config, seeds[0])
    for r in range(BASE_VERSION):  # every live island reports: each round merges at once
        round_deltas = []
        for i, (_name, client) in enumerate(islands.items()):
            delta, tokens = random_values(100 + 10 * r + i, 0.1), 100 * (i + 1)
            client.push(
                0,
                base=pb.FragmentVersion(incarnation=incarnation, version=r),
                tokens=tokens,
                inner_steps=10,
                sequence=r,
                delta=delta,
                encoding=Encoding.FP32,
                block_size=0,
            )
            round_deltas.append((delta, tokens))
        wait_until(lambda: observer.pull(0)[0].version == r + 1)
        reference.merge(round_deltas)
    reference.assert_matches(observer.pull(0)[1])
    pending_a = (random_values(200, 0.1), 150)
    islands["a"].push(
        0,
        base=pb.FragmentVersion(incarnation=incarnation, version=BASE_VERSION),
        tokens=pending_a[1],
        inner_steps=10,
        sequence=100,
        delta=pending_a[0],
        encoding=Encoding.FP32,
        block_size=0,
    )
    islands["c"].push(
        1,
        base=pb.FragmentVersion(incarnation=incarnation, version=0),
        tokens=10,
        inner_steps=10,
        sequence=0,
        delta=random_values(201, 0.1),
        encoding=Encoding.FP32,
        block_size=0,
    )
    channel = open_channel(
        server.port,
        [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)],
    )
    yield Scene(
        server, syncer_pb2_grpc.SyncerStub(channel), observer, incarnation, reference, {"a": pending_a}, islands
    )
    channel.close()
    observer.close()
    for client in islands.values():
        client.close()


@dataclass
class Snapshot:
    fragments: dict
    live_islands: list[str]
    rejected: int
    values: dict


def snapshot(scene: Scene) -> Snapshot:
    status = scene.observer.status()
    fragments = {
        f.fragment_id: (
            f.seeded,
            f.version.incarnation,
            f.version.version,
            f.pending,
            f.last_contributors,
            f.last_merge_unix,
            f.max_staleness_seen,
            f.tokens_merged,
        )
        for f in status.fragments
    }
    values = {}
    for p, (seeded, *_) in fragments.items():
        if seeded:
            version, named = scene.observer.pull(p)
            values[p] = ((version.incarnation, version.version), named)
    return Snapshot(fragments, list(status.live_islands), status.rejected_pushes, values)


def assert_unchanged(before: Snapshot, after: Snapshot) -> None:
    assert after.fragments == before.fragments
    assert after.live_islands == before.live_islands
    assert after.values.keys() == before.values.keys()
    for p, (version, named) in before.values.items():
        assert after.values[p][0] == version
        for (name, want), (_, got) in zip(named, after.values[p][1]):
            assert torch.equal(got, want), f"fragment {p} tensor {name} changed"


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


# Push streams. Each builder takes the scene and the island sending, and returns the messages of one stream.


def valid_delta(seed: int = 300) -> list[tuple[str, torch.Tensor]]:
    return random_values(seed, 0.1)


def push_header(
    scene: Scene,
    island: str,
    payloads,
    *,
    fragment: int = 0,
    base: pb.FragmentVersion | None = None,
    sequence: int = 7,
    **fields,
) -> pb.PushChunk:
    """A push header; `fields` set or override its other fields (tokens, inner steps, seconds)."""
    header = pb.PushHeader(
        island_id=island,
        fragment_id=fragment,
        base=base or scene.base(),
        tokens=100,
        inner_steps=10,
        sequence=sequence,
        tensors=payloads,
    )
    for name, value in fields.items():
        setattr(header, name, value)
    return pb.PushChunk(header=header)


def push_stream(scene, island, named=None, encoding=Encoding.FP32, block_size=0, **header) -> list[pb.PushChunk]:
    payloads, blobs = wire.tensor_payloads(named or valid_delta(), encoding, block_size)
    return [push_header(scene, island, payloads, **header), framed(pb.PushChunk, b"".join(blobs))]  # one chunk: small


def with_data(scene, island, payloads, data: bytes) -> list[pb.PushChunk]:
    return [push_header(scene, island, payloads), framed(pb.PushChunk, data)]


def chunked_push(scene, island) -> list[pb.PushChunk]:
    """A valid push whose data travels in chunks of 1 KiB, as the client frames them."""
    payloads, blobs = wire.tensor_payloads(valid_delta(), Encoding.FP32, 0)
    header = push_header(scene, island, payloads).header
    return [pb.PushChunk.FromString(m) for m in wire.push_messages(header, payloads, blobs, max_chunk=1024)]


def swap_chunks(chunks: list, first: int = 1, second: int = 2) -> list:
    """`chunks` with two data messages exchanged: every byte arrives, in the wrong place."""
    chunks = list(chunks)
    chunks[first], chunks[second] = chunks[second], chunks[first]
    return chunks


def repeated_chunk(scene, island):
    """The first data message sent twice and the second never: the stream keeps its declared length."""
    chunks = chunked_push(scene, island)
    return [*chunks[:2], chunks[1], *chunks[3:]]


def flip_a_byte(chunks: list, index: int = 1) -> list:
    """`chunks` with one bit flipped in data message `index`: in the lowest byte of its second float32, so the
    damaged value is still finite and would decode as another value."""
    chunks = list(chunks)
    damaged = type(chunks[index])()
    damaged.CopyFrom(chunks[index])
    data = bytearray(damaged.data)
    data[4] ^= 0x01
    damaged.data = bytes(data)
    chunks[index] = damaged
    return chunks


def corrupt_first_value(encoding: Encoding, block_size: int, raw: bytes, top_k: int = 0) -> Callable:
    """A stream whose first tensor's first 4 (or 2) bytes — a value, or the first block's scale — are `raw`."""

    def build(scene, island):
        payloads, blobs = wire.tensor_payloads(valid_delta(), encoding, block_size, top_k)
        blobs[0] = raw + blobs[0][len(raw) :]
        return with_data(scene, island, payloads, b"".join(blobs))

    return build


def sparse_indices_zeroed(scene, island):
    """A sparse stream whose first tensor names index 0 for every kept value: repeated within each block.
    Its last bytes are the indices (two per block of 32, five bits each: 2048 / 32 · 10 bits = 80 bytes)."""
    payloads, blobs = wire.tensor_payloads(valid_delta(), Encoding.SPARSE, 32, 2)
    blobs[0] = blobs[0][:-80] + bytes(80)
    return with_data(scene, island, payloads, b"".join(blobs))


def with_payload_changes(
    change: Callable[[list[pb.TensorPayload]], None],
    extra: bytes = b"",
    encoding: Encoding = Encoding.FP32,
    block_size: int = 0,
    top_k: int = 0,
) -> Callable:
    def build(scene, island):
        payloads, blobs = wire.tensor_payloads(valid_delta(), encoding, block_size, top_k)
        change(payloads)
        return with_data(scene, island, payloads, b"".join(blobs) + extra)

    return build


def set_field(index: int, **fields) -> Callable[[list[pb.TensorPayload]], None]:
    def change(payloads):
        for key, value in fields.items():
            setattr(payloads[index], key, value)

    return change


def truncated(scene, island):
    chunks = push_stream(scene, island)
    return [chunks[0], framed(pb.PushChunk, chunks[1].data[:-100])]


def trailing(scene, island):
    chunks = push_stream(scene, island)
    return [*chunks, framed(pb.PushChunk, b"\x00" * 8, offset=len(chunks[1].data))]


def second_header(scene, island):
    chunks = push_stream(scene, island)
    return chunks[:1] + chunks[:1] + chunks[1:]


def data_first(scene, island):
    chunks = push_stream(scene, island)
    return chunks[1:] + chunks[:1]


def oversize_message(scene, island):
    """A valid header, then one data message of 6 MiB: beyond the 4 MiB chunks plus any slack for framing."""
    payloads, _ = wire.tensor_payloads(valid_delta(), Encoding.FP32, 0)
    return with_data(scene, island, payloads, b"\0" * (6 * MiB))


def oversize_chunk(scene, island):
    """One data message a byte over the contract's 4 MiB chunk limit (small enough for gRPC's own limit)."""
    payloads, _ = wire.tensor_payloads(valid_delta(), Encoding.FP32, 0)
    return with_data(scene, island, payloads, b"\0" * (4 * MiB + 1))


def beyond_fragment_size(scene, island):
    """A header consistent in itself (int8 with one scale per element: 5 bytes per element) that declares more
    bytes than the fragment holds in float32 (4 per element): refused as oversize before any data is read."""
    return push_stream(scene, island, encoding=Encoding.INT8, block_size=1)


NAN32, INF32 = struct.pack("<f", math.nan), struct.pack("<f", math.inf)
PUSH_CASES = {
    "wrong shape": (lambda s, i: push_stream(s, i, [("w", torch.zeros(32, 64)), ("b", torch.zeros(32))]), INVALID),
    "wrong tensor count": (lambda s, i: push_stream(s, i, valid_delta()[:1]), INVALID),
    "extra tensor": (lambda s, i: push_stream(s, i, [*valid_delta(), ("c", torch.zeros(2))]), INVALID),
    "wrong tensor name": (
        lambda s, i: push_stream(s, i, [("x", t) for _, t in valid_delta()[:1]] + valid_delta()[1:]),
        INVALID,
    ),
    "bfloat16 dtype for a float32 fragment": (
        lambda s, i: push_stream(s, i, [(n, t.bfloat16()) for n, t in valid_delta()]),
        INVALID,
    ),
    "unknown dtype": (with_payload_changes(set_field(0, dtype=7)), INVALID),
    "NaN in fp32 data": (corrupt_first_value(Encoding.FP32, 0, NAN32), INVALID),
    "Inf in fp32 data": (corrupt_first_value(Encoding.FP32, 0, INF32), INVALID),
    "-Inf in fp32 data": (corrupt_first_value(Encoding.FP32, 0, struct.pack("<f", -math.inf)), INVALID),
    "NaN in bf16 data": (corrupt_first_value(Encoding.BF16, 0, b"\xc0\x7f"), INVALID),
    "Inf scale in int8 data": (corrupt_first_value(Encoding.INT8, 32, INF32), INVALID),
    "NaN scale in int4 data": (corrupt_first_value(Encoding.INT4, 32, NAN32), INVALID),
    "NaN scale in sparse data": (corrupt_first_value(Encoding.SPARSE, 32, NAN32, top_k=2), INVALID),
    "negative scale in sparse data": (corrupt_first_value(Encoding.SPARSE, 32, struct.pack("<f", -1.0), 2), INVALID),
    "sparse indices repeated within a block": (sparse_indices_zeroed, INVALID),
    "sparse without top_k": (
        with_payload_changes(set_field(0, top_k=0), encoding=Encoding.SPARSE, block_size=32, top_k=2),
        INVALID,
    ),
    "sparse top_k beyond its block": (
        with_payload_changes(set_field(0, top_k=33), encoding=Encoding.SPARSE, block_size=32, top_k=2),
        INVALID,
    ),
    "unknown encoding": (with_payload_changes(set_field(0, encoding=9)), INVALID),
    "odd int4 block size": (
        with_payload_changes(set_field(0, block_size=3), encoding=Encoding.INT4, block_size=32),
        INVALID,
    ),
    "int8 without a block size": (
        with_payload_changes(set_field(0, block_size=0), encoding=Encoding.INT8, block_size=32),
        INVALID,
    ),
    "unknown fragment": (lambda s, i: push_stream(s, i, fragment=7), INVALID),
    "unseeded fragment": (lambda s, i: push_stream(s, i, fragment=2, base=s.base(0)), PRECONDITION),
    "stale beyond maxStaleness": (lambda s, i: push_stream(s, i, base=s.base(0)), PRECONDITION),
    "base ahead of the current version": (lambda s, i: push_stream(s, i, base=s.base(BASE_VERSION + 1)), PRECONDITION),
    "base from another incarnation": (
        lambda s, i: push_stream(s, i, base=pb.FragmentVersion(incarnation=s.incarnation + 1, version=BASE_VERSION)),
        PRECONDITION,
    ),
    "data message over 4 MiB plus slack": (oversize_message, EXHAUSTED),
    "data message over the 4 MiB chunk limit": (oversize_chunk, EXHAUSTED),
    "header declares more bytes than the fragment holds": (beyond_fragment_size, EXHAUSTED),
    "byte_length beyond what the shape implies": (
        with_payload_changes(lambda ps: setattr(ps[0], "byte_length", ps[0].byte_length + 4), extra=b"\0" * 4),
        INVALID,
    ),
    "byte_length short of what the shape implies": (
        with_payload_changes(lambda ps: setattr(ps[0], "byte_length", ps[0].byte_length - 4)),
        INVALID,
    ),
    "negative dimension": (with_payload_changes(lambda ps: ps[1].shape.__setitem__(0, -32)), INVALID),
    "truncated stream": (truncated, INVALID),
    "data chunks reordered": (lambda s, i: swap_chunks(chunked_push(s, i)), INVALID),
    "a data chunk repeated in place of the next": (repeated_chunk, INVALID),
    "a flipped byte in the data": (lambda s, i: flip_a_byte(chunked_push(s, i)), INVALID),
    "a flipped byte in a one-chunk push": (lambda s, i: flip_a_byte(push_stream(s, i)), INVALID),
    "trailing bytes": (trailing, INVALID),
    "second header": (second_header, INVALID),
    "data before the header": (data_first, INVALID),
    "empty stream": (lambda s, i: [], INVALID),
    "message with neither header nor data": (lambda s, i: [*push_stream(s, i)[:1], pb.PushChunk()], INVALID),
    "no island id": (lambda s, i: push_stream(s, ""), INVALID),
}
HEADER_FIELD_CASES = {  # each refused naming its field (`transport.fields`): "<case>: <field>"
    "Inf seconds per step: step_seconds": lambda s, i: push_stream(s, i, step_seconds=math.inf),
    "NaN seconds per step: step_seconds": lambda s, i: push_stream(s, i, step_seconds=math.nan),
    "1e-300 seconds per step: step_seconds": lambda s, i: push_stream(s, i, step_seconds=1e-300),
    "negative seconds per step: step_seconds": lambda s, i: push_stream(s, i, step_seconds=-1.0),
    "a step of more than an hour: step_seconds": lambda s, i: push_stream(s, i, step_seconds=3601.0),
    "2^64 - 1 inner steps: inner_steps": lambda s, i: push_stream(s, i, inner_steps=2**64 - 1),
    "2^20 + 1 inner steps: inner_steps": lambda s, i: push_stream(s, i, inner_steps=2**20 + 1),
    "2^64 - 1 tokens: tokens": lambda s, i: push_stream(s, i, inner_steps=2**20, tokens=2**64 - 1),
    "Inf slack: slack_seconds": lambda s, i: push_stream(s, i, slack_seconds=math.inf),
    "an island id with a space: island_id": lambda s, i: push_stream(s, "is land"),
    "a fragment id beyond any job: fragment_id": lambda s, i: push_stream(s, i, fragment=2**32 - 1),
}
PUSH_CASES |= {case: (build, INVALID) for case, build in HEADER_FIELD_CASES.items()}


@pytest.mark.parametrize("case", list(PUSH_CASES))
def test_hostile_push_is_refused_and_changes_nothing(scene, case):
    build, code = PUSH_CASES[case]
    before = snapshot(scene)
    # b has no pending push on fragment 0: if this one were taken, fragment 0 would show two pending.
    error = refused(lambda: scene.stub.PushDelta(iter(build(scene, "b")), metadata=AUTH, timeout=30))
    assert error.code() == code, error.details()
    after = snapshot(scene)
    assert_unchanged(before, after)
    if case == "data message over 4 MiB plus slack":
        # gRPC itself may refuse the message before the shard's code sees it; then nothing is counted.
        assert after.rejected - before.rejected in (0, 1)
    else:
        assert after.rejected == before.rejected + 1


@pytest.mark.parametrize("case", list(HEADER_FIELD_CASES))
def test_a_header_field_out_of_its_rule_is_refused_naming_the_field(scene, case):
    field = case.rsplit(": ", 1)[1]
    error = refused(lambda: scene.stub.PushDelta(iter(HEADER_FIELD_CASES[case](scene, "b")), metadata=AUTH, timeout=30))
    assert error.code() == INVALID
    assert f".{field}:" in error.details(), error.details()
    labels = {"reason": "field"}
    assert scene.server.metrics.registry.get_sample_value("diloco_syncer_rejected_pushes_total", labels) == 1


def test_the_cadence_relayed_to_islands_is_always_one_an_island_can_pace_by(scene):
    """Only a push whose step time is within its rule is taken; what the shard relays is what it took."""
    for step_seconds in (math.inf, 1e-300, 5e-324):
        refused(lambda: scene.stub.PushDelta(iter(push_stream(scene, "b", step_seconds=step_seconds)), metadata=AUTH))
    reply = scene.stub.PushDelta(iter(push_stream(scene, "b", step_seconds=0.5)), metadata=AUTH, timeout=30)
    assert reply.cadence_step_seconds == 0.5


def test_refused_pushes_never_reach_a_merge(scene):
    """Island a, holding a valid pending delta, sends every hostile push; the next merge uses only valid deltas."""
    for case, (build, code) in PUSH_CASES.items():
        error = refused(lambda: scene.stub.PushDelta(iter(build(scene, "a")), metadata=AUTH, timeout=30))
        assert error.code() == code, case
    contributions = [scene.pending["a"]]
    for i, name in enumerate("bc"):
        delta, tokens = random_values(400 + i, 0.1), 50 * (i + 1)
        reply = scene.islands[name].push(
            0,
            base=scene.base(),
            tokens=tokens,
            inner_steps=10,
            sequence=9,
            delta=delta,
            encoding=Encoding.FP32,
            block_size=0,
        )
        assert not reply.duplicate
        contributions.append((delta, tokens))
    _version, values = wait_until(lambda: (got := scene.observer.pull(0))[0].version == BASE_VERSION + 1 and got)
    scene.reference.merge(contributions)
    scene.reference.assert_matches(values)
    status = next(f for f in scene.observer.status().fragments if f.fragment_id == 0)
    assert (status.last_contributors, status.pending) == (3, 0)


# Seeds: fragment 2 awaits its seed and must still await it after each refusal.


def seed_chunks(fragment, payloads, blobs, max_chunk=wire.MAX_CHUNK_BYTES) -> list[pb.FragmentChunk]:
    messages = wire.fragment_messages(fragment, pb.FragmentVersion(), payloads, blobs, max_chunk)
    return [pb.FragmentChunk.FromString(m) for m in messages]


def seed_stream(named, fragment=2) -> list[pb.FragmentChunk]:
    return seed_chunks(fragment, *wire.tensor_payloads(named, Encoding.FP32, 0))


def seed_with_nan():
    payloads, blobs = wire.tensor_payloads(random_values(5), Encoding.FP32, 0)
    blobs[1] = NAN32 + blobs[1][4:]
    return seed_chunks(2, payloads, blobs)


def seed_declaring_4_tib():
    huge = pb.TensorPayload(name="w", shape=[2**40], dtype=pb.FLOAT32, encoding=pb.FP32, byte_length=2**42)
    header = pb.FragmentHeader(fragment_id=2, tensors=[huge])
    return [pb.FragmentChunk(header=header), framed(pb.FragmentChunk, b"\0" * 1024)]


def sparse_seed_declaring_4_tib():
    """A sparse tensor of 2^40 values is 64 MiB on the wire (one scale and one value per block of 64 Ki) but
    4 TiB once decoded: the decoded size is bounded as well as the bytes."""
    numel, block_size = 2**40, 2**16
    huge = pb.TensorPayload(
        name="w",
        shape=[numel],
        dtype=pb.FLOAT32,
        encoding=pb.SPARSE,
        block_size=block_size,
        top_k=1,
        byte_length=encoded_nbytes(numel, Encoding.SPARSE, block_size, 1),
    )
    header = pb.FragmentHeader(fragment_id=2, tensors=[huge])
    return [pb.FragmentChunk(header=header), framed(pb.FragmentChunk, b"\0" * 1024)]


def chunked_seed() -> list[pb.FragmentChunk]:
    return seed_chunks(2, *wire.tensor_payloads(random_values(5), Encoding.FP32, 0), max_chunk=1024)


SEED_CASES = {
    "NaN value": (seed_with_nan, INVALID),
    "no tensors": (lambda: seed_stream([]), INVALID),
    "header declares more than a fragment may hold": (seed_declaring_4_tib, EXHAUSTED),
    "sparse header decoding to more than a fragment may hold": (sparse_seed_declaring_4_tib, EXHAUSTED),
    "truncated": (lambda: seed_stream(random_values(5))[:1], INVALID),
    "data chunks reordered": (lambda: swap_chunks(chunked_seed()), INVALID),
    "a flipped byte in the data": (lambda: flip_a_byte(chunked_seed()), INVALID),
    "data before the header": (lambda: seed_stream(random_values(5))[::-1], INVALID),
    "unknown fragment": (lambda: seed_stream(random_values(5), fragment=7), INVALID),
    "empty stream": (lambda: [], INVALID),
    "a tensor of no elements": (lambda: seed_stream([("w", torch.zeros(0)), *random_values(5)]), INVALID),
    "only tensors of no elements": (lambda: seed_stream([("w", torch.zeros(4, 0))]), INVALID),
}


@pytest.mark.parametrize("case", list(SEED_CASES))
def test_hostile_seed_is_refused_and_changes_nothing(scene, case):
    build, code = SEED_CASES[case]
    before = snapshot(scene)
    error = refused(lambda: scene.stub.Seed(iter(build()), metadata=AUTH, timeout=30))
    assert error.code() == code, error.details()
    after = snapshot(scene)
    assert_unchanged(before, after)
    assert after.rejected == before.rejected + 1
    assert list(scene.islands["a"].join(3).unseeded_fragments) == [2]


@pytest.mark.parametrize(
    "request_, code",
    [
        (pb.PullRequest(fragment_id=7), INVALID),
        (pb.PullRequest(fragment_id=2), PRECONDITION),
        (pb.PullRequest(fragment_id=0, encoding=9), INVALID),
        (pb.PullRequest(fragment_id=0, island_id="intruder", delta_encoding=9), INVALID),
        (pb.PullRequest(fragment_id=0, island_id="is land"), INVALID),
        (pb.PullRequest(fragment_id=2**32 - 1), INVALID),
    ],
    ids=[
        "unknown fragment",
        "unseeded fragment",
        "unknown encoding",
        "unknown delta encoding",
        "invalid island id",
        "fragment id beyond any job",
    ],
)
def test_hostile_pull_is_refused(scene, request_, code):
    before = snapshot(scene)
    error = refused(lambda: list(scene.stub.Pull(request_, metadata=AUTH, timeout=30)))
    assert error.code() == code, error.details()
    assert_unchanged(before, snapshot(scene))


# Pulls through a link that damages them: the island refuses what it cannot trust, and the shard is untouched.

LARGE = [("w", torch.randn(1_200_000, generator=torch.Generator().manual_seed(9)))]  # 4.8 MB: two data messages
PULL_DAMAGE = {"data chunks reordered": swap_chunks, "a flipped byte in the data": flip_a_byte}


@contextmanager
def damaging_link(port: int, damage: Callable[[list], list]) -> Iterator[int]:
    """A gRPC hop in front of the shard that passes each Pull reply on after `damage` rewrote its messages
    (FragmentChunk, in order); yields the port to pull from."""
    options = [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)]
    channel = open_channel(port, options)
    upstream = channel.unary_stream("/diloco.v1.Syncer/Pull")  # serialized bytes in and out

    def pull(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        metadata = [(key, value) for key, value in context.invocation_metadata() if key == "authorization"]
        replies = [pb.FragmentChunk.FromString(raw) for raw in upstream(request, metadata=metadata, timeout=30)]
        yield from (chunk.SerializeToString() for chunk in damage(replies))

    handler = grpc.method_handlers_generic_handler(
        "diloco.v1.Syncer", {"Pull": grpc.unary_stream_rpc_method_handler(pull)}
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=2), handlers=[handler], options=options)
    link_port = tls.add_port(server, "127.0.0.1:0", TEST_PKI.server)
    server.start()
    try:
        yield link_port
    finally:
        server.stop(grace=0)
        channel.close()


def test_a_pull_through_an_intact_link_arrives_whole(scene):
    assert scene.observer.seed(2, LARGE).accepted
    passed = []
    with damaging_link(scene.server.port, lambda chunks: passed.extend(chunks) or chunks) as port:
        with make_client(port) as island:
            _version, values = island.pull(2)
    assert len(passed) == 3  # a header and two data messages: the damages below have something to work on
    assert torch.equal(values[0][1], LARGE[0][1])


@pytest.mark.parametrize("case", list(PULL_DAMAGE))
def test_a_pull_damaged_on_the_way_is_refused_by_the_island(scene, case):
    assert scene.observer.seed(2, LARGE).accepted
    before = snapshot(scene)
    with damaging_link(scene.server.port, PULL_DAMAGE[case]) as port, make_client(port) as island:
        with pytest.raises(wire.WireError) as error:
            island.pull(2)
    assert error.value.code == INVALID, error.value.message
    assert_unchanged(before, snapshot(scene))


def test_join_with_another_layout_is_refused_and_does_not_make_the_island_live(scene):
    before = snapshot(scene)
    error = refused(
        lambda: scene.stub.Join(pb.JoinRequest(island_id="zed", num_fragments=4), metadata=AUTH, timeout=30)
    )
    assert error.code() == INVALID
    assert_unchanged(before, snapshot(scene))


# Credentials

CREDENTIALS = {
    "missing": None,
    "wrong token": (("authorization", "Bearer wrong-token"),),
    "token without the Bearer scheme": (("authorization", TOKEN),),
    "prefix of the token": (("authorization", f"Bearer {TOKEN[:-1]}"),),
    "token with a suffix": (("authorization", f"Bearer {TOKEN}x"),),
    "empty bearer": (("authorization", "Bearer "),),
}

CALLS = {
    "Join": lambda s, md: s.stub.Join(pb.JoinRequest(island_id="intruder", num_fragments=3), metadata=md, timeout=30),
    "Seed": lambda s, md: s.stub.Seed(iter(seed_stream(random_values(9))), metadata=md, timeout=30),
    "PushDelta": lambda s, md: s.stub.PushDelta(iter(push_stream(s, "intruder")), metadata=md, timeout=30),
    "Pull": lambda s, md: list(
        s.stub.Pull(pb.PullRequest(fragment_id=0, island_id="intruder"), metadata=md, timeout=30)
    ),
    "Status": lambda s, md: s.stub.Status(pb.StatusRequest(), metadata=md, timeout=30),
    # Only an island that joined can leave: c, which the authorised call at the end then makes leave.
    "Leave": lambda s, md: s.stub.Leave(pb.LeaveRequest(island_id="c"), metadata=md, timeout=30),
}


def test_the_credential_checks_cover_every_call_of_the_service():
    assert set(CALLS) == set(pb.DESCRIPTOR.services_by_name["Syncer"].methods_by_name)


@pytest.mark.parametrize("rpc", list(CALLS))
def test_every_call_needs_the_token(scene, rpc):
    before = snapshot(scene)
    for name, metadata in CREDENTIALS.items():
        error = refused(lambda: CALLS[rpc](scene, metadata))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, name
        after = snapshot(scene)
        assert "intruder" not in after.live_islands
        assert_unchanged(before, after)  # fragment 2 is still unseeded, nothing pending was added
    CALLS[rpc](scene, AUTH)  # the same call with the token goes through


def test_a_leave_without_an_island_is_invalid(scene):
    before = snapshot(scene)
    error = refused(lambda: scene.stub.Leave(pb.LeaveRequest(), metadata=AUTH, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_unchanged(before, snapshot(scene))
    assert not scene.observer.status().left_islands


# A client that gives up halfway


def cancelled_push(scene: Scene, chunks: list[pb.PushChunk], data: bytes) -> None:
    """Sends the header and `data`, then cancels the call without ever half-closing the stream."""
    sent, release = threading.Event(), threading.Event()

    def stream():
        yield chunks[0]
        yield framed(pb.PushChunk, data)
        sent.set()
        release.wait(30)

    call = scene.stub.PushDelta.future(stream(), metadata=AUTH, timeout=30)
    try:
        assert sent.wait(10)
        time.sleep(0.3)  # let the shard read what was sent
        assert call.cancel()
    finally:
        release.set()
    assert call.code() == grpc.StatusCode.CANCELLED
    time.sleep(0.3)


def pending_on_fragment0(scene: Scene) -> int:
    return next(f for f in scene.observer.status().fragments if f.fragment_id == 0).pending


def test_push_cancelled_mid_data_changes_nothing(scene):
    before = snapshot(scene)
    chunks = push_stream(scene, "b", sequence=11)
    cancelled_push(scene, chunks, chunks[1].data[: len(chunks[1].data) // 2])
    assert_unchanged(before, snapshot(scene))
    # The cancelled push was never counted: sent again whole, the same push is new to the shard.
    reply = scene.stub.PushDelta(iter(chunks), metadata=AUTH, timeout=30)
    assert not reply.duplicate and reply.current.version == BASE_VERSION
    assert pending_on_fragment0(scene) == 2


def test_push_cancelled_after_all_its_data_counts_at_most_once(scene):
    """All data sent, the stream never half-closed, then cancelled. gRPC's sync server may see the cancel as
    the end of the stream, so the shard may take the push (as if only the reply were lost); either way it
    counts once: the retry is then a duplicate, and nothing but b's pending contribution changes."""
    before = snapshot(scene)
    chunks = push_stream(scene, "b", sequence=11)
    cancelled_push(scene, chunks, chunks[1].data)
    taken = pending_on_fragment0(scene) == 2
    reply = scene.stub.PushDelta(iter(chunks), metadata=AUTH, timeout=30)
    assert reply.duplicate == taken and reply.current.version == BASE_VERSION
    after = snapshot(scene)
    assert pending_on_fragment0(scene) == 2
    assert after.values.keys() == before.values.keys()
    for p, (version, named) in before.values.items():
        assert after.values[p][0] == version
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(named, after.values[p][1]))


# Memory: what a refused stream costs the shard


def test_a_push_beyond_the_pending_byte_bound_is_refused_and_changes_nothing(start_server):
    """A shard whose pending deltas may take one fragment's bytes: a joined island's push to the other
    fragment is refused RESOURCE_EXHAUSTED and leaves the pending deltas and live islands as they were."""
    values = random_values(1)
    fragment_bytes = sum(v.numel() * 4 for _, v in values)
    server = start_server(config_for(quorum=2, grace_seconds=300.0), max_pending_bytes=fragment_bytes)
    with make_client(server.port, "a") as a, make_client(server.port, "b") as b, make_client(server.port) as observer:
        for island in (a, b):
            island.join(2)
        base = observer.pull(0)[0]
        push = dict(base=base, tokens=100, inner_steps=10, sequence=1, encoding=Encoding.FP32, block_size=0)
        a.push(0, delta=random_values(2, 0.1), **push)
        before = observer.status()
        error = refused(lambda: b.push(1, delta=random_values(3, 0.1), **push))
        assert error.code() == EXHAUSTED, error.details()
        after = observer.status()
    assert [f.pending for f in after.fragments] == [f.pending for f in before.fragments] == [1, 0]
    assert after.live_islands == before.live_islands == ["a", "b"]


def peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_a_header_that_lies_about_its_size_costs_no_memory(syncer_process):
    """A seed header may declare up to the shard's fragment limit (16 GiB by default) and then send almost
    nothing: the shard must not reserve what was declared before the data arrives (the contract's reason for
    checking every declared length is that a peer is untrusted)."""
    process = syncer_process(config_for())
    declared = 1024 * MiB
    lying = pb.TensorPayload(name="w", shape=[declared // 4], dtype=pb.FLOAT32, encoding=pb.FP32, byte_length=declared)
    chunks = [
        pb.FragmentChunk(header=pb.FragmentHeader(fragment_id=0, tensors=[lying])),
        framed(pb.FragmentChunk, b"\0" * 1024),
    ]
    with open_channel(process.port) as channel:
        stub = syncer_pb2_grpc.SyncerStub(channel)
        stub.Status(pb.StatusRequest(), metadata=AUTH, timeout=30)  # everything a call needs is loaded
        peak_before = peak_rss_bytes(process.proc.pid)
        error = refused(lambda: stub.Seed(iter(chunks), metadata=AUTH, timeout=60))
        assert error.code() == INVALID, error.details()  # truncated: 1 KiB of the 1 GiB declared
        growth = peak_rss_bytes(process.proc.pid) - peak_before
    assert growth < declared // 4, f"a 1 KiB stream declaring 1 GiB raised the peak memory by {growth >> 20} MiB"
    with make_client(process.port) as client:
        assert list(client.join(2).unseeded_fragments) == [0, 1]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_ids_that_never_joined_cannot_fill_the_shard_with_pending_deltas(syncer_process):
    """Many ids that never joined push a 4 MiB delta each: the fragment takes pending contributions from them
    only up to max(joined islands, quorum) and refuses the rest RESOURCE_EXHAUSTED from the header alone,
    before any data is read; the pending count, the live islands and the shard's peak memory stay bounded,
    and the islands that joined still push."""
    process = syncer_process(config_for(fragments=1, quorum=2, grace_seconds=300.0))
    named = [("w", torch.zeros(MiB))]  # 4 MiB of float32
    strangers = 64
    with (
        open_channel(
            process.port,
            [("grpc.max_send_message_length", 8 * MiB), ("grpc.max_receive_message_length", 8 * MiB)],
        ) as channel,
        make_client(process.port) as observer,
    ):
        stub = syncer_pb2_grpc.SyncerStub(channel)
        assert observer.seed(0, named).accepted
        for island in ("a", "b"):
            with make_client(process.port, island) as client:
                client.join(1)
        base = observer.pull(0)[0]
        payloads, blobs = wire.tensor_payloads([("w", torch.full((MiB,), 0.01))], Encoding.FP32, 0)

        def header(island: str) -> pb.PushChunk:
            return pb.PushChunk(
                header=pb.PushHeader(
                    island_id=island, fragment_id=0, base=base, tokens=100, inner_steps=10, sequence=1, tensors=payloads
                )
            )

        def push(island: str) -> pb.PushReply:
            return stub.PushDelta(iter([header(island), framed(pb.PushChunk, blobs[0])]), metadata=AUTH, timeout=30)

        for island in ("x-0", "x-1"):  # room for a quorum's worth, two joined islands' worth
            assert not push(island).duplicate
        peak_before = peak_rss_bytes(process.proc.pid)
        before = observer.status()
        for i in range(2, strangers):
            error = refused(lambda i=i: push(f"x-{i}"))
            assert error.code() == EXHAUSTED, error.details()
        # Refused from the header alone: a stream that never sends its data is answered all the same.
        release = threading.Event()

        def header_only():
            yield header("x-late")
            release.wait(30)

        try:
            error = refused(lambda: stub.PushDelta(header_only(), metadata=AUTH, timeout=20))
        finally:
            release.set()
        assert error.code() == EXHAUSTED, error.details()
        growth = peak_rss_bytes(process.proc.pid) - peak_before
        after = observer.status()
        assert [(f.version, f.pending) for f in after.fragments] == [(f.version, f.pending) for f in before.fragments]
        assert after.fragments[0].pending == 2
        assert after.live_islands == before.live_islands == ["a", "b"]
        with make_client(process.port, "a") as island:  # a joined island still has room
            island.push(
                0, base=base, tokens=100, inner_steps=10, sequence=1, delta=named, encoding=Encoding.FP32, block_size=0
            )
        assert observer.status().fragments[0].pending == 3
    assert growth < strangers * MiB, f"{strangers} refused 4 MiB pushes raised the peak memory by {growth >> 20} MiB"
