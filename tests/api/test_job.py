"""The DiLoCoJob spec model: defaults, camelCase, and refusals that name the offending field."""

import json

import pytest
from pydantic import ValidationError

from diloco.api.job import (
    PRESET_TENSORS,
    DiLoCoJob,
    DiLoCoJobSpec,
    DiLoCoJobStatus,
    Exposure,
    IslandSpec,
    ModelSize,
    Phase,
    validate_job_name,
)
from diloco.core.config import Encoding, TrainingConfig

REMOTE = {"endpoints": ["syncers.example.com:443"], "tokenSecret": "remote-token", "caSecret": "remote-ca"}


def minimal(**overrides):
    return {"image": "registry.example/diloco:1", "islands": [{"name": "a"}], **overrides}


def refusal(data) -> str:
    """Every error of validating `data`, as 'loc: message' lines."""
    with pytest.raises(ValidationError) as caught:
        DiLoCoJobSpec.model_validate(data)
    return "\n".join(".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in caught.value.errors())


def test_defaults_are_those_documented():
    spec = DiLoCoJobSpec.model_validate(minimal())
    assert spec.training == TrainingConfig()
    assert spec.image_pull_policy == "IfNotPresent"
    assert spec.trainer.model is None and spec.trainer.data is None and spec.trainer.command is None
    assert (spec.trainer.rendezvous_port, spec.trainer.metrics_port) == (29500, 9090)
    island = spec.islands[0]
    assert (island.replicas, island.accelerators_per_pod, island.accelerator_resource) == (1, 0, "nvidia.com/gpu")
    assert island.spot is False and island.pod_template is None
    assert island.checkpoint is None, "an island's checkpoints live in an emptyDir unless it asks for a volume"
    assert (spec.syncer.shards, spec.syncer.port, spec.syncer.metrics_port) == (1, 50051, 9090)
    assert spec.syncer.checkpoint.size == "1Gi" and spec.syncer.checkpoint.interval_seconds == 30
    assert (spec.failure_policy.restart_budget, spec.failure_policy.backoff_seconds) == (10, 10)
    assert spec.stop_condition.outer_steps is None and spec.stop_condition.tokens is None
    assert spec.suspend is False and spec.ttl_seconds_after_finished is None
    assert spec.syncer_image == spec.image


def test_camel_case_manifest_with_every_section():
    spec = DiLoCoJobSpec.model_validate(
        minimal(
            imagePullPolicy="Always",
            trainer={"model": "small", "data": "/data/tokens.bin", "args": ["--batch-size", "32"]},
            training={"innerSteps": 50, "fragments": 2, "overlapSteps": 3, "quorum": 2, "encoding": "int8"},
            islands=[
                {
                    "name": "h100",
                    "replicas": 4,
                    "acceleratorsPerPod": 8,
                    "spot": True,
                    "nodeSelector": {"pool": "h100"},
                    "tolerations": [{"key": "gpu", "operator": "Exists"}],
                    "resources": {"limits": {"memory": "512Gi", "cpu": 64}},
                    "priorityClassName": "training",
                    "podTemplate": {"spec": {"terminationGracePeriodSeconds": 120}},
                },
                {"name": "a100", "replicas": 2, "acceleratorResource": "nvidia.com/gpu"},
            ],
            syncer={
                "shards": 2,
                "image": "registry.example/syncer:1",
                "checkpoint": {"size": "50Gi", "storageClassName": "fast"},
            },
            failurePolicy={"restartBudget": 3, "backoffSeconds": 30},
            stopCondition={"outerSteps": 1000},
            ttlSecondsAfterFinished=3600,
        )
    )
    assert spec.trainer.model == "small" and spec.trainer.preset is ModelSize.SMALL
    assert spec.training.encoding is Encoding.INT8 and spec.training.quorum == 2
    assert [i.name for i in spec.islands] == ["h100", "a100"]
    assert spec.islands[0].resources.limits == {"memory": "512Gi", "cpu": 64}
    assert spec.islands[0].tolerations[0].operator == "Exists"
    assert spec.syncer_image == "registry.example/syncer:1"
    assert spec.stop_condition.outer_steps == 1000
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert DiLoCoJobSpec.model_validate(dumped) == spec
    assert "acceleratorsPerPod" in dumped["islands"][0] and "ttlSecondsAfterFinished" in dumped


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"islands": []}, "islands"),
        ({"islands": [{"name": "A_b"}]}, "islands.0.name"),
        ({"islands": [{"name": "x" * 22}]}, "islands.0.name"),
        ({"islands": [{"name": "1st"}]}, "islands.0.name"),
        ({"islands": [{"name": "a", "replicas": 0}]}, "islands.0.replicas"),
        ({"islands": [{"name": "a", "acceleratorsPerPod": -1}]}, "islands.0.acceleratorsPerPod"),
        ({"islands": [{"name": "a", "acceleratorResource": "not a resource"}]}, "islands.0.acceleratorResource"),
        (
            {"islands": [{"name": "a", "resources": {"limits": {"memory": "lots"}}}]},
            "islands.0.resources.limits.memory",
        ),
        ({"islands": [{"name": "a", "tolerations": [{"operator": "Maybe"}]}]}, "islands.0.tolerations.0.operator"),
        ({"islands": [{"name": "a", "replica": 2}]}, "islands.0.replica"),
        ({"islands": [{"name": "a", "checkpoint": {"size": 1024}}]}, "islands.0.checkpoint.size"),
        ({"islands": [{"name": "a", "checkpoint": {"size": "1" * 65}}]}, "islands.0.checkpoint.size"),
        ({"islands": [{"name": "a", "checkpoint": {"checkpointEvery": 0}}]}, "islands.0.checkpoint.checkpointEvery"),
        ({"image": ""}, "image"),
        ({"imagePullPolicy": "Sometimes"}, "imagePullPolicy"),
        ({"trainer": {"model": "huge"}}, "trainer.model"),
        ({"training": {"mixAlpha": 1.5}}, "training.mixAlpha"),
        ({"training": {"encoding": "int2"}}, "training.encoding"),
        ({"syncer": {"shards": 0}}, "syncer.shards"),
        ({"syncer": {"port": 70000}}, "syncer.port"),
        ({"failurePolicy": {"restartBudget": -1}}, "failurePolicy.restartBudget"),
        ({"stopCondition": {"outerSteps": 0}}, "stopCondition.outerSteps"),
        ({"ttlSecondsAfterFinished": -5}, "ttlSecondsAfterFinished"),
        ({"export": {"claimName": "Models"}}, "export.claimName"),
        ({"export": {"claimName": "models", "path": "../other"}}, "export.path"),
        ({"export": {"claimName": "models", "path": "/abs"}}, "export.path"),
        ({"export": {"claimName": "models", "path": "runs/.hidden"}}, "export.path"),
    ],
)
def test_field_bounds_are_refused_at_the_field(change, named):
    lines = refusal(minimal(**change)).splitlines()
    assert any(line.startswith(named + ":") or line.startswith(named + ".") for line in lines), lines


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"islands": [{"name": "a"}, {"name": "a"}]}, "spec.islands[].name must be unique"),
        ({"islands": [{"name": "syncer-0"}]}, "spec.islands[].name must not have the form syncer-<n>"),
        ({"training": {"quorum": 2}}, "spec.training.quorum (K=2) must not exceed the number of islands"),
        ({"training": {"fragments": 4}, "syncer": {"shards": 5}}, "spec.syncer.shards (5) must not exceed"),
        ({"training": {"innerSteps": 2, "fragments": 3, "overlapSteps": 0}}, "fragments (P=3) must not exceed"),
        ({"training": {"innerSteps": 8, "fragments": 4, "overlapSteps": 2}}, "overlapSteps (tau=2) must be less"),
        (
            {"trainer": {"command": ["python", "train.py"], "model": "tiny"}},
            "spec.trainer.model, modelConfig, initFrom",
        ),
        ({"trainer": {"command": ["python"], "precision": "bf16"}}, "cannot be set together with spec.trainer.command"),
        ({"trainer": {"command": ["python"], "activationCheckpointing": False}}, "configure the built-in trainer"),
        ({"trainer": {"command": ["python"], "data": "/x"}}, "cannot be set together with spec.trainer.command"),
        ({"syncer": {"port": 9090}}, "spec.syncer.port, metricsPort and healthPort must differ"),
        ({"syncer": {"healthPort": 9090}}, "spec.syncer.port, metricsPort and healthPort must differ"),
        ({"tls": {"serverSecret": "s"}}, "spec.tls.serverSecret and spec.tls.caSecret are named together"),
        ({"tls": {"serverSecret": "s", "caSecret": "c", "mutual": True}}, "spec.tls.clientSecret is named exactly"),
        ({"tls": {"clientSecret": "c", "mutual": True}}, "spec.tls.clientSecret is named exactly"),
        ({"tls": {"insecurePlaintext": True, "mutual": True}}, "spec.tls.insecurePlaintext turns TLS off"),
        ({"syncer": {"expose": {"type": "NodePort"}}}, "spec.syncer.expose.nodeAddress is set exactly when"),
        ({"syncer": {"expose": {"nodeAddress": "10.0.0.1"}}}, "spec.syncer.expose.nodeAddress is set exactly when"),
        ({"syncer": {"expose": {"type": "GRPCRoute", "domain": "x.io"}}}, "spec.syncer.expose.gateway and"),
        ({"syncer": {"expose": {"gateway": {"name": "g"}}}}, "spec.syncer.expose.gateway and"),
        ({"remoteSyncers": REMOTE, "syncer": {"shards": 2}}, "spec.syncer.shards must equal the number of"),
        ({"remoteSyncers": REMOTE, "syncer": {"image": "s:1"}}, "spec.remoteSyncers replaces the job's own syncers"),
        (
            {"remoteSyncers": REMOTE, "syncer": {"expose": {"type": "LoadBalancer"}}},
            "spec.remoteSyncers replaces the job's own syncers",
        ),
        ({"remoteSyncers": REMOTE, "tls": {"mutual": True}}, "spec.tls (which secures the job's own syncers)"),
        ({"remoteSyncers": REMOTE, "export": {"claimName": "out"}}, "spec.export reads the job's own shards"),
    ],
)
def test_cross_field_rules_name_the_fields(change, message):
    assert message in refusal(minimal(**change))


def test_shards_are_exposed_in_the_cluster_unless_the_job_says_how_else():
    assert DiLoCoJobSpec.model_validate(minimal()).syncer.expose.type is Exposure.CLUSTER_IP
    node_port = DiLoCoJobSpec.model_validate(minimal(syncer={"expose": {"type": "NodePort", "nodeAddress": "::1"}}))
    assert node_port.syncer.expose.node_address == "::1"
    route = {"type": "GRPCRoute", "gateway": {"name": "edge", "namespace": "infra"}, "domain": "syncers.example.com"}
    exposed = DiLoCoJobSpec.model_validate(minimal(syncer={"expose": route})).syncer.expose
    assert exposed.gateway is not None and exposed.gateway.namespace == "infra" and exposed.gateway_port == 443


def test_remote_syncers_name_one_endpoint_per_shard_and_their_secrets():
    remote = {**REMOTE, "endpoints": ["127.0.0.2:31000", "[::1]:31001"], "clientSecret": "client"}
    spec = DiLoCoJobSpec.model_validate(minimal(remoteSyncers=remote, syncer={"shards": 2}, training={"fragments": 2}))
    assert spec.remote_syncers is not None and spec.remote_syncers.endpoints == remote["endpoints"]
    assert spec.tls_secrets == ["remote-ca", "client"]
    assert "remoteSyncers.endpoints.0" in refusal(minimal(remoteSyncers={**REMOTE, "endpoints": ["no-port"]}))


def test_a_custom_command_replaces_the_builtin_trainer():
    spec = DiLoCoJobSpec.model_validate(minimal(trainer={"command": ["python", "-m", "mytrain"]}))
    assert spec.trainer.command == ["python", "-m", "mytrain"] and spec.trainer.model is None


def test_an_export_names_a_claim_and_an_optional_folder_inside_it():
    spec = DiLoCoJobSpec.model_validate(minimal(export={"claimName": "models", "path": "runs/tiny-1.0"}))
    assert spec.export is not None and (spec.export.claim_name, spec.export.path) == ("models", "runs/tiny-1.0")
    assert DiLoCoJobSpec.model_validate(minimal()).export is None


def test_quorum_may_equal_the_number_of_islands():
    spec = DiLoCoJobSpec.model_validate(minimal(islands=[{"name": "a"}, {"name": "b"}], training={"quorum": 2}))
    assert spec.training.quorum == 2


def test_island_names_near_the_reserved_form_are_fine():
    for name in ("syncer", "syncers-0", "my-syncer-1", "syncer-a"):
        assert IslandSpec(name=name).name == name


@pytest.mark.parametrize("name", ["job", "a", "j-1", "x" * 30])
def test_job_names_that_fit(name):
    assert validate_job_name(name) == name


@pytest.mark.parametrize("name", ["Job", "1job", "job-", "job.x", "x" * 31])
def test_job_names_refused_with_the_field_named(name):
    with pytest.raises(ValueError, match="metadata.name must be a DNS-1035 label of at most 30"):
        validate_job_name(name)


def test_whole_manifest_and_status():
    job = DiLoCoJob.model_validate(
        {
            "apiVersion": "diloco.dev/v1alpha1",
            "kind": "DiLoCoJob",
            "metadata": {"name": "demo"},
            "spec": minimal(),
            "status": {"phase": "Running", "islandsReady": "1/1", "outerStep": 3},
        }
    )
    assert job.status.phase is Phase.RUNNING and job.status.outer_step == 3
    with pytest.raises(ValidationError, match="metadata.name"):
        DiLoCoJob.model_validate(
            {"apiVersion": "diloco.dev/v1alpha1", "kind": "DiLoCoJob", "metadata": {"name": "Demo"}, "spec": minimal()}
        )


def test_status_defaults_and_final_phases():
    status = DiLoCoJobStatus()
    assert status.phase is Phase.PENDING and status.islands_ready == "0/0" and status.goodput is None
    assert {p for p in Phase if p.finished} == {Phase.SUCCEEDED, Phase.FAILED}


# --- pod-template overrides: an allowlist, refused beyond it with the field named ------------------------------


def with_override(template, where="islands"):
    if where == "syncer":
        return minimal(syncer={"podTemplate": template})
    return minimal(islands=[{"name": "a", "podTemplate": template}])


ALLOWED_OVERRIDES = {
    "labels-annotations": {"metadata": {"labels": {"team": "llm"}, "annotations": {"note": "x"}}},
    "placement": {
        "spec": {
            "nodeSelector": {"pool": "h100"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}},
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
            "priorityClassName": "training-high",
            "terminationGracePeriodSeconds": 120,
            "imagePullSecrets": [{"name": "registry"}],
        }
    },
    "trainer-container": {
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "image": "registry.example/diloco:1-cu121",
                    "args": ["--batch-size", "8"],
                    "env": [
                        {"name": "NCCL_IB_DISABLE", "value": "1"},
                        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                    ],
                    "envFrom": [{"configMapRef": {"name": "knobs"}}],
                    "resources": {"limits": {"memory": "64Gi"}},
                    "volumeMounts": [{"name": "corpus", "mountPath": "/data", "readOnly": True, "subPath": "v1"}],
                }
            ]
        }
    },
    "sidecar": {"spec": {"containers": [{"name": "sidecar", "image": "busybox", "command": ["sleep", "inf"]}]}},
    "safe-volumes": {
        "spec": {
            "volumes": [
                {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
                {"name": "knobs", "configMap": {"name": "knobs"}},
                {"name": "creds", "secret": {"secretName": "creds"}},
                {"name": "corpus", "persistentVolumeClaim": {"claimName": "corpus", "readOnly": True}},
                {"name": "bucket", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {"b": "x"}}},
            ]
        }
    },
}


@pytest.mark.parametrize("where", ["islands", "syncer"])
@pytest.mark.parametrize("template", ALLOWED_OVERRIDES.values(), ids=ALLOWED_OVERRIDES.keys())
def test_an_override_may_set_placement_image_env_resources_and_safe_volumes(template, where):
    spec = DiLoCoJobSpec.model_validate(with_override(template, where))
    override = spec.islands[0].pod_template if where == "islands" else spec.syncer.pod_template
    assert override.patch() == template


REFUSED_OVERRIDES = [
    ({"spec": {"hostNetwork": True}}, "podTemplate.spec.hostNetwork"),
    ({"spec": {"hostPID": True}}, "podTemplate.spec.hostPID"),
    ({"spec": {"hostIPC": True}}, "podTemplate.spec.hostIPC"),
    ({"spec": {"securityContext": {"runAsUser": 0}}}, "podTemplate.spec.securityContext"),
    ({"spec": {"serviceAccountName": "admin"}}, "podTemplate.spec.serviceAccountName"),
    ({"spec": {"automountServiceAccountToken": True}}, "podTemplate.spec.automountServiceAccountToken"),
    ({"spec": {"nodeName": "node-1"}}, "podTemplate.spec.nodeName"),
    ({"spec": {"initContainers": [{"name": "x", "image": "busybox"}]}}, "podTemplate.spec.initContainers"),
    (
        {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
        "podTemplate.spec.volumes.0.hostPath",
    ),
    (
        {"spec": {"volumes": [{"name": "sa", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}]}},
        "podTemplate.spec.volumes.0.projected",
    ),
    (
        {"spec": {"containers": [{"name": "trainer", "securityContext": {"privileged": True}}]}},
        "podTemplate.spec.containers.0.securityContext",
    ),
    (
        {"spec": {"containers": [{"name": "trainer", "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}]}},
        "podTemplate.spec.containers.0.securityContext",
    ),
    (
        {
            "spec": {
                "containers": [
                    {
                        "name": "x",
                        "volumeMounts": [{"name": "v", "mountPath": "/m", "mountPropagation": "Bidirectional"}],
                    }
                ]
            }
        },
        "podTemplate.spec.containers.0.volumeMounts.0.mountPropagation",
    ),
    ({"spec": {"containers": [{"image": "busybox"}]}}, "podTemplate.spec.containers.0.name"),
    ({"spec": {"containers": [{"name": "trainer", "command": [""]}]}}, "podTemplate.spec.containers.0.command.0"),
    ({"spec": {"volumes": [{"name": "empty"}]}}, "podTemplate.spec.volumes.0"),
    (
        {"spec": {"volumes": [{"name": "two", "emptyDir": {}, "configMap": {"name": "c"}}]}},
        "podTemplate.spec.volumes.0",
    ),
    ({"spec": {"terminationGracePeriodSeconds": -1}}, "podTemplate.spec.terminationGracePeriodSeconds"),
    ({"spec": None}, "podTemplate.spec"),
    ({"spec": {"containers": None}}, "podTemplate.spec.containers"),
    ({"metadata": {"name": "x"}}, "podTemplate.metadata.name"),
]


@pytest.mark.parametrize("where", ["islands", "syncer"])
@pytest.mark.parametrize(("template", "named"), REFUSED_OVERRIDES)
def test_an_override_beyond_the_allowlist_is_refused_at_the_field(template, named, where):
    prefix = "islands.0." if where == "islands" else "syncer."
    lines = refusal(with_override(template, where)).splitlines()
    assert any(line.startswith(prefix + named + ":") or line.startswith(prefix + named + ".") for line in lines), lines


# --- a job's pods reach nothing that is not theirs --------------------------------------------------------------

OTHER_JOBS = "diloco-other-tls"  # another job's certificates, as the operator names them
OPERATORS = "diloco-operator-token-key"  # the key every job's token derives from
REACHING_PAST_THE_JOB = [
    ({"spec": {"volumes": [{"name": "v", "secret": {"secretName": OTHER_JOBS}}]}}, "volumes.0.secret.secretName"),
    (
        {
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": OPERATORS, "key": "token"}}}],
                    }
                ]
            }
        },
        "containers.0.env.0.valueFrom.secretKeyRef.name",
    ),
    (
        {"spec": {"containers": [{"name": "trainer", "envFrom": [{"secretRef": {"name": "diloco-other-token"}}]}]}},
        "containers.0.envFrom.0.secretRef.name",
    ),
    (
        {"spec": {"volumes": [{"name": "v", "csi": {"driver": "d", "nodePublishSecretRef": {"name": OPERATORS}}}]}},
        "volumes.0.csi.nodePublishSecretRef.name",
    ),
    ({"spec": {"imagePullSecrets": [{"name": OTHER_JOBS}]}}, "imagePullSecrets.0.name"),
    (
        {"spec": {"volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "other-syncer-0"}}]}},
        "volumes.0.persistentVolumeClaim.claimName",
    ),
    (
        {"spec": {"volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "checkpoints-other-a-0"}}]}},
        "volumes.0.persistentVolumeClaim.claimName",
    ),
    (
        {"spec": {"volumes": [{"name": "v", "projected": {"sources": [{"secret": {"name": "x"}}]}}]}},
        "volumes.0.projected",
    ),
]


@pytest.mark.parametrize("where", ["islands", "syncer"])
@pytest.mark.parametrize(("template", "named"), REACHING_PAST_THE_JOB)
def test_an_override_naming_the_operators_or_another_jobs_secrets_or_claims_is_refused_at_the_field(
    template, named, where
):
    prefix = ("islands.0." if where == "islands" else "syncer.") + "podTemplate.spec."
    lines = refusal(with_override(template, where)).splitlines()
    assert any(line.startswith(prefix + named) for line in lines), lines


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tls": {"serverSecret": OTHER_JOBS, "caSecret": OTHER_JOBS}}, "tls.serverSecret"),
        (
            {"remoteSyncers": {"endpoints": ["a:1"], "tokenSecret": "diloco-other-token", "caSecret": "c"}},
            "remoteSyncers.tokenSecret",
        ),
        ({"export": {"claimName": "other-syncer-0"}}, "export.claimName"),
    ],
)
def test_the_jobs_own_secret_and_claim_fields_refuse_the_operators_too(change, named):
    assert any(line.startswith(named) for line in refusal(minimal(**change)).splitlines())


@pytest.mark.parametrize(
    "labels",
    [
        {"diloco.dev/island": "other"},
        {"diloco.dev/job": "other"},
        {"diloco.dev/shard": "0", "app.kubernetes.io/component": "syncer"},
        {"app.kubernetes.io/name": "diloco-operator"},
        {"app.kubernetes.io/instance": "x"},
        {"app.kubernetes.io/managed-by": "me"},
    ],
)
@pytest.mark.parametrize("field", ["labels", "annotations"])
def test_an_override_cannot_set_the_operators_own_labels_or_annotations(labels, field):
    lines = refusal(with_override({"metadata": {field: labels}})).splitlines()
    assert any(line.startswith(f"islands.0.podTemplate.metadata.{field}") for line in lines), lines
    assert "diloco.dev/*" in "\n".join(lines)


def test_an_override_cannot_pin_the_token_fingerprint_and_other_keys_of_its_own_stay_allowed():
    pinned = with_override({"metadata": {"annotations": {"diloco.dev/token-hash": "0123456789abcdef"}}})
    assert "islands.0.podTemplate.metadata.annotations" in refusal(pinned)
    own = {"app.kubernetes.io/part-of": "llm", "team.example.com/owner": "me", "diloco.dev.example/x": "y"}
    spec = DiLoCoJobSpec.model_validate(with_override({"metadata": {"labels": own, "annotations": own}}))
    assert spec.islands[0].pod_template.metadata.labels == own


# --- manifests that could never run -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"islands": [{"name": "a", "resources": {"requests": {"cpu": "-1"}}}]}, "islands.0.resources.requests.cpu"),
        ({"islands": [{"name": "a", "resources": {"requests": {"cpu": -1}}}]}, "islands.0.resources.requests.cpu"),
        (
            {"islands": [{"name": "a", "resources": {"limits": {"memory": "-1Gi"}}}]},
            "islands.0.resources.limits.memory",
        ),
        ({"syncer": {"resources": {"limits": {"cpu": "-500m"}}}}, "syncer.resources.limits.cpu"),
        ({"syncer": {"checkpoint": {"size": "-1Gi"}}}, "syncer.checkpoint.size"),
        ({"trainer": {"command": [""]}}, "trainer.command.0"),
        ({"trainer": {"command": ["python", ""]}}, "trainer.command.1"),
    ],
)
def test_negative_quantities_and_empty_command_words_are_refused_at_the_field(change, named):
    lines = refusal(minimal(**change)).splitlines()
    assert any(line.startswith(named + ":") or line.startswith(named + ".") for line in lines), lines


def test_quantities_that_resources_use_are_accepted():
    limits = {"cpu": "500m", "memory": "1.5Gi", "ephemeral-storage": "1e3", "nvidia.com/gpu": 0, "x": "+2", "y": "1e-3"}
    spec = DiLoCoJobSpec.model_validate(minimal(islands=[{"name": "a", "resources": {"limits": limits}}]))
    assert spec.islands[0].resources.limits == limits


@pytest.mark.parametrize("model", list(ModelSize))
def test_fragments_beyond_the_presets_tensor_count_are_refused(model):
    tensors = PRESET_TENSORS[model]
    training = {"innerSteps": tensors + 1, "fragments": tensors + 1, "overlapSteps": 0}
    message = refusal(minimal(trainer={"model": model.value}, training=training))
    assert f"spec.training.fragments (P={tensors + 1}) must not exceed the {tensors} tensors" in message, message
    at_limit = {**training, "fragments": tensors}
    assert DiLoCoJobSpec.model_validate(minimal(trainer={"model": model.value}, training=at_limit))


def test_the_default_preset_bounds_fragments_and_a_custom_trainer_is_not_bounded():
    tensors = PRESET_TENSORS[ModelSize.TINY]
    training = {"innerSteps": 100, "fragments": tensors + 1, "overlapSteps": 0}
    assert f"must not exceed the {tensors} tensors of the tiny preset" in refusal(minimal(training=training))
    spec = DiLoCoJobSpec.model_validate(minimal(trainer={"command": ["python", "mine.py"]}, training=training))
    assert spec.training.fragments == tensors + 1


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 2048}


def test_a_hugging_face_model_is_named_by_its_config_file_or_inline():
    by_file = DiLoCoJobSpec.model_validate(minimal(trainer={"model": "/data/llama/config.json"}))
    assert by_file.trainer.preset is None and by_file.trainer.model_argument == "/data/llama/config.json"
    inline = DiLoCoJobSpec.model_validate(minimal(trainer={"modelConfig": LLAMA, "tokenizer": "/data/tok.json"}))
    assert inline.trainer.preset is None and json.loads(inline.trainer.model_argument) == LLAMA
    resumed = DiLoCoJobSpec.model_validate(minimal(trainer={"initFrom": "/data/checkpoint"}))
    assert resumed.trainer.preset is None and resumed.trainer.model_argument == "", "initFrom's own configuration"
    preset = DiLoCoJobSpec.model_validate(minimal(trainer={"model": "medium", "initFrom": "/data/gpt2"}))
    assert preset.trainer.preset is ModelSize.MEDIUM and preset.trainer.model_argument == "medium"
    assert DiLoCoJobSpec.model_validate(minimal()).trainer.model_argument == "tiny"


def test_a_hugging_face_model_is_not_held_to_a_presets_tensor_count():
    many = {"training": {"fragments": 60, "innerSteps": 600, "overlapSteps": 2}, "syncer": {"shards": 1}}
    assert "fragments" in refusal(minimal(**many))
    DiLoCoJobSpec.model_validate(minimal(trainer={"modelConfig": LLAMA}, **many))


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"model": "huge"}, "String should match pattern"),
        ({"model": "config.json"}, "String should match pattern"),
        ({"model": "tiny", "modelConfig": LLAMA}, "name the model two ways"),
        ({"modelConfig": {"hidden_size": 64}}, "needs its model_type"),
        ({"tokenizer": "relative/tokenizer.json"}, "String should match pattern"),
        ({"command": ["python", "t.py"], "tokenizer": "/t.json"}, "cannot be set together with spec.trainer.command"),
    ],
)
def test_a_model_named_wrongly_is_refused(trainer, message):
    assert message in refusal(minimal(trainer=trainer))
