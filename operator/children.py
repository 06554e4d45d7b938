"""Every child object of a DiLoCoJob, rendered as plain dicts from the spec: no API calls, no clock.

Per job: a ConfigMap (training config JSON), a Secret (the gRPC bearer token the islands present and the tokens
the shards accept, decided by the caller, see `tokens.py` and `policies/token_rotation.py`, and passed in; the
presented token's fingerprint annotates the island templates, so a new one rolls the islands, while the shards
read the accepted tokens again whenever the Secret changes, without a restart), the TLS Secret the operator makes
when the job names none (`job_tls.py`, whose certificates' fingerprint rolls the pods that mount them), and a
NetworkPolicy that admits only the job's own pods (and the operator) to the syncers, or anyone once they are
exposed outside the cluster.
Per syncer shard: a Service, a Deployment (one pod, Recreate, so two incarnations never share a
checkpoint), a PersistentVolumeClaim, and a GRPCRoute when the job exposes its shards through a Gateway
(`exposure.py`). Per island: a headless Service and a StatefulSet whose pods take their torch.distributed
ranks from the ordinal (one rank per accelerator, see `trainer_env`). A job training against another
cluster's shards (spec.remoteSyncers) has only its ConfigMap and islands, which mount the Secrets it names.
Replica counts come from the caller's decisions (`Scale`), so suspending, re-forming and finishing are
rendering the same objects with other numbers.

Each object carries `diloco.dev/applied-hash`, a digest of everything else in it: the operator applies
an object only when the live one carries another digest.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from diloco import pod_env
from diloco.api.job import (
    DiLoCoJobSpec,
    Exposure,
    IslandSpec,
    PodTemplateOverride,
    ResourceRequirements,
    Toleration,
    TrainerSpec,
    VolumeRequest,
    validate_job_name,
)
from diloco.core.config import Precision
from diloco.operator import naming as n
from diloco.operator.exposure import grpc_route, service_type, shard_targets
from diloco.operator.job_tls import JobTls
from diloco.operator.overrides import merge
from diloco.operator.tokens import ACCEPTED_KEY, JobTokens, fingerprint

CONFIG_DIR = "/etc/diloco"
TOKEN_DIR = "/var/run/secrets/diloco"
CHECKPOINT_DIR = "/var/lib/diloco"
CONFIG_FILE = f"{CONFIG_DIR}/{n.CONFIG_KEY}"
TOKEN_FILE = f"{TOKEN_DIR}/{n.TOKEN_KEY}"
CHECKPOINT_VOLUME = "checkpoints"
EXPORT_DIR = "/export"
SHARD_CHECKPOINTS_DIR = "/shards"
EXPORT_ATTEMPTS = 3
RUN_AS = 10001
WORKER_COMMAND = ("diloco-worker",)
SYNCER_COMMAND = ("diloco-syncer",)
DEFAULT_DATA = "stdlib"
TRAINER_GRACE_SECONDS = pod_env.DEFAULT_GRACE_SECONDS
"""Seconds an island pod has after SIGTERM unless its pod template sets terminationGracePeriodSeconds: the
built-in worker finishes its step, pushes its last steps and says Leave within them."""

SPOT_TOLERATIONS: tuple[dict[str, str], ...] = (
    {"key": "cloud.google.com/gke-spot", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "cloud.google.com/gke-preemptible", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "karpenter.sh/capacity-type", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "eks.amazonaws.com/capacityType", "operator": "Exists", "effect": "NoSchedule"},
)
"""Taints that cloud providers and common provisioners put on spot/preemptible nodes."""


@dataclass(frozen=True)
class OperatorRef:
    """Where the operator's pods run, so the NetworkPolicy lets them call the syncers' Status RPC."""

    namespace: str
    pod_labels: Mapping[str, str] = field(default_factory=lambda: {"app.kubernetes.io/name": "diloco-operator"})


@dataclass(frozen=True)
class Scale:
    """Replicas decided for this pass: per island name, and for every syncer shard (0 or 1); and whether
    the job's model export (spec.export) is to run."""

    islands: Mapping[str, int]
    syncers: int
    export: bool = False


def digest(obj: Any) -> str:
    """A short, stable digest of a JSON-able value."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _stamped(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"].setdefault("annotations", {})[n.ANNOTATION_HASH] = digest(obj)
    return obj


def _metadata(job: n.JobRef, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": job.namespace, "labels": labels, "ownerReferences": [job.owner_reference()]}


def _tolerations(items: list[Toleration]) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in items]


def _resources(requirements: ResourceRequirements, extra: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Quantities as strings, the form the API server returns, so applied and live objects compare equal."""
    out: dict[str, Any] = {}
    for kind in ("requests", "limits"):
        values = {**getattr(requirements, kind), **(extra or {})}
        if values:
            out[kind] = {name: str(quantity) for name, quantity in values.items()}
    return out


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security(read_only_root: bool) -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
    }


def _overridden(template: dict[str, Any], override: PodTemplateOverride | None) -> dict[str, Any]:
    """The template with the job's override merged last. The override cannot set security settings (the API
    model allows none); a container it adds gets the same confinement as the operator's own."""
    if override is None:
        return template
    merged: dict[str, Any] = merge(template, override.patch())
    for container in merged["spec"]["containers"]:
        container.setdefault("securityContext", _container_security(read_only_root=False))
    return merged


def _env(values: Mapping[str, str]) -> list[dict[str, Any]]:
    return [{"name": key, "value": value} for key, value in values.items()]


def _shared_volumes(job: str, spec: DiLoCoJobSpec) -> list[dict[str, Any]]:
    """The config, and the token: the job's own Secret, or the remote shards' token Secret as the job names
    it (until it exists the kubelet holds the pods back rather than start them without a token)."""
    remote = spec.remote_syncers
    token = remote.token_secret if remote is not None else n.token_secret_name(job)
    return [
        {"name": "config", "configMap": {"name": n.config_map_name(job)}},
        {"name": "token", "secret": {"secretName": token, "defaultMode": 0o440}},
    ]


def _shared_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True},
    ]


def _shared_env(token_key: str = n.TOKEN_KEY) -> dict[str, str]:
    """Where the config and the token are: the token the islands present, or (`ACCEPTED_KEY`) the shards'
    file of every token they accept."""
    return {pod_env.CONFIG_FILE: CONFIG_FILE, pod_env.TOKEN_FILE: f"{TOKEN_DIR}/{token_key}"}


def config_hash(spec: DiLoCoJobSpec, *, syncer: bool) -> str:
    """Digest of the training config as a syncer or an island acts on it; it annotates their pod templates
    so a config change rolls the pods it concerns, and only those."""
    return digest(spec.training.syncer_json() if syncer else spec.training.to_json())


def template_annotations(
    spec: DiLoCoJobSpec, token: str | None, tls_fingerprint: str, *, syncer: bool
) -> dict[str, str]:
    """What rolls a pod when it changes: the training config, the token an island presents (a syncer's pods,
    which re-read the tokens they accept, are not rolled by a new one: `token` None), and the certificates its
    pods mount (`JobTls.fingerprint`)."""
    held = {} if token is None else {n.ANNOTATION_TOKEN_HASH: fingerprint(token)}
    return {n.ANNOTATION_CONFIG_HASH: config_hash(spec, syncer=syncer), **held, n.ANNOTATION_TLS_HASH: tls_fingerprint}


def config_map(job: n.JobRef, spec: DiLoCoJobSpec) -> dict[str, Any]:
    return _stamped(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(job, n.config_map_name(job.name), n.common_labels(job.name, None, "config")),
            "data": {n.CONFIG_KEY: spec.training.to_json()},
        }
    )


def token_secret(job: n.JobRef, tokens: JobTokens) -> dict[str, Any]:
    """The token the islands present (`token`) and, one per line, those the shards accept (`accepted`)."""
    return _stamped(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _metadata(job, n.token_secret_name(job.name), n.common_labels(job.name, None, "token")),
            "type": "Opaque",
            "data": {key: base64.b64encode(value.encode()).decode() for key, value in tokens.secret_data().items()},
        }
    )


def tls_secret(job: n.JobRef, made: Mapping[str, bytes]) -> dict[str, Any]:
    """The CA and certificates the operator made for a job that names no Secret (`job_tls`)."""
    return _stamped(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _metadata(job, n.tls_secret_name(job.name), n.common_labels(job.name, None, "tls")),
            "type": "Opaque",
            "data": {key: base64.b64encode(value).decode() for key, value in sorted(made.items())},
        }
    )


def syncer_service(job: n.JobRef, spec: DiLoCoJobSpec, shard: int) -> dict[str, Any]:
    """A shard's Service. Exposed outside the cluster (NodePort, LoadBalancer), it carries the gRPC port
    alone: a Service's type applies to every port it lists, and the metrics, open to the cluster's scrapers,
    are no business of other datacenters (scrapers reach them at the pod's metrics port)."""
    kind = service_type(spec)
    ports = [
        {
            "name": "grpc",
            "port": spec.syncer.port,
            "targetPort": "grpc",
            "protocol": "TCP",
            "appProtocol": "kubernetes.io/h2c",
        }
    ]
    if kind == Exposure.CLUSTER_IP.value:
        ports.append({"name": "metrics", "port": spec.syncer.metrics_port, "targetPort": "metrics", "protocol": "TCP"})
    return _stamped(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(job, n.syncer_name(job.name, shard), n.shard_labels(job.name, shard)),
            "spec": {"type": kind, "selector": n.shard_selector(job.name, shard), "ports": ports},
        }
    )


def _claim_spec(request: VolumeRequest) -> dict[str, Any]:
    """A PersistentVolumeClaim's spec: one node's volume of the size and StorageClass asked for."""
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": str(request.size)}},
    }
    if request.storage_class_name:
        claim["storageClassName"] = request.storage_class_name
    return claim


def syncer_claim(job: n.JobRef, spec: DiLoCoJobSpec, shard: int) -> dict[str, Any]:
    return _stamped(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": _metadata(job, n.syncer_name(job.name, shard), n.shard_labels(job.name, shard)),
            "spec": _claim_spec(spec.syncer.checkpoint),
        }
    )


def _grpc_probe(port: int, period: int, failures: int) -> dict[str, Any]:
    return {"grpc": {"port": port}, "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": 2}


def shard_threads(spec: DiLoCoJobSpec) -> int | None:
    """The cores a syncer shard works on: its CPU request (the cores it is sure of; beyond them its threads
    would wait on each other), else its limit, in whole cores and at least one. A shard decodes, merges and
    encodes whole fragments on these; torch would otherwise start a thread per core of the node. None: no CPU
    named, and the shard takes every CPU it may run on."""
    cpu = spec.syncer.resources.requests.get("cpu") or spec.syncer.resources.limits.get("cpu")
    if cpu is None:
        return None
    return max(1, int(parse_quantity(str(cpu))))


def declared_islands(spec: DiLoCoJobSpec) -> int | None:
    """The most islands a round of the shards' merges is made of: the job's own, when they are all the
    shards serve. None when the shards are exposed outside the cluster, where islands of other clusters' jobs
    train against them too and no spec here says how many."""
    if spec.syncer.expose.type is not Exposure.CLUSTER_IP:
        return None
    return len(spec.islands)


def syncer_deployment(job: n.JobRef, spec: DiLoCoJobSpec, shard: int, replicas: int, tls: JobTls) -> dict[str, Any]:
    syncer = spec.syncer
    labels = n.shard_labels(job.name, shard)
    env = {
        **_shared_env(ACCEPTED_KEY),
        **tls.env(syncer=True),
        "DILOCO_HEALTH_PORT": str(syncer.health_port),
        "DILOCO_SHARD_INDEX": str(shard),
        "DILOCO_NUM_SHARDS": str(syncer.shards),
        "DILOCO_SYNCER_PORT": str(syncer.port),
        "DILOCO_METRICS_PORT": str(syncer.metrics_port),
        "DILOCO_CHECKPOINT_DIR": CHECKPOINT_DIR,
        "DILOCO_CHECKPOINT_INTERVAL": f"{syncer.checkpoint.interval_seconds:g}",
    }
    if (threads := shard_threads(spec)) is not None:
        env |= {"DILOCO_SYNCER_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    if (declared := declared_islands(spec)) is not None:
        env["DILOCO_ISLANDS"] = str(declared)
    container = {
        "name": n.SYNCER_CONTAINER,
        "image": spec.syncer_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(SYNCER_COMMAND),
        "env": _env(env),
        "ports": [
            {"name": "grpc", "containerPort": syncer.port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": syncer.metrics_port, "protocol": "TCP"},
            {"name": "health", "containerPort": syncer.health_port, "protocol": "TCP"},
        ],
        # A shard loads its whole checkpoint before it serves: the startup probe allows ten minutes. The
        # kubelet's gRPC probes cannot speak TLS: they ask the plaintext health port.
        "startupProbe": _grpc_probe(syncer.health_port, period=5, failures=120),
        "readinessProbe": _grpc_probe(syncer.health_port, period=5, failures=2),
        "livenessProbe": _grpc_probe(syncer.health_port, period=10, failures=6),
        "resources": _resources(syncer.resources),
        "securityContext": _container_security(read_only_root=True),
        "volumeMounts": [
            {"name": CHECKPOINT_VOLUME, "mountPath": CHECKPOINT_DIR},
            *_shared_mounts(),
            *tls.mounts(),
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        # SIGTERM makes the shard write a final, clean checkpoint.
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": [
            {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": n.syncer_name(job.name, shard)}},
            *_shared_volumes(job.name, spec),
            *tls.volumes(job, syncer=True),
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    if syncer.node_selector:
        pod_spec["nodeSelector"] = dict(syncer.node_selector)
    if syncer.tolerations:
        pod_spec["tolerations"] = _tolerations(syncer.tolerations)
    if syncer.priority_class_name:
        pod_spec["priorityClassName"] = syncer.priority_class_name
    template = {
        "metadata": {
            "labels": labels,
            "annotations": template_annotations(spec, None, tls.fingerprint(job, syncer=True), syncer=True),
        },
        "spec": pod_spec,
    }
    template = _overridden(template, syncer.pod_template)
    return _stamped(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _metadata(job, n.syncer_name(job.name, shard), labels),
            "spec": {
                "replicas": replicas,
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": n.shard_selector(job.name, shard)},
                "template": template,
            },
        }
    )


def island_service(job: n.JobRef, spec: DiLoCoJobSpec, island: IslandSpec) -> dict[str, Any]:
    """Headless: gives every pod a stable DNS name, published before it is ready, for the rendezvous."""
    return _stamped(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(job, n.island_name(job.name, island.name), n.island_labels(job.name, island.name)),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": n.island_selector(job.name, island.name),
                "ports": [
                    {
                        "name": "rendezvous",
                        "port": spec.trainer.rendezvous_port,
                        "targetPort": "rendezvous",
                        "protocol": "TCP",
                    },
                ],
            },
        }
    )


def island_grace_seconds(island: IslandSpec) -> int:
    """The island pods' terminationGracePeriodSeconds: the pod template's, else the default."""
    override = island.pod_template.spec.termination_grace_period_seconds if island.pod_template else None
    return TRAINER_GRACE_SECONDS if override is None else override


def threads_per_rank(island: IslandSpec) -> int | None:
    """CPU threads for each rank: the pod's CPU (its limit, else its request) shared among its ranks. torch
    otherwise starts a thread per core of the node however little CPU the pod has, and a pod of one CPU on a
    many-core node then runs many times slower than with one thread. None: the island names no CPU."""
    cpu = island.resources.limits.get("cpu") or island.resources.requests.get("cpu")
    if cpu is None:
        return None
    return max(1, int(parse_quantity(str(cpu)) // max(1, island.accelerators_per_pod)))


def builtin_model_env(trainer: TrainerSpec) -> dict[str, str]:
    """The model and tokenizer as the built-in worker and `diloco export` read them (DILOCO_MODEL, a preset, a
    path or the inline configuration; DILOCO_INIT_FROM; DILOCO_TOKENIZER)."""
    values = {pod_env.MODEL: trainer.model_argument}
    if trainer.init_from is not None:
        values[pod_env.INIT_FROM] = trainer.init_from
    if trainer.tokenizer is not None:
        values[pod_env.TOKENIZER] = trainer.tokenizer
    return values


def trainer_env(job: n.JobRef, spec: DiLoCoJobSpec, island: IslandSpec) -> list[dict[str, Any]]:
    """DILOCO_* for `Learner.from_env` and the built-in worker, and torch.distributed's static rendezvous,
    whose master is the island's ordinal-0 pod. The world is every rank of the island: one per accelerator
    of every pod (one per pod without accelerators). The pod's NODE_RANK is its StatefulSet ordinal; a pod
    of one rank also gets RANK (the same number), while the ranks of a pod of N are numbered ordinal x N +
    local rank by the pod's launcher (the built-in worker's, or torchrun's). The pod's grace period goes
    down too, so that one setting bounds the worker's last pushes after SIGTERM."""
    checkpoint = island.checkpoint
    pod = pod_env.IslandPod(
        job=job.name,
        island=island.name,
        syncers=shard_targets(job, spec),
        config_file=CONFIG_FILE,
        token_file=TOKEN_FILE,
        metrics_port=spec.trainer.metrics_port,
        accelerators_per_pod=island.accelerators_per_pod,
        grace_seconds=island_grace_seconds(island),
        checkpoint_dir=CHECKPOINT_DIR,
        checkpoint_every=checkpoint.checkpoint_every if checkpoint is not None else None,
        threads=threads_per_rank(island),
        world_size=island.replicas * max(1, island.accelerators_per_pod),
        master_addr=n.rank0_address(job.name, job.namespace, island.name),
        master_port=spec.trainer.rendezvous_port,
        trainer=builtin_trainer_env(spec, island),
    )
    ordinal = {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{n.POD_INDEX_LABEL}']"}}}
    return [
        *_env(pod.variables()),
        *({"name": name, **ordinal} for name in pod.ordinal_variables),
        {"name": pod_env.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]


def builtin_trainer_env(spec: DiLoCoJobSpec, island: IslandSpec) -> dict[str, str]:
    """The built-in trainer's settings (`diloco-worker`), none for a command of one's own: the model, the data
    and the island's own share of it (its place among the job's islands), the precision."""
    trainer = spec.trainer
    if not trainer.builtin:
        return {}
    values = builtin_model_env(trainer) | {
        pod_env.DATA: trainer.data or DEFAULT_DATA,
        pod_env.DATA_SHARD: str(next(i for i, own in enumerate(spec.islands) if own.name == island.name)),
        pod_env.DATA_SHARDS: str(len(spec.islands)),
    }
    if trainer.text_field is not None:
        values[pod_env.TEXT_FIELD] = trainer.text_field
    return values | {
        pod_env.PRECISION: (trainer.precision or Precision.AUTO).value,
        pod_env.ACTIVATION_CHECKPOINTING: "1" if trainer.activation_checkpointing else "0",
    }


TRAINER_READINESS_PATH = "/readyz"
"""What a trainer's `Learner` (diloco-worker's or a custom command's, `Learner.from_env`) answers on its
metrics port: 200 while the rank trains as part of the job (it joined every syncer shard, took the global
model from them, and finished a step recently), 503 otherwise (see diloco.worker.metrics)."""


def _trainer_readiness(port: int) -> dict[str, Any]:
    """Every trainer is Ready while it trains, so an island that cannot reach its shards, crash-loops or
    hangs is never Ready. No liveness probe: a slow step is not a dead process, and a kill would be charged
    to the restart budget. A custom command is one that trains with `Learner.from_env` (spec.trainer), which
    serves the path: it gets the same probe."""
    return {
        "httpGet": {"path": TRAINER_READINESS_PATH, "port": port},
        "periodSeconds": 5,
        "failureThreshold": 3,
        "timeoutSeconds": 2,
    }


def island_template(job: n.JobRef, spec: DiLoCoJobSpec, island: IslandSpec, token: str, tls: JobTls) -> dict[str, Any]:
    """The pod template of an island, with the island's pod-template override merged in last."""
    accelerators = {island.accelerator_resource: island.accelerators_per_pod} if island.accelerators_per_pod else None
    container = {
        "name": n.TRAINER_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(spec.trainer.command or WORKER_COMMAND),
        "env": [*trainer_env(job, spec, island), *_env(tls.env(syncer=False))],
        "ports": [
            {"name": "rendezvous", "containerPort": spec.trainer.rendezvous_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": spec.trainer.metrics_port, "protocol": "TCP"},
        ],
        "readinessProbe": _trainer_readiness(spec.trainer.metrics_port),
        "resources": _resources(island.resources, accelerators),
        "securityContext": _container_security(read_only_root=False),
        "volumeMounts": [
            *_shared_mounts(),
            *tls.mounts(),
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": CHECKPOINT_VOLUME, "mountPath": CHECKPOINT_DIR},
        ],
    }
    if spec.trainer.args:
        container["args"] = list(spec.trainer.args)
    tolerations = _tolerations(island.tolerations) + (list(SPOT_TOLERATIONS) if island.spot else [])
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        "terminationGracePeriodSeconds": TRAINER_GRACE_SECONDS,
        "containers": [container],
        # Shared memory for data loaders and NCCL, which the container runtime's 64 MiB default starves.
        "volumes": [
            *_shared_volumes(job.name, spec),
            *tls.volumes(job, syncer=False),
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            # The island's optimizer checkpoints (diloco.worker.island_checkpoint): a trainer container the
            # kubelet restarts in its pod resumes warm from them; with island.checkpoint, a replaced pod too
            # (the StatefulSet's claim of that name, `island_statefulset`).
            *([{"name": CHECKPOINT_VOLUME, "emptyDir": {}}] if island.checkpoint is None else []),
        ],
    }
    if island.node_selector:
        pod_spec["nodeSelector"] = dict(island.node_selector)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if island.affinity:
        pod_spec["affinity"] = island.affinity
    if island.priority_class_name:
        pod_spec["priorityClassName"] = island.priority_class_name
    template = {
        "metadata": {
            "labels": n.island_labels(job.name, island.name),
            "annotations": template_annotations(spec, token, tls.fingerprint(job, syncer=False), syncer=False),
        },
        "spec": pod_spec,
    }
    return _overridden(template, island.pod_template)


def island_statefulset(
    job: n.JobRef, spec: DiLoCoJobSpec, island: IslandSpec, replicas: int, token: str, tls: JobTls
) -> dict[str, Any]:
    """Parallel pod management: ranks start together. OnDelete updates: a template change is rolled out by
    the operator re-forming the whole island, never one rank at a time (which would break the
    torch.distributed world once per pod). With island.checkpoint, a claim per pod for its checkpoints, kept
    while the island is scaled down (a re-form scales it to zero) and deleted with the StatefulSet."""
    name = n.island_name(job.name, island.name)
    labels = n.island_labels(job.name, island.name)
    statefulset: dict[str, Any] = {
        "serviceName": name,
        "replicas": replicas,
        "podManagementPolicy": "Parallel",
        "updateStrategy": {"type": "OnDelete"},
        "selector": {"matchLabels": n.island_selector(job.name, island.name)},
        "template": island_template(job, spec, island, token, tls),
    }
    if island.checkpoint is not None:
        statefulset["volumeClaimTemplates"] = [
            {"metadata": {"name": CHECKPOINT_VOLUME, "labels": labels}, "spec": _claim_spec(island.checkpoint)}
        ]
        statefulset["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Retain"}
    return _stamped(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": _metadata(job, name, labels),
            "spec": statefulset,
        }
    )


def network_policy(job: n.JobRef, spec: DiLoCoJobSpec, operator: OperatorRef | None) -> dict[str, Any]:
    """The syncers' gRPC port admits the job's own pods and the operator, or every client once the shards are
    exposed outside the cluster (spec.syncer.expose: islands of other clusters come from anywhere, and TLS
    and the token are what keep strangers out); metrics stay open to scrapers."""
    peers: list[dict[str, Any]] = [{"podSelector": {"matchLabels": n.job_selector(job.name)}}]
    if operator is not None:
        peers.append(
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator.namespace}},
                "podSelector": {"matchLabels": dict(operator.pod_labels)},
            }
        )
    return _stamped(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(job, n.network_policy_name(job.name), n.common_labels(job.name, None, "network")),
            "spec": {
                "podSelector": {"matchLabels": {**n.job_selector(job.name), n.LABEL_COMPONENT: n.COMPONENT_SYNCER}},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        **({"from": peers} if spec.syncer.expose.type is Exposure.CLUSTER_IP else {}),
                        "ports": [{"port": spec.syncer.port, "protocol": "TCP"}],
                    },
                    {"ports": [{"port": spec.syncer.metrics_port, "protocol": "TCP"}]},
                ],
            },
        }
    )


def model_volumes(spec: DiLoCoJobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The mounts and volumes of the first island's trainer container that hold files (not emptyDir), read-only:
    where its config.json, tokenizer and initFrom folder are, which the export reads at the same paths."""
    template = spec.islands[0].pod_template
    if template is None or not spec.trainer.builtin:
        return [], []
    containers = [c for c in template.spec.containers if c.name == n.TRAINER_CONTAINER]
    volumes = {v.name: v for v in template.spec.volumes if v.empty_dir is None}
    mounts = [m for c in containers for m in c.volume_mounts if m.name in volumes]
    claimed = [
        volumes[name].model_dump(by_alias=True, exclude_none=True) for name in dict.fromkeys(m.name for m in mounts)
    ]
    for volume in claimed:
        if "persistentVolumeClaim" in volume:
            volume["persistentVolumeClaim"] = {**volume["persistentVolumeClaim"], "readOnly": True}
    return [{**m.model_dump(by_alias=True, exclude_none=True), "readOnly": True} for m in mounts], claimed


def export_job(job: n.JobRef, spec: DiLoCoJobSpec) -> dict[str, Any]:
    """The batch Job that writes a succeeded job's model: `diloco export` over the shards' final
    checkpoints (their volumes, mounted read-only once the shards have stopped) into the volume and folder
    spec.export names, with the job's training config recorded beside it, in Hugging Face's layout: it names the
    model and tokenizer as the islands do, and mounts the volumes the first island's trainer reads them from."""
    if spec.export is None:
        raise ValueError("the job names no export (spec.export)")
    shards = range(spec.syncer.shards)
    command = [
        "diloco",
        "export",
        f"{EXPORT_DIR}/{spec.export.path or job.name}",
        "--checkpoints",
        *(f"{SHARD_CHECKPOINTS_DIR}/{shard}" for shard in shards),
        "--config",
        f"{CONFIG_DIR}/{n.CONFIG_KEY}",
    ]
    trainer_mounts, trainer_volumes = model_volumes(spec)
    container = {
        "name": n.COMPONENT_EXPORT,
        "image": spec.syncer_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": command,
        "resources": _resources(spec.syncer.resources),
        "securityContext": _container_security(read_only_root=True),
        "volumeMounts": [
            *(
                {"name": f"shard-{shard}", "mountPath": f"{SHARD_CHECKPOINTS_DIR}/{shard}", "readOnly": True}
                for shard in shards
            ),
            {"name": "export", "mountPath": EXPORT_DIR},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            *trainer_mounts,
        ],
    }
    if spec.trainer.builtin:  # the model and tokenizer the islands trained, named as they were named
        container["env"] = _env({**builtin_model_env(spec.trainer), "HF_HUB_OFFLINE": "1"})
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            *(
                {
                    "name": f"shard-{shard}",
                    "persistentVolumeClaim": {"claimName": n.syncer_name(job.name, shard), "readOnly": True},
                }
                for shard in shards
            ),
            {"name": "export", "persistentVolumeClaim": {"claimName": spec.export.claim_name}},
            {"name": "config", "configMap": {"name": n.config_map_name(job.name)}},
            {"name": "tmp", "emptyDir": {}},
            *trainer_volumes,
        ],
    }
    if spec.syncer.node_selector:
        pod_spec["nodeSelector"] = dict(spec.syncer.node_selector)
    if spec.syncer.tolerations:
        pod_spec["tolerations"] = _tolerations(spec.syncer.tolerations)
    labels = n.export_labels(job.name)
    return _stamped(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": _metadata(job, n.export_job_name(job.name), labels),
            "spec": {
                "backoffLimit": EXPORT_ATTEMPTS - 1,
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        }
    )


def render_children(
    job: n.JobRef, spec: DiLoCoJobSpec, tokens: JobTokens, scale: Scale, operator: OperatorRef | None, *, tls: JobTls
) -> list[dict[str, Any]]:
    """Every child, in the order they are best created: config and credentials, then syncers, then islands;
    last the model's export once the job has succeeded and its shards have stopped. A job training against
    another cluster's shards (spec.remoteSyncers) has no syncers here, and its islands mount the token Secret
    it names (`tokens`, theirs, only fingerprints it)."""
    validate_job_name(job.name)
    children = [config_map(job, spec)]
    if spec.remote_syncers is None:
        children += [token_secret(job, tokens), network_policy(job, spec, operator)]
    if tls.made is not None:
        children.append(tls_secret(job, tls.made))
    for shard in range(spec.syncer.shards if spec.remote_syncers is None else 0):
        children += [
            syncer_claim(job, spec, shard),
            syncer_service(job, spec, shard),
            syncer_deployment(job, spec, shard, scale.syncers, tls),
        ]
        if spec.syncer.expose.type is Exposure.GRPC_ROUTE:
            children.append(_stamped(grpc_route(job, spec, shard)))
    for island in spec.islands:
        children += [
            island_service(job, spec, island),
            island_statefulset(job, spec, island, scale.islands.get(island.name, 0), tokens.presented, tls),
        ]
    if scale.export:
        children.append(export_job(job, spec))
    return children


def child_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    """Identity of a child within its job's namespace."""
    return obj["kind"], obj["metadata"]["name"]
