"""Slow and idle streams against a real shard: they never starve the other calls or the health service. A
stream that stops sending is cancelled once it has been idle for the shard's bound, and a shard whose data
threads are all held still answers Status and the health check."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from syncer_harness import TOKEN, config_for, make_client, open_channel, random_values, wait_until

from diloco.core.encoding import Encoding
from diloco.syncer.server import SyncerServer
from diloco.transport import wire
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.v1 import syncer_pb2_grpc

pytestmark = pytest.mark.process

AUTH = (("authorization", f"Bearer {TOKEN}"),)
THREADS = 32  # the shard's data threads, as in the issue: one idle stream each, and more
NORMAL_DEADLINE = 10.0  # what a probe or an island would wait for a small call


def push_header(island: str, incarnation: int) -> pb.PushChunk:
    payloads, _ = wire.tensor_payloads(random_values(1, 0.1), Encoding.FP32, 0)
    return pb.PushChunk(
        header=pb.PushHeader(
            island_id=island,
            fragment_id=0,
            base=pb.FragmentVersion(incarnation=incarnation, version=0),
            tokens=100,
            inner_steps=10,
            sequence=0,
            tensors=payloads,
        )
    )


@contextmanager
def idle_pushes(server: SyncerServer, count: int) -> Iterator[list[grpc.Future]]:
    """`count` pushes that send their header and then nothing, neither data nor the end of the stream."""
    release = threading.Event()
    with make_client(server.port) as observer:
        incarnation = observer.pull(0)[0].incarnation

    def stream(island: str) -> Iterator[pb.PushChunk]:
        yield push_header(island, incarnation)
        release.wait(120)

    with open_channel(server.port) as channel:
        stub = syncer_pb2_grpc.SyncerStub(channel)
        calls = [stub.PushDelta.future(stream(f"idle-{i}"), metadata=AUTH, timeout=120) for i in range(count)]
        try:
            yield calls
        finally:
            release.set()
            for call in calls:
                call.cancel()


def test_idle_streams_leave_status_and_health_answering(start_server):
    """The streams hold every data thread (the idle bound is the long default): the calls probes and
    operators make still answer within a normal deadline."""
    server = start_server(config_for())
    with idle_pushes(server, THREADS + 8) as calls, open_channel(server.port) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "diloco.v1.Syncer"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=NORMAL_DEADLINE)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        status = syncer_pb2_grpc.SyncerStub(channel).Status(pb.StatusRequest(), metadata=AUTH, timeout=NORMAL_DEADLINE)
        assert [f.pending for f in status.fragments] == [0, 0]
        assert not any(call.done() for call in calls)  # the streams were still open all along


def test_idle_streams_are_cancelled_and_pulls_and_pushes_go_on(start_server):
    """With a short idle bound the idle streams are cancelled; pulls and pushes queued behind them answer
    within their normal deadlines, and the cancelled streams left nothing behind."""
    server = start_server(config_for(), stream_idle_seconds=0.5)
    with idle_pushes(server, THREADS + 8) as calls:
        with make_client(server.port, "a", timeout=NORMAL_DEADLINE, retry_for=0) as island:
            island.join(2)
            version, _ = island.pull(0)
            reply = island.push(
                0,
                base=version,
                tokens=100,
                inner_steps=10,
                sequence=1,
                delta=random_values(2, 0.1),
                encoding=Encoding.FP32,
                block_size=0,
            )
            assert not reply.duplicate
            wait_until(lambda: island.pull(0, have=version) is not None)  # a alone is live: merged at once
            status = island.status()
        for call in calls:
            assert call.exception(timeout=NORMAL_DEADLINE).code() == grpc.StatusCode.CANCELLED
    fragment = next(f for f in status.fragments if f.fragment_id == 0)
    assert (fragment.version.version, fragment.last_contributors, fragment.pending) == (1, 1, 0)  # a's push alone
    assert status.live_islands == ["a"]


@pytest.mark.parametrize("rpc", ["PushDelta", "Seed"])
def test_a_stream_that_sends_nothing_more_is_cancelled_after_the_idle_bound(start_server, rpc):
    server = start_server(config_for(), seed=rpc == "PushDelta", stream_idle_seconds=0.5)
    release = threading.Event()
    with make_client(server.port) as observer:
        incarnation = observer.pull(0)[0].incarnation if rpc == "PushDelta" else 0
        before = observer.status()
    header = (
        push_header("b", incarnation)
        if rpc == "PushDelta"
        else pb.FragmentChunk(header=pb.FragmentHeader(fragment_id=0, tensors=push_header("b", 0).header.tensors))
    )

    def stream():
        yield header
        release.wait(60)

    with open_channel(server.port) as channel:
        call = getattr(syncer_pb2_grpc.SyncerStub(channel), rpc).future(stream(), metadata=AUTH, timeout=30)
        try:
            assert call.exception(timeout=NORMAL_DEADLINE).code() == grpc.StatusCode.CANCELLED
        finally:
            release.set()
    with make_client(server.port) as observer:
        after = observer.status()
    assert [(f.seeded, f.version, f.pending) for f in after.fragments] == [
        (f.seeded, f.version, f.pending) for f in before.fragments
    ]
    assert after.live_islands == before.live_islands
