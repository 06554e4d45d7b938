"""Names, labels and owner references of a job's children: deterministic, so the operator finds what it
made by computing it again, never by remembering it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from diloco.api.job import API_GROUP, API_VERSION, ISLAND_NAME_MAX, JOB_NAME_MAX, KIND, OPERATOR_SECRET_PREFIX

MANAGER = "diloco-operator"
"""Server-side-apply field manager, and the `app.kubernetes.io/managed-by` label value."""

LABEL_JOB = f"{API_GROUP}/job"
LABEL_ISLAND = f"{API_GROUP}/island"
LABEL_SHARD = f"{API_GROUP}/shard"
LABEL_ROLE = f"{API_GROUP}/role"
LABEL_COMPONENT = "app.kubernetes.io/component"
ANNOTATION_HASH = f"{API_GROUP}/applied-hash"
ANNOTATION_CONFIG_HASH = f"{API_GROUP}/config-hash"
ANNOTATION_TOKEN_HASH = f"{API_GROUP}/token-hash"
ANNOTATION_ROTATE_TOKEN = f"{API_GROUP}/rotate-token"
ANNOTATION_TLS_HASH = f"{API_GROUP}/tls-hash"
TOKEN_KEY_SECRET = f"{OPERATOR_SECRET_PREFIX}operator-token-key"
"""The Secret, in the operator's namespace, holding the key every job's token derives from."""

COMPONENT_SYNCER = "syncer"
COMPONENT_ISLAND = "island"
COMPONENT_EXPORT = "export"

CONFIG_KEY = "training.json"
TOKEN_KEY = "token"
TRAINER_CONTAINER = "trainer"
SYNCER_CONTAINER = "syncer"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
REVISION_LABEL = "controller-revision-hash"


@dataclass(frozen=True)
class JobRef:
    """The identity of a DiLoCoJob: enough to name, label and own its children."""

    name: str
    namespace: str
    uid: str
    token_rotation: str = ""
    """The job's `diloco.dev/rotate-token` annotation (see `tokens.job_token`)."""

    def owner_reference(self) -> dict[str, object]:
        """Makes the job the children's controller, so deleting it garbage-collects them."""
        return {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def config_map_name(job: str) -> str:
    return f"{job}-config"


def token_secret_name(job: str) -> str:
    """The Secret of the job's token. Every Secret the operator makes is named `diloco-*`, a prefix no field of
    a job may name (`diloco.api.job.SecretName`): one job's pods never mount another's credentials."""
    return f"{OPERATOR_SECRET_PREFIX}{job}-token"


def tls_secret_name(job: str) -> str:
    """The Secret of the certificates the operator makes for a job that names none (its CA's key is in none)."""
    return f"{OPERATOR_SECRET_PREFIX}{job}-tls"


def network_policy_name(job: str) -> str:
    return f"{job}-syncers"


def syncer_name(job: str, shard: int) -> str:
    """Service, Deployment and PersistentVolumeClaim of one shard."""
    return f"{job}-syncer-{shard}"


ISLAND_CHILD_MAX = JOB_NAME_MAX + 1 + ISLAND_NAME_MAX
"""The longest island child name, the cap diloco/api/job.py keeps StatefulSet names within."""
DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
SUFFIX_CHARS = 4
"""Base-36 digest characters that tell apart islands whose names contain '-' (36**4: 1.7 million)."""


def _suffix(job: str, island: str) -> str:
    """`0` and a digest of both names: a last segment that no island name (a letter first) and no shard
    index (no leading zero) can be."""
    value = int.from_bytes(hashlib.sha256(f"{job}\0{island}".encode()).digest()[:8], "big")
    chars = []
    for _ in range(SUFFIX_CHARS):
        value, digit = divmod(value, len(DIGITS))
        chars.append(DIGITS[digit])
    return "0" + "".join(chars)


def island_name(job: str, island: str) -> str:
    """StatefulSet and headless Service of one island: `<job>-<island>` when the island's name has no '-',
    so the last '-' splits it back into job and island and no two jobs' islands share a name (nor one a
    shard's `<job>-syncer-<i>`, whose last segment is digits). An island whose name has a '-' could be
    read two ways (job `a` island `b-x`, job `a-b` island `x`): its name ends in `_suffix` instead."""
    if "-" not in island:
        return f"{job}-{island}"
    suffix = _suffix(job, island)
    return f"{f'{job}-{island}'[: ISLAND_CHILD_MAX - len(suffix) - 1]}-{suffix}"


def job_selector(job: str) -> dict[str, str]:
    """The label every child of the job carries: one list call per kind finds them all."""
    return {LABEL_JOB: job}


def common_labels(job: str, component: str | None, role: str) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "diloco",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/managed-by": MANAGER,
        LABEL_JOB: job,
        LABEL_ROLE: role,
    }
    if component:
        labels[LABEL_COMPONENT] = component
    return labels


def island_selector(job: str, island: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_ISLAND: island}


def island_labels(job: str, island: str) -> dict[str, str]:
    return {**common_labels(job, COMPONENT_ISLAND, "trainer"), LABEL_ISLAND: island}


def shard_selector(job: str, shard: int) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_SHARD: str(shard)}


def shard_labels(job: str, shard: int) -> dict[str, str]:
    return {**common_labels(job, COMPONENT_SYNCER, "syncer"), LABEL_SHARD: str(shard)}


def export_job_name(job: str) -> str:
    """The batch Job that writes a succeeded job's model to its export volume."""
    return f"{job}-export"


def export_labels(job: str) -> dict[str, str]:
    return common_labels(job, COMPONENT_EXPORT, "export")


def syncer_address(job: str, namespace: str, shard: int, port: int) -> str:
    """host:port of a shard's Service, resolvable from any pod through the cluster's DNS search path."""
    return f"{syncer_name(job, shard)}.{namespace}.svc:{port}"


def rank0_address(job: str, namespace: str, island: str) -> str:
    """DNS name of an island's ordinal-0 pod in its headless Service (torch.distributed MASTER_ADDR)."""
    sts = island_name(job, island)
    return f"{sts}-0.{sts}.{namespace}.svc"
