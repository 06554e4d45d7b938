"""Why a TLS handshake was refused, for a client whose call failed UNAVAILABLE.

gRPC Python reports a refused handshake (wrong CA, plaintext server, client certificate refused, expired
certificate) only as UNAVAILABLE "Socket closed", the same as a shard that is down, so a client would retry
it for minutes while nothing can change. `probe` makes one handshake of its own with Python's `ssl` and the
same CA and client certificate, and names the reason; `HandshakeRefused` carries it with what to check.
"""

from __future__ import annotations

import enum
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass
from typing import Final

from diloco.transport.tls import Tls, TlsError

_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + empty SETTINGS
"""What a gRPC client sends first; a server that took our certificate answers it, one that did not sends an alert
(under TLS 1.3 a server judges the client certificate after the client's handshake is done)."""


class Refused(enum.Enum):
    """A reason a server and this client cannot agree on TLS; each says what to check."""

    VERIFY_FAILED = (
        "the shard's certificate failed verification: check that --tls-ca-file is the CA that signed it, "
        "that it names the host dialled, and that it has not expired"
    )
    PLAINTEXT_SERVER = (
        "the shard speaks plaintext, not TLS: give both sides TLS settings, or --insecure-plaintext to both"
    )
    CLIENT_CERT_REFUSED = (
        "the shard refused this client's certificate (mutual TLS): check that --tls-mutual, --tls-cert-file "
        "and --tls-key-file are given, and that the shard's --tls-ca-file signed the certificate"
    )


class HandshakeRefused(TlsError):
    """A server refused the TLS handshake for a reason no retry changes."""

    def __init__(self, target: str, reason: Refused, detail: str) -> None:
        super().__init__(f"TLS handshake with {target} refused: {reason.value} ({detail})")
        self.target = target
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Finding:
    """What a probe found: the reason and the `ssl` module's own words for it."""

    reason: Refused
    detail: str


_CLIENT_CERT_ALERTS = ("CERTIFICATE_REQUIRED", "BAD_CERTIFICATE", "UNKNOWN_CA", "CERTIFICATE_UNKNOWN")
_NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNKNOWN_PROTOCOL")


def split_target(target: str) -> tuple[str, int]:
    """(host, port) of a gRPC target `host:port` or `[v6]:port`, with an optional `dns:`/`ipv4:` scheme."""
    address = target.split(":", 1)[1].lstrip("/") if target.startswith(("dns:", "ipv4:", "ipv6:")) else target
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _context(tls: Tls, folder: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the host name, as gRPC does
    context.set_alpn_protocols(["h2"])
    if tls.ca is not None:
        context.load_verify_locations(cadata=tls.ca.decode())
    if tls.mutual and tls.cert is not None and tls.key is not None:
        # `ssl` loads a certificate chain from files only: a private folder (0700) that lives for the probe
        cert, key = os.path.join(folder, "tls.crt"), os.path.join(folder, "tls.key")
        for path, pem in ((cert, tls.cert), (key, tls.key)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as file:
                file.write(pem)
        context.load_cert_chain(cert, key)
    return context


def _classify(error: ssl.SSLError) -> Finding | None:
    """The reason `ssl` refused a handshake in its words, when they name one (an alert, or a peer not speaking TLS)."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return Finding(Refused.VERIFY_FAILED, error.verify_message or str(error))
    text = f"{error.reason or ''} {error}".upper()
    if any(alert in text for alert in _CLIENT_CERT_ALERTS):
        return Finding(Refused.CLIENT_CERT_REFUSED, error.reason or str(error))
    if any(sign in text for sign in _NOT_TLS):
        return Finding(Refused.PLAINTEXT_SERVER, error.reason or str(error))
    return None


_CLOSED: Final = "the shard closed the connection after the handshake"
"""What `_attempt` finds when a server whose certificate verified closed the connection before a byte of HTTP/2:
under TLS 1.3 a server judges the client's certificate after the client's handshake ends, and gRPC's then closes
without an alert, so this is how it refuses a client certificate."""


def _attempt(host: str, port: int, context: ssl.SSLContext, timeout: float) -> Finding | str | None:
    """One handshake and the first bytes after it: a named reason, `_CLOSED`, or None (nothing to name)."""
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None  # refused, unreachable or timed out: a shard that is down, not a TLS problem
    with raw:
        try:
            conn = context.wrap_socket(raw, server_hostname=host)
        except ssl.SSLError as error:
            return _classify(error)
        except OSError:
            return None
        with conn:
            try:
                conn.sendall(_HTTP2_PREFACE)
                if conn.recv(1):  # the server's SETTINGS: it took this client
                    return None
            except ssl.SSLError as error:
                if (finding := _classify(error)) is not None:
                    return finding
            except TimeoutError:
                return None
            except OSError:
                pass
    return _CLOSED


def probe(target: str, tls: Tls, timeout: float = 5.0) -> Finding | None:
    """Why the server at `target` refuses a TLS handshake from a client holding `tls`; None when it does not,
    or when it cannot be told (connection refused, timed out, cut mid-handshake): those may pass, so are retried.
    A connection closed after the handshake is tried twice, so that a shard closing as it stops is not taken for
    one refusing this client's certificate."""
    host, port = split_target(target)
    with tempfile.TemporaryDirectory(prefix="diloco-probe-") as folder:
        try:
            context = _context(tls, folder)
        except OSError:  # ssl.SSLError included: unusable settings of our own are for gRPC and `tls` to say
            return None
        found = _attempt(host, port, context, timeout)
        if found == _CLOSED:
            found = _attempt(host, port, context, timeout)
    if not isinstance(found, str):
        return found
    presents = "" if tls.mutual else ", and this client presents no certificate"
    return Finding(Refused.CLIENT_CERT_REFUSED, f"{found}{presents}")
