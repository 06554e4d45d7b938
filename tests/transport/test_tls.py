"""The one rule of how a side secures its channels: TLS from the mounted PEM files, enough for its role, or
plaintext only when asked for by name and never together with TLS settings."""

from __future__ import annotations

import argparse
import datetime

import pytest
from support import TEST_PKI

from diloco.settings import add_tls_arguments, load_security
from diloco.transport import certificates
from diloco.transport.tls import PLAINTEXT, Role, Tls, TlsError, load, throwaway_pki


@pytest.fixture
def pem_files(tmp_path):
    files = {"ca": TEST_PKI.ca.cert, "cert": TEST_PKI.server_cert.cert, "key": TEST_PKI.server_cert.key}
    paths = {}
    for name, pem in files.items():
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_bytes(pem)
    return {name: str(path) for name, path in paths.items()}


def settings(**given):
    return {"ca_file": None, "cert_file": None, "key_file": None, "mutual": False, "insecure_plaintext": False} | given


def test_a_server_holds_its_certificate_and_key(pem_files):
    loaded = load(Role.SERVER, **settings(cert_file=pem_files["cert"], key_file=pem_files["key"]))
    assert loaded == Tls(cert=TEST_PKI.server_cert.cert, key=TEST_PKI.server_cert.key)


def test_a_client_holds_the_ca(pem_files):
    assert load(Role.CLIENT, **settings(ca_file=pem_files["ca"])) == Tls(ca=TEST_PKI.ca.cert)


@pytest.mark.parametrize(
    ("role", "given", "missing"),
    [
        (Role.SERVER, {"ca_file": "ca"}, "certificate and key"),
        (Role.SERVER, {"cert_file": "cert", "key_file": "key", "mutual": True}, "CA that signs client"),
        (Role.CLIENT, {"cert_file": "cert", "key_file": "key"}, "CA that signed the server"),
        (Role.CLIENT, {"ca_file": "ca", "mutual": True}, "client's certificate"),
        (Role.CLIENT, {"ca_file": "ca", "cert_file": "cert"}, "give both or neither"),
    ],
)
def test_settings_not_enough_for_the_role_name_what_is_missing(pem_files, role, given, missing):
    files = {key: pem_files[value] if key.endswith("_file") else value for key, value in given.items()}
    with pytest.raises(TlsError, match=missing):
        load(role, **settings(**files))


@pytest.mark.parametrize(("role", "needed"), [(Role.SERVER, "--tls-cert-file"), (Role.CLIENT, "--tls-ca-file")])
def test_no_settings_at_all_is_an_error_not_plaintext(role, needed):
    with pytest.raises(TlsError, match="--insecure-plaintext") as refused:
        load(role, **settings())
    assert needed in str(refused.value)


def test_plaintext_is_what_was_asked_for_by_name():
    assert load(Role.SERVER, **settings(insecure_plaintext=True)) is PLAINTEXT


def test_plaintext_with_tls_settings_is_a_contradiction(pem_files):
    with pytest.raises(TlsError, match="contradicts"):
        load(Role.CLIENT, **settings(ca_file=pem_files["ca"], insecure_plaintext=True))


def test_an_unreadable_file_is_named(tmp_path):
    with pytest.raises(TlsError, match="missing.pem"):
        load(Role.CLIENT, **settings(ca_file=str(tmp_path / "missing.pem")))


def test_flags_win_over_the_environment_of_the_same_name(pem_files, monkeypatch):
    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    monkeypatch.setenv("DILOCO_TLS_CA_FILE", "/nonexistent/ca.crt")
    monkeypatch.setenv("DILOCO_TLS_MUTUAL", "1")
    monkeypatch.setenv("DILOCO_TLS_CERT_FILE", pem_files["cert"])
    monkeypatch.setenv("DILOCO_TLS_KEY_FILE", pem_files["key"])
    loaded = load_security(Role.CLIENT, parser.parse_args(["--tls-ca-file", pem_files["ca"]]))
    assert loaded == Tls(ca=TEST_PKI.ca.cert, cert=TEST_PKI.server_cert.cert, key=TEST_PKI.server_cert.key, mutual=True)


def test_the_environment_alone_can_ask_for_plaintext(monkeypatch):
    monkeypatch.setenv("DILOCO_INSECURE_PLAINTEXT", "1")
    assert load_security(Role.CLIENT) is PLAINTEXT


def test_a_throwaway_pki_issues_for_loopback_from_one_ca():
    pki = throwaway_pki(mutual=True)
    assert certificates.names_of(pki.server_cert.cert) == {"127.0.0.1", "localhost", "::1"}
    assert certificates.signed_by(pki.server_cert.cert, pki.ca.cert)
    assert certificates.signed_by(pki.client_cert.cert, pki.ca.cert)
    assert not certificates.signed_by(pki.client_cert.cert, TEST_PKI.ca.cert)
    assert pki.server.check(Role.SERVER).mutual and pki.client.check(Role.CLIENT).mutual


def test_a_certificate_never_outlives_its_ca():
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    ca = certificates.new_ca("ca", now, valid_for=datetime.timedelta(days=10))
    issued = certificates.issue(ca, "syncer", now, names=["syncer"], server=True)
    assert certificates.expires(issued.cert) == certificates.expires(ca.cert)
