"""What derives from the operator's key rather than being stored: a job's gRPC bearer token, HMAC-SHA256 of the
job's identity (namespace, name, uid) and its rotation (the `diloco.dev/rotate-token` annotation) under the
operator's key, and the private key of the CA the operator makes for a job (`ca_key`), which therefore lives in
no Secret a pod could mount. The job's Secret is a copy the pods mount, never the only one: deleting it brings
the same token back on the next pass, and only a new rotation value (or a new job) changes it. While a rotation
rolls through the islands the Secret holds two tokens (`JobTokens`: the one presented, and those the shards
accept; `policies.token_rotation` says when each changes). The key lives in one Secret in the operator's own
namespace (`kube.load_token_key`), out of reach of those who manage jobs; one job's token reveals nothing
of another's."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.operator import naming as n
from diloco.transport import certificates
from diloco.transport.auth import token_fingerprint

KEY_BYTES = 32
"""256 bits: the key and the tokens are as strong as HMAC-SHA256 allows."""
ACCEPTED_KEY = "accepted"
"""The key of the job's token Secret listing, one per line, every token its shards accept (`diloco-syncer
--token-file` reads it, and reads it again when it changes); `naming.TOKEN_KEY` holds the one presented."""


@dataclass(frozen=True)
class JobTokens:
    """A job's tokens on one pass: the one its islands and the operator present, and every one its shards
    accept (the presented one, and the one it replaces while a rotation rolls through the islands)."""

    presented: str
    accepted: tuple[str, ...]

    @classmethod
    def only(cls, token: str) -> JobTokens:
        return cls(token, (token,))

    def secret_data(self) -> dict[str, str]:
        """The job's token Secret's data, unencoded."""
        return {n.TOKEN_KEY: self.presented, ACCEPTED_KEY: "\n".join(self.accepted) + "\n"}

    @classmethod
    def from_secret(cls, secret: Mapping[str, Any] | None) -> JobTokens | None:
        """What a token Secret holds; None when it holds no presented token."""
        data = (secret or {}).get("data") or {}
        if n.TOKEN_KEY not in data:
            return None
        presented = base64.b64decode(data[n.TOKEN_KEY]).decode().strip()
        listed = base64.b64decode(data.get(ACCEPTED_KEY, "")).decode().split()
        return cls(presented, tuple(dict.fromkeys([*listed, presented])))


def job_token(key: bytes, job: n.JobRef, rotation: str) -> str:
    """The token of `job` at `rotation`: the same on every pass, from every replica holding `key`."""
    message = "\0".join((job.namespace, job.name, job.uid, rotation)).encode()
    return base64.urlsafe_b64encode(hmac.new(key, message, hashlib.sha256).digest()).decode().rstrip("=")


def ca_key(key: bytes, job: n.JobRef) -> bytes:
    """The private key (PEM) of the CA the operator makes for `job` (`job_tls`): the same on every pass, from
    every replica holding `key`, and unrelated to the job's token or to another job's CA."""
    seed = hmac.new(key, "\0".join(("diloco ca key", job.namespace, job.name, job.uid)).encode(), hashlib.sha256)
    return certificates.derived_key(seed.digest())


def rotation_of(metadata: Mapping[str, Any]) -> str:
    """The job's `diloco.dev/rotate-token` annotation: setting or changing it rotates the token."""
    return str((metadata.get("annotations") or {}).get(n.ANNOTATION_ROTATE_TOKEN, ""))


fingerprint = token_fingerprint
"""Names a token in island pod templates, so a new one rolls the islands, and in a shard's Status, so the
operator knows a shard took it (`diloco.transport.auth.token_fingerprint`)."""
