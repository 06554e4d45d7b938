"""A server's certificate replaced on disk is served to the next connection without a restart, whether the
files are rewritten or a Secret volume swaps its `..data` symlink; a broken replacement keeps the old one. A
client's CA and certificate, replaced on disk, are used from its next call on."""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from diloco.transport import certificates, tls
from diloco.transport.client import SyncerClient
from diloco.transport.reload import checked
from diloco.transport.tls import Pki, Role, Tls, throwaway_pki

pytestmark = pytest.mark.process


class SecretVolume:
    """PEM files laid out as the kubelet mounts a Secret: each name a symlink into `..data`, itself a symlink
    to a timestamped folder, swapped atomically on an update."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version = 0

    def write(self, files: dict[str, bytes]) -> None:
        self.version += 1
        folder = self.root / f"..v{self.version}"
        folder.mkdir()
        for name, pem in files.items():
            (folder / name).write_bytes(pem)
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(Path("..data") / name)
        (self.root / "..data_tmp").symlink_to(folder.name)
        os.replace(self.root / "..data_tmp", self.root / "..data")

    def path(self, name: str) -> str:
        return str(self.root / name)


def server_files(pki: Pki) -> dict[str, bytes]:
    return {"ca.crt": pki.ca.cert, "tls.crt": pki.server_cert.cert, "tls.key": pki.server_cert.key}


@pytest.fixture
def volume(tmp_path: Path) -> SecretVolume:
    return SecretVolume(tmp_path)


@pytest.fixture
def serve(volume: SecretVolume) -> Iterator[Callable[..., str]]:
    servers: list[grpc.Server] = []

    def start(*, mutual: bool = False) -> str:
        security = tls.load(
            Role.SERVER,
            ca_file=volume.path("ca.crt"),
            cert_file=volume.path("tls.crt"),
            key_file=volume.path("tls.key"),
            mutual=mutual,
            insecure_plaintext=False,
        )
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = tls.add_port(server, "127.0.0.1:0", security)
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def connects(target: str, client: Tls) -> bool:
    """Whether a new connection (no subchannel shared with earlier ones) trusting `client` gets an answer."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with tls.channel(target, client, options) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            return False
    return True


def test_a_certificate_swapped_in_a_secret_volume_is_served_to_the_next_connection(volume, serve):
    old, new = throwaway_pki(), throwaway_pki()
    volume.write(server_files(old))
    target = serve()
    assert connects(target, old.client) and not connects(target, new.client)

    volume.write(server_files(new))

    assert connects(target, new.client), "the server still serves the certificate it started with"
    assert not connects(target, old.client)


def test_files_rewritten_in_place_are_reloaded_and_the_reload_logged(tmp_path, caplog):
    old, new = throwaway_pki(), throwaway_pki()
    paths = {name: tmp_path / name for name in server_files(old)}
    for name, pem in server_files(old).items():
        paths[name].write_bytes(pem)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    security = tls.read(tls.Files(cert=str(paths["tls.crt"]), key=str(paths["tls.key"])), mutual=False)
    served: list[Tls] = []
    target = f"127.0.0.1:{tls.add_port(server, '127.0.0.1:0', security, on_reload=served.append)}"
    server.start()
    try:
        for name, pem in server_files(new).items():
            paths[name].write_bytes(pem)
        with caplog.at_level(logging.INFO, logger="diloco.transport.reload"):
            assert connects(target, new.client)
    finally:
        server.stop(None)
    assert [s.cert for s in served] == [new.server_cert.cert]
    reloaded = [r for r in caplog.records if r.getMessage() == "TLS certificate reloaded"]
    assert len(reloaded) == 1
    assert reloaded[0].expires == certificates.expires(new.server_cert.cert).isoformat()


def mismatched(old: Pki, new: Pki) -> dict[str, bytes]:
    return server_files(new) | {"tls.key": old.server_cert.key}


def half_written(old: Pki, new: Pki) -> dict[str, bytes]:
    return server_files(new) | {"tls.crt": new.server_cert.cert[: len(new.server_cert.cert) // 2]}


@pytest.mark.parametrize("broken", [mismatched, half_written])
def test_a_broken_replacement_is_a_warning_and_the_old_certificate_stays(volume, serve, caplog, broken):
    old, new = throwaway_pki(), throwaway_pki()
    volume.write(server_files(old))
    target = serve()

    volume.write(broken(old, new))
    with caplog.at_level(logging.WARNING, logger="diloco.transport.reload"):
        assert connects(target, old.client), "a broken replacement took the server's TLS down"
        assert connects(target, old.client)
    warnings = [r for r in caplog.records if "cannot be used" in r.getMessage()]
    assert len(warnings) == 1, "one WARNING per broken set of files, not one per handshake"

    volume.write(server_files(new))  # the rotation completed: served from the next connection
    assert connects(target, new.client)


def test_a_mutual_server_reloads_the_ca_of_its_clients(volume, serve):
    old, new = throwaway_pki(mutual=True), throwaway_pki(mutual=True)
    volume.write(server_files(old))
    target = serve(mutual=True)
    assert connects(target, old.client)

    volume.write(server_files(new))

    assert connects(target, new.client)
    assert not connects(target, Tls(ca=new.ca.cert, cert=old.client_cert.cert, key=old.client_cert.key, mutual=True))


def test_a_reload_is_checked_before_it_is_served():
    now = datetime.datetime.now(datetime.UTC)
    pki = throwaway_pki()
    other = certificates.issue(pki.ca, "other", now, names=["127.0.0.1"], server=True)
    assert checked(pki.server) == pki.server
    with pytest.raises(tls.TlsError, match="not for the private key"):
        checked(Tls(cert=pki.server_cert.cert, key=other.key))
    with pytest.raises(tls.TlsError, match="does not parse"):
        checked(Tls(cert=pki.server_cert.cert[:100], key=pki.server_cert.key))


def client_files(pki: Pki) -> dict[str, bytes]:
    return {"ca.crt": pki.ca.cert, "tls.crt": pki.client_cert.cert, "tls.key": pki.client_cert.key}


@pytest.mark.parametrize("mutual", [False, True])
def test_a_client_reads_its_rotated_files_before_its_next_call(volume, serve, tmp_path, caplog, mutual):
    """The shards were rotated to a new CA first; the island's Secret follows: its client, built from the old
    files, reaches them from its next call on, without a restart. A broken set in between is a WARNING."""
    new = throwaway_pki(mutual=mutual)
    volume.write(server_files(new))
    target = serve(mutual=mutual)
    island = SecretVolume(tmp_path / "island")
    island.root.mkdir()
    island.write(client_files(throwaway_pki(mutual=mutual)))
    security = tls.load(
        Role.CLIENT,
        ca_file=island.path("ca.crt"),
        cert_file=island.path("tls.crt") if mutual else None,
        key_file=island.path("tls.key") if mutual else None,
        mutual=mutual,
        insecure_plaintext=False,
    )
    with SyncerClient(target, "token", security=security) as client:
        assert not client.wait_ready(1.0), "the old CA trusts the shard no longer"
        with caplog.at_level(logging.WARNING, logger="diloco.transport.reload"):
            island.write(client_files(new) | {"ca.crt": b"not a certificate"})
            assert not client.wait_ready(1.0)
        assert [r for r in caplog.records if "cannot be used" in r.getMessage()], "a broken set is a WARNING"
        island.write(client_files(new))
        assert client.wait_ready(5.0), "the rotated files are read before the next call"
