"""A refused call changes nothing, whoever makes it and whatever it names: island ids are checked before
anything else, only an island that joined counts as live or may leave, bytes that are no request are
INVALID_ARGUMENT (never INTERNAL, which clients retry), and a decoder allocates no more than was sent."""

from __future__ import annotations

import os
import struct

import grpc
import pytest
import test_hostile
from syncer_harness import ReferenceFragment, config_for, framed, make_client, open_channel, random_values, wait_until
from test_hostile import (
    AUTH,
    INVALID,
    PRECONDITION,
    Scene,
    assert_unchanged,
    peak_rss_bytes,
    push_stream,
    refused,
    seed_stream,
    snapshot,
)

from diloco.core.encoding import Encoding
from diloco.syncer import checkpoint
from diloco.transport import wire
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.v1 import syncer_pb2_grpc

pytestmark = pytest.mark.process

MiB = 1024 * 1024
scene = test_hostile.scene  # the fixture: a shard with history, as the hostile tests see it
INVENTED = [f"invented-{i}" for i in range(1000)]


def fp32_push(client, base: pb.FragmentVersion, delta, tokens: int, sequence: int = 0) -> pb.PushReply:
    return client.push(
        0,
        base=base,
        tokens=tokens,
        inner_steps=10,
        sequence=sequence,
        delta=delta,
        encoding=Encoding.FP32,
        block_size=0,
    )


def test_invented_islands_pulling_unknown_fragments_dilute_no_merge(start_server):
    """1000 invented ids pull fragments the shard does not own or has not seeded, and send truncated
    pushes: none becomes live, so the next merge of both joined islands is a whole step, at once."""
    config = config_for(fragments=3, quorum=2, grace_seconds=1.0, island_timeout_seconds=600.0)
    server = start_server(config, seed=False)
    seeds = random_values(0)
    with make_client(server.port) as observer:
        assert observer.seed(0, seeds).accepted
        islands = {name: make_client(server.port, name) for name in ("island-a", "island-b")}
        for client in islands.values():
            client.join(3)
        live_before = list(observer.status().live_islands)
        base, _ = observer.pull(0)
        with open_channel(server.port) as channel:
            stub = syncer_pb2_grpc.SyncerStub(channel)
            for island in INVENTED:
                for fragment, code in ((7, INVALID), (1, PRECONDITION)):
                    request = pb.PullRequest(fragment_id=fragment, island_id=island)
                    error = refused(lambda: list(stub.Pull(request, metadata=AUTH, timeout=30)))
                    assert error.code() == code, error.details()
            for island in INVENTED[:50]:
                header, data = push_stream_for(island, base)
                error = refused(
                    lambda: stub.PushDelta(iter([header, framed(pb.PushChunk, data[: len(data) // 2])]), metadata=AUTH)
                )
                assert error.code() == INVALID, error.details()
        assert list(observer.status().live_islands) == live_before == ["island-a", "island-b"]
        reference = ReferenceFragment(config, seeds)
        contributions = [(random_values(10 + i, 0.1), 100 * (i + 1)) for i in range(2)]
        for client, (delta, tokens) in zip(islands.values(), contributions):
            assert not fp32_push(client, base, delta, tokens).duplicate
        _, values = wait_until(lambda: (got := observer.pull(0))[0].version == 1 and got)
        reference.merge(contributions, live=2)
        reference.assert_matches(values)
        for client in islands.values():
            client.close()


def push_stream_for(island: str, base: pb.FragmentVersion) -> tuple[pb.PushChunk, bytes]:
    """A valid push header for fragment 0 and its data, to be cut short."""
    payloads, blobs = wire.tensor_payloads(random_values(5, 0.1), Encoding.FP32, 0)
    header = pb.PushHeader(island_id=island, fragment_id=0, base=base, tokens=1, inner_steps=1, tensors=payloads)
    return pb.PushChunk(header=header), b"".join(blobs)


def test_leave_of_an_island_that_never_joined_is_refused_and_not_checkpointed(start_server, tmp_path):
    server = start_server(config_for(), checkpoint_dir=tmp_path / "ckpt")
    with make_client(server.port, "stranger") as stranger, make_client(server.port, "member") as member:
        with pytest.raises(grpc.RpcError) as error:
            stranger.leave(10)
        assert error.value.code() == PRECONDITION, error.value.details()
        assert list(stranger.status().left_islands) == []
        member.join(2)
        member.leave(10)
        member.leave(10)  # a retried Leave is answered as the first was
        assert list(member.status().left_islands) == ["member"]
    server.stop(grace=0)
    saved = checkpoint.load(checkpoint.checkpoint_path(tmp_path / "ckpt", 0, 1))
    assert saved is not None and list(saved["left"]) == ["member"] and "stranger" not in saved["islands"]


BAD_IDS = {
    "longer than 63 characters": "a" * 64,
    "50 KB": "a" * 50_000,
    "a space": "island a",
    "a slash": "island/a",
    "a newline": "island\n",
    "non-ASCII": "île",
    "leading dash": "-island",
    "trailing dot": "island.",
}


def calls_naming(island: str) -> dict:
    return {
        "Join": lambda s: s.stub.Join(pb.JoinRequest(island_id=island, num_fragments=3), metadata=AUTH, timeout=30),
        "Pull": lambda s: list(s.stub.Pull(pb.PullRequest(fragment_id=0, island_id=island), metadata=AUTH, timeout=30)),
        "PushDelta": lambda s: s.stub.PushDelta(iter(push_stream(s, island)), metadata=AUTH, timeout=30),
        "Leave": lambda s: s.stub.Leave(pb.LeaveRequest(island_id=island), metadata=AUTH, timeout=30),
    }


@pytest.mark.parametrize("bad", list(BAD_IDS))
def test_an_island_id_outside_the_rule_is_invalid_on_every_call(scene: Scene, bad):
    for rpc, call in calls_naming(BAD_IDS[bad]).items():
        before = snapshot(scene)
        error = refused(lambda: call(scene))
        assert error.code() == INVALID, (rpc, error.details())
        after = snapshot(scene)
        assert_unchanged(before, after)
        assert after.rejected == before.rejected + 1, rpc
        assert list(scene.observer.status().left_islands) == []


def with_invalid_utf8(message, marker: str = "MARKER") -> bytes:
    """`message` serialized with the string `marker` replaced by as many bytes that are not UTF-8."""
    raw = message.SerializeToString()
    assert marker.encode() in raw
    return raw.replace(marker.encode(), b"\xff\xfe\xfd\xfc\xfb\xfa")


def raw_call(scene: Scene, rpc: str, payload: bytes) -> None:
    """Calls `rpc` with bytes as they are: one request message, or a stream of one message."""
    method = f"/diloco.v1.Syncer/{rpc}"
    identity = lambda raw: raw  # noqa: E731
    with open_channel(scene.server.port) as channel:
        if rpc in ("Seed", "PushDelta"):
            channel.stream_unary(method, identity, identity)(iter([payload]), metadata=AUTH, timeout=30)
        elif rpc == "Pull":
            list(channel.unary_stream(method, identity, identity)(payload, metadata=AUTH, timeout=30))
        else:
            channel.unary_unary(method, identity, identity)(payload, metadata=AUTH, timeout=30)


UNDECODABLE = {
    "Join": lambda: with_invalid_utf8(pb.JoinRequest(island_id="MARKER", num_fragments=3)),
    "Pull": lambda: with_invalid_utf8(pb.PullRequest(fragment_id=0, island_id="MARKER")),
    "Leave": lambda: with_invalid_utf8(pb.LeaveRequest(island_id="MARKER")),
    "PushDelta": lambda: with_invalid_utf8(pb.PushChunk(header=pb.PushHeader(island_id="MARKER", fragment_id=0))),
    "Seed": lambda: with_invalid_utf8(seed_stream(random_values(9))[0], marker="w"),
    "Status": lambda: b"\xff\xff\xff",  # no string to spoil: bytes that are no message at all
}


def test_the_undecodable_requests_cover_every_call_of_the_service():
    assert set(UNDECODABLE) == set(pb.DESCRIPTOR.services_by_name["Syncer"].methods_by_name)


def test_a_request_that_is_no_message_is_invalid_on_every_call(scene: Scene):
    """Invalid UTF-8 in a string field (or bytes that are no message) is the caller's error, never INTERNAL,
    which a client would retry as the shard's."""
    for rpc, build in UNDECODABLE.items():
        before = snapshot(scene)
        error = refused(lambda: raw_call(scene, rpc, build()))
        assert error.code() == INVALID, (rpc, error.code(), error.details())
        after = snapshot(scene)
        assert_unchanged(before, after)
        assert after.rejected == before.rejected + 1, rpc


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_an_int4_push_declaring_a_huge_block_size_is_invalid_and_costs_no_memory(syncer_process):
    """One scale block of 2^28 values over a 2048-value tensor: the byte length matches (one scale and 1 KiB
    of nibbles), so only a bound on the block size, and a decoder that allocates by what was sent, keep the
    shard from taking 1 GiB per tensor."""
    process = syncer_process(config_for())
    block = 2**28
    named = random_values(3)
    with make_client(process.port, "island-a") as island:
        island.join(2)
        for p in (0, 1):
            island.seed(p, named)
        base, _ = island.pull(0)
    payloads, blobs = [], []
    for name, tensor in named:
        blob = struct.pack("<f", 0.01) + b"\x11" * ((tensor.numel() + 1) // 2)
        payloads.append(
            pb.TensorPayload(
                name=name,
                shape=list(tensor.shape),
                dtype=pb.FLOAT32,
                encoding=pb.INT4,
                block_size=block,
                byte_length=len(blob),
            )
        )
        blobs.append(blob)
    header = pb.PushHeader(island_id="island-a", fragment_id=0, base=base, tokens=1, inner_steps=1, tensors=payloads)
    chunks = [pb.PushChunk(header=header), framed(pb.PushChunk, b"".join(blobs))]
    with open_channel(process.port) as channel:
        stub = syncer_pb2_grpc.SyncerStub(channel)
        stub.Status(pb.StatusRequest(), metadata=AUTH, timeout=30)  # everything a call needs is loaded
        peak_before = peak_rss_bytes(process.proc.pid)
        error = refused(lambda: stub.PushDelta(iter(chunks), metadata=AUTH, timeout=60))
        assert error.code() == INVALID, error.details()
        growth = peak_rss_bytes(process.proc.pid) - peak_before
        status = stub.Status(pb.StatusRequest(), metadata=AUTH, timeout=30)
    assert growth < 64 * MiB, f"a 1 KiB push declaring 2^28-value blocks raised the peak memory by {growth >> 20} MiB"
    assert [(f.pending, f.version.version) for f in status.fragments] == [(0, 0), (0, 0)]
