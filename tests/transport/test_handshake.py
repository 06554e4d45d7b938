"""A refused TLS handshake is named, not retried: wrong CA, expired or misnamed certificate, plaintext server
and client certificate refused each end a call at once with the reason and what to check; a shard that is
down (connection refused) is still retried as before."""

from __future__ import annotations

import datetime
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from diloco.transport import certificates, tls
from diloco.transport.client import Backoff, SyncerClient
from diloco.transport.handshake import HandshakeRefused, Refused, probe, split_target
from diloco.transport.tls import Security, Tls, throwaway_pki

pytestmark = pytest.mark.process

PKI = throwaway_pki()
MUTUAL = throwaway_pki(mutual=True)
STRANGER = throwaway_pki(mutual=True)
"""A CA and certificates no server here trusts, nor is trusted by a client here."""


def expired() -> tuple[Tls, Tls]:
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    ca = certificates.new_ca("test CA", long_ago)
    server = certificates.issue(
        ca, "syncer", long_ago, names=["127.0.0.1"], server=True, valid_for=datetime.timedelta(days=1)
    )
    return Tls(ca=ca.cert, cert=server.cert, key=server.key), Tls(ca=ca.cert)


def misnamed() -> tuple[Tls, Tls]:
    now = datetime.datetime.now(datetime.UTC)
    server = certificates.issue(PKI.ca, "syncer", now, names=["syncer-0.example"], server=True)
    return Tls(cert=server.cert, key=server.key), PKI.client


EXPIRED, MISNAMED = expired(), misnamed()
NO_CLIENT_CERT = Tls(ca=MUTUAL.ca.cert)
FOREIGN_CLIENT_CERT = Tls(ca=MUTUAL.ca.cert, cert=STRANGER.client_cert.cert, key=STRANGER.client_cert.key, mutual=True)

REFUSED = [
    pytest.param(PKI.server, STRANGER.client, Refused.VERIFY_FAILED, "unable to get local issuer", id="wrong-ca"),
    pytest.param(*EXPIRED, Refused.VERIFY_FAILED, "expired", id="expired-server-cert"),
    pytest.param(*MISNAMED, Refused.VERIFY_FAILED, "mismatch", id="name-mismatch"),
    pytest.param(tls.PLAINTEXT, PKI.client, Refused.PLAINTEXT_SERVER, "WRONG_VERSION_NUMBER", id="plaintext-server"),
    pytest.param(MUTUAL.server, NO_CLIENT_CERT, Refused.CLIENT_CERT_REFUSED, "no certificate", id="no-client-cert"),
    pytest.param(MUTUAL.server, FOREIGN_CLIENT_CERT, Refused.CLIENT_CERT_REFUSED, "closed", id="foreign-client-cert"),
]


@pytest.fixture
def serve() -> Iterator[Callable[[Security], str]]:
    """Starts a gRPC server on loopback with no service: a handshake is all these tests ask of it."""
    servers: list[grpc.Server] = []

    def start(security: Security) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        port = tls.add_port(server, "127.0.0.1:0", security)
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(target: str, security: Security, *, retry_for: float) -> SyncerClient:
    return SyncerClient(
        target, "token", security=security, timeout=5.0, retry_for=retry_for, backoff=Backoff(0.05, 0.5)
    )


@pytest.mark.parametrize(("server", "client_tls", "reason", "detail"), REFUSED)
def test_a_probe_names_why_the_handshake_was_refused(serve, server, client_tls, reason, detail):
    found = probe(serve(server), client_tls)
    assert found is not None and found.reason is reason
    assert detail.lower() in found.detail.lower()


@pytest.mark.parametrize("pki", [PKI, MUTUAL], ids=["tls", "mutual"])
def test_a_probe_finds_nothing_wrong_with_a_handshake_that_passes(serve, pki):
    assert probe(serve(pki.server), pki.client) is None


def test_a_shard_that_closes_one_connection_as_it_stops_is_not_taken_for_a_refusal(tmp_path):
    """A TLS server that completes one handshake, closes it without a byte and stops listening: what a shard
    stopping looks like, and, once only, what a shard refusing a client certificate looks like."""
    (tmp_path / "tls.crt").write_bytes(PKI.server_cert.cert)
    (tmp_path / "tls.key").write_bytes(PKI.server_cert.key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def close_one() -> None:
        with listener, listener.accept()[0] as raw, context.wrap_socket(raw, server_side=True):
            pass

    stopping = threading.Thread(target=close_one)
    stopping.start()
    assert probe(f"127.0.0.1:{port}", PKI.client) is None
    stopping.join(10)


def test_a_probe_of_a_shard_that_is_down_finds_nothing_to_name():
    assert probe(f"127.0.0.1:{unused_port()}", PKI.client) is None


@pytest.mark.parametrize(("server", "client_tls", "reason", "detail"), REFUSED)
def test_a_refused_handshake_ends_the_call_with_its_reason_not_retries(
    serve, caplog, server, client_tls, reason, detail
):
    target = serve(server)
    started = time.monotonic()
    with client(target, client_tls, retry_for=60.0) as island, caplog.at_level(logging.WARNING):
        with pytest.raises(HandshakeRefused) as refused:
            island.status()
        with pytest.raises(HandshakeRefused):
            island.status()
    assert time.monotonic() - started < 30.0, "the refused handshake was retried"
    assert refused.value.reason is reason and refused.value.target == target
    assert reason.value in str(refused.value) and detail.lower() in str(refused.value).lower()
    assert isinstance(refused.value.__cause__, grpc.RpcError)
    warned = [r for r in caplog.records if r.name == "diloco.transport.client" and r.levelno == logging.WARNING]
    assert len(warned) == 1, "a refused handshake is a WARNING once, not one per call"


def test_a_shard_that_is_down_is_still_retried():
    started = time.monotonic()
    with client(f"127.0.0.1:{unused_port()}", PKI.client, retry_for=1.0) as island:
        with pytest.raises(grpc.RpcError) as failed:
            island.status()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started >= 1.0, "gave up before retry_for"


def test_a_shard_that_takes_the_handshake_answers_as_before(serve):
    with client(serve(PKI.server), PKI.client, retry_for=5.0) as island:
        with pytest.raises(grpc.RpcError) as answered:
            island.status()
    assert answered.value.code() == grpc.StatusCode.UNIMPLEMENTED  # the server has no Syncer: TLS was fine


@pytest.mark.parametrize(
    ("target", "address"),
    [("syncer-0.ns.svc:50051", ("syncer-0.ns.svc", 50051)), ("dns:///h:1", ("h", 1)), ("[::1]:7", ("::1", 7))],
)
def test_a_target_names_the_host_and_port_a_probe_dials(target, address):
    assert split_target(target) == address
