"""Which calls are the first on their connection, against a real TLS server on loopback: each connection's
first call is told once however many calls it carries, a connection refused in the handshake is told only
as a handshake begun, and a new connection from the address of a closed one counts again."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from support import TEST_PKI

from diloco.transport import connections, tls
from diloco.transport.connections import ConnectionWatch

METHOD = "/test.Echo/Call"


class Counts:
    def __init__(self) -> None:
        self.handshakes = 0
        self.first_calls = 0

    def handshake(self) -> None:
        self.handshakes += 1

    def first_call(self) -> None:
        self.first_calls += 1


@pytest.fixture(params=["127.0.0.1", "[::1]"], ids=["IPv4", "IPv6"])
def watched(request):
    """A TLS server whose one method echoes, watched; the counts its watch reports, and its address."""
    counts = Counts()
    watch = ConnectionWatch(counts.handshake, counts.first_call)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[watch])
    echo = grpc.unary_unary_rpc_method_handler(lambda request, _context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Call": echo}),))
    watch.port = tls.add_port(server, f"{request.param}:0", TEST_PKI.server, on_handshake=watch.handshake_begun)
    if watch.port == 0:
        pytest.skip(f"no loopback at {request.param}")
    server.start()
    yield counts, f"{request.param}:{watch.port}"
    server.stop(0).wait()


def call(channel: grpc.Channel) -> bytes:
    return channel.unary_unary(METHOD)(b"ping", timeout=10)


def test_each_connection_is_told_once_at_its_first_call(watched):
    counts, address = watched
    for connection in range(1, 3):
        with tls.channel(address, TEST_PKI.client) as channel:
            assert [call(channel) for _ in range(3)] == [b"ping"] * 3
        assert (counts.handshakes, counts.first_calls) == (connection, connection)


def test_a_connection_refused_in_the_handshake_makes_no_first_call(watched):
    counts, address = watched
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            call(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (counts.handshakes, counts.first_calls) == (1, 0)


def test_a_new_connection_from_a_closed_ones_address_counts_again(monkeypatch):
    """The peer address alone would take it for the old connection: channelz's socket ids tell them apart."""
    live = {"ipv4:10.0.0.7:40000": 11}
    monkeypatch.setattr(connections, "_server_ids", lambda: [1])
    monkeypatch.setattr(connections, "_sockets", lambda _server: dict(live))
    monkeypatch.setattr(connections, "_local_port", lambda _socket: 443)
    counts = Counts()
    watch = ConnectionWatch(counts.handshake, counts.first_call)
    watch.port = 443

    watch.handshake_begun()
    assert [watch._called_first("ipv4:10.0.0.7:40000") for _ in range(2)] == [True, False]
    live["ipv4:10.0.0.7:40000"] = 12  # closed, and a new connection took its address
    watch.handshake_begun()
    assert watch._called_first("ipv4:10.0.0.7:40000")
    assert counts.handshakes == 2


def test_what_grpc_reads_from_a_behavior_is_kept():
    """The syncer runs some calls on threads of their own (`experimental_thread_pool` on the behavior)."""
    pool = futures.ThreadPoolExecutor(max_workers=1)

    def behavior(request, _context):
        return request

    behavior.experimental_thread_pool = pool
    watch = ConnectionWatch(lambda: None, lambda: None)
    handler = watch.intercept_service(lambda _details: grpc.unary_unary_rpc_method_handler(behavior), None)
    assert handler.unary_unary.experimental_thread_pool is pool
    pool.shutdown()
