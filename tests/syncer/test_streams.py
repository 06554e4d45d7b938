"""Slow and idle streams against a real shard: they never starve the other calls or the health service. A
stream that stops sending is cancelled once it has been idle for the shard's bound, and a shard whose data
threads are all held still answers Status and the health check."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
import torch
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
LARGE_FLOATS = 8 * 1024 * 1024  # a 32 MiB fragment: more than a connection buffers for a reader that takes nothing


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


def assert_answering(channel: grpc.Channel) -> None:
    """The calls probes and operators make answer within a normal deadline."""
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "diloco.v1.Syncer"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=NORMAL_DEADLINE)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    syncer_pb2_grpc.SyncerStub(channel).Status(pb.StatusRequest(), metadata=AUTH, timeout=NORMAL_DEADLINE)


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


def test_a_pull_whose_reader_takes_nothing_is_cancelled_and_frees_its_thread(start_server):
    """A Pull of more than the connection buffers, never read, on a shard with one data thread: the health
    check and Status answer meanwhile, and the shard stops waiting on the reader after the idle bound, so
    another island's pull of the same fragment is served whole within a normal deadline."""
    server = start_server(config_for(), seed=False, max_workers=1, stream_idle_seconds=0.5)
    values = [("w", torch.arange(LARGE_FLOATS, dtype=torch.float32))]
    with make_client(server.port, "seeder") as seeder:
        seeder.seed(0, values)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        unread = syncer_pb2_grpc.SyncerStub(channel).Pull(pb.PullRequest(fragment_id=0), metadata=AUTH, timeout=60)
        try:
            assert_answering(channel)
            with make_client(server.port, timeout=NORMAL_DEADLINE, retry_for=0) as island:
                _, pulled = island.pull(0)
        finally:
            unread.cancel()
    assert torch.equal(dict(pulled)["w"], values[0][1])
    assert server.metrics.rejected.labels("idle_stream")._value.get() == 1


def test_data_calls_beyond_the_queue_bound_are_refused_and_the_shard_stays_live(start_server):
    """With every data thread held and the queue full, one more data call is refused at once with
    RESOURCE_EXHAUSTED, while the health check and Status still answer; once the held calls end, the
    shard takes pushes and pulls again."""
    server = start_server(config_for(), max_workers=2, max_queued_calls=3)
    held = 2 + 3
    with idle_pushes(server, held) as calls:
        wait_until(lambda: server.data_threads.calls() == held)
        with make_client(server.port, "a", timeout=NORMAL_DEADLINE, retry_for=0) as island:
            with pytest.raises(grpc.RpcError) as refused:
                island.pull(0)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                assert_answering(channel)
        assert not any(call.done() for call in calls)
    wait_until(lambda: server.data_threads.calls() == 0)
    with make_client(server.port, "a", timeout=NORMAL_DEADLINE, retry_for=0) as island:
        island.join(2)
        version, _ = island.pull(0)
        island.push(
            0,
            base=version,
            tokens=100,
            inner_steps=10,
            sequence=1,
            delta=random_values(2, 0.1),
            encoding=Encoding.FP32,
            block_size=0,
        )
        wait_until(lambda: island.pull(0, have=version) is not None)
    assert server.metrics.rejected.labels("busy")._value.get() == 1
