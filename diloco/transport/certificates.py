"""Minting a small private PKI: a CA of one job (or one `diloco run`) and the certificates it issues to the
syncers (server) and, for mutual TLS, to the islands and the operator (client).

P-256 keys (quick to make, small on the wire) and a CA that signs nothing but this job's certificates, so
trusting it trusts nobody else. Pure functions of their arguments and the clock they are given.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = datetime.timedelta(days=365)
"""How long a minted certificate is valid: the operator renews one well before (see `operator.job_tls`)."""
CLOCK_SKEW = datetime.timedelta(minutes=5)
"""A certificate is valid from a little before it was made, so a peer whose clock is behind accepts it."""


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM-encoded."""

    cert: bytes
    key: bytes


P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
SEED_BYTES = 32


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def derived_key(seed: bytes) -> bytes:
    """A P-256 private key (PEM) that is a function of `seed`, a secret of at least SEED_BYTES bytes: a key
    that need not be stored anywhere, since whoever holds the seed makes it again. The scalar is the seed's
    SHA-512 reduced into [1, n-1], so its bias is below 2**-250."""
    if len(seed) < SEED_BYTES:
        raise ValueError(f"a key seed needs at least {SEED_BYTES} bytes of secret, got {len(seed)}")
    scalar = int.from_bytes(hashlib.sha512(seed).digest(), "big") % (P256_ORDER - 1) + 1
    return _pem_key(ec.derive_private_key(scalar, ec.SECP256R1()))


def _load_key(pem: bytes) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("the key is not an elliptic-curve key this module made")
    return key


def holds_key(cert: bytes, key: bytes) -> bool:
    """Whether the certificate `cert` is for the private key `key` (its public half is the certificate's)."""
    try:
        public = x509.load_pem_x509_certificate(cert).public_key()
        return public == _load_key(key).public_key()
    except (ValueError, TypeError):
        return False


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def new_ca(
    common_name: str, now: datetime.datetime, valid_for: datetime.timedelta = VALID_FOR, key: bytes | None = None
) -> Issued:
    """A self-signed CA that may sign end-entity certificates only (path length 0), for `key` (PEM; a new one
    when None)."""
    private = _key() if key is None else _load_key(key)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + valid_for)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(private.public_key()), critical=False)
        .sign(private, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(private))


def _alt_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def issue(
    ca: Issued,
    common_name: str,
    now: datetime.datetime,
    *,
    names: Sequence[str] = (),
    server: bool,
    valid_for: datetime.timedelta = VALID_FOR,
) -> Issued:
    """A certificate signed by `ca`: for a server answering at `names` (DNS names or IP addresses), or
    (`server` False) for a client, identified by `common_name`."""
    if server and not names:
        raise ValueError("a server certificate needs the names its clients reach it at")
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = _load_key(ca.key)
    key = _key()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(min(now + valid_for, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName([_alt_name(n) for n in names]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def signed_by(cert: bytes, ca: bytes) -> bool:
    """Whether `cert` carries a valid signature of the CA certificate `ca`."""
    try:
        x509.load_pem_x509_certificate(cert).verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def names_of(cert: bytes) -> frozenset[str]:
    """The DNS names and IP addresses a certificate is valid for."""
    try:
        alt = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return frozenset()
    return frozenset(
        [*alt.value.get_values_for_type(x509.DNSName), *map(str, alt.value.get_values_for_type(x509.IPAddress))]
    )


def expires(cert: bytes) -> datetime.datetime:
    return x509.load_pem_x509_certificate(cert).not_valid_after_utc
