"""Names, labels and owner references of a job's children: deterministic, so the operator finds what it
made by computing it again, never by remembering it."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.api.job import API_GROUP, API_VERSION, KIND

MANAGER = "diloco-operator"
"""Server-side-apply field manager, and the `app.kubernetes.io/managed-by` label value."""

LABEL_JOB = f"{API_GROUP}/job"
LABEL_ISLAND = f"{API_GROUP}/island"
LABEL_SHARD = f"{API_GROUP}/shard"
LABEL_ROLE = f"{API_GROUP}/role"
ANNOTATION_HASH = f"{API_GROUP}/applied-hash"
ANNOTATION_CONFIG_HASH = f"{API_GROUP}/config-hash"

COMPONENT_SYNCER = "syncer"
COMPONENT_ISLAND = "island"

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
    return f"{job}-token"


def network_policy_name(job: str) -> str:
    return f"{job}-syncers"


def syncer_name(job: str, shard: int) -> str:
    """Service, Deployment and PersistentVolumeClaim of one shard."""
    return f"{job}-syncer-{shard}"


def island_name(job: str, island: str) -> str:
    """StatefulSet and headless Service of one island."""
    return f"{job}-{island}"


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
        labels["app.kubernetes.io/component"] = component
    return labels


def island_selector(job: str, island: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_ISLAND: island}


def island_labels(job: str, island: str) -> dict[str, str]:
    return {**common_labels(job, COMPONENT_ISLAND, "trainer"), LABEL_ISLAND: island}


def shard_selector(job: str, shard: int) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_SHARD: str(shard)}


def shard_labels(job: str, shard: int) -> dict[str, str]:
    return {**common_labels(job, COMPONENT_SYNCER, "syncer"), LABEL_SHARD: str(shard)}


def syncer_address(job: str, namespace: str, shard: int, port: int) -> str:
    """host:port of a shard's Service, resolvable from any pod through the cluster's DNS search path."""
    return f"{syncer_name(job, shard)}.{namespace}.svc:{port}"


def rank0_address(job: str, namespace: str, island: str) -> str:
    """DNS name of an island's ordinal-0 pod in its headless Service (torch.distributed MASTER_ADDR)."""
    sts = island_name(job, island)
    return f"{sts}-0.{sts}.{namespace}.svc"
