"""A shard whose certificate is rotated on disk serves the new one without a restart, and judges its expiry
afresh: the metric follows it and a new certificate expiring soon is a WARNING like one served at start."""

from __future__ import annotations

import datetime
import logging

import pytest
from syncer_harness import config_for, make_client

from diloco.transport import certificates, tls
from diloco.transport.tls import Role, Tls

pytestmark = pytest.mark.process

DAY = 86_400


def expiry_metric(server) -> float:
    return server.metrics.registry.get_sample_value("diloco_syncer_tls_certificate_expiry_timestamp_seconds")


def test_a_rotated_certificate_is_served_and_its_expiry_judged_again(start_server, tmp_path, caplog):
    now = datetime.datetime.now(datetime.UTC)
    ca = certificates.new_ca("test CA", now)
    lasting = certificates.issue(ca, "syncer", now, names=["127.0.0.1"], server=True)
    expiring = certificates.issue(
        ca, "syncer", now, names=["127.0.0.1"], server=True, valid_for=datetime.timedelta(days=1)
    )
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(lasting.cert)
    key.write_bytes(lasting.key)
    security = tls.load(
        Role.SERVER, ca_file=None, cert_file=str(cert), key_file=str(key), mutual=False, insecure_plaintext=False
    )
    server = start_server(config_for(), security=security, seed=False)
    assert expiry_metric(server) == certificates.expires(lasting.cert).timestamp()

    cert.write_bytes(expiring.cert)
    key.write_bytes(expiring.key)
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        with make_client(server.port, security=Tls(ca=ca.cert)) as client:  # a new connection: a new handshake
            assert client.status().num_shards == 1
    assert expiry_metric(server) == certificates.expires(expiring.cert).timestamp()
    assert any("certificate expires soon" in r.getMessage() for r in caplog.records)
