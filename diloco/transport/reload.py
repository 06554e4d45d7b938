"""TLS files read again when they are replaced, so rotating a certificate or a CA needs no restart, on either
side of a call.

Kubernetes Secret volumes swap a `..data` symlink atomically, cert-manager and rotation tools rewrite the
files in place. Whether they changed is a `stat` of the files (each followed to what it names now): a server
asks at every handshake (`tls.add_port`), a client before every attempt of a call (`SyncerClient`). A changed
set is read and checked before it is used: a half-written or mismatched pair is a WARNING and what was used
so far stays.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import grpc

from diloco.transport.tls import Files, Role, Tls, TlsError, read, server_configuration

log = logging.getLogger("diloco.transport.reload")

Stamp = tuple[tuple[int, int, int, int], ...]


def stamp(files: Files) -> Stamp:
    """What changes when any of `files` is replaced or rewritten: device, inode, size and mtime of each."""
    paths = [path for path in (files.ca, files.cert, files.key) if path]
    stats = [os.stat(path) for path in paths]  # follows symlinks: a swapped `..data` is a new inode
    return tuple((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)


def checked(tls: Tls, role: Role = Role.SERVER) -> Tls:
    """`tls` when it is enough for `role`, its certificate and key (if any) parse and belong together, and the
    CA parses; else TlsError."""
    from cryptography import x509  # only when a certificate is in hand
    from cryptography.hazmat.primitives import serialization

    tls.check(role)
    try:
        if tls.ca is not None:
            x509.load_pem_x509_certificates(tls.ca)
        if tls.cert is None or tls.key is None:
            return tls
        public = x509.load_pem_x509_certificate(tls.cert).public_key()
        key = serialization.load_pem_private_key(tls.key, password=None)
    except (ValueError, TypeError) as error:
        raise TlsError(f"a certificate, key or CA does not parse: {error}") from None
    if public != key.public_key():
        raise TlsError("the certificate is not for the private key beside it")
    return tls


class Watched:
    """The TLS settings of one side, read from `files`: `changed` reads them again once the files changed, and
    answers the new settings when they are valid for `role` and differ from the current ones."""

    def __init__(self, tls: Tls, files: Files, role: Role) -> None:
        self.current = tls
        self._files = files
        self._role = role
        self._lock = threading.Lock()
        self._seen = self._stamp()

    def _stamp(self) -> Stamp | None:
        try:
            return stamp(self._files)
        except OSError:
            return None  # mid-swap, or gone: what was used so far stays

    def changed(self) -> Tls | None:
        """The new settings when the files changed into valid ones since last asked; else None (unchanged)."""
        with self._lock:
            seen = self._stamp()
            if seen is None or seen == self._seen:
                return None
            self._seen = seen  # a broken set is warned of once, and read again when it changes again
            try:
                fresh = checked(read(self._files, mutual=self.current.mutual), self._role)
            except TlsError as error:
                log.warning(
                    "TLS files changed but cannot be used: the previous ones stay",
                    extra={
                        "ca_file": self._files.ca,
                        "cert_file": self._files.cert,
                        "key_file": self._files.key,
                        "error": str(error),
                    },
                )
                return None
            if fresh == self.current:
                return None  # touched, not changed
            self.current = fresh
            return fresh


class Reloader:
    """The certificate a server serves from `files`; `fetch`, called at each handshake, reads them again once
    they changed. `on_reload` is told of each new certificate served (its expiry metric and warning)."""

    def __init__(self, tls: Tls, files: Files, on_reload: Callable[[Tls], None] | None = None) -> None:
        self._watched = Watched(tls, files, Role.SERVER)
        self._files = files
        self._on_reload = on_reload

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when the files changed into a valid one since last asked; else None (unchanged)."""
        fresh = self._watched.changed()
        if fresh is None:
            return None
        from diloco.transport import certificates

        assert fresh.cert is not None
        log.info(
            "TLS certificate reloaded",
            extra={"cert_file": self._files.cert, "expires": certificates.expires(fresh.cert).isoformat()},
        )
        if self._on_reload is not None:
            self._on_reload(fresh)
        return server_configuration(fresh)
