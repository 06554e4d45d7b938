"""Slow and idle streams against a real shard: they never starve the other calls or the health service. A
stream that stops sending is cancelled once it has been idle for the shard's bound, and a shard whose data
threads are all held still answers Status and the health check."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

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
def idle_pushes(server: SyncerServer, count: int, *, one_client: bool = False) -> Iterator[list[grpc.Future]]:
    """`count` pushes that send their header and then nothing, neither data nor the end of the stream: each
    from a client (a connection) of its own, or all from `one_client`."""
    release = threading.Event()
    with make_client(server.port) as observer:
        incarnation = observer.pull(0)[0].incarnation

    def stream(island: str) -> Iterator[pb.PushChunk]:
        yield push_header(island, incarnation)
        release.wait(120)

    with ExitStack() as stack:
        own_connection = [("grpc.use_local_subchannel_pool", 1)]
        channels = [stack.enter_context(open_channel(server.port, own_connection)) for _ in range(count)]
        stubs = [syncer_pb2_grpc.SyncerStub(channels[0 if one_client else i]) for i in range(count)]
        calls = [stub.PushDelta.future(stream(f"idle-{i}"), metadata=AUTH, timeout=120) for i, stub in enumerate(stubs)]
        try:
            yield calls
        finally:
            release.set()
            for call in calls:
                call.cancel()


def push_and_see_it_merged(server: SyncerServer) -> pb.StatusReply:
    """Island `a` joins, pushes fragment 0 and sees it merged (alone live, it is merged at once); the shard's
    Status then."""
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
        wait_until(lambda: island.pull(0, have=version) is not None)
        return island.status()


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
        status = push_and_see_it_merged(server)
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
    with open_channel(server.port) as channel:
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
            with open_channel(server.port) as channel:
                assert_answering(channel)
        assert not any(call.done() for call in calls)
    wait_until(lambda: server.data_threads.calls() == 0)
    push_and_see_it_merged(server)
    assert server.metrics.rejected.labels("busy")._value.get() == 1


def test_one_client_holds_no_more_than_its_share_of_the_data_threads(start_server):
    """One client opens 96 header-only streams (the idle bound is the long default): those beyond its share
    of the data threads are refused at once, and an honest island's pull and push go through meanwhile."""
    server = start_server(config_for(), max_workers=8)
    with idle_pushes(server, 96, one_client=True) as calls:
        wait_until(lambda: sum(call.done() for call in calls) == 96 - server.client_calls.most)
        refused = [call for call in calls if call.done()]
        assert {call.exception().code() for call in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        push_and_see_it_merged(server)
    assert server.metrics.rejected.labels("client_limit")._value.get() == 96 - server.client_calls.most


def test_a_data_call_that_expires_in_the_queue_is_counted_as_expired_not_malformed(start_server):
    """Idle streams hold both data threads until the shard cancels them; a push queued behind them expires
    meanwhile, and reaches its thread with nothing to read: it is counted as expired, not as malformed."""
    server = start_server(config_for(), max_workers=2, stream_idle_seconds=1.5)
    with idle_pushes(server, 2):
        wait_until(lambda: server.data_threads.calls() == 2)
        with open_channel(server.port) as channel:  # a push that waits for a thread past its deadline
            stub = syncer_pb2_grpc.SyncerStub(channel)
            with pytest.raises(grpc.RpcError) as queued:
                stub.PushDelta(iter([push_header("late", 0)]), metadata=AUTH, timeout=0.5)
            assert queued.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: server.metrics.rejected.labels("expired")._value.get() == 1)
        assert server.metrics.rejected.labels("malformed")._value.get() == 0  # before the idle streams end
