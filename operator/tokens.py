"""A job's gRPC bearer token, derived rather than stored: HMAC-SHA256 of the job's identity (namespace, name,
uid) and its rotation (the `diloco.dev/rotate-token` annotation) under the operator's key. The job's Secret is
a copy the pods mount, never the only one: deleting it brings the same token back on the next pass, and
only a new rotation value (or a new job) changes it. The key lives in one Secret in the operator's own
namespace (`kube.load_token_key`), out of reach of those who manage jobs; one job's token reveals nothing
of another's."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

from diloco.operator import naming as n

KEY_BYTES = 32
"""256 bits: the key and the tokens are as strong as HMAC-SHA256 allows."""


def job_token(key: bytes, job: n.JobRef, rotation: str) -> str:
    """The token of `job` at `rotation`: the same on every pass, from every replica holding `key`."""
    message = "\0".join((job.namespace, job.name, job.uid, rotation)).encode()
    return base64.urlsafe_b64encode(hmac.new(key, message, hashlib.sha256).digest()).decode().rstrip("=")


def rotation_of(metadata: Mapping[str, Any]) -> str:
    """The job's `diloco.dev/rotate-token` annotation: setting or changing it rotates the token."""
    return str((metadata.get("annotations") or {}).get(n.ANNOTATION_ROTATE_TOKEN, ""))


def fingerprint(token: str) -> str:
    """Names a token in pod templates, so a new token rolls every pod holding it, without revealing it (a
    truncated digest of 256 random-looking bits)."""
    return hashlib.sha256(b"diloco token fingerprint\0" + token.encode()).hexdigest()[:16]
