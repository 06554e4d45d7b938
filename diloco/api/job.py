"""The `DiLoCoJob` resource: its spec and status, the single source of truth for the CRD, the operator and
the examples.

`deploy/render.py` derives the CRD's OpenAPI schema from these models, so every description, default and
bound written here is what the API server documents and enforces. Rules that span fields are enforced twice:
by a pydantic validator (so `DiLoCoJobSpec.model_validate` refuses what the API server would) and by a CEL
rule (`x-kubernetes-validations`) in the model's JSON-schema extras. Those that relate knobs are stated once,
in `diloco.core.rules`, with both forms; the others are written here side by side. Both messages name the
field with its full path in the manifest.
"""

from __future__ import annotations

import datetime
import enum
import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator
from pydantic.config import JsonDict, JsonValue

from diloco.core.config import CamelModel, Precision, TrainingConfig
from diloco.core.island_id import ISLAND_ID_MAX_CHARS
from diloco.core.rules import QUORUM_WITHIN_ISLANDS, RULES, SHARDS_WITHIN_FRAGMENTS

API_GROUP = "diloco.dev"
API_VERSION = "v1alpha1"
KIND = "DiLoCoJob"
PLURAL = "dilocojobs"
SINGULAR = "dilocojob"
SHORT_NAMES = ("dj",)
CATEGORIES = ("diloco",)

# Children are named `<job>-<island>` (a StatefulSet: its pods carry `controller-revision-hash=<name>-<10
# chars>`, a label value of at most 63 characters, so the name stays within 52) and `<job>-syncer-<i>` (a
# Service, a DNS-1035 label). These caps keep every derived name legal.
JOB_NAME_MAX = 30
ISLAND_NAME_MAX = 21
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
RESERVED_ISLAND_NAME = r"^syncer-[0-9]+$"
MAX_ISLANDS = 512
MAX_SHARDS = 64
# The status keeps an accounting record per island pod, and the whole object (spec and status) must fit in one
# etcd value (1.5 MiB by default): at these bounds the largest status a job can have stays within
# STATUS_BYTES_BUDGET (tests/api/test_job_status_size.py builds it), leaving the rest to the spec.
MAX_JOB_PODS = 1536
STATUS_BYTES_BUDGET = 1 << 20
MAX_CONDITION_MESSAGE = 1024
# Kubernetes' quantity syntax without the minus sign: no resource or volume size is negative (the API server
# would refuse the child at every pass, long after it accepted the job).
QUANTITY = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
QUANTITY_MAX = 64
"""Characters of a quantity written as a string, where a CEL rule compares it: the API server estimates a rule's
cost from the longest value a field may hold (and takes an int-or-string for one of any length)."""
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
RELATIVE_PATH = r"^[A-Za-z0-9_][-A-Za-z0-9_.]*(/[A-Za-z0-9_][-A-Za-z0-9_.]*)*$"
"""A relative path whose segments do not start with a dot: no `..`, no way out of the volume."""
QUALIFIED_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)

JOB_NAME_RULE = {
    "rule": f"size(self.metadata.name) <= {JOB_NAME_MAX} && self.metadata.name.matches('{DNS_LABEL}')",
    "message": f"metadata.name must be a DNS-1035 label of at most {JOB_NAME_MAX} characters (lower-case "
    "letters, digits and '-', starting with a letter): it prefixes the names of the job's Services and "
    "StatefulSets",
    "fieldPath": ".metadata.name",
}


MSG_BUILTIN_OR_COMMAND = (
    "spec.trainer.model, modelConfig, initFrom, tokenizer, data, textField, precision and activationCheckpointing "
    "configure the built-in trainer and cannot be set together with spec.trainer.command"
)
MSG_MODEL_ONCE = "spec.trainer.model and spec.trainer.modelConfig name the model two ways: set one"
CONTAINER_PATH = r"^/.*[^/]$"
"""An absolute path inside the container (the image's files, or a volume the pod template mounts)."""
MSG_RESERVED_ISLAND = (
    "spec.islands[].name must not have the form syncer-<n>: <job>-syncer-<n> names the syncer shard Services"
)
MSG_JOB_PODS = (
    f"spec.islands[].replicas must add up to at most {MAX_JOB_PODS} pods: the job's status keeps a record of each, "
    "and the job must fit in one object of the API server"
)
MSG_ISLAND_VOLUME_FIXED = (
    "spec.islands[].checkpoint cannot be added to or removed from an island that exists, nor its size or "
    "storageClassName changed: they are its StatefulSet's volumeClaimTemplates, which Kubernetes keeps as "
    "created (checkpointEvery may change; or add the island under a new name)"
)
ISLAND_VOLUME_FIXED_RULE = (
    "has(self.checkpoint) == has(oldSelf.checkpoint) && (!has(self.checkpoint) || "
    "(self.checkpoint.size == oldSelf.checkpoint.size && "
    "(has(self.checkpoint.storageClassName) ? self.checkpoint.storageClassName : '') == "
    "(has(oldSelf.checkpoint.storageClassName) ? oldSelf.checkpoint.storageClassName : '')))"
)
MSG_SYNCER_PORTS = "spec.syncer.port, metricsPort and healthPort must differ"
MSG_TLS_SERVER_AND_CA = (
    "spec.tls.serverSecret and spec.tls.caSecret are named together, or neither (the operator then makes a CA "
    "for the job)"
)
MSG_TLS_CLIENT_SECRET = (
    "spec.tls.clientSecret is named exactly when spec.tls.mutual is set with the job's own Secrets "
    "(spec.tls.serverSecret): islands present its certificate"
)
MSG_REMOTE_SHARDS = "spec.syncer.shards must equal the number of spec.remoteSyncers.endpoints (one per shard)"
MSG_REMOTE_LOCAL_SYNCERS = (
    "spec.remoteSyncers replaces the job's own syncers: spec.syncer.image, podTemplate, priorityClassName, "
    "nodeSelector, tolerations and a spec.syncer.expose type other than ClusterIP cannot be set with it"
)
MSG_REMOTE_TLS = (
    "spec.remoteSyncers names its own CA and client certificate: spec.tls (which secures the job's own syncers) "
    "cannot be set with it"
)
MSG_REMOTE_EXPORT = "spec.export reads the job's own shards' volumes: it cannot be set with spec.remoteSyncers"
MSG_TLS_PLAINTEXT = "spec.tls.insecurePlaintext turns TLS off: it cannot be set with Secrets or spec.tls.mutual"


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """One `x-kubernetes-validations` entry; `field_path` points the API server's error at the field."""
    entry: JsonDict = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def validate_job_name(name: str) -> str:
    """The same check as the CRD's root CEL rule, for code that builds children without the API server."""
    if len(name) > JOB_NAME_MAX or not re.match(DNS_LABEL, name):
        raise ValueError(JOB_NAME_RULE["message"] + f", got {name!r}")
    return name


Quantity = Annotated[
    Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=QUANTITY)],
    Field(json_schema_extra={"x-kubernetes-int-or-string": True}),
]
"""A non-negative Kubernetes resource quantity: an integer or a string such as `500m`, `16Gi`."""

Command = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
"""A container command: at least one word, none of them empty (an empty word is never an executable)."""

FreeForm = Annotated[dict[str, Any], Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})]
"""An object passed through to Kubernetes as written (validated by the API server when it is applied)."""

OPERATOR_SECRET_PREFIX = "diloco-"
"""Every Secret the operator makes starts so: each job's token and certificates (`diloco-<job>-token`,
`diloco-<job>-tls`) and the key in its own namespace that every token derives from."""
MSG_OPERATOR_SECRET = (
    f"spec.*.podTemplate, spec.tls and spec.remoteSyncers must not name a Secret {OPERATOR_SECRET_PREFIX}*: those are "
    "the operator's (a job's token and certificates, the key every token derives from), and a job's pods reach its "
    "own credentials, never another job's"
)
SHARD_CLAIM_SUFFIX, ISLAND_CLAIM_PREFIX = "-syncer-[0-9]+$", "checkpoints-"
"""The forms of the PersistentVolumeClaims the operator makes: a shard's `<job>-syncer-<n>` and an island pod's
`checkpoints-<statefulset>-<n>`. Short, as the API server's cost estimate of the rule on every volume of every
island's pod template wants them."""
OPERATOR_CLAIM_RULE = f"!self.matches('{SHARD_CLAIM_SUFFIX}') && !self.startsWith('{ISLAND_CLAIM_PREFIX}')"
MSG_OPERATOR_CLAIM = (
    "spec.*.podTemplate volumes and spec.export.claimName must not name a PersistentVolumeClaim ending in "
    "-syncer-<n> or starting with checkpoints-: those are a job's shard and island checkpoints (<job>-syncer-<n>, "
    "checkpoints-<statefulset>-<n>), which no other job's pods read or write"
)


def _not_operators_secret(name: str) -> str:
    if name.startswith(OPERATOR_SECRET_PREFIX):
        raise ValueError(f"{MSG_OPERATOR_SECRET}, got {name!r}")
    return name


def _not_operators_claim(name: str) -> str:
    if re.search(SHARD_CLAIM_SUFFIX, name) or name.startswith(ISLAND_CLAIM_PREFIX):
        raise ValueError(f"{MSG_OPERATOR_CLAIM}, got {name!r}")
    return name


SecretName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=253,
        json_schema_extra={
            "x-kubernetes-validations": [cel(f"!self.startsWith('{OPERATOR_SECRET_PREFIX}')", MSG_OPERATOR_SECRET)]
        },
    ),
    AfterValidator(_not_operators_secret),
]
"""A Secret of the job's namespace that a job names: any but the operator's (MSG_OPERATOR_SECRET)."""

ClaimName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        json_schema_extra={"x-kubernetes-validations": [cel(OPERATOR_CLAIM_RULE, MSG_OPERATOR_CLAIM)]},
    ),
    AfterValidator(_not_operators_claim),
]
"""A PersistentVolumeClaim of the job's namespace that a job names: any but the operator's (MSG_OPERATOR_CLAIM)."""


class ModelSize(str, enum.Enum):
    """Presets of the built-in GPT-style trainer (see `diloco.worker.model.PRESETS`)."""

    TINY = "tiny"
    SMALL = "small"
    MEDIUM = "medium"
    LARGE = "large"
    XL = "xl"


PRESET_TENSORS: dict[ModelSize, int] = {
    ModelSize.TINY: 52,
    ModelSize.SMALL: 100,
    ModelSize.MEDIUM: 148,
    ModelSize.LARGE: 292,
    ModelSize.XL: 220,
}
"""Trainable tensors of each preset (`diloco.worker.model`; tests/worker/test_model.py checks they agree): a
fragment holds whole tensors, so the built-in trainer cannot cut a preset into more fragments than these."""

MSG_FRAGMENTS_WITHIN_TENSORS = (
    "spec.training.fragments (P) must not exceed the number of tensors of the built-in trainer's model preset ("
    + ", ".join(f"{size.value}: {count}" for size, count in PRESET_TENSORS.items())
    + "): every fragment holds at least one whole tensor"
)
FRAGMENTS_WITHIN_TENSORS_RULE = (
    "has(self.trainer.command) || has(self.trainer.modelConfig) "
    "|| (has(self.trainer.model) ? self.trainer.model.startsWith('/') : has(self.trainer.initFrom)) "
    "|| self.training.fragments <= {"
    + ", ".join(f"'{size.value}': {count}" for size, count in PRESET_TENSORS.items())
    + f"}}[has(self.trainer.model) ? self.trainer.model : '{ModelSize.TINY.value}']"
)


MODEL_NAME = f"^({'|'.join(size.value for size in ModelSize)})$|{CONTAINER_PATH}"
"""A preset's name, or the path of a config.json."""


class Toleration(CamelModel):
    """A Kubernetes toleration, as in a pod spec."""

    key: str | None = Field(None, description="Taint key the toleration applies to; empty with Exists: all.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal (default Equal).")
    value: str | None = Field(None, description="Taint value to match with the Equal operator.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; empty: all effects."
    )
    toleration_seconds: int | None = Field(
        None, ge=0, description="With NoExecute: seconds the pod stays bound after the taint appears."
    )


class ResourceRequirements(CamelModel):
    """Requests and limits of a container, as in a pod spec."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description="Minimum resources, e.g. cpu: 4.")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Maximum resources, e.g. memory: 64Gi.")


def _exactly_one(sources: tuple[str, ...], message: str) -> JsonDict:
    """The CEL rule of an object that sets exactly one of `sources` (camelCase names)."""
    return cel(" + ".join(f"(has(self.{source}) ? 1 : 0)" for source in sources) + " == 1", message)


def _count_set(model: CamelModel, fields: tuple[str, ...]) -> int:
    return sum(getattr(model, name) is not None for name in fields)


class SecretKeySelector(CamelModel):
    """One key of a Secret of the job's namespace (not one of the operator's)."""

    name: SecretName = Field(description="Secret name.")
    key: str = Field(min_length=1, description="Key in the Secret.")
    optional: bool | None = Field(None, description="Start without the variable when the Secret or key is missing.")


class ConfigMapKeySelector(CamelModel):
    """One key of a ConfigMap of the job's namespace."""

    name: str = Field(min_length=1, max_length=253, description="ConfigMap name.")
    key: str = Field(min_length=1, description="Key in the ConfigMap.")
    optional: bool | None = Field(None, description="Start without the variable when the map or key is missing.")


class FieldSelector(CamelModel):
    """A field of the pod (downward API), such as metadata.name or status.podIP."""

    field_path: str = Field(min_length=1, description="Path of the field, e.g. metadata.name.")
    api_version: str | None = Field(None, description="Version of the schema the path is written in (v1).")


class ResourceFieldSelector(CamelModel):
    """A container's resource request or limit (downward API)."""

    resource: str = Field(min_length=1, description="e.g. limits.cpu, requests.memory.")
    container_name: str | None = Field(None, description="Container whose resources; this one when unset.")
    divisor: Quantity | None = Field(None, description="Unit the value is expressed in (1 when unset).")


ENV_SOURCES = ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef")
MSG_ONE_ENV_SOURCE = (
    f"spec.*.podTemplate.spec.containers[].env[].valueFrom must set exactly one of {', '.join(ENV_SOURCES)}"
)


class EnvVarSource(CamelModel):
    """Where a variable's value comes from, as in a pod spec."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [_exactly_one(ENV_SOURCES, MSG_ONE_ENV_SOURCE)]}
    )

    secret_key_ref: SecretKeySelector | None = Field(None, description="A key of a Secret of the namespace.")
    config_map_key_ref: ConfigMapKeySelector | None = Field(None, description="A key of a ConfigMap.")
    field_ref: FieldSelector | None = Field(None, description="A field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(None, description="A request or limit of a container.")

    @model_validator(mode="after")
    def _one_source(self) -> EnvVarSource:
        if _count_set(self, ("secret_key_ref", "config_map_key_ref", "field_ref", "resource_field_ref")) != 1:
            raise ValueError(MSG_ONE_ENV_SOURCE)
        return self


class EnvVar(CamelModel):
    """An environment variable of a container, as in a pod spec."""

    name: str = Field(min_length=1, description="Variable name.")
    value: str | None = Field(None, description="Literal value.")
    value_from: EnvVarSource | None = Field(
        None, description="A secretKeyRef, configMapKeyRef, fieldRef or resourceFieldRef, as in a pod spec."
    )


class SecretEnvSource(CamelModel):
    """A Secret of the job's namespace (not one of the operator's) whose keys become variables."""

    name: SecretName = Field(description="Secret name.")
    optional: bool | None = Field(None, description="Start without them when the Secret is missing.")


class ConfigMapEnvSource(CamelModel):
    """A ConfigMap of the job's namespace whose keys become variables."""

    name: str = Field(min_length=1, max_length=253, description="ConfigMap name.")
    optional: bool | None = Field(None, description="Start without them when the ConfigMap is missing.")


ENV_FROM_SOURCES = ("secretRef", "configMapRef")
MSG_ONE_ENV_FROM_SOURCE = (
    "spec.*.podTemplate.spec.containers[].envFrom[] must set exactly one of secretRef, configMapRef"
)


class EnvFromSource(CamelModel):
    """A ConfigMap's or Secret's keys as variables, as in a pod spec."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [_exactly_one(ENV_FROM_SOURCES, MSG_ONE_ENV_FROM_SOURCE)]}
    )

    prefix: str | None = Field(None, description="Prepended to every key's variable name.")
    secret_ref: SecretEnvSource | None = Field(None, description="A Secret of the namespace.")
    config_map_ref: ConfigMapEnvSource | None = Field(None, description="A ConfigMap of the namespace.")

    @model_validator(mode="after")
    def _one_source(self) -> EnvFromSource:
        if _count_set(self, ("secret_ref", "config_map_ref")) != 1:
            raise ValueError(MSG_ONE_ENV_FROM_SOURCE)
        return self


class VolumeMount(CamelModel):
    """Where a container mounts one of the pod's volumes."""

    name: str = Field(min_length=1, description="Name of a volume of the pod.")
    mount_path: str = Field(min_length=1, description="Path inside the container.")
    read_only: bool | None = Field(None, description="Mount read-only.")
    sub_path: str | None = Field(None, description="Sub-path of the volume to mount instead of its root.")


MAX_OVERRIDE_ITEMS = 32
"""Items of each list an override holds (envFrom, volumes, mounts, a volume's keys, imagePullSecrets): more than
a pod needs, and a bound the API server's cost estimate of the CEL rules on them needs (it multiplies a rule's
cost by every list around it: islands, containers, env)."""
MAX_CONTAINERS, MAX_ENV = 8, 128
"""Containers an override changes or adds (the operator's and a few sidecars), and variables per container."""


class ContainerOverride(CamelModel):
    """Changes to a container of the pod, found by name; another name adds a container (a sidecar), which
    runs under the same security settings as the operator's containers."""

    name: str = Field(min_length=1, description="'trainer' or 'syncer' changes the operator's container.")
    image: str | None = Field(None, min_length=1, description="Container image.")
    command: Command | None = Field(None, description="Container command.")
    args: list[str] = Field(default_factory=list, description="Container arguments.")
    env: list[EnvVar] = Field(
        default_factory=list, max_length=MAX_ENV, description="Variables added or replaced, by name."
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list,
        max_length=MAX_OVERRIDE_ITEMS,
        description="ConfigMaps and Secrets whose keys become variables, as in a pod spec.",
    )
    resources: ResourceRequirements | None = Field(None, description="Requests and limits.")
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=MAX_OVERRIDE_ITEMS, description="Mounts added or replaced, by name."
    )


class KeyToPath(CamelModel):
    """A key of a ConfigMap or Secret written to a file of the given path."""

    key: str = Field(min_length=1, description="Key.")
    path: str = Field(min_length=1, pattern=RELATIVE_PATH, description="File, relative to the volume.")
    mode: int | None = Field(None, ge=0, le=0o777, description="Permission bits of the file.")


class SecretVolumeSource(CamelModel):
    """A Secret of the job's namespace (not one of the operator's) as files."""

    secret_name: SecretName = Field(description="Secret name.")
    items: list[KeyToPath] = Field(
        default_factory=list, max_length=MAX_OVERRIDE_ITEMS, description="Keys to write (every key when empty)."
    )
    default_mode: int | None = Field(None, ge=0, le=0o777, description="Permission bits of the files.")
    optional: bool | None = Field(None, description="Start without it when the Secret is missing.")


class ConfigMapVolumeSource(CamelModel):
    """A ConfigMap of the job's namespace as files."""

    name: str = Field(min_length=1, max_length=253, description="ConfigMap name.")
    items: list[KeyToPath] = Field(
        default_factory=list, max_length=MAX_OVERRIDE_ITEMS, description="Keys to write (every key when empty)."
    )
    default_mode: int | None = Field(None, ge=0, le=0o777, description="Permission bits of the files.")
    optional: bool | None = Field(None, description="Start without it when the ConfigMap is missing.")


class EmptyDirVolumeSource(CamelModel):
    """Scratch space that lives as long as the pod."""

    medium: Literal["", "Memory"] | None = Field(None, description="'Memory' for a tmpfs; the node's disk when unset.")
    size_limit: Quantity | None = Field(None, description="Most the volume may hold.")


class ClaimVolumeSource(CamelModel):
    """A PersistentVolumeClaim of the job's namespace (not one of the operator's)."""

    claim_name: ClaimName = Field(description="Claim name.")
    read_only: bool | None = Field(None, description="Mount read-only.")


class SecretReference(CamelModel):
    """A Secret of the job's namespace (not one of the operator's), by name."""

    name: SecretName = Field(description="Secret name.")


class CsiVolumeSource(CamelModel):
    """An inline ephemeral volume of a CSI driver (a bucket, a dataset cache)."""

    driver: str = Field(min_length=1, max_length=253, description="Name of the CSI driver.")
    read_only: bool | None = Field(None, description="Mount read-only.")
    fs_type: str | None = Field(None, description="Filesystem type, if the driver asks for one.")
    volume_attributes: dict[str, str] = Field(default_factory=dict, description="The driver's own settings.")
    node_publish_secret_ref: SecretReference | None = Field(
        None, description="A Secret of the namespace the driver receives (not one of the operator's)."
    )


SAFE_VOLUME_SOURCES = ("emptyDir", "configMap", "secret", "persistentVolumeClaim", "csi")
"""Volume kinds an override may add: none reaches the node's filesystem or the API server's credentials."""

MSG_ONE_VOLUME_SOURCE = (
    f"spec.*.podTemplate.spec.volumes[] must each set exactly one of {', '.join(SAFE_VOLUME_SOURCES)}"
)


class VolumeOverride(CamelModel):
    """A volume added to (or replacing, by name, one of) the pod's volumes, of a kind that stays inside the
    pod: no hostPath, no projected service-account token, and none of the operator's Secrets or claims."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [_exactly_one(SAFE_VOLUME_SOURCES, MSG_ONE_VOLUME_SOURCE)]}
    )

    name: str = Field(min_length=1, description="Volume name, referred to by volumeMounts.")
    empty_dir: EmptyDirVolumeSource | None = Field(None, description="Scratch space (medium, sizeLimit).")
    config_map: ConfigMapVolumeSource | None = Field(None, description="A ConfigMap's keys as files.")
    secret: SecretVolumeSource | None = Field(None, description="A Secret's keys as files.")
    persistent_volume_claim: ClaimVolumeSource | None = Field(
        None, description="A PersistentVolumeClaim of the job's namespace (claimName, readOnly)."
    )
    csi: CsiVolumeSource | None = Field(None, description="An inline ephemeral CSI volume.")

    @model_validator(mode="after")
    def _one_source(self) -> VolumeOverride:
        if _count_set(self, ("empty_dir", "config_map", "secret", "persistent_volume_claim", "csi")) != 1:
            raise ValueError(MSG_ONE_VOLUME_SOURCE)
        return self


class PodSpecOverride(CamelModel):
    """The pod-spec fields an override may set. Host namespaces, host paths, security contexts, service
    accounts and node names are not among them: they are refused, never merged."""

    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations of the pods.")
    affinity: FreeForm | None = Field(None, description="Node, pod and anti-affinity, as in a pod spec.")
    topology_spread_constraints: list[FreeForm] = Field(
        default_factory=list, description="How the pods spread across zones or nodes, as in a pod spec."
    )
    priority_class_name: str | None = Field(None, min_length=1, description="PriorityClass of the pods.")
    termination_grace_period_seconds: int | None = Field(
        None, ge=0, description="Seconds a pod has to exit after SIGTERM."
    )
    image_pull_secrets: list[SecretReference] = Field(
        default_factory=list,
        max_length=MAX_OVERRIDE_ITEMS,
        description="Secrets with registry credentials for the pods' images.",
    )
    containers: list[ContainerOverride] = Field(
        default_factory=list, max_length=MAX_CONTAINERS, description="Containers changed or added."
    )
    volumes: list[VolumeOverride] = Field(
        default_factory=list, max_length=MAX_OVERRIDE_ITEMS, description="Volumes added or replaced."
    )


OPERATOR_KEY_PREFIX = f"{API_GROUP}/"
OPERATOR_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/component",
)
"""The standard labels the operator sets on a job's pods, beside its own `diloco.dev/` keys."""
MSG_OPERATOR_KEYS = (
    f"spec.*.podTemplate.metadata labels and annotations must not set the operator's keys ({OPERATOR_KEY_PREFIX}*, "
    f"{', '.join(OPERATOR_LABELS)}): they select the job's pods for its StatefulSets, Services and NetworkPolicy, and "
    "their fingerprints of the token, certificates and config roll them"
)
MAX_POD_METADATA = 64
"""Labels, and annotations, an override may add: a bound the API server's cost estimate of their rule needs."""
OPERATOR_KEYS_RULE = (
    f"self.all(k, !k.startsWith('{OPERATOR_KEY_PREFIX}') && !(k in [{', '.join(repr(k) for k in OPERATOR_LABELS)}]))"
)


def _without_operator_keys(values: dict[str, str]) -> dict[str, str]:
    taken = sorted(k for k in values if k.startswith(OPERATOR_KEY_PREFIX) or k in OPERATOR_LABELS)
    if taken:
        raise ValueError(f"{MSG_OPERATOR_KEYS}, got {', '.join(taken)}")
    return values


PodMetadata = Annotated[
    dict[str, str],
    Field(
        default_factory=dict,
        max_length=MAX_POD_METADATA,
        json_schema_extra={"x-kubernetes-validations": [cel(OPERATOR_KEYS_RULE, MSG_OPERATOR_KEYS)]},
    ),
    AfterValidator(_without_operator_keys),
]


class PodMetadataOverride(CamelModel):
    """Labels and annotations added to the pods; the operator's own keys are not among those they may set."""

    labels: PodMetadata = Field(description="Labels added to the pods.")
    annotations: PodMetadata = Field(description="Annotations added to the pods.")


class PodTemplateOverride(CamelModel):
    """What a job may change in the pods the operator generates: an allowlist, so a manifest cannot give its
    pods the node's network, processes or filesystem, root, or capabilities."""

    metadata: PodMetadataOverride = Field(default_factory=PodMetadataOverride, description="Pod labels, annotations.")
    spec: PodSpecOverride = Field(default_factory=PodSpecOverride, description="Pod spec fields.")

    def patch(self) -> dict[str, Any]:
        """The merge patch: only what was set (an empty list or map changes nothing)."""
        return self.model_dump(by_alias=True, exclude_defaults=True)


class TrainerSpec(CamelModel):
    """What each island pod runs: the built-in `diloco-worker` (a model and a data source) or a command of your
    own that uses `diloco.worker.Learner.from_env`."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.command) || (!has(self.model) && !has(self.modelConfig) && !has(self.initFrom) "
                    "&& !has(self.tokenizer) && !has(self.data) && !has(self.textField) && !has(self.precision) "
                    "&& !has(self.activationCheckpointing))",
                    MSG_BUILTIN_OR_COMMAND,
                ),
                cel("!(has(self.model) && has(self.modelConfig))", MSG_MODEL_ONCE),
            ]
        }
    )

    model: str | None = Field(
        None,
        max_length=4096,
        pattern=MODEL_NAME,
        description="Built-in trainer: a model preset (tiny, small, medium, large, xl), or the absolute path of "
        "a Hugging Face config.json (in the image, or on a volume the island's podTemplate mounts) of a "
        "transformers causal LM, built from the job's seed on every island (no weights are downloaded); tiny "
        "when unset (or initFrom's configuration).",
    )
    inline_model: FreeForm | None = Field(
        None,
        alias="modelConfig",
        description="Built-in trainer: a Hugging Face configuration inline (the contents of a config.json, with "
        "its model_type: llama, qwen2, gpt_neox, gemma, ...), instead of spec.trainer.model.",
    )
    init_from: str | None = Field(
        None,
        max_length=4096,
        pattern=CONTAINER_PATH,
        description="Built-in trainer: a Hugging Face checkpoint folder (config.json, safetensors) in the "
        "container to start from (continued pretraining); its configuration is the model's unless "
        "spec.trainer.model names one it fits.",
    )
    tokenizer: str | None = Field(
        None,
        max_length=4096,
        pattern=CONTAINER_PATH,
        description="Built-in trainer: a tokenizer.json (the tokenizers library's) in the container that "
        "tokenises text data; unset: the preset's (bytes for tiny and small, a BPE for the others).",
    )
    precision: Precision | None = Field(
        None,
        description="Built-in trainer: arithmetic of the forward and backward passes (auto: bf16 autocast on "
        "accelerators that have it, else fp32; auto when unset). Master weights, optimizer state and outer deltas "
        "stay fp32.",
    )
    activation_checkpointing: bool | None = Field(
        None,
        description="Built-in trainer: recompute each block's activations in the backward pass, trading about "
        "a third more compute for memory (for the larger models); off when unset.",
    )
    data: str | None = Field(
        None,
        min_length=1,
        description="Built-in trainer: the training set inside the container: 'stdlib' for the embedded corpus, "
        "a file, or a folder of shards read in path order: token files (.bin, .npy: diloco tokenize) or text "
        "(.txt, .jsonl, .parquet, tokenised as read). Each island reads its own share in order, its position "
        "kept with its checkpoint; stdlib when unset.",
    )
    text_field: str | None = Field(
        None, min_length=1, description="Built-in trainer: the text field of .jsonl and .parquet rows; text when unset."
    )
    command: Command | None = Field(
        None,
        description="Custom trainer: the container command, replacing diloco-worker. It receives the same "
        "DILOCO_* and rendezvous environment.",
    )
    args: list[str] = Field(default_factory=list, description="Arguments appended to the trainer command.")
    rendezvous_port: int = Field(
        29500, ge=1, le=65535, description="Port of torch.distributed rendezvous on each island's rank-0 pod."
    )
    metrics_port: int = Field(9090, ge=1, le=65535, description="Port of the trainer's Prometheus metrics.")

    @model_validator(mode="after")
    def _builtin_or_custom(self) -> TrainerSpec:
        builtin_only = (
            self.model,
            self.inline_model,
            self.init_from,
            self.tokenizer,
            self.data,
            self.text_field,
            self.precision,
            self.activation_checkpointing,
        )
        if self.command is not None and any(value is not None for value in builtin_only):
            raise ValueError(MSG_BUILTIN_OR_COMMAND)
        if self.model is not None and self.inline_model is not None:
            raise ValueError(MSG_MODEL_ONCE)
        if self.inline_model is not None and not isinstance(self.inline_model.get("model_type"), str):
            raise ValueError("spec.trainer.modelConfig is a Hugging Face configuration: it needs its model_type")
        return self

    @property
    def builtin(self) -> bool:
        """Whether the pods run the built-in trainer (no custom command)."""
        return self.command is None

    @property
    def preset(self) -> ModelSize | None:
        """The built-in trainer's model preset (tiny when nothing names a model); None with a custom command or
        a Hugging Face model (a config.json, an inline configuration, or initFrom's)."""
        if not self.builtin or self.inline_model is not None:
            return None
        if self.model is None:
            return None if self.init_from is not None else ModelSize.TINY
        return ModelSize(self.model) if self.model in {size.value for size in ModelSize} else None

    @property
    def model_argument(self) -> str:
        """The model as diloco-worker and diloco export take it (--model, DILOCO_MODEL): a preset, a path, or
        the inline configuration as JSON; empty for initFrom's own."""
        if self.inline_model is not None:
            return json.dumps(self.inline_model, sort_keys=True, separators=(",", ":"))
        if self.model is None and self.init_from is not None:
            return ""
        return self.model or ModelSize.TINY.value


class IslandSpec(CamelModel):
    """A learner: a StatefulSet of pods training one model replica with ordinary data parallelism, pushing
    fragment deltas to the syncers on its own schedule. Islands with different pod templates (node pools,
    accelerator generations, images) mix freely in one job."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"!self.name.matches('{RESERVED_ISLAND_NAME}')", MSG_RESERVED_ISLAND, ".name"),
                cel(ISLAND_VOLUME_FIXED_RULE, MSG_ISLAND_VOLUME_FIXED, ".checkpoint"),
            ]
        }
    )

    name: str = Field(
        max_length=ISLAND_NAME_MAX,
        pattern=DNS_LABEL,
        description=f"Island name, unique in the job: a DNS-1035 label of at most {ISLAND_NAME_MAX} "
        "characters. The island's StatefulSet and headless Service are named <job>-<name>.",
    )
    replicas: int = Field(
        1, ge=1, le=MAX_JOB_PODS, description="Pods in the island; they form one torch.distributed world."
    )
    accelerators_per_pod: int = Field(0, ge=0, le=64, description="Accelerators each pod requests (0: CPU only).")
    accelerator_resource: str = Field(
        "nvidia.com/gpu",
        pattern=QUALIFIED_NAME,
        description="Extended resource name of the accelerator, e.g. nvidia.com/gpu, amd.com/gpu, google.com/tpu.",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations added to the pods.")
    affinity: FreeForm | None = Field(None, description="Pod affinity, as in a pod spec.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Trainer container resources; the accelerators are added to requests and limits.",
    )
    spot: bool = Field(
        False,
        description="The island runs on spot/preemptible capacity: its pods tolerate the usual spot taints "
        "(GKE, AKS, EKS/Karpenter). Preemptions never count against the restart budget, spot or not.",
    )
    priority_class_name: str | None = Field(None, description="PriorityClass of the island's pods.")
    checkpoint: IslandCheckpoint | None = Field(
        None,
        description="A PersistentVolumeClaim per pod for the island's optimizer checkpoints, so that a pod "
        "deleted or lost with its node comes back warm; an emptyDir (lost with the pod) when unset. The claims "
        "are kept while the island is scaled down (a re-form, a suspend, the job's end: whenScaled Retain) and "
        "deleted with the job (whenDeleted Delete). Set when the island is created: it cannot be added, removed "
        "or resized later.",
    )
    pod_template: PodTemplateOverride | None = Field(
        None,
        description="A PodTemplateSpec fragment merged last into the generated template (RFC 7386 merge patch, "
        "except that lists of objects with a name, such as containers, env and volumes, merge item by "
        "name). The trainer container is named 'trainer'. Only the fields listed here may be set: "
        "placement, image, command, env, resources, volumes of safe kinds and their mounts, labels and "
        "annotations; the pod's security settings are the operator's.",
    )


class VolumeRequest(CamelModel):
    """The PersistentVolumeClaims the operator asks for: their size and StorageClass."""

    size: Quantity = Field("1Gi", description="Requested size of each volume.")
    storage_class_name: str | None = Field(
        None, max_length=253, description="StorageClass of the volumes; cluster default when unset."
    )


class CheckpointStorage(VolumeRequest):
    """The PersistentVolumeClaim each syncer shard keeps its fragments, momentum and versions in."""

    interval_seconds: float = Field(30.0, gt=0, description="Seconds between two checkpoints of a shard.")


class IslandCheckpoint(VolumeRequest):
    """The island's StatefulSet's volumeClaimTemplates, holding each pod's ranks' inner-optimizer checkpoints
    (`diloco.worker.island_checkpoint`), and how often they are written. Its size is a quantity string only:
    a CEL rule compares it (ISLAND_VOLUME_FIXED_RULE), within the API server's cost budget (QUANTITY_MAX)."""

    size: str = Field(
        "1Gi",
        pattern=QUANTITY,
        max_length=QUANTITY_MAX,
        description="Requested size of each volume, a quantity string such as 2Gi.",
    )
    checkpoint_every: int | None = Field(
        None,
        ge=1,
        description="Inner steps between two checkpoints of each rank, in the built-in trainer and in a "
        "custom command's Learner alike (DILOCO_CHECKPOINT_EVERY); 50 when unset.",
    )


class Exposure(str, enum.Enum):
    """How each syncer shard is reached: inside the cluster only, or from outside it too."""

    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"
    GRPC_ROUTE = "GRPCRoute"


MSG_EXPOSE_NODE_ADDRESS = "spec.syncer.expose.nodeAddress is set exactly when spec.syncer.expose.type is NodePort"
MSG_EXPOSE_ROUTE = (
    "spec.syncer.expose.gateway and spec.syncer.expose.domain are set exactly when spec.syncer.expose.type is GRPCRoute"
)
HOST = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*|[0-9a-fA-F.:]+)$"
"""A DNS name or an IPv4/IPv6 address, as a certificate's subject alternative name holds it."""


class GatewayRef(CamelModel):
    """The user's Gateway (Gateway API) a GRPCRoute attaches to, as a route's parentRef."""

    name: str = Field(min_length=1, max_length=253, description="Gateway name.")
    namespace: str | None = Field(
        None, min_length=1, max_length=63, description="Gateway namespace; the job's when unset."
    )
    section_name: str | None = Field(
        None, min_length=1, max_length=253, description="Listener of the Gateway to attach to; all when unset."
    )


class SyncerExposure(CamelModel):
    """How the shards are exposed. Each shard keeps its Service; NodePort and LoadBalancer make that Service of
    the type, with its gRPC port alone (the metrics port stays inside the cluster), GRPCRoute adds a Gateway
    API route per shard (hostname <job>-syncer-<n>.<domain>) to the user's Gateway. status.syncer.endpoints
    lists where each shard is reached, and the certificate the operator makes names those addresses."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.nodeAddress) == (self.type == 'NodePort')", MSG_EXPOSE_NODE_ADDRESS, ".nodeAddress"),
                cel(
                    "has(self.gateway) == (self.type == 'GRPCRoute') && has(self.domain) == (self.type == 'GRPCRoute')",
                    MSG_EXPOSE_ROUTE,
                    ".gateway",
                ),
            ]
        }
    )

    type: Exposure = Field(
        Exposure.CLUSTER_IP,
        description="ClusterIP (inside the cluster only), NodePort, LoadBalancer, or GRPCRoute (a route of the "
        "user's Gateway).",
    )
    node_address: str | None = Field(
        None,
        max_length=253,
        pattern=HOST,
        description="NodePort: the address (IP or DNS name) at which islands outside the cluster reach the nodes.",
    )
    gateway: GatewayRef | None = Field(None, description="GRPCRoute: the Gateway the routes attach to.")
    domain: str | None = Field(
        None,
        max_length=200,
        pattern=DNS_SUBDOMAIN,
        description="GRPCRoute: shard n is served at <job>-syncer-<n>.<domain>, a name the Gateway answers for.",
    )
    gateway_port: int = Field(443, ge=1, le=65535, description="GRPCRoute: port of the Gateway's listener.")

    @model_validator(mode="after")
    def _settings_of_the_type(self) -> SyncerExposure:
        if (self.node_address is not None) != (self.type is Exposure.NODE_PORT):
            raise ValueError(MSG_EXPOSE_NODE_ADDRESS)
        route = self.type is Exposure.GRPC_ROUTE
        if (self.gateway is not None) != route or (self.domain is not None) != route:
            raise ValueError(MSG_EXPOSE_ROUTE)
        return self


class SyncerSpec(CamelModel):
    """The CPU-only shards that merge fragment deltas; shard i owns fragments p with p mod shards = i."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.port != self.metricsPort && self.port != self.healthPort "
                    "&& self.metricsPort != self.healthPort",
                    MSG_SYNCER_PORTS,
                )
            ]
        }
    )

    shards: int = Field(
        1, ge=1, le=MAX_SHARDS, description="Syncer shards; at most spec.training.fragments. Immutable."
    )
    image: str | None = Field(None, min_length=1, description="Syncer image; spec.image when unset.")
    port: int = Field(50051, ge=1, le=65535, description="gRPC port of every shard.")
    metrics_port: int = Field(9090, ge=1, le=65535, description="Prometheus port of every shard.")
    health_port: int = Field(
        50052,
        ge=1,
        le=65535,
        description="Plaintext port serving grpc.health.v1 alone, for the kubelet's gRPC probes (which cannot "
        "speak TLS).",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Resources of each shard's container."
    )
    checkpoint: CheckpointStorage = Field(default_factory=CheckpointStorage, description="Per-shard checkpoint volume.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the shard pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations of the shard pods.")
    priority_class_name: str | None = Field(None, description="PriorityClass of the shard pods.")
    pod_template: PodTemplateOverride | None = Field(
        None,
        description="A PodTemplateSpec fragment merged into each shard's template, as for islands (the same "
        "fields may be set); the container is named 'syncer'.",
    )
    expose: SyncerExposure = Field(
        default_factory=SyncerExposure, description="How each shard is reached from outside the cluster, if at all."
    )

    @model_validator(mode="after")
    def _ports_differ(self) -> SyncerSpec:
        if len({self.port, self.metrics_port, self.health_port}) < 3:
            raise ValueError(MSG_SYNCER_PORTS)
        return self


class TlsSpec(CamelModel):
    """How the job's gRPC channels (islands and the operator to the syncers) are secured: TLS always, with the
    job's own Secrets or, when none is named, a CA the operator makes for the job; mutual TLS on request;
    plaintext only when asked for by name. The bearer token is required either way."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.serverSecret) == has(self.caSecret)", MSG_TLS_SERVER_AND_CA, ".caSecret"),
                cel(
                    "has(self.clientSecret) == (self.mutual && has(self.serverSecret))",
                    MSG_TLS_CLIENT_SECRET,
                    ".clientSecret",
                ),
                cel(
                    "!self.insecurePlaintext || !(has(self.serverSecret) || has(self.caSecret) || self.mutual)",
                    MSG_TLS_PLAINTEXT,
                    ".insecurePlaintext",
                ),
            ]
        }
    )

    server_secret: SecretName | None = Field(
        None,
        description="A kubernetes.io/tls Secret (tls.crt, tls.key) the syncers serve with: a certificate for the "
        "names of the syncer Services (<job>-syncer-<n>.<namespace>.svc and the longer forms), signed by the CA "
        "of caSecret. Unset: the operator makes a CA for the job and a certificate in Secret <job>-tls.",
    )
    ca_secret: SecretName | None = Field(
        None,
        description="A Secret whose ca.crt is the CA that signed serverSecret's certificate (and, for mutual TLS, "
        "clientSecret's): islands and the operator trust it alone.",
    )
    client_secret: SecretName | None = Field(
        None,
        description="For mutual TLS with serverSecret: a kubernetes.io/tls Secret with the client certificate the "
        "islands and the operator present.",
    )
    mutual: bool = Field(
        False, description="Mutual TLS: syncers refuse every client without a certificate of the job's CA."
    )
    insecure_plaintext: bool = Field(
        False,
        description="No TLS at all: model updates and the token cross the network in the clear. For networks "
        "that encrypt every link themselves.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TlsSpec:
        if (self.server_secret is None) != (self.ca_secret is None):
            raise ValueError(MSG_TLS_SERVER_AND_CA)
        if (self.client_secret is not None) != (self.mutual and self.server_secret is not None):
            raise ValueError(MSG_TLS_CLIENT_SECRET)
        if self.insecure_plaintext and (self.server_secret is not None or self.mutual):
            raise ValueError(MSG_TLS_PLAINTEXT)
        return self

    @property
    def named_secrets(self) -> list[str]:
        """The Secrets the job names (CA, server, client), each once."""
        return list(dict.fromkeys(n for n in (self.ca_secret, self.server_secret, self.client_secret) if n))

    @property
    def operator_made(self) -> bool:
        """Whether the operator makes the job's CA and certificates (no Secret named, TLS on)."""
        return not self.insecure_plaintext and self.server_secret is None


ENDPOINT = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*|\[[0-9a-fA-F:]+\]):[0-9]{1,5}$"
"""host:port, the host a DNS name, an IPv4 address or a bracketed IPv6 address."""
ENDPOINT_MAX = 253 + len(":65535")


class RemoteSyncers(CamelModel):
    """Syncer shards another cluster runs (their job's status.syncer.endpoints): this job then runs only its
    islands, which train against them, and reads its progress from them."""

    endpoints: list[Annotated[str, Field(max_length=ENDPOINT_MAX, pattern=ENDPOINT)]] = Field(
        min_length=1,
        max_length=MAX_SHARDS,
        description="host:port of each shard, in shard order (shard n owns fragments p with p mod shards = n).",
    )
    token_secret: SecretName = Field(
        description="A Secret whose 'token' key is the bearer token of the syncers' job (a copy of its "
        "diloco-<job>-token)."
    )
    ca_secret: SecretName = Field(description="A Secret whose ca.crt is the CA that signed the shards' certificate.")
    client_secret: SecretName | None = Field(
        None,
        description="For shards that require mutual TLS: a kubernetes.io/tls Secret with a client certificate "
        "their CA signed, which the islands and the operator present.",
    )

    @property
    def named_secrets(self) -> list[str]:
        """The Secrets holding the CA and the client certificate, each once (the token's is read apart)."""
        return list(dict.fromkeys(n for n in (self.ca_secret, self.client_secret) if n))


class FailurePolicy(CamelModel):
    """When failures end the job. A failure re-forms the island (all its pods restart together, so every
    rank rejoins the rendezvous); a preemption re-forms it too but is never counted."""

    restart_budget: int = Field(
        10,
        ge=0,
        description="Failures (container restarts, failed or lost pods, not preemptions) an island may have; "
        "one more fails the job.",
    )
    backoff_seconds: int = Field(
        10, ge=0, le=3600, description="Seconds an island stays at zero pods after a failure before it re-forms."
    )


class UpdateStrategy(CamelModel):
    """How a change of the islands' pod template (image, command, env, resources...) reaches running
    islands: a few at a time, each re-formed on the new template and synced with the shards again before
    the next begins, so the others train on throughout. Syncer shards take their own changes one at a time."""

    max_unavailable: int = Field(
        1, ge=1, description="Islands re-formed for a pod-template change at once; the others keep training."
    )


class StopCondition(CamelModel):
    """The job succeeds as soon as either bound is reached by every fragment; with neither, it trains until
    deleted or suspended."""

    outer_steps: int | None = Field(None, ge=1, description="Outer steps (merges) every fragment must reach.")
    tokens: int | None = Field(None, ge=1, description="Tokens every fragment's merges must account for.")


class ModelExport(CamelModel):
    """Where a job that succeeds leaves its trained model: `diloco export`'s files (model.safetensors and
    config.json), assembled from the shards' final checkpoints once they have stopped."""

    claim_name: ClaimName = Field(
        description="A PersistentVolumeClaim of the job's namespace (not one of the operator's), which the export "
        "pod mounts and writes to."
    )
    path: str | None = Field(
        None,
        max_length=255,
        pattern=RELATIVE_PATH,
        description="Folder inside the volume to write into (created); the job's name when unset.",
    )


# How the spec's validator names knobs in its messages: by their path in the manifest.
SPEC_NAMES = {
    "quorum": "spec.training.quorum",
    "islands": "spec.islands",
    "shards": "spec.syncer.shards",
    "fragments": "spec.training.fragments",
}


def _spec_rules() -> list[JsonValue]:
    return [
        *(cel(rule.cel, rule.message, rule.field_path) for rule in RULES),
        cel(FRAGMENTS_WITHIN_TENSORS_RULE, MSG_FRAGMENTS_WITHIN_TENSORS, ".training.fragments"),
        cel(f"self.islands.map(i, i.replicas).sum() <= {MAX_JOB_PODS}", MSG_JOB_PODS, ".islands"),
        cel(
            "self.training.fragments == oldSelf.training.fragments",
            "spec.training.fragments is immutable: the syncers' state is cut into that many fragments",
            ".training.fragments",
        ),
        cel(
            "!has(self.remoteSyncers) || self.syncer.shards == size(self.remoteSyncers.endpoints)",
            MSG_REMOTE_SHARDS,
            ".syncer.shards",
        ),
        cel(
            "!has(self.remoteSyncers) || !(has(self.syncer.image) || has(self.syncer.podTemplate) "
            "|| has(self.syncer.priorityClassName) "
            "|| (has(self.syncer.nodeSelector) && size(self.syncer.nodeSelector) > 0) "
            "|| (has(self.syncer.tolerations) && size(self.syncer.tolerations) > 0) "
            "|| self.syncer.expose.type != 'ClusterIP')",
            MSG_REMOTE_LOCAL_SYNCERS,
            ".syncer",
        ),
        cel(
            "!has(self.remoteSyncers) || !(has(self.tls.serverSecret) || has(self.tls.caSecret) "
            "|| has(self.tls.clientSecret) || self.tls.mutual || self.tls.insecurePlaintext)",
            MSG_REMOTE_TLS,
            ".tls",
        ),
        cel("!has(self.remoteSyncers) || !has(self.export)", MSG_REMOTE_EXPORT, ".export"),
        cel(
            "self.syncer.shards == oldSelf.syncer.shards",
            "spec.syncer.shards is immutable: fragments are assigned to shards by their number",
            ".syncer.shards",
        ),
    ]


class DiLoCoJobSpec(CamelModel):
    """A Decoupled DiLoCo training job: islands of accelerators that train apart and merge model fragments
    through sharded syncers."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _spec_rules()})

    image: str = Field(
        min_length=1, description="Image with diloco-worker and diloco-syncer (deploy/Dockerfile.trainer)."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy of every container of the job."
    )
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="What the island pods run.")
    training: TrainingConfig = Field(
        default_factory=TrainingConfig,
        description="DiLoCo knobs shared by every island and shard: H, P, tau, alpha, encoding, quorum K, grace, "
        "staleness and both optimizers.",
    )
    islands: list[IslandSpec] = Field(
        min_length=1,
        max_length=MAX_ISLANDS,
        description="The learners; names are unique.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    syncer: SyncerSpec = Field(default_factory=SyncerSpec, description="The syncer shards.")
    tls: TlsSpec = Field(default_factory=TlsSpec, description="TLS of the job's gRPC channels.")
    remote_syncers: RemoteSyncers | None = Field(
        None,
        description="Train against the shards of a job in another cluster instead of running syncers here; "
        "spec.syncer.shards must match, and spec.training must equal that job's.",
    )
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy, description="Restart budget and backoff.")
    update_strategy: UpdateStrategy = Field(
        default_factory=UpdateStrategy, description="How pod-template changes roll through the islands."
    )
    stop_condition: StopCondition = Field(default_factory=StopCondition, description="When the job succeeds.")
    export: ModelExport | None = Field(
        None, description="Write the trained model to a volume when the job succeeds (status.export says where)."
    )
    suspend: bool = Field(
        False, description="Scale every island to zero, keeping the syncers and their state; false resumes."
    )
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the job (and its children) this long after it succeeded or failed."
    )

    @field_validator("islands")
    @classmethod
    def _unique_island_names(cls, islands: list[IslandSpec]) -> list[IslandSpec]:
        seen: set[str] = set()
        for island in islands:
            if island.name in seen:
                raise ValueError(f"spec.islands[].name must be unique: {island.name!r} appears twice")
            seen.add(island.name)
            if re.match(RESERVED_ISLAND_NAME, island.name):
                raise ValueError(MSG_RESERVED_ISLAND)
        return islands

    @model_validator(mode="after")
    def _cross_field_rules(self) -> DiLoCoJobSpec:
        """The rules that involve the islands and shards (TrainingConfig checks those among its own knobs)."""
        QUORUM_WITHIN_ISLANDS.check(SPEC_NAMES, quorum=self.training.quorum, islands=len(self.islands))
        SHARDS_WITHIN_FRAGMENTS.check(SPEC_NAMES, shards=self.syncer.shards, fragments=self.training.fragments)
        pods = sum(island.replicas for island in self.islands)
        if pods > MAX_JOB_PODS:
            raise ValueError(f"{MSG_JOB_PODS}, got {pods}")
        if self.remote_syncers is not None:
            self._remote_rules(self.remote_syncers)
        preset = self.trainer.preset
        if preset is not None and self.training.fragments > PRESET_TENSORS[preset]:
            raise ValueError(
                f"spec.training.fragments (P={self.training.fragments}) must not exceed the "
                f"{PRESET_TENSORS[preset]} tensors of the {preset.value} preset (spec.trainer.model): every "
                "fragment holds at least one whole tensor"
            )
        return self

    def _remote_rules(self, remote: RemoteSyncers) -> None:
        if self.syncer.shards != len(remote.endpoints):
            raise ValueError(f"{MSG_REMOTE_SHARDS}, got {self.syncer.shards} and {len(remote.endpoints)}")
        syncer = self.syncer
        local = (syncer.image, syncer.pod_template, syncer.priority_class_name)
        if (
            any(value is not None for value in local)
            or syncer.node_selector
            or syncer.tolerations
            or syncer.expose.type is not Exposure.CLUSTER_IP
        ):
            raise ValueError(MSG_REMOTE_LOCAL_SYNCERS)
        tls = self.tls
        if tls.named_secrets or tls.mutual or tls.insecure_plaintext:
            raise ValueError(MSG_REMOTE_TLS)
        if self.export is not None:
            raise ValueError(MSG_REMOTE_EXPORT)

    @property
    def tls_secrets(self) -> list[str]:
        """The Secrets holding the CA and certificates the job's pods mount, when the job names them."""
        return self.remote_syncers.named_secrets if self.remote_syncers is not None else self.tls.named_secrets

    @property
    def syncer_image(self) -> str:
        return self.syncer.image or self.image


def cut(text: str, limit: int) -> str:
    """`text` within `limit` characters, its end replaced by an ellipsis when it was longer."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Phase(str, enum.Enum):
    """Pending: not trained yet. Running: every island and shard ready. Degraded: training goes on without
    some island pods or a shard. Suspended, Succeeded and Failed as named; the last two are final."""

    PENDING = "Pending"
    RUNNING = "Running"
    DEGRADED = "Degraded"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    @property
    def finished(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class Condition(CamelModel):
    """A status condition, as `metav1.Condition`."""

    type: str = Field(description="Ready, Degraded, Suspended, Complete, Failed or SyncerStateLost.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason for the last transition.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: datetime.datetime = Field(description="When status last changed.")
    observed_generation: int | None = Field(None, description="metadata.generation the condition was set for.")

    @field_validator("message")
    @classmethod
    def _bounded(cls, message: str) -> str:
        """Cut to MAX_CONDITION_MESSAGE characters, so that the status stays within its budget."""
        return cut(message, MAX_CONDITION_MESSAGE)


class PodRecord(CamelModel):
    """The last observation of one island pod, kept so that a failure is counted once, even across
    operator restarts, and a vanished pod can be judged by what it was."""

    ordinal: int = Field(ge=0, description="StatefulSet ordinal (the pod's rank).")
    uid: str = Field(description="Pod UID.")
    restarts: int = Field(0, ge=0, description="Sum of the pod's container restart counts.")
    node: str | None = Field(None, description="Node the pod ran on.")
    disrupted: bool = Field(False, description="The pod carried the DisruptionTarget condition.")
    failed: bool = Field(False, description="The pod was seen in phase Failed (already counted).")
    owner: str | None = Field(None, description="UID of the StatefulSet that controlled the pod.")


class Reform(CamelModel):
    """An island being re-formed: held at zero pods until every pod is gone and `holdUntil` has passed."""

    reason: Literal["Failure", "Preemption", "Update"] = Field(description="Why the island re-forms.")
    since: datetime.datetime = Field(description="When the re-form began.")
    hold_until: datetime.datetime = Field(description="Earliest time the pods come back.")


IslandReason = Literal["Unschedulable", "PushesRefused", "NotSyncing", "SyncerStateLost"]
"""Why an island does not train (`diloco.api.conditions.Reason` names each)."""
MAX_ISLAND_MESSAGE = 64


class IslandStatus(CamelModel):
    """One island as last observed."""

    name: str = Field(description="Island name.")
    desired: int = Field(0, ge=0, description="Pods the island should have now (0 when stopped).")
    ready: int = Field(0, ge=0, description="Pods ready.")
    restarts: int = Field(0, ge=0, description="Failures counted against spec.failurePolicy.restartBudget.")
    preemptions: int = Field(0, ge=0, description="Pods preempted or lost with their node (not counted).")
    last_sync: datetime.datetime | None = Field(None, description="Last time a syncer shard reported the island live.")
    loss: float | None = Field(None, description="Training loss last reported by the island's rank-0 pod.")
    reform: Reform | None = Field(None, description="Set while the island is being re-formed.")
    rolled_at: datetime.datetime | None = Field(
        None,
        description="When the island came back on a new pod template; cleared once every pod is ready and a "
        "shard reports it live again (a rolling update waits for that).",
    )
    pods: list[PodRecord] = Field(default_factory=list, description="Accounting record of the island's pods.")
    reason: IslandReason | None = Field(
        None,
        description="Why the island does not train, when it does not: Unschedulable (a pod the scheduler cannot "
        "place), PushesRefused (the syncer shards refuse its token), NotSyncing (no merge brought back within the "
        "bound its H and step time give), SyncerStateLost (a shard lost its state and the island has not synced "
        "with it since).",
    )
    message: str | None = Field(
        None,
        description=f"The reason in words, cut to {MAX_ISLAND_MESSAGE} characters (the job's conditions say it whole).",
    )

    @field_validator("message")
    @classmethod
    def _bounded(cls, message: str | None) -> str | None:
        """Cut to MAX_ISLAND_MESSAGE characters: with hundreds of islands, the status stays within its budget."""
        return None if message is None else cut(message, MAX_ISLAND_MESSAGE)


class ShardLineage(CamelModel):
    """A shard's state as the operator follows it: the id the shard drew for it, and what the states it lost
    before had merged."""

    shard: int = Field(ge=0, description="Shard index.")
    lineage: str | None = Field(
        None,
        pattern="^[0-9a-f]{16}$",
        description="The id of the shard's state (16 hex digits), drawn when it starts without a checkpoint: a new "
        "one means the shard came back without its state, however far its versions have got again. None from a "
        "shard that does not say it (an older image): its state's losses are told by versions alone.",
    )
    carried_outer_steps: int = Field(
        0,
        ge=0,
        description="Outer steps the shard's fragments had merged in states since lost (the least of its "
        "fragments), still counted toward spec.stopCondition: the islands seed such a shard with the model "
        "they hold.",
    )
    carried_tokens: int = Field(0, ge=0, description="Tokens counted the same way.")


class SyncerStatus(CamelModel):
    """Readiness of the syncer shards."""

    shards: int = Field(0, ge=0, description="Shards the job has.")
    ready: int = Field(0, ge=0, description="Shards whose Deployment reports a ready pod.")
    reachable: int = Field(0, ge=0, description="Shards that answered the last Status call.")
    last_state_loss: datetime.datetime | None = Field(
        None,
        description="When the operator last saw a shard come back without the state it had (a new lineage, or a "
        "fragment's version went back): the islands that have not synced since do not train (condition "
        "SyncerStateLost).",
    )
    lineages: list[ShardLineage] = Field(
        default_factory=list,
        max_length=MAX_SHARDS,
        description="Each shard's state as last reported, with what the states it lost had merged.",
    )
    endpoints: list[Annotated[str, Field(max_length=ENDPOINT_MAX)]] = Field(
        default_factory=list,
        max_length=MAX_SHARDS,
        description="host:port at which each shard is reached from outside the cluster (spec.syncer.expose), in "
        "shard order, once known; with spec.remoteSyncers, their endpoints.",
    )


class RemoteIsland(CamelModel):
    """An island that is not in this job's spec but that its shards report live: one of another cluster's job
    training against them (spec.remoteSyncers there)."""

    name: str = Field(max_length=ISLAND_ID_MAX_CHARS, description="Island name, as it joined the shards.")
    last_sync: datetime.datetime = Field(description="Last time a shard reported the island live.")


class FragmentProgress(CamelModel):
    """A fragment's progress as its shard last reported it."""

    fragment: int = Field(ge=0, description="Fragment index.")
    shard: int = Field(ge=0, description="Owning shard.")
    version: int = Field(0, ge=0, description="Outer steps (merges) applied to the fragment.")
    tokens: int = Field(0, ge=0, description="Tokens behind the merged contributions.")
    last_merge: datetime.datetime | None = Field(None, description="Time of the last merge.")


class ExportPhase(str, enum.Enum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ExportStatus(CamelModel):
    """The trained model's export: where it goes and how far it got."""

    phase: ExportPhase = Field(description="Pending (until the shards have stopped), Running, Succeeded or Failed.")
    location: str = Field(description="<claimName>:/<path>: the volume and folder the model is written to.")
    message: str | None = Field(None, max_length=MAX_CONDITION_MESSAGE, description="Why it is pending or failed.")
    completion_time: datetime.datetime | None = Field(None, description="When the export succeeded.")


class DiLoCoJobStatus(CamelModel):
    """What the operator observed and decided; every field is recomputed from the cluster on each pass."""

    phase: Phase = Field(Phase.PENDING, description="Pending, Running, Degraded, Suspended, Succeeded or Failed.")
    observed_generation: int | None = Field(None, description="metadata.generation of the last reconcile.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Degraded, Suspended, Complete, Failed, SyncerStateLost."
    )
    islands_ready: str = Field("0/0", description="Islands with every pod ready / islands that should run.")
    islands: list[IslandStatus] = Field(default_factory=list, description="Per-island counts.")
    remote_islands: list[RemoteIsland] = Field(
        default_factory=list,
        max_length=MAX_ISLANDS,
        description="Islands of other clusters' jobs that the shards reported live within the last hour.",
    )
    syncer: SyncerStatus = Field(default_factory=SyncerStatus, description="Syncer readiness.")
    fragments: list[FragmentProgress] = Field(default_factory=list, description="Per-fragment progress.")
    outer_step: int = Field(
        0,
        ge=0,
        description="Outer steps every fragment has reached (the minimum), with those its shard carries from "
        "states since lost (syncer.lineages).",
    )
    tokens: int = Field(
        0, ge=0, description="Tokens every fragment's merges account for (the minimum), with those a shard lost."
    )
    carried_outer_steps: int = Field(
        0,
        ge=0,
        description="The most outer steps a shard carries from states since lost (syncer.lineages[]."
        "carriedOuterSteps), counted in outerStep toward spec.stopCondition.",
    )
    carried_tokens: int = Field(0, ge=0, description="The most tokens a shard carries the same way.")
    loss: float | None = Field(None, description="Mean of the islands' last reported training losses.")
    goodput: float | None = Field(
        None, ge=0, le=1, description="Ready island pod-seconds / desired island pod-seconds while training."
    )
    ready_pod_seconds: float = Field(0.0, ge=0, description="Accumulated ready island pod-seconds.")
    desired_pod_seconds: float = Field(0.0, ge=0, description="Accumulated desired island pod-seconds.")
    last_observed: datetime.datetime | None = Field(None, description="Time of the last observation.")
    start_time: datetime.datetime | None = Field(None, description="When training first had a ready island and shards.")
    completion_time: datetime.datetime | None = Field(None, description="When the job succeeded or failed.")
    export: ExportStatus | None = Field(None, description="The trained model's export (spec.export).")


class DiLoCoJob(CamelModel):
    """A whole manifest, for code and tests that read one (the API server's own metadata is not modelled)."""

    api_version: Literal["diloco.dev/v1alpha1"]
    kind: Literal["DiLoCoJob"]
    metadata: dict[str, Any]
    spec: DiLoCoJobSpec
    status: DiLoCoJobStatus | None = None

    @field_validator("metadata")
    @classmethod
    def _name(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        if "name" in metadata:
            validate_job_name(metadata["name"])
        return metadata
