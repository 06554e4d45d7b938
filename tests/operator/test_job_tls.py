"""A job's TLS as the operator decides it: a CA of the job's own, made once and kept, whose key is derived and
stored nowhere; certificates for every name of the syncer Services, re-issued only when the names change or the
end nears; what each pod mounts and the variables that point it there; and the operator's own way of calling the
shards."""

from __future__ import annotations

import base64
import datetime

import grpc
import pytest
from support import TEST_PKI

from diloco.api.job import DiLoCoJobSpec
from diloco.core.config import TrainingConfig
from diloco.operator import naming as n
from diloco.operator.job_tls import RENEW_BEFORE, job_tls, operator_made_data, secret_bytes, server_names
from diloco.operator.tokens import ca_key
from diloco.syncer.server import SyncerServer
from diloco.transport import certificates
from diloco.transport.auth import bearer_metadata
from diloco.transport.tls import PLAINTEXT, Tls
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.v1 import syncer_pb2_grpc

JOB = n.JobRef(name="demo", namespace="ml", uid="uid-1")
NOW = datetime.datetime(2026, 11, 24, tzinfo=datetime.UTC)
OPERATOR_KEY = b"k" * 32
CA_KEY = ca_key(OPERATOR_KEY, JOB)


def spec(**tls) -> DiLoCoJobSpec:
    return DiLoCoJobSpec.model_validate(
        {"image": "img", "islands": [{"name": "a"}], "syncer": {"shards": 2}, "training": {"fragments": 2}, "tls": tls}
    )


def as_secret(data: dict[str, bytes]) -> dict:
    return {"data": {key: base64.b64encode(value).decode() for key, value in data.items()}}


def test_the_server_certificate_names_every_form_of_every_shard_service():
    made = operator_made_data(JOB, {}, server_names(JOB, 2), NOW, CA_KEY)
    assert certificates.names_of(made["tls.crt"]) == {
        f"demo-syncer-{shard}{suffix}" for shard in (0, 1) for suffix in ("", ".ml", ".ml.svc", ".ml.svc.cluster.local")
    }
    assert certificates.signed_by(made["tls.crt"], made["ca.crt"])
    assert certificates.signed_by(made["client.crt"], made["ca.crt"])


def test_what_lives_is_kept_and_a_new_shard_reissues_the_server_certificate_under_the_same_ca():
    made = operator_made_data(JOB, {}, server_names(JOB, 2), NOW, CA_KEY)
    assert operator_made_data(JOB, made, server_names(JOB, 2), NOW, CA_KEY) == made
    grown = operator_made_data(JOB, made, server_names(JOB, 3), NOW, CA_KEY)
    assert grown["ca.crt"] == made["ca.crt"] and grown["client.crt"] == made["client.crt"]
    assert grown["tls.crt"] != made["tls.crt"] and "demo-syncer-2.ml.svc" in certificates.names_of(grown["tls.crt"])


def test_certificates_near_their_end_are_renewed():
    made = operator_made_data(JOB, {}, server_names(JOB, 1), NOW, CA_KEY)
    later = certificates.expires(made["tls.crt"]) - RENEW_BEFORE + datetime.timedelta(days=1)
    renewed = operator_made_data(JOB, made, server_names(JOB, 1), later, CA_KEY)
    assert renewed["ca.crt"] == made["ca.crt"], "the CA outlives its certificates"
    assert certificates.expires(renewed["tls.crt"]) > certificates.expires(made["tls.crt"])
    assert certificates.expires(renewed["client.crt"]) > certificates.expires(made["client.crt"])


@pytest.mark.parametrize(
    "damaged",
    [{"ca.crt": TEST_PKI.ca.cert, "tls.crt": b"junk"}, {"ca.crt": b"junk"}],
    ids=["another CA", "junk CA"],
)
def test_a_damaged_secret_is_made_anew(damaged):
    made = operator_made_data(JOB, damaged, server_names(JOB, 1), NOW, CA_KEY)
    assert made["ca.crt"] not in (TEST_PKI.ca.cert, b"junk")
    assert certificates.signed_by(made["tls.crt"], made["ca.crt"])


def test_the_ca_key_is_derived_for_the_job_and_kept_in_no_secret():
    """The CA's private key is a function of the operator's key and the job: made again on every pass, never
    written where a pod could mount it. A Secret that held one (as older versions kept it) loses it, and the CA
    is made anew for the derived key, so that what signed the job's certificates is what the operator holds."""
    assert ca_key(OPERATOR_KEY, JOB) == CA_KEY
    assert ca_key(OPERATOR_KEY, n.JobRef(name="other", namespace="ml", uid="uid-2")) != CA_KEY
    assert ca_key(b"q" * 32, JOB) != CA_KEY
    made = operator_made_data(JOB, {}, server_names(JOB, 1), NOW, CA_KEY)
    assert set(made) == {"ca.crt", "tls.crt", "tls.key", "client.crt", "client.key"}
    assert certificates.holds_key(made["ca.crt"], CA_KEY)
    old = certificates.new_ca("diloco CA of ml/demo", NOW)
    legacy = {"ca.crt": old.cert, "ca.key": old.key, "tls.crt": made["tls.crt"], "tls.key": made["tls.key"]}
    moved = operator_made_data(JOB, legacy, server_names(JOB, 1), NOW, CA_KEY)
    assert "ca.key" not in moved and certificates.holds_key(moved["ca.crt"], CA_KEY)
    assert certificates.signed_by(moved["tls.crt"], moved["ca.crt"])


def test_the_operator_made_server_certificate_serves_the_service_name_over_tls():
    """A real shard with the made certificate, reached under its Service's name: the islands' and the
    operator's view of the job's TLS holds together."""
    made = job_tls(JOB, spec(mutual=True), None, {}, NOW, ca_key=CA_KEY)
    assert made.made is not None and isinstance(made.probe, Tls)
    server = SyncerServer(
        TrainingConfig(fragments=2, inner_steps=10, overlap_steps=1),
        shard_index=0,
        num_shards=1,
        token="t",
        security=Tls(ca=made.made["ca.crt"], cert=made.made["tls.crt"], key=made.made["tls.key"], mutual=True),
    )
    server.start()
    try:
        credentials = grpc.ssl_channel_credentials(made.probe.ca, made.probe.key, made.probe.cert)
        options = [("grpc.ssl_target_name_override", "demo-syncer-0.ml.svc")]
        with grpc.secure_channel(f"127.0.0.1:{server.port}", credentials, options=options) as channel:
            reply = syncer_pb2_grpc.SyncerStub(channel).Status(
                pb.StatusRequest(), metadata=bearer_metadata("t"), timeout=10
            )
        assert reply.num_shards == 1
    finally:
        server.stop(grace=0)


@pytest.mark.parametrize(
    ("tls", "syncer_env", "island_env"),
    [
        ({}, {"CA", "CERT", "KEY"}, {"CA"}),
        ({"mutual": True}, {"CA", "CERT", "KEY", "MUTUAL"}, {"CA", "CERT", "KEY", "MUTUAL"}),
    ],
    ids=["server TLS", "mutual TLS"],
)
def test_each_side_is_pointed_at_what_its_role_needs(tls, syncer_env, island_env):
    decided = job_tls(JOB, spec(**tls), None, {}, NOW, ca_key=CA_KEY)
    assert {k.removeprefix("DILOCO_TLS_").removesuffix("_FILE") for k in decided.env(syncer=True)} == syncer_env
    assert {k.removeprefix("DILOCO_TLS_").removesuffix("_FILE") for k in decided.env(syncer=False)} == island_env


def test_no_pod_mounts_the_cas_key_and_islands_get_the_client_certificate_as_their_own():
    decided = job_tls(JOB, spec(mutual=True), None, {}, NOW, ca_key=CA_KEY)

    def files(syncer):
        (volume,) = decided.volumes(JOB, syncer=syncer)
        (source,) = volume["projected"]["sources"]
        assert source["secret"]["name"] == "diloco-demo-tls"
        return {item["key"]: item["path"] for item in source["secret"]["items"]}

    assert files(syncer=True) == {"ca.crt": "ca.crt", "tls.crt": "tls.crt", "tls.key": "tls.key"}
    assert files(syncer=False) == {"ca.crt": "ca.crt", "client.crt": "tls.crt", "client.key": "tls.key"}


def test_named_secrets_are_mounted_as_they_are_and_the_operator_trusts_their_ca():
    named = {
        "our-ca": as_secret({"ca.crt": TEST_PKI.ca.cert}),
        "syncer-cert": as_secret({"tls.crt": TEST_PKI.server_cert.cert, "tls.key": TEST_PKI.server_cert.key}),
        "island-cert": as_secret({"tls.crt": TEST_PKI.client_cert.cert, "tls.key": TEST_PKI.client_cert.key}),
    }
    decided = job_tls(
        JOB,
        spec(serverSecret="syncer-cert", caSecret="our-ca", clientSecret="island-cert", mutual=True),
        None,
        named,
        NOW,
        ca_key=CA_KEY,
    )
    assert decided.made is None
    assert decided.probe == Tls(
        ca=TEST_PKI.ca.cert, cert=TEST_PKI.client_cert.cert, key=TEST_PKI.client_cert.key, mutual=True
    )
    (syncer,) = decided.volumes(JOB, syncer=True)
    (island,) = decided.volumes(JOB, syncer=False)
    assert [s["secret"]["name"] for s in syncer["projected"]["sources"]] == ["our-ca", "syncer-cert"]
    assert [s["secret"]["name"] for s in island["projected"]["sources"]] == ["our-ca", "island-cert"]


def test_a_rotated_named_certificate_changes_the_fingerprint():
    def fingerprint(cert: bytes, syncer: bool) -> str:
        named = {"ca": as_secret({"ca.crt": TEST_PKI.ca.cert}), "srv": as_secret({"tls.crt": cert, "tls.key": b"k"})}
        return job_tls(JOB, spec(serverSecret="srv", caSecret="ca"), None, named, NOW, ca_key=CA_KEY).fingerprint(
            JOB, syncer
        )

    assert fingerprint(b"one", syncer=True) != fingerprint(b"two", syncer=True)
    assert fingerprint(b"one", syncer=False) == fingerprint(b"two", syncer=False), "islands hold only the CA"


def test_plaintext_mounts_nothing_and_says_so():
    decided = job_tls(JOB, spec(insecurePlaintext=True), None, {}, NOW, ca_key=CA_KEY)
    assert decided.probe is PLAINTEXT and decided.made is None
    assert decided.volumes(JOB, syncer=True) == [] and decided.mounts() == []
    assert decided.env(syncer=True) == decided.env(syncer=False) == {"DILOCO_INSECURE_PLAINTEXT": "1"}


def test_secret_bytes_of_a_missing_secret_is_empty():
    assert secret_bytes(None) == {}


def test_the_server_certificate_also_names_the_hosts_the_shards_are_exposed_at():
    made = job_tls(JOB, spec(), None, {}, NOW, external=["127.0.0.5", "syncers.example.com"], ca_key=CA_KEY).made
    assert made is not None
    assert {"127.0.0.5", "syncers.example.com", "demo-syncer-1.ml.svc"} <= certificates.names_of(made["tls.crt"])
    again = job_tls(
        JOB, spec(), as_secret(made), {}, NOW, external=["127.0.0.5", "syncers.example.com"], ca_key=CA_KEY
    ).made
    assert again == made, "the same hosts keep the certificate"
    moved = job_tls(JOB, spec(), as_secret(made), {}, NOW, external=["127.0.0.6"], ca_key=CA_KEY).made
    assert (
        moved is not None
        and moved["ca.crt"] == made["ca.crt"]
        and "127.0.0.6" in certificates.names_of(moved["tls.crt"])
    )


def remote_spec(**remote) -> DiLoCoJobSpec:
    endpoints = {"endpoints": ["127.0.0.5:31000", "127.0.0.5:31001"], "tokenSecret": "far-token", "caSecret": "far-ca"}
    return DiLoCoJobSpec.model_validate(
        {
            "image": "img",
            "islands": [{"name": "b"}],
            "syncer": {"shards": 2},
            "training": {"fragments": 2},
            "remoteSyncers": {**endpoints, **remote},
        }
    )


def test_islands_of_remote_shards_mount_the_ca_and_client_certificate_the_job_names_and_nothing_is_made():
    named = {
        "far-ca": as_secret({"ca.crt": TEST_PKI.ca.cert}),
        "far-client": as_secret({"tls.crt": TEST_PKI.client_cert.cert, "tls.key": TEST_PKI.client_cert.key}),
    }
    server_tls = job_tls(JOB, remote_spec(), None, named, NOW, ca_key=CA_KEY)
    assert server_tls.made is None and server_tls.probe == Tls(ca=TEST_PKI.ca.cert)
    assert server_tls.env(syncer=False) == {"DILOCO_TLS_CA_FILE": "/var/run/secrets/diloco-tls/ca.crt"}

    mutual = job_tls(JOB, remote_spec(clientSecret="far-client"), None, named, NOW, ca_key=CA_KEY)
    assert mutual.probe == Tls(
        ca=TEST_PKI.ca.cert, cert=TEST_PKI.client_cert.cert, key=TEST_PKI.client_cert.key, mutual=True
    )
    (island,) = mutual.volumes(JOB, syncer=False)
    assert [s["secret"]["name"] for s in island["projected"]["sources"]] == ["far-ca", "far-client"]
    assert mutual.env(syncer=False)["DILOCO_TLS_MUTUAL"] == "1"

    missing = job_tls(
        JOB, remote_spec(clientSecret="far-client"), None, {"far-ca": named["far-ca"]}, NOW, ca_key=CA_KEY
    )
    assert missing.probe == "Secret far-client not found"
