"""Hostile transport against a real shard on loopback: a client that does not trust the job's CA, one whose
certificate another CA signed (mutual TLS), one with no certificate (mutual TLS) and one speaking plaintext
are refused in the handshake, before any call exists: no handler and not even the token check sees them,
the shard's state is untouched, and each is counted in the shard's metrics as a connection that made no call.
Over TLS the bearer token is still required on every call, and the job's clients leave that count alone."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import TEST_PKI
from syncer_harness import TOKEN, config_for, make_client

from diloco.syncer.server import SyncerServer
from diloco.transport import tls
from diloco.transport.auth import bearer_metadata
from diloco.transport.tls import Pki, throwaway_pki
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.v1 import syncer_pb2_grpc

MUTUAL = throwaway_pki(mutual=True)
STRANGER = throwaway_pki(mutual=True)
"""Another CA, and a client certificate it issued: valid, but not the job's."""

Credentials = Callable[[Pki], grpc.ChannelCredentials | None]
HOSTILE: dict[str, Credentials] = {
    "a client that does not trust the job's CA": lambda pki: grpc.ssl_channel_credentials(
        root_certificates=STRANGER.ca.cert,
        private_key=pki.client_cert.key,
        certificate_chain=pki.client_cert.cert,
    ),
    "a client with the system's CAs only": lambda pki: grpc.ssl_channel_credentials(
        private_key=pki.client_cert.key, certificate_chain=pki.client_cert.cert
    ),
    "a plaintext client": lambda pki: None,
}
HOSTILE_UNDER_MUTUAL: dict[str, Credentials] = {
    "a certificate of another CA": lambda pki: grpc.ssl_channel_credentials(
        root_certificates=pki.ca.cert,
        private_key=STRANGER.client_cert.key,
        certificate_chain=STRANGER.client_cert.cert,
    ),
    "no client certificate": lambda pki: grpc.ssl_channel_credentials(root_certificates=pki.ca.cert),
}


def sample(server: SyncerServer, name: str) -> float:
    return server.metrics.registry.get_sample_value(name) or 0.0


def handshakes(server: SyncerServer) -> float:
    return sample(server, "diloco_syncer_tls_handshakes_total")


def without_calls(server: SyncerServer) -> float:
    """Connections that made no call: those refused in the handshake."""
    return sample(server, "diloco_syncer_tls_connections_without_calls")


def with_calls(server: SyncerServer) -> float:
    return sample(server, "diloco_syncer_tls_connections_with_calls_total")


def token_refusals(server: SyncerServer) -> float:
    return (
        server.metrics.registry.get_sample_value("diloco_syncer_rejected_pushes_total", {"reason": "unauthenticated"})
        or 0.0
    )


def join_as_intruder(port: int, credentials: grpc.ChannelCredentials | None) -> grpc.RpcError:
    """A Join with the job's own token, over `credentials` (None: plaintext), on a connection of its own as
    from a process of its own (gRPC would otherwise share a connection in backoff among channels); the error
    it ends with."""
    target, own = f"127.0.0.1:{port}", [("grpc.use_local_subchannel_pool", 1)]
    channel = (
        grpc.insecure_channel(target, own) if credentials is None else grpc.secure_channel(target, credentials, own)
    )
    with channel:
        with pytest.raises(grpc.RpcError) as refused:
            syncer_pb2_grpc.SyncerStub(channel).Join(
                pb.JoinRequest(island_id="intruder", num_fragments=2), metadata=bearer_metadata(TOKEN), timeout=10
            )
    return refused.value


def assert_refused_in_handshake(server: SyncerServer, credentials: grpc.ChannelCredentials | None) -> None:
    refusals_before = token_refusals(server)
    for attempt in range(1, 3):
        error = join_as_intruder(server.port, credentials)
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert "intruder" not in server.state.live_islands(server.clock()), "the Join handler ran"
        assert server.state.unseeded() == [0, 1], "the shard's state changed"
        assert token_refusals(server) == refusals_before, "the call got as far as the token check"
        assert (handshakes(server), without_calls(server)) == (attempt, attempt), "not counted once per attempt"
    assert with_calls(server) == 0


@pytest.mark.parametrize("mutual", [False, True], ids=["server TLS", "mutual TLS"])
@pytest.mark.parametrize("hostile", HOSTILE)
def test_a_client_outside_the_jobs_tls_is_refused_before_any_handler(start_server, hostile, mutual):
    pki = MUTUAL if mutual else TEST_PKI
    server = start_server(config_for(), seed=False, security=pki.server)
    assert_refused_in_handshake(server, HOSTILE[hostile](pki))


@pytest.mark.parametrize("hostile", HOSTILE_UNDER_MUTUAL)
def test_under_mutual_tls_a_client_without_a_certificate_of_the_jobs_ca_is_refused(start_server, hostile):
    server = start_server(config_for(), seed=False, security=MUTUAL.server)
    assert_refused_in_handshake(server, HOSTILE_UNDER_MUTUAL[hostile](MUTUAL))


@pytest.mark.parametrize("mutual", [False, True], ids=["server TLS", "mutual TLS"])
def test_the_jobs_clients_are_served_and_still_need_the_token(start_server, mutual):
    pki = MUTUAL if mutual else TEST_PKI
    server = start_server(config_for(), seed=False, security=pki.server)
    with make_client(server.port, "island-a", security=pki.client) as client:
        assert list(client.join(2).unseeded_fragments) == [0, 1]
    assert "island-a" in server.state.live_islands(server.clock())

    with tls.channel(f"127.0.0.1:{server.port}", pki.client) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            syncer_pb2_grpc.SyncerStub(channel).Join(
                pb.JoinRequest(island_id="tokenless", num_fragments=2),
                metadata=bearer_metadata("not-the-token"),
                timeout=10,
            )
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "tokenless" not in server.state.live_islands(server.clock())
    assert token_refusals(server) == 1
    assert (handshakes(server), with_calls(server), without_calls(server)) == (2, 2, 0)


def test_a_shard_exports_when_the_certificate_it_serves_expires(start_server):
    server = start_server(config_for(), seed=False)
    expires = x509.load_pem_x509_certificate(TEST_PKI.server_cert.cert).not_valid_after_utc.timestamp()
    assert sample(server, "diloco_syncer_tls_certificate_expiry_timestamp_seconds") == expires
    plaintext = start_server(config_for(), seed=False, security=tls.PLAINTEXT)
    assert sample(plaintext, "diloco_syncer_tls_certificate_expiry_timestamp_seconds") == 0, "none served"


def test_a_plaintext_shard_serves_only_when_asked_for_by_name(start_server):
    server = start_server(config_for(), seed=False, security=tls.PLAINTEXT)
    with make_client(server.port, "island-a", security=tls.PLAINTEXT) as client:
        assert list(client.join(2).unseeded_fragments) == [0, 1]
    assert handshakes(server) == 0


def test_the_health_port_answers_plaintext_probes_and_serves_nothing_else(start_server):
    """The kubelet's gRPC probes cannot speak TLS: health alone is served in plaintext, on a port of its own."""
    server = start_server(config_for(), seed=False, health_port=0)
    with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as refused:
            syncer_pb2_grpc.SyncerStub(channel).Join(
                pb.JoinRequest(island_id="intruder", num_fragments=2), metadata=bearer_metadata(TOKEN), timeout=10
            )
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "intruder" not in server.state.live_islands(server.clock())
