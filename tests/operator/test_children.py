"""Every child of a DiLoCoJob, rendered from a spec: names, labels, owners, env, probes, resources,
tolerations, overrides, and that each is a well-formed Kubernetes object."""

import base64
import datetime
import json
import os

import pytest
from kubernetes.client import models as k8s

from diloco.api.job import DiLoCoJobSpec
from diloco.core.config import TrainingConfig
from diloco.operator import naming as n
from diloco.operator.children import (
    SPOT_TOLERATIONS,
    OperatorRef,
    Scale,
    child_key,
    render_children,
    tls_secret,
)
from diloco.operator.job_tls import job_tls, operator_made_data, server_names
from diloco.operator.overrides import merge
from diloco.operator.tokens import JobTokens, ca_key, fingerprint
from diloco.settings import load_security
from diloco.transport.tls import Role, TlsError

JOB = n.JobRef(name="demo", namespace="ml", uid="0b7c6c1e-uid")
NOW = datetime.datetime(2026, 11, 24, tzinfo=datetime.UTC)
CA_KEY = ca_key(b"k" * 32, JOB)
LIVE_TLS = tls_secret(JOB, operator_made_data(JOB, {}, server_names(JOB, 2), NOW, CA_KEY))
"""The job's operator-made TLS Secret as it lives, so renderings of a two-shard job reuse its certificates."""
MODELS = {
    "ConfigMap": k8s.V1ConfigMap,
    "Secret": k8s.V1Secret,
    "Service": k8s.V1Service,
    "PersistentVolumeClaim": k8s.V1PersistentVolumeClaim,
    "Deployment": k8s.V1Deployment,
    "StatefulSet": k8s.V1StatefulSet,
    "NetworkPolicy": k8s.V1NetworkPolicy,
}


def make_spec(**overrides) -> DiLoCoJobSpec:
    data = {
        "image": "reg.example/diloco:1",
        "training": {"innerSteps": 40, "fragments": 4, "overlapSteps": 2},
        "islands": [
            {
                "name": "h100",
                "replicas": 4,
                "acceleratorsPerPod": 8,
                "spot": True,
                "nodeSelector": {"pool": "h100"},
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                            ]
                        }
                    }
                },
                "resources": {"requests": {"cpu": 32}, "limits": {"memory": "256Gi"}},
                "priorityClassName": "training",
            },
            {"name": "a100", "replicas": 1},
        ],
        "syncer": {
            "shards": 2,
            "resources": {"requests": {"cpu": "2"}},
            "checkpoint": {"size": "20Gi", "storageClassName": "ssd"},
        },
    }
    data.update(overrides)
    return DiLoCoJobSpec.model_validate(data)


def render(spec=None, scale=None, token="s3cret", operator=OperatorRef("diloco-system"), named=None, tokens=None):
    spec = spec or make_spec()
    scale = scale or Scale(islands={i.name: i.replicas for i in spec.islands}, syncers=1)
    tls = job_tls(JOB, spec, LIVE_TLS, named or {}, NOW, ca_key=CA_KEY)
    tokens = tokens or JobTokens.only(token)
    return {child_key(obj): obj for obj in render_children(JOB, spec, tokens, scale, operator, tls=tls)}


def env_of(container) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_every_child_is_named_deterministically():
    assert set(render()) == {
        ("ConfigMap", "demo-config"),
        ("Secret", "diloco-demo-token"),
        ("Secret", "diloco-demo-tls"),
        ("NetworkPolicy", "demo-syncers"),
        ("PersistentVolumeClaim", "demo-syncer-0"),
        ("Service", "demo-syncer-0"),
        ("Deployment", "demo-syncer-0"),
        ("PersistentVolumeClaim", "demo-syncer-1"),
        ("Service", "demo-syncer-1"),
        ("Deployment", "demo-syncer-1"),
        ("Service", "demo-h100"),
        ("StatefulSet", "demo-h100"),
        ("Service", "demo-a100"),
        ("StatefulSet", "demo-a100"),
    }


def test_every_child_is_a_valid_kubernetes_object():
    for (kind, name), obj in render().items():
        parsed = MODELS[kind].from_dict(obj)
        assert parsed.metadata.name == name and parsed.metadata.namespace == "ml"


def test_labels_and_owner_references():
    for (_kind, name), obj in render().items():
        meta = obj["metadata"]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "diloco", name
        assert labels["app.kubernetes.io/instance"] == "demo"
        assert labels["app.kubernetes.io/managed-by"] == "diloco-operator"
        assert labels["diloco.dev/job"] == "demo" and labels["diloco.dev/role"]
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "diloco.dev/v1alpha1",
                "kind": "DiLoCoJob",
                "name": "demo",
                "uid": JOB.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    children = render()
    island = children[("StatefulSet", "demo-h100")]["metadata"]["labels"]
    assert (island["app.kubernetes.io/component"], island["diloco.dev/island"], island["diloco.dev/role"]) == (
        "island",
        "h100",
        "trainer",
    )
    shard = children[("Deployment", "demo-syncer-1")]["metadata"]["labels"]
    assert (shard["app.kubernetes.io/component"], shard["diloco.dev/shard"], shard["diloco.dev/role"]) == (
        "syncer",
        "1",
        "syncer",
    )


def test_rendering_is_deterministic_and_digests_track_content():
    first, again = render(), render()
    assert first == again
    digests = {k: v["metadata"]["annotations"][n.ANNOTATION_HASH] for k, v in first.items()}
    changed = render(scale=Scale(islands={"h100": 0, "a100": 1}, syncers=1))
    for key, obj in changed.items():
        same = obj["metadata"]["annotations"][n.ANNOTATION_HASH] == digests[key]
        assert same == (key != ("StatefulSet", "demo-h100")), key


def test_config_map_holds_the_training_config_and_pods_roll_when_it_changes():
    spec = make_spec()
    cm = render(spec)[("ConfigMap", "demo-config")]
    assert TrainingConfig.from_json(cm["data"][n.CONFIG_KEY]) == spec.training
    hash_before = render(spec)[("StatefulSet", "demo-a100")]["spec"]["template"]["metadata"]["annotations"]
    other = make_spec(training={"innerSteps": 40, "fragments": 4, "overlapSteps": 2, "quorum": 2})
    hash_after = render(other)[("StatefulSet", "demo-a100")]["spec"]["template"]["metadata"]["annotations"]
    assert hash_before[n.ANNOTATION_CONFIG_HASH] != hash_after[n.ANNOTATION_CONFIG_HASH]


def test_shard_pods_roll_only_for_the_knobs_shards_act_on():
    def shard_hash(**training):
        spec = make_spec(training={"innerSteps": 40, "fragments": 4, "overlapSteps": 2, **training})
        return render(spec)[("Deployment", "demo-syncer-0")]["spec"]["template"]["metadata"]["annotations"][
            n.ANNOTATION_CONFIG_HASH
        ]

    base = shard_hash()
    assert shard_hash(innerSteps=80, mixAlpha=0.3, encoding="int8", inner={"lr": 0.01}) == base
    assert shard_hash(quorum=2) != base and shard_hash(outer={"lr": 0.5}) != base


def test_secret_carries_the_token_presented_and_those_accepted():
    secret = render(token="tok-123")[("Secret", "diloco-demo-token")]
    assert secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"][n.TOKEN_KEY]).decode() == "tok-123"
    assert base64.b64decode(secret["data"]["accepted"]).decode() == "tok-123\n"
    rotating = render(tokens=JobTokens("old", ("old", "new")))[("Secret", "diloco-demo-token")]
    assert base64.b64decode(rotating["data"][n.TOKEN_KEY]).decode() == "old"
    assert base64.b64decode(rotating["data"]["accepted"]).decode() == "old\nnew\n"
    assert JobTokens.from_secret(rotating) == JobTokens("old", ("old", "new"))


def test_syncer_deployment():
    spec = make_spec()
    deployment = render(spec, scale=Scale(islands={}, syncers=1))[("Deployment", "demo-syncer-1")]
    dspec = deployment["spec"]
    assert dspec["replicas"] == 1 and dspec["strategy"] == {"type": "Recreate"}
    assert dspec["selector"]["matchLabels"].items() <= dspec["template"]["metadata"]["labels"].items()
    pod = dspec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "syncer" and container["command"] == ["diloco-syncer"]
    assert container["image"] == spec.image
    env = env_of(container)
    assert env["DILOCO_SHARD_INDEX"] == "1" and env["DILOCO_NUM_SHARDS"] == "2"
    assert env["DILOCO_SYNCER_PORT"] == "50051" and env["DILOCO_METRICS_PORT"] == "9090"
    assert env["DILOCO_CHECKPOINT_DIR"] == "/var/lib/diloco" and env["DILOCO_CHECKPOINT_INTERVAL"] == "30"
    assert env["DILOCO_CONFIG_FILE"] == "/etc/diloco/training.json"
    assert env["DILOCO_TOKEN_FILE"] == "/var/run/secrets/diloco/accepted", "every token the shard accepts"
    assert env["DILOCO_HEALTH_PORT"] == "50052"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # the kubelet's probes speak no TLS
        assert container[probe]["grpc"] == {"port": 50052}, probe
    assert container["resources"] == {"requests": {"cpu": "2"}}
    assert {"name": "checkpoints", "mountPath": "/var/lib/diloco"} in container["volumeMounts"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "demo-syncer-1"}} in pod["volumes"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False


def test_a_shard_works_on_as_many_threads_as_cores_it_requests():
    def env(resources):
        spec = make_spec(syncer={"shards": 1, "resources": resources})
        (container,) = render(spec)[("Deployment", "demo-syncer-0")]["spec"]["template"]["spec"]["containers"]
        return env_of(container)

    sixteen = env({"requests": {"cpu": "16"}, "limits": {"cpu": "32"}})
    assert sixteen["DILOCO_SYNCER_THREADS"] == "16" and sixteen["OMP_NUM_THREADS"] == "16", "the request, not the limit"
    assert env({"limits": {"cpu": 8}})["DILOCO_SYNCER_THREADS"] == "8", "a limit alone"
    assert env({"requests": {"cpu": "2500m"}})["DILOCO_SYNCER_THREADS"] == "2", "whole cores"
    assert env({"requests": {"cpu": "250m"}})["DILOCO_SYNCER_THREADS"] == "1", "never fewer than one"
    assert "DILOCO_SYNCER_THREADS" not in env({}), "no CPU named: every CPU it may run on"


def test_a_shard_is_told_how_many_islands_the_job_declares_unless_other_clusters_train_against_it():
    def env(**syncer):
        spec = make_spec(islands=[{"name": f"i{k}", "replicas": 2} for k in range(3)], syncer={"shards": 1, **syncer})
        (container,) = render(spec)[("Deployment", "demo-syncer-0")]["spec"]["template"]["spec"]["containers"]
        return env_of(container)

    assert env()["DILOCO_ISLANDS"] == "3", "islands, not their pods"
    assert "DILOCO_ISLANDS" not in env(expose={"type": "LoadBalancer"}), "islands of other clusters come too"


def test_syncer_image_override_and_stopped_syncers():
    spec = make_spec(syncer={"shards": 1, "image": "reg.example/syncer:2"})
    deployment = render(spec, scale=Scale(islands={}, syncers=0))[("Deployment", "demo-syncer-0")]
    assert deployment["spec"]["replicas"] == 0
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "reg.example/syncer:2"


def test_syncer_environment_is_what_diloco_syncer_reads(monkeypatch):
    from diloco.syncer.main import parse_args

    container = render()[("Deployment", "demo-syncer-1")]["spec"]["template"]["spec"]["containers"][0]
    for name, value in env_of(container).items():
        monkeypatch.setenv(name, value)
    args = parse_args([])
    assert (args.shard_index, args.num_shards, args.port, args.metrics_port) == (1, 2, 50051, 9090)
    assert (args.checkpoint_dir, args.checkpoint_interval) == ("/var/lib/diloco", 30.0)
    assert args.health_port == 50052
    with pytest.raises(TlsError, match="/var/run/secrets/diloco-tls/"):  # read from where the Secret is mounted
        load_security(Role.SERVER, args)


def test_syncer_service_and_claim():
    children = render()
    service = children[("Service", "demo-syncer-0")]["spec"]
    assert service["selector"] == {"diloco.dev/job": "demo", "diloco.dev/shard": "0"}
    assert {p["name"]: p["port"] for p in service["ports"]} == {"grpc": 50051, "metrics": 9090}
    claim = children[("PersistentVolumeClaim", "demo-syncer-0")]["spec"]
    assert claim["resources"] == {"requests": {"storage": "20Gi"}} and claim["storageClassName"] == "ssd"
    assert claim["accessModes"] == ["ReadWriteOnce"]


def test_island_statefulset():
    sts = render()[("StatefulSet", "demo-h100")]["spec"]
    assert sts["replicas"] == 4 and sts["podManagementPolicy"] == "Parallel"
    assert sts["updateStrategy"] == {"type": "OnDelete"} and sts["serviceName"] == "demo-h100"
    assert sts["selector"]["matchLabels"] == {"diloco.dev/job": "demo", "diloco.dev/island": "h100"}
    assert sts["selector"]["matchLabels"].items() <= sts["template"]["metadata"]["labels"].items()
    pod = sts["template"]["spec"]
    (trainer,) = pod["containers"]
    assert trainer["name"] == "trainer" and trainer["command"] == ["diloco-worker"]
    assert trainer["resources"] == {
        "requests": {"cpu": "32", "nvidia.com/gpu": "8"},
        "limits": {"memory": "256Gi", "nvidia.com/gpu": "8"},
    }
    assert pod["nodeSelector"] == {"pool": "h100"} and pod["priorityClassName"] == "training"
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert pod["tolerations"][0] == {"key": "gpu", "operator": "Exists"}
    assert pod["tolerations"][1:] == list(SPOT_TOLERATIONS)
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "checkpoints", "emptyDir": {}} in pod["volumes"], "a restarted trainer container resumes warm"
    assert {"name": "checkpoints", "mountPath": "/var/lib/diloco"} in trainer["volumeMounts"]
    assert env_of(trainer)["DILOCO_CHECKPOINT_DIR"] == "/var/lib/diloco"
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_an_island_checkpoint_volume_is_a_claim_per_pod_kept_while_the_island_is_scaled_down():
    """island.checkpoint: the StatefulSet's volumeClaimTemplates mounted where the emptyDir was, so a replaced
    pod finds its checkpoints; claims outlive a re-form (scaled to zero) and go with the job."""
    islands = [
        {"name": "h100", "checkpoint": {"size": "5Gi", "storageClassName": "ssd", "checkpointEvery": 20}},
        {"name": "a100"},
    ]
    children = render(make_spec(islands=islands))
    sts = children[("StatefulSet", "demo-h100")]["spec"]
    (template,) = sts["volumeClaimTemplates"]
    assert template["metadata"]["name"] == "checkpoints"
    assert template["metadata"]["labels"] == children[("StatefulSet", "demo-h100")]["metadata"]["labels"]
    assert template["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "5Gi"}},
        "storageClassName": "ssd",
    }
    assert sts["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    pod = sts["template"]["spec"]
    (trainer,) = pod["containers"]
    assert not any(v["name"] == "checkpoints" for v in pod["volumes"]), "the claim, not an emptyDir"
    assert {"name": "checkpoints", "mountPath": "/var/lib/diloco"} in trainer["volumeMounts"]
    assert env_of(trainer)["DILOCO_CHECKPOINT_EVERY"] == "20"
    k8s.V1StatefulSet.from_dict(children[("StatefulSet", "demo-h100")])

    plain = children[("StatefulSet", "demo-a100")]["spec"]
    assert "volumeClaimTemplates" not in plain and "persistentVolumeClaimRetentionPolicy" not in plain
    assert "DILOCO_CHECKPOINT_EVERY" not in env_of(plain["template"]["spec"]["containers"][0]), "the worker's own"


def test_an_island_checkpoint_without_an_interval_leaves_the_workers_default():
    islands = [{"name": "h100", "checkpoint": {}}]
    sts = render(make_spec(islands=islands))[("StatefulSet", "demo-h100")]["spec"]
    assert sts["volumeClaimTemplates"][0]["spec"]["resources"] == {"requests": {"storage": "1Gi"}}
    assert "storageClassName" not in sts["volumeClaimTemplates"][0]["spec"], "the cluster's default class"
    assert "DILOCO_CHECKPOINT_EVERY" not in env_of(sts["template"]["spec"]["containers"][0])


def test_every_trainer_is_ready_only_while_it_trains():
    """The readiness probe asks the learner's /readyz on the metrics port, the built-in worker's and a custom
    command's alike (`Learner.from_env` serves it)."""
    container = render()[("StatefulSet", "demo-h100")]["spec"]["template"]["spec"]["containers"][0]
    probe = container["readinessProbe"]
    assert probe["httpGet"] == {"path": "/readyz", "port": 9090}
    assert probe["periodSeconds"] > 0 and probe["failureThreshold"] >= 1
    assert "livenessProbe" not in container
    custom = make_spec(trainer={"command": ["python", "-m", "mine"]})
    trainer = render(custom)[("StatefulSet", "demo-a100")]["spec"]["template"]["spec"]["containers"][0]
    assert trainer["readinessProbe"] == probe


def test_the_trainer_readiness_probe_asks_what_diloco_worker_serves():
    from diloco.worker.metrics import READINESS_PATH

    container = render()[("StatefulSet", "demo-h100")]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == READINESS_PATH
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (
        container["readinessProbe"]["httpGet"]["port"]
        == ports["metrics"]
        == int(env_of(container)["DILOCO_METRICS_PORT"])
    )


def test_island_environment_rendezvous_and_syncers():
    pod = render()[("StatefulSet", "demo-h100")]["spec"]["template"]["spec"]
    env = env_of(pod["containers"][0])
    assert env["DILOCO_SYNCERS"] == "demo-syncer-0.ml.svc:50051,demo-syncer-1.ml.svc:50051"
    assert env["DILOCO_ISLAND"] == "h100" and env["DILOCO_JOB"] == "demo"
    assert env["DILOCO_MODEL"] == "tiny" and env["DILOCO_DATA"] == "stdlib"
    assert env["DILOCO_PRECISION"] == "auto" and env["DILOCO_ACTIVATION_CHECKPOINTING"] == "0"
    assert env["MASTER_PORT"] == "29500"
    assert env["MASTER_ADDR"] == "demo-h100-0.demo-h100.ml.svc"
    assert env["DILOCO_CONFIG_FILE"] == "/etc/diloco/training.json"
    assert env["DILOCO_TOKEN_FILE"] == "/var/run/secrets/diloco/token"


ORDINAL = {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}


def test_an_island_world_has_one_rank_per_accelerator_of_every_pod():
    """4 pods of 8 accelerators: 32 ranks; each pod's launcher numbers its own from the pod's NODE_RANK."""
    env = env_of(render()[("StatefulSet", "demo-h100")]["spec"]["template"]["spec"]["containers"][0])
    assert env["DILOCO_ACCELERATORS_PER_POD"] == "8"
    assert env["WORLD_SIZE"] == "32" and env["NODE_RANK"] == ORDINAL
    assert "RANK" not in env, "a pod of eight ranks has no one rank"


def test_a_pod_without_accelerators_is_one_rank_numbered_by_its_ordinal():
    env = env_of(render()[("StatefulSet", "demo-a100")]["spec"]["template"]["spec"]["containers"][0])
    assert env["DILOCO_ACCELERATORS_PER_POD"] == "0" and env["WORLD_SIZE"] == "1"
    assert env["RANK"] == env["NODE_RANK"] == ORDINAL


def test_island_environment_is_what_diloco_worker_reads(monkeypatch):
    worker_main = pytest.importorskip("diloco.worker.main")
    from diloco.worker.pod_ranks import PodShape

    container = render()[("StatefulSet", "demo-h100")]["spec"]["template"]["spec"]["containers"][0]
    for name, value in env_of(container).items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    args = worker_main.parse_args([])
    assert args.island == "h100" and args.model == "tiny" and args.data == "stdlib"
    assert args.syncers.split(",") == ["demo-syncer-0.ml.svc:50051", "demo-syncer-1.ml.svc:50051"]
    pod_3 = {**os.environ, "NODE_RANK": "3"}  # what the kubelet makes of the ordinal's fieldRef
    shape = PodShape.from_env(pod_3)
    assert shape == PodShape(pods=4, ranks_per_pod=8, node_rank=3) and shape.global_rank(7) == 31
    with pytest.raises(TlsError, match="/var/run/secrets/diloco-tls/ca.crt"):
        load_security(Role.CLIENT, args)
    assert args.steps is None  # no step cap: the pods train until the job is done and they get SIGTERM
    assert args.termination_grace_seconds == 30


def test_pod_templates_carry_a_fingerprint_of_the_certificates_so_new_ones_roll_every_holder():
    spec = make_spec()
    scale = Scale(islands={i.name: i.replicas for i in spec.islands}, syncers=1)
    kept = render()
    remade = {
        child_key(obj): obj
        for obj in render_children(
            JOB,
            spec,
            JobTokens.only("s3cret"),
            scale,
            OperatorRef("diloco-system"),
            tls=job_tls(JOB, spec, None, {}, NOW, ca_key=CA_KEY),
        )
    }
    for key in (("Deployment", "demo-syncer-0"), ("StatefulSet", "demo-h100")):
        old = kept[key]["spec"]["template"]["metadata"]["annotations"]["diloco.dev/tls-hash"]
        assert old and old != remade[key]["spec"]["template"]["metadata"]["annotations"]["diloco.dev/tls-hash"]
    assert render() == kept, "the live Secret's certificates are kept"


def test_the_trainer_learns_its_pods_grace_period():
    """One knob: the pod's terminationGracePeriodSeconds, which also bounds the worker's last pushes."""
    default = render()[("StatefulSet", "demo-a100")]["spec"]["template"]["spec"]
    assert env_of(default["containers"][0])["DILOCO_TERMINATION_GRACE_SECONDS"] == "30"
    assert default["terminationGracePeriodSeconds"] == 30
    override = {"spec": {"terminationGracePeriodSeconds": 120}}
    spec = make_spec(islands=[{"name": "old", "podTemplate": override}])
    pod = render(spec)[("StatefulSet", "demo-old")]["spec"]["template"]["spec"]
    assert env_of(pod["containers"][0])["DILOCO_TERMINATION_GRACE_SECONDS"] == "120"
    assert pod["terminationGracePeriodSeconds"] == 120


def test_headless_island_service():
    service = render()[("Service", "demo-a100")]["spec"]
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
    assert service["selector"] == {"diloco.dev/job": "demo", "diloco.dev/island": "a100"}
    assert service["ports"][0]["port"] == 29500


def test_cpu_island_without_spot_has_no_accelerators_or_tolerations():
    pod = render()[("StatefulSet", "demo-a100")]["spec"]["template"]["spec"]
    assert "tolerations" not in pod and "nodeSelector" not in pod and "priorityClassName" not in pod
    assert pod["containers"][0]["resources"] == {}


def test_builtin_trainer_settings_and_custom_command():
    spec = make_spec(
        trainer={
            "model": "xl",
            "data": "/data/t.bin",
            "precision": "bf16",
            "activationCheckpointing": True,
            "args": ["--batch-size", "8"],
        }
    )
    trainer = render(spec)[("StatefulSet", "demo-a100")]["spec"]["template"]["spec"]["containers"][0]
    assert env_of(trainer)["DILOCO_MODEL"] == "xl" and env_of(trainer)["DILOCO_DATA"] == "/data/t.bin"
    assert env_of(trainer)["DILOCO_PRECISION"] == "bf16" and env_of(trainer)["DILOCO_ACTIVATION_CHECKPOINTING"] == "1"
    assert trainer["args"] == ["--batch-size", "8"]
    custom = make_spec(trainer={"command": ["python", "-m", "mine"]})
    trainer = render(custom)[("StatefulSet", "demo-a100")]["spec"]["template"]["spec"]["containers"][0]
    assert trainer["command"] == ["python", "-m", "mine"] and "args" not in trainer
    assert "DILOCO_PRECISION" not in env_of(trainer), "a custom trainer chooses its own arithmetic"
    assert "DILOCO_MODEL" not in env_of(trainer) and "DILOCO_SYNCERS" in env_of(trainer)


def test_each_island_reads_its_own_share_of_the_data_and_the_model_its_named():
    llama = {"model_type": "llama", "hidden_size": 64}
    spec = make_spec(trainer={"modelConfig": llama, "tokenizer": "/data/tokenizer.json", "textField": "body"})
    children = render(spec)
    envs = [
        env_of(children[("StatefulSet", f"demo-{name}")]["spec"]["template"]["spec"]["containers"][0])
        for name in ("h100", "a100")
    ]
    assert [(e["DILOCO_DATA_SHARD"], e["DILOCO_DATA_SHARDS"]) for e in envs] == [("0", "2"), ("1", "2")]
    assert all(json.loads(e["DILOCO_MODEL"]) == llama and e["DILOCO_TOKENIZER"] == "/data/tokenizer.json" for e in envs)
    assert envs[0]["DILOCO_TEXT_FIELD"] == "body" and "DILOCO_INIT_FROM" not in envs[0]
    resumed = make_spec(trainer={"initFrom": "/data/checkpoint"})
    env = env_of(render(resumed)[("StatefulSet", "demo-a100")]["spec"]["template"]["spec"]["containers"][0])
    assert env["DILOCO_MODEL"] == "" and env["DILOCO_INIT_FROM"] == "/data/checkpoint"


def test_the_export_job_names_the_model_and_reads_it_where_the_first_islands_trainer_does():
    data = {
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "volumeMounts": [
                        {"name": "corpus", "mountPath": "/data"},
                        {"name": "scratch", "mountPath": "/scratch"},
                    ],
                }
            ],
            "volumes": [
                {"name": "corpus", "persistentVolumeClaim": {"claimName": "corpus"}},
                {"name": "scratch", "emptyDir": {}},
            ],
        }
    }
    spec = make_spec(
        trainer={"model": "/data/config.json", "tokenizer": "/data/tokenizer.json"},
        islands=[{"name": "a", "podTemplate": data}, {"name": "b"}],
        export={"claimName": "models"},
    )
    pod = render(spec, scale=Scale(islands={}, syncers=0, export=True))[("Job", "demo-export")]["spec"]["template"][
        "spec"
    ]
    (container,) = pod["containers"]
    assert env_of(container)["DILOCO_MODEL"] == "/data/config.json"
    assert env_of(container)["DILOCO_TOKENIZER"] == "/data/tokenizer.json"
    assert {"name": "corpus", "mountPath": "/data", "readOnly": True} in container["volumeMounts"]
    assert {"name": "corpus", "persistentVolumeClaim": {"claimName": "corpus", "readOnly": True}} in pod["volumes"]
    assert "scratch" not in {v["name"] for v in pod["volumes"]}, "an emptyDir holds nothing to read"


def test_the_export_job_reads_every_shards_volume_and_writes_to_the_named_claim():
    spec = make_spec(export={"claimName": "models", "path": "runs/demo"})
    assert ("Job", "demo-export") not in render(spec)
    job = render(spec, scale=Scale(islands={}, syncers=0, export=True))[("Job", "demo-export")]
    assert k8s.V1Job.from_dict(job).metadata.name == "demo-export"
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
    (container,) = pod["containers"]
    assert container["command"] == [
        "diloco",
        "export",
        "/export/runs/demo",
        "--checkpoints",
        "/shards/0",
        "/shards/1",
        "--config",
        "/etc/diloco/training.json",
    ]
    claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {
        "shard-0": {"claimName": "demo-syncer-0", "readOnly": True},
        "shard-1": {"claimName": "demo-syncer-1", "readOnly": True},
        "export": {"claimName": "models"},
    }
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["shard-0"]["readOnly"] and not mounts["export"].get("readOnly")
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_pod_template_override_is_merged_last():
    override = {
        "metadata": {"labels": {"team": "llm"}},
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "image": "reg.example/diloco:1-cu121",
                    "env": [
                        {"name": "NCCL_IB_DISABLE", "value": "1"},
                        {"name": "DILOCO_DATA", "value": "/mnt/override"},
                    ],
                },
                {"name": "sidecar", "image": "busybox"},
            ],
            "volumes": [{"name": "corpus", "persistentVolumeClaim": {"claimName": "corpus"}}],
            "terminationGracePeriodSeconds": 120,
        },
    }
    spec = make_spec(islands=[{"name": "old", "podTemplate": override}])
    template = render(spec)[("StatefulSet", "demo-old")]["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "llm"
    assert template["metadata"]["labels"]["diloco.dev/island"] == "old"
    trainer, sidecar = template["spec"]["containers"]
    assert trainer["image"] == "reg.example/diloco:1-cu121" and trainer["command"] == ["diloco-worker"]
    env = env_of(trainer)
    assert env["NCCL_IB_DISABLE"] == "1" and env["DILOCO_DATA"] == "/mnt/override" and env["DILOCO_ISLAND"] == "old"
    assert {k: v for k, v in sidecar.items() if k != "securityContext"} == {"name": "sidecar", "image": "busybox"}
    assert [v["name"] for v in template["spec"]["volumes"]] == [
        "config",
        "token",
        "tls",
        "dshm",
        "checkpoints",
        "corpus",
    ]
    assert template["spec"]["terminationGracePeriodSeconds"] == 120
    k8s.V1PodTemplateSpec.from_dict(template)


def test_every_container_of_every_pod_keeps_the_secure_defaults_whatever_the_override_adds():
    def override(container):
        return {
            "spec": {"containers": [{"name": container, "image": "other"}, {"name": "sidecar", "image": "busybox"}]}
        }

    spec = make_spec(
        islands=[{"name": "old", "podTemplate": override("trainer")}], syncer={"podTemplate": override("syncer")}
    )
    children = render(spec)
    for key in (("StatefulSet", "demo-old"), ("Deployment", "demo-syncer-0")):
        pod = children[key]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert len(pod["containers"]) == 2
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, (key, container["name"])
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}, (key, container["name"])
        assert not any(k.startswith("host") for k in pod), key


def test_merge_semantics():
    base = {"a": {"b": 1, "c": [1, 2]}, "items": [{"name": "x", "v": 1}, {"name": "y", "v": 2}]}
    patch = {"a": {"c": [3], "d": None}, "items": [{"name": "y", "v": 20}, {"name": "z"}], "new": {"k": None}}
    assert merge(base, patch) == {
        "a": {"b": 1, "c": [3]},
        "items": [{"name": "x", "v": 1}, {"name": "y", "v": 20}, {"name": "z"}],
        "new": {},
    }
    assert base["items"][1]["v"] == 2
    assert merge({"items": [{"name": "x"}]}, {"items": []}) == {"items": []}
    assert merge({"a": 1}, {"a": None}) == {}


def test_network_policy_admits_only_the_job_and_the_operator():
    policy = render()[("NetworkPolicy", "demo-syncers")]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"diloco.dev/job": "demo", "app.kubernetes.io/component": "syncer"}
    assert policy["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule = policy["ingress"]
    assert grpc_rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    assert grpc_rule["from"] == [
        {"podSelector": {"matchLabels": {"diloco.dev/job": "demo"}}},
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "diloco-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "diloco-operator"}},
        },
    ]
    assert metrics_rule == {"ports": [{"port": 9090, "protocol": "TCP"}]}
    alone = render(operator=None)[("NetworkPolicy", "demo-syncers")]["spec"]["ingress"][0]["from"]
    assert alone == [{"podSelector": {"matchLabels": {"diloco.dev/job": "demo"}}}]


def test_scale_decides_island_replicas():
    children = render(scale=Scale(islands={"h100": 0}, syncers=1))
    assert children[("StatefulSet", "demo-h100")]["spec"]["replicas"] == 0
    assert children[("StatefulSet", "demo-a100")]["spec"]["replicas"] == 0


def test_a_job_name_too_long_for_its_children_is_refused():
    with pytest.raises(ValueError, match="metadata.name"):
        job = n.JobRef("x" * 31, "ml", "uid")
        tls = job_tls(job, make_spec(), None, {}, NOW, ca_key=CA_KEY)
        render_children(job, make_spec(), JobTokens.only("t"), Scale({}, 1), None, tls=tls)


def test_children_serialise_to_json():
    for obj in render().values():
        assert json.loads(json.dumps(obj)) == obj


def test_island_templates_carry_a_fingerprint_of_the_token_they_present_so_a_new_one_rolls_them():
    before, after = render(token="first-token"), render(token="second-token")
    old = before[("StatefulSet", "demo-h100")]["spec"]["template"]["metadata"]["annotations"]["diloco.dev/token-hash"]
    new = after[("StatefulSet", "demo-h100")]["spec"]["template"]["metadata"]["annotations"]["diloco.dev/token-hash"]
    assert old != new and "token" not in old
    assert render(token="first-token") == before
    accepting = render(tokens=JobTokens("first-token", ("first-token", "second-token")))
    assert accepting[("StatefulSet", "demo-h100")] == before[("StatefulSet", "demo-h100")], "nothing rolls yet"


def test_a_new_token_restarts_no_shard_they_read_the_tokens_they_accept_again():
    before, after = render(token="first-token"), render(token="second-token")
    template = before[("Deployment", "demo-syncer-0")]["spec"]["template"]
    assert "diloco.dev/token-hash" not in template["metadata"]["annotations"]
    assert after[("Deployment", "demo-syncer-0")] == before[("Deployment", "demo-syncer-0")]


@pytest.mark.parametrize(
    ("first", "second"),
    [(("a", "b-x"), ("a-b", "x")), (("a", "syncer-syncer-0"), ("a-syncer", "x")), (("a", "b-c-d"), ("a-b", "c-d"))],
)
def test_child_names_of_two_jobs_never_collide(first, second):
    def names(job, island):
        spec = make_spec(islands=[{"name": island, "replicas": 1}], syncer={"shards": 1})
        ref = n.JobRef(name=job, namespace="ml", uid=job)
        scale = Scale(islands={island: 1}, syncers=1)
        tls = job_tls(ref, spec, None, {}, NOW, ca_key=CA_KEY)
        return {child_key(obj) for obj in render_children(ref, spec, JobTokens.only("t"), scale, None, tls=tls)}

    assert not names(*first) & names(*second)


def test_exposed_shards_open_their_grpc_port_to_every_client_and_a_route_joins_each_shard():
    route = {"type": "GRPCRoute", "gateway": {"name": "edge"}, "domain": "ex.io"}
    children = render(make_spec(syncer={"shards": 2, "expose": route}))
    assert [key for key in children if key[0] == "GRPCRoute"] == [
        ("GRPCRoute", "demo-syncer-0"),
        ("GRPCRoute", "demo-syncer-1"),
    ]
    assert n.ANNOTATION_HASH in children[("GRPCRoute", "demo-syncer-0")]["metadata"]["annotations"]
    grpc_rule = children[("NetworkPolicy", "demo-syncers")]["spec"]["ingress"][0]
    assert grpc_rule == {"ports": [{"port": 50051, "protocol": "TCP"}]}, "TLS and the token keep strangers out"
    balanced = render(make_spec(syncer={"shards": 2, "expose": {"type": "LoadBalancer"}}))
    service = balanced[("Service", "demo-syncer-0")]["spec"]
    assert service["type"] == "LoadBalancer"
    assert [p["name"] for p in service["ports"]] == ["grpc"], "metrics stay inside the cluster"
    noded = render(make_spec(syncer={"shards": 2, "expose": {"type": "NodePort", "nodeAddress": "203.0.113.7"}}))
    assert [p["name"] for p in noded[("Service", "demo-syncer-1")]["spec"]["ports"]] == ["grpc"]
    assert not any(kind == "GRPCRoute" for kind, _ in balanced)


def test_a_job_against_remote_shards_renders_only_its_islands_mounting_their_token_and_dialling_them():
    remote = {"endpoints": ["127.0.0.5:31000", "127.0.0.5:31001"], "tokenSecret": "far-token", "caSecret": "far-ca"}
    spec = make_spec(syncer={"shards": 2}, remoteSyncers=remote)
    named = {"far-ca": {"data": {"ca.crt": base64.b64encode(b"ca").decode()}}}
    children = render(spec, token="their-token", named=named)
    assert sorted(children) == [
        ("ConfigMap", "demo-config"),
        ("Service", "demo-a100"),
        ("Service", "demo-h100"),
        ("StatefulSet", "demo-a100"),
        ("StatefulSet", "demo-h100"),
    ]
    pod = children[("StatefulSet", "demo-h100")]["spec"]["template"]
    (token,) = [v for v in pod["spec"]["volumes"] if v["name"] == "token"]
    assert token["secret"]["secretName"] == "far-token"
    assert pod["metadata"]["annotations"][n.ANNOTATION_TOKEN_HASH] == fingerprint("their-token")
    (trainer,) = pod["spec"]["containers"]
    assert env_of(trainer)["DILOCO_SYNCERS"] == "127.0.0.5:31000,127.0.0.5:31001"
    assert env_of(trainer)["DILOCO_TLS_CA_FILE"] == "/var/run/secrets/diloco-tls/ca.crt"


def test_each_rank_gets_its_share_of_the_pods_cpu_as_threads():
    spec = make_spec()
    rendered = render(spec)

    def threads(island):
        (container,) = rendered[("StatefulSet", f"demo-{island}")]["spec"]["template"]["spec"]["containers"]
        return env_of(container).get("OMP_NUM_THREADS")

    assert threads("h100") == "4", "32 CPUs among 8 ranks"
    assert threads("a100") is None, "no CPU named: torch's own default"
    one_cpu = make_spec(islands=[{"name": "cpu", "replicas": 2, "resources": {"requests": {"cpu": "500m"}}}])
    (container,) = render(one_cpu)[("StatefulSet", "demo-cpu")]["spec"]["template"]["spec"]["containers"]
    assert env_of(container)["OMP_NUM_THREADS"] == "1", "never fewer than one"
