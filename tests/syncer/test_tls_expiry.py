"""A shard's certificate nearing or past its expiry is said in the shard's own log when it starts, at WARNING,
beside the expiry time it exports as a metric."""

from __future__ import annotations

import datetime
import logging

import pytest
from syncer_harness import config_for, make_client

from diloco.transport import certificates
from diloco.transport.tls import Tls

pytestmark = pytest.mark.process

DAY = 86_400


def pki_expiring_in(valid_for: datetime.timedelta) -> tuple[Tls, Tls]:
    now = datetime.datetime.now(datetime.UTC)
    ca = certificates.new_ca("test CA", now)
    server = certificates.issue(ca, "syncer", now, names=["127.0.0.1"], server=True, valid_for=valid_for)
    return Tls(ca=ca.cert, cert=server.cert, key=server.key), Tls(ca=ca.cert)


def seconds_to_expiry(server) -> float:
    expires = server.metrics.registry.get_sample_value("diloco_syncer_tls_certificate_expiry_timestamp_seconds")
    return expires - datetime.datetime.now(datetime.UTC).timestamp()


def test_a_certificate_expiring_within_two_weeks_is_a_warning(start_server, caplog):
    server_tls, client_tls = pki_expiring_in(datetime.timedelta(days=1))
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        server = start_server(config_for(), security=server_tls, seed=False)
    assert any("certificate expires soon" in r.getMessage() for r in caplog.records)
    assert DAY - 600 < seconds_to_expiry(server) <= DAY
    with make_client(server.port, security=client_tls) as client:  # it still serves until then
        assert client.status().num_shards == 1


def test_a_certificate_far_from_expiry_is_no_warning(start_server, caplog):
    server_tls, _ = pki_expiring_in(datetime.timedelta(days=90))
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        server = start_server(config_for(), security=server_tls, seed=False)
    assert not [r for r in caplog.records if "certificate" in r.getMessage()]
    assert seconds_to_expiry(server) > 89 * DAY
