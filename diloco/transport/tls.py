"""How every channel of a job is secured, one rule for every side (syncer, island, operator, `diloco status`):
TLS against the job's CA, mutual when the job asks for it, or plaintext only when asked for by name.

A server holds its certificate and key, and the CA when it demands client certificates (mutual TLS); a
client holds the CA that verifies the server, and its own certificate and key for mutual TLS. The bearer
token is checked on every call over either (`auth`). gRPC refuses a connection that fails the handshake
before any call exists, so no handler, and no interceptor, ever sees it; gRPC reports neither that outcome
nor its reason to Python (only to its own log), so a server is told of the handshakes begun (`on_handshake`)
and counts the refused ones as the connections that made no call (`connections`).
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, cast

import grpc

if TYPE_CHECKING:  # issuing certificates (cryptography) is for local runs and tests, not a process's start
    from diloco.transport import certificates

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
"""What a server certificate for one machine (`diloco run`, tests, benchmarks) is valid for."""


EXPIRY_WARNING = datetime.timedelta(days=14)
"""A certificate expiring sooner is logged at WARNING when a shard starts: time to renew it, and a shard serving
an expired one otherwise says nothing in its own log while every handshake fails."""


def seconds_to_expiry(cert: bytes, now: datetime.datetime) -> float:
    """Seconds until the first certificate of a PEM chain expires at `now` (negative once it has)."""
    from cryptography import x509  # only when a certificate is in hand: plaintext processes never load it

    return (x509.load_pem_x509_certificate(cert).not_valid_after_utc - now).total_seconds()


class TlsError(ValueError):
    """Settings that cannot secure a channel: a missing file, or a contradiction."""


class Role(enum.Enum):
    SERVER = "server"
    CLIENT = "client"


@dataclass(frozen=True)
class Files:
    """Where a side's PEMs were read from: a server reads them again when they are replaced in place (a
    Secret volume swaps them atomically, cert-manager renews them), so it never needs a restart to rotate."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class Tls:
    """PEM bytes one side holds: `ca` verifies the peer; `cert` and `key` present this side (always for a
    server, for a client under mutual TLS); `mutual` has a server demand a client certificate signed by `ca`.
    `files`, when they came from files, where (not part of what the side holds: two equal PEMs are equal)."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    mutual: bool = False
    files: Files | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsError("a certificate and its key go together: give both or neither")

    def check(self, role: Role) -> Tls:
        """Itself, when it is enough for `role`; else TlsError saying what is missing."""
        if role is Role.SERVER:
            if self.cert is None:
                raise TlsError("a TLS server needs its certificate and key (--tls-cert-file, --tls-key-file)")
            if self.mutual and self.ca is None:
                raise TlsError("mutual TLS needs the CA that signs client certificates (--tls-ca-file)")
        else:
            if self.ca is None:
                raise TlsError("a TLS client needs the CA that signed the server's certificate (--tls-ca-file)")
            if self.mutual and self.cert is None:
                raise TlsError("mutual TLS needs this client's certificate and key (--tls-cert-file, --tls-key-file)")
        return self


@dataclass(frozen=True)
class Plaintext:
    """No TLS: bytes and the token in the clear. Never a default, only what someone asked for by name."""


PLAINTEXT: Final = Plaintext()
Security = Tls | Plaintext


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise TlsError(f"cannot read the {what} {path}: {error.strerror}") from None


def load(
    role: Role,
    *,
    ca_file: str | None,
    cert_file: str | None,
    key_file: str | None,
    mutual: bool,
    insecure_plaintext: bool,
) -> Security:
    """The security of `role` from PEM files (mounted Secrets); plaintext only with `insecure_plaintext`, and
    never together with TLS files, so a half-configured side fails loudly instead of sending in the clear."""
    if insecure_plaintext:
        if ca_file or cert_file or key_file or mutual:
            raise TlsError("--insecure-plaintext contradicts the TLS settings given with it: choose one")
        return PLAINTEXT
    if not (ca_file or cert_file or key_file):
        needed = "--tls-cert-file and --tls-key-file" if role is Role.SERVER else "--tls-ca-file"
        raise TlsError(
            f"no TLS settings: pass {needed} (or DILOCO_TLS_*); "
            "--insecure-plaintext (DILOCO_INSECURE_PLAINTEXT=1) sends in the clear"
        )
    return read(Files(ca=ca_file or None, cert=cert_file or None, key=key_file or None), mutual=mutual).check(role)


def read(files: Files, *, mutual: bool) -> Tls:
    """The PEMs `files` name, as they are now (TlsError for one that cannot be read)."""
    return Tls(
        ca=_read(files.ca, "CA certificate"),
        cert=_read(files.cert, "certificate"),
        key=_read(files.key, "private key"),
        mutual=mutual,
        files=files,
    )


def channel(target: str, security: Security, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to a server at `target`, whose certificate must name the target's host and chain to the CA."""
    if isinstance(security, Plaintext):
        return grpc.insecure_channel(target, options=options)
    tls = security.check(Role.CLIENT)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.ca,
        private_key=tls.key if tls.mutual else None,
        certificate_chain=tls.cert if tls.mutual else None,
    )
    return grpc.secure_channel(target, credentials, options=options)


def server_configuration(tls: Tls) -> grpc.ServerCertificateConfiguration:
    """What gRPC serves for `tls`, a server's certificate and key (and the CA of its clients)."""
    assert tls.cert is not None and tls.key is not None  # check(Role.SERVER) makes sure of it
    return grpc.ssl_server_certificate_configuration([(tls.key, tls.cert)], root_certificates=tls.ca)


def add_port(
    server: grpc.Server,
    address: str,
    security: Security,
    on_handshake: Callable[[], None] | None = None,
    on_reload: Callable[[Tls], None] | None = None,
) -> int:
    """Binds `address`; the port bound (0 when binding failed). `on_handshake` is told of each TLS handshake
    begun, before its outcome is known: one per connection, refused ones included. A certificate read from
    files is read again when they change (`reload`); `on_reload` is told of each one served from then on."""
    if isinstance(security, Plaintext):
        return server.add_insecure_port(address)
    tls = security.check(Role.SERVER)
    config = server_configuration(tls)
    from diloco.transport.reload import Reloader  # it reads this module's settings

    reloader = None if tls.files is None else Reloader(tls, tls.files, on_reload)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # gRPC asks at every handshake whether the certificate changed (None: it has not).
        if on_handshake is not None:
            on_handshake()
        return None if reloader is None else reloader.fetch()

    # gRPC takes None from the fetcher as "unchanged", though its type stubs know only a new configuration.
    fetcher = cast(Callable[[], grpc.ServerCertificateConfiguration], fetch)
    credentials = grpc.dynamic_ssl_server_credentials(config, fetcher, require_client_authentication=tls.mutual)
    return server.add_secure_port(address, credentials)


@dataclass(frozen=True)
class Pki:
    """A throwaway CA and the certificates it issued to a server and to a client."""

    ca: certificates.Issued
    server_cert: certificates.Issued
    client_cert: certificates.Issued
    mutual: bool = False

    @property
    def server(self) -> Tls:
        return Tls(ca=self.ca.cert, cert=self.server_cert.cert, key=self.server_cert.key, mutual=self.mutual)

    @property
    def client(self) -> Tls:
        return Tls(ca=self.ca.cert, cert=self.client_cert.cert, key=self.client_cert.key, mutual=self.mutual)


def throwaway_pki(names: Sequence[str] = LOOPBACK_NAMES, *, mutual: bool = False) -> Pki:
    """A fresh CA, a server certificate for `names` and a client certificate, for one run on one machine:
    `diloco run`, the tests and the benchmarks exercise TLS as a cluster does, with nothing to set up."""
    from diloco.transport import certificates

    now = datetime.datetime.now(datetime.UTC)
    ca = certificates.new_ca("diloco throwaway CA", now)
    return Pki(
        ca=ca,
        server_cert=certificates.issue(ca, "diloco syncer", now, names=names, server=True),
        client_cert=certificates.issue(ca, "diloco client", now, server=False),
        mutual=mutual,
    )
