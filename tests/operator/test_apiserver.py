"""Against a real kube-apiserver: the CRD is accepted, defaults and refuses as designed (messages naming the
field), the API layer works, and the operator, run as its own ServiceAccount under deploy/rbac.yaml,
converges jobs, honours suspend, final phases and the TTL, and changes nothing when restarted."""

from __future__ import annotations

import datetime
import json
import time
import urllib.request
from functools import partial
from pathlib import Path

import pytest
import support
import yaml
from kubernetes import config as kube_config
from operator_harness import NAMESPACE, OperatorProcess, install

from diloco.api.job import (
    ISLAND_NAME_MAX,
    MAX_ISLANDS,
    MAX_JOB_PODS,
    DiLoCoJobStatus,
    ExportPhase,
    ExportStatus,
    Phase,
)
from diloco.operator.event_recorder import EventRecorder
from diloco.operator.events import Event
from diloco.operator.job_status import ShardObservation
from diloco.operator.kube import ApiError, Kube
from diloco.operator.naming import JobRef
from diloco.operator.policies.model_export import WAITING_FOR_SHARDS
from diloco.operator.reconcile import Reconciler, status_patch
from diloco.operator.tokens import JobTokens

# The API server answers slower than loopback gRPC: poll for a minute, twice a second.
wait_until = partial(support.wait_until, timeout=60.0, interval=0.5)

pytestmark = [pytest.mark.process, pytest.mark.filterwarnings("ignore:Unverified HTTPS request")]

ROOT = Path(__file__).resolve().parents[2]
RESYNC = 1.0


REMOTE = {"endpoints": ["127.0.0.2:31000", "127.0.0.2:31001"], "tokenSecret": "t", "caSecret": "c"}


def job_manifest(name, **spec):
    body = {
        "image": "diloco-trainer:dev",
        "training": {"innerSteps": 20, "fragments": 2, "overlapSteps": 1},
        "islands": [{"name": "a", "replicas": 2}, {"name": "b"}],
        "syncer": {"shards": 2},
    }
    body.update(spec)
    return yaml.safe_dump(
        {"apiVersion": "diloco.dev/v1alpha1", "kind": "DiLoCoJob", "metadata": {"name": name}, "spec": body}
    )


@pytest.fixture(scope="module")
def kube(control_plane):
    return Kube(kube_config.new_client_from_config(config_file=str(control_plane.admin_kubeconfig)))


def namespace(plane, name):
    plane.kubectl("create", "namespace", name)
    return name


# --- the CRD ------------------------------------------------------------------------------------


def test_exposed_shards_and_remote_syncers_are_accepted(control_plane, kube):
    ns = namespace(control_plane, "reach")
    exposed = {"syncer": {"shards": 2, "expose": {"type": "LoadBalancer"}}}
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("exposed", **exposed))
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("remote", remoteSyncers=REMOTE))
    try:
        expose = kube.get("DiLoCoJob", ns, "exposed")["spec"]["syncer"]["expose"]
        assert expose == {"type": "LoadBalancer", "gatewayPort": 443}
        remote = kube.get("DiLoCoJob", ns, "remote")["spec"]
        assert remote["remoteSyncers"] == REMOTE and remote["syncer"]["expose"]["type"] == "ClusterIP"
    finally:
        # Gone before a later test starts an operator, which would reconcile them in a terminating namespace.
        control_plane.kubectl("-n", ns, "delete", "dj", "--all", "--wait=true", timeout=120)
        control_plane.kubectl("delete", "namespace", ns, "--wait=false")


def test_examples_are_accepted_with_every_default_filled_in(control_plane, kube):
    ns = namespace(control_plane, "examples")
    control_plane.kubectl("-n", ns, "apply", "-f", str(ROOT / "deploy" / "examples"))
    tiny = kube.get("DiLoCoJob", ns, "tiny-cpu")
    assert tiny["spec"]["training"]["outer"] == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert tiny["spec"]["training"]["maxStaleness"] == 4 and tiny["spec"]["failurePolicy"]["restartBudget"] == 10
    assert tiny["spec"]["syncer"]["checkpoint"] == {"size": "1Gi", "intervalSeconds": 30}
    assert tiny["spec"]["islands"][0]["acceleratorResource"] == "nvidia.com/gpu"
    mixed = kube.get("DiLoCoJob", ns, "llm-mixed")
    assert mixed["spec"]["islands"][0]["podTemplate"]["spec"]["volumes"][0]["name"] == "corpus"
    listing = control_plane.kubectl("-n", ns, "get", "dj").stdout.splitlines()[0].split()
    assert listing[:4] == ["NAME", "PHASE", "ISLANDS", "OUTER"]


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("quorum", {"training": {"quorum": 3}}, "spec.training.quorum: Invalid value: spec.training.quorum must not"),
        (
            "frag",
            {"training": {"innerSteps": 2, "fragments": 3, "overlapSteps": 0}, "syncer": {"shards": 1}},
            "spec.training.fragments: Invalid value: spec.training.fragments (P) must not exceed",
        ),
        (
            "tau",
            {"training": {"innerSteps": 8, "fragments": 4, "overlapSteps": 2}},
            "spec.training.overlapSteps: Invalid value",
        ),
        ("shards", {"syncer": {"shards": 3}}, "spec.syncer.shards: Invalid value: spec.syncer.shards must not exceed"),
        ("dup", {"islands": [{"name": "a"}, {"name": "a"}]}, "spec.islands[1]: Duplicate value"),
        ("reserved", {"islands": [{"name": "syncer-1"}]}, "spec.islands[0].name: Invalid value"),
        (
            "cmd",
            {"trainer": {"command": ["python"], "model": "tiny"}},
            "cannot be set together with spec.trainer.command",
        ),
        (
            "cmd-bf16",
            {"trainer": {"command": ["python"], "precision": "bf16"}},
            "cannot be set together with spec.trainer.command",
        ),
        ("precision", {"trainer": {"precision": "fp8"}}, "spec.trainer.precision: Unsupported value"),
        ("ports", {"syncer": {"shards": 1, "port": 9090}}, "spec.syncer: Invalid value"),
        ("tls-ca", {"tls": {"serverSecret": "s"}}, "spec.tls.caSecret: Invalid value"),
        ("tls-client", {"tls": {"serverSecret": "s", "caSecret": "c", "mutual": True}}, "spec.tls.clientSecret"),
        ("tls-plain", {"tls": {"insecurePlaintext": True, "mutual": True}}, "spec.tls.insecurePlaintext: Invalid"),
        ("np", {"syncer": {"expose": {"type": "NodePort"}}}, "spec.syncer.expose.nodeAddress: Invalid value"),
        ("route", {"syncer": {"expose": {"type": "GRPCRoute"}}}, "spec.syncer.expose.gateway: Invalid value"),
        ("r-shards", {"remoteSyncers": REMOTE, "syncer": {"shards": 1}}, "spec.syncer.shards: Invalid value"),
        ("r-image", {"remoteSyncers": REMOTE, "syncer": {"image": "s:1"}}, "spec.syncer: Invalid value"),
        ("r-tls", {"remoteSyncers": REMOTE, "tls": {"mutual": True}}, "spec.tls: Invalid value"),
        ("r-export", {"remoteSyncers": REMOTE, "export": {"claimName": "out"}}, "spec.export: Invalid value"),
        ("r-endpoint", {"remoteSyncers": {**REMOTE, "endpoints": ["x"]}}, "spec.remoteSyncers.endpoints[0]"),
        (
            "qty",
            {"islands": [{"name": "a", "resources": {"limits": {"memory": "lots"}}}]},
            "spec.islands[0].resources.limits.memory",
        ),
        (
            "alpha",
            {"training": {"innerSteps": 20, "fragments": 2, "overlapSteps": 1, "mixAlpha": 2}},
            "spec.training.mixAlpha",
        ),
        ("a" * 31, {}, "metadata.name: Invalid value: metadata.name must be a DNS-1035 label of at most 30"),
        (
            "pods",
            {"islands": [{"name": "a", "replicas": MAX_JOB_PODS}, {"name": "b"}]},
            f"spec.islands: Invalid value: spec.islands[].replicas must add up to at most {MAX_JOB_PODS} pods",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) and len(value) < 12 else None,
)
def test_bad_manifests_are_refused_naming_the_field(control_plane, name, change, message):
    result = control_plane.kubectl("-n", "default", "apply", "-f", "-", stdin=job_manifest(name, **change), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def trainer_override(**fields):
    return {"islands": [{"name": "a", "podTemplate": {"spec": {"containers": [{"name": "trainer", **fields}]}}}]}


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        (
            "hostnet",
            {"islands": [{"name": "a", "podTemplate": {"spec": {"hostNetwork": True}}}]},
            'unknown field "spec.islands[0].podTemplate.spec.hostNetwork"',
        ),
        (
            "hostpath",
            {
                "islands": [
                    {"name": "a", "podTemplate": {"spec": {"volumes": [{"name": "r", "hostPath": {"path": "/"}}]}}}
                ]
            },
            'unknown field "spec.islands[0].podTemplate.spec.volumes[0].hostPath"',
        ),
        (
            "root",
            {"syncer": {"shards": 2, "podTemplate": {"spec": {"securityContext": {"runAsUser": 0}}}}},
            'unknown field "spec.syncer.podTemplate.spec.securityContext"',
        ),
        (
            "caps",
            trainer_override(securityContext={"capabilities": {"add": ["SYS_ADMIN"]}, "privileged": True}),
            'unknown field "spec.islands[0].podTemplate.spec.containers[0].securityContext"',
        ),
        (
            "p-tiny",
            {"training": {"innerSteps": 60, "fragments": 53, "overlapSteps": 0}},
            "spec.training.fragments: Invalid value: spec.training.fragments (P) must not exceed the number of tensors",
        ),
        (
            "cpu",
            {"islands": [{"name": "a", "resources": {"requests": {"cpu": "-1"}}}]},
            "spec.islands[0].resources.requests.cpu",
        ),
        ("cmd0", {"trainer": {"command": [""]}}, "spec.trainer.command[0]"),
        ("cmd1", trainer_override(command=["python", ""]), "spec.islands[0].podTemplate.spec.containers[0].command[1]"),
    ],
    ids=lambda value: value if isinstance(value, str) and len(value) < 12 else None,
)
def test_unsafe_or_unrunnable_manifests_are_refused_naming_the_field(control_plane, name, change, message):
    result = control_plane.kubectl("-n", "default", "apply", "-f", "-", stdin=job_manifest(name, **change), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def island_override(template):
    return {"islands": [{"name": "a", "podTemplate": template}]}


def trainer_env(*env, **fields):
    return island_override({"spec": {"containers": [{"name": "trainer", "env": list(env), **fields}]}})


OTHER_JOBS_TLS = "diloco-victim-tls"
OPERATORS_KEY = "diloco-operator-token-key"
SECRET_REFUSED = "must not name a Secret diloco-*"
KEY_REF = {"name": OPERATORS_KEY}
VICTIMS_CLAIM = {"claimName": "victim-syncer-0"}
OPERATORS_LABEL = {"app.kubernetes.io/name": "diloco-operator"}
REACHING_PAST_THE_JOB = [
    (
        "secret-volume",
        island_override({"spec": {"volumes": [{"name": "v", "secret": {"secretName": OTHER_JOBS_TLS}}]}}),
        "spec.islands[0].podTemplate.spec.volumes[0].secret.secretName",
        SECRET_REFUSED,
    ),
    (
        "secret-key-ref",
        trainer_env({"name": "K", "valueFrom": {"secretKeyRef": {"name": OPERATORS_KEY, "key": "token"}}}),
        "spec.islands[0].podTemplate.spec.containers[0].env[0].valueFrom.secretKeyRef.name",
        SECRET_REFUSED,
    ),
    (
        "env-from",
        trainer_env(envFrom=[{"secretRef": {"name": "diloco-victim-token"}}]),
        "spec.islands[0].podTemplate.spec.containers[0].envFrom[0].secretRef.name",
        SECRET_REFUSED,
    ),
    (
        "csi-secret",
        island_override(
            {
                "spec": {
                    "volumes": [{"name": "v", "csi": {"driver": "d", "nodePublishSecretRef": {"name": OPERATORS_KEY}}}]
                }
            }
        ),
        "spec.islands[0].podTemplate.spec.volumes[0].csi.nodePublishSecretRef.name",
        SECRET_REFUSED,
    ),
    (
        "pull-secret",
        island_override({"spec": {"imagePullSecrets": [{"name": OTHER_JOBS_TLS}]}}),
        "spec.islands[0].podTemplate.spec.imagePullSecrets[0].name",
        SECRET_REFUSED,
    ),
    (
        "projected",
        island_override({"spec": {"volumes": [{"name": "v", "projected": {"sources": [{"secret": {"name": "x"}}]}}]}}),
        'unknown field "spec.islands[0].podTemplate.spec.volumes[0].projected"',
        "",
    ),
    (
        "tls-secret",
        {"tls": {"serverSecret": OTHER_JOBS_TLS, "caSecret": OTHER_JOBS_TLS}},
        "spec.tls.serverSecret",
        SECRET_REFUSED,
    ),
    (
        "claim",
        island_override(
            {"spec": {"volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "victim-syncer-0"}}]}}
        ),
        "spec.islands[0].podTemplate.spec.volumes[0].persistentVolumeClaim.claimName",
        "must not name a PersistentVolumeClaim",
    ),
    (
        "island-label",
        island_override({"metadata": {"labels": {"diloco.dev/island": "b"}}}),
        "spec.islands[0].podTemplate.metadata.labels",
        "must not set the operator's keys",
    ),
    (
        "job-label",
        island_override({"metadata": {"labels": {"diloco.dev/job": "victim"}}}),
        "spec.islands[0].podTemplate.metadata.labels",
        "must not set the operator's keys",
    ),
    (
        "shard-labels",
        island_override({"metadata": {"labels": {"diloco.dev/shard": "0", "app.kubernetes.io/component": "syncer"}}}),
        "spec.islands[0].podTemplate.metadata.labels",
        "must not set the operator's keys",
    ),
    (
        "operator-label",
        {
            "syncer": {
                "shards": 2,
                "podTemplate": {"metadata": {"labels": {"app.kubernetes.io/name": "diloco-operator"}}},
            }
        },
        "spec.syncer.podTemplate.metadata.labels",
        "must not set the operator's keys",
    ),
    (
        "token-hash",
        island_override({"metadata": {"annotations": {"diloco.dev/token-hash": "0123456789abcdef"}}}),
        "spec.islands[0].podTemplate.metadata.annotations",
        "must not set the operator's keys",
    ),
]


@pytest.mark.parametrize(
    ("name", "change", "field", "message"),
    REACHING_PAST_THE_JOB,
    ids=[case[0] for case in REACHING_PAST_THE_JOB],
)
def test_an_override_reaching_past_its_job_is_refused_at_kubectl_apply_naming_the_field(
    control_plane, name, change, field, message
):
    """Each way a job was seen reaching the operator's or another job's Secrets, claims or labels."""
    result = control_plane.kubectl("-n", "default", "apply", "-f", "-", stdin=job_manifest(name, **change), check=False)
    assert result.returncode != 0 and field in result.stderr and message in result.stderr, result.stderr


def test_an_override_naming_the_jobs_own_secrets_and_labels_of_its_own_is_accepted(control_plane, kube):
    hf_key = {"name": "hf-token", "key": "t"}  # the user's own Secret, with a name ending in -token all the same
    own = island_override(
        {
            "metadata": {"labels": {"team": "llm", "app.kubernetes.io/part-of": "research"}},
            "spec": {
                "volumes": [{"name": "hf", "secret": {"secretName": "hf-token"}}],
                "containers": [
                    {
                        "name": "trainer",
                        "env": [{"name": "HF", "valueFrom": {"secretKeyRef": hf_key}}],
                    }
                ],
            },
        }
    )
    control_plane.kubectl("-n", "default", "apply", "-f", "-", stdin=job_manifest("own", **own))
    stored = kube.get("DiLoCoJob", "default", "own")["spec"]["islands"][0]["podTemplate"]
    assert stored["spec"]["volumes"] == [{"name": "hf", "secret": {"secretName": "hf-token"}}]
    control_plane.kubectl("-n", "default", "delete", "dj", "own", "--wait=true", timeout=60)


def test_a_status_patch_clears_a_nested_field_the_status_no_longer_has(control_plane, kube):
    """The operator's status patch names what a field lost with null, so a merge patch clears it: an export
    that succeeded no longer says it waits for the shards."""
    control_plane.kubectl("-n", "default", "apply", "-f", "-", stdin=job_manifest("exported"))
    waiting = DiLoCoJobStatus(
        phase=Phase.SUCCEEDED,
        export=ExportStatus(phase=ExportPhase.PENDING, location="m:/exported", message=WAITING_FOR_SHARDS),
    )
    done = waiting.model_copy(update={"export": ExportStatus(phase=ExportPhase.SUCCEEDED, location="m:/exported")})
    for status in (waiting, done):
        body = json.dumps({"status": status_patch(status)})
        control_plane.kubectl(
            "-n", "default", "patch", "dj", "exported", "--subresource=status", "--type=merge", "-p", body
        )
    export = kube.get("DiLoCoJob", "default", "exported")["status"]["export"]
    assert export == {"phase": "Succeeded", "location": "m:/exported"}
    control_plane.kubectl("-n", "default", "delete", "dj", "exported", "--wait=true", timeout=60)


def test_an_unsafe_override_sent_without_field_validation_is_dropped_or_refused(control_plane, kube):
    """Clients that skip strict field validation get the unknown field pruned, never merged into a pod."""
    change = {"islands": [{"name": "a", "podTemplate": {"spec": {"hostPID": True, "nodeSelector": {"pool": "x"}}}}]}
    control_plane.kubectl(
        "-n", "default", "apply", "--validate=false", "-f", "-", stdin=job_manifest("pruned", **change)
    )
    stored = kube.get("DiLoCoJob", "default", "pruned")["spec"]["islands"][0]["podTemplate"]
    assert stored["spec"] == {"nodeSelector": {"pool": "x"}}
    hostpath = {
        "islands": [{"name": "a", "podTemplate": {"spec": {"volumes": [{"name": "r", "hostPath": {"path": "/"}}]}}}]
    }
    result = control_plane.kubectl(
        "-n", "default", "apply", "--validate=false", "-f", "-", stdin=job_manifest("pruned2", **hostpath), check=False
    )
    assert result.returncode != 0 and "spec.islands[0].podTemplate.spec.volumes[0]" in result.stderr, result.stderr


def test_the_largest_job_the_crd_admits_takes_its_largest_status(control_plane, kube, tmp_path):
    """MAX_ISLANDS islands holding MAX_JOB_PODS pods in all, and the largest status they can have: the API
    server (and etcd behind it) stores the whole object."""
    ns = namespace(control_plane, "largest")
    per_island = MAX_JOB_PODS // MAX_ISLANDS
    islands = [{"name": f"i{n:0{ISLAND_NAME_MAX - 1}d}", "replicas": per_island} for n in range(MAX_ISLANDS)]
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("largest", islands=islands))
    try:
        patch = tmp_path / "status.json"
        patch.write_text(json.dumps({"status": support.largest_status()}))
        control_plane.kubectl(
            "-n", ns, "patch", "dj", "largest", "--subresource=status", "--type=merge", "--patch-file", str(patch)
        )
        stored = kube.get("DiLoCoJob", ns, "largest")
        assert len(stored["status"]["islands"]) == MAX_ISLANDS
        assert sum(len(i["pods"]) for i in stored["status"]["islands"]) == MAX_JOB_PODS
    finally:
        # Gone before the next test starts an operator, which would otherwise reconcile its 512 islands.
        control_plane.kubectl("-n", ns, "delete", "dj", "largest", "--wait=true", timeout=120)
        control_plane.kubectl("delete", "namespace", ns, "--wait=false")


def test_fragments_and_shards_are_immutable(control_plane):
    control_plane.kubectl("-n", "default", "apply", "-f", "-", stdin=job_manifest("fixed"))
    for patch, message in (
        ({"training": {"fragments": 4, "innerSteps": 40}}, "spec.training.fragments is immutable"),
        ({"syncer": {"shards": 1}}, "spec.syncer.shards is immutable"),
    ):
        result = control_plane.kubectl(
            "-n", "default", "patch", "dj", "fixed", "--type", "merge", "-p", json.dumps({"spec": patch}), check=False
        )
        assert result.returncode != 0 and message in result.stderr, result.stderr


def test_an_islands_checkpoint_volume_is_fixed_once_the_island_exists(control_plane):
    """A StatefulSet's volumeClaimTemplates cannot change: the API server refuses, naming the field, what
    would change them on an existing island, and accepts a new interval or a new island with a volume."""
    volume = {"size": "1Gi", "checkpointEvery": 10}
    before = [{"name": "a", "checkpoint": volume}, {"name": "b"}]
    control_plane.kubectl("-n", "default", "apply", "-f", "-", stdin=job_manifest("volumes", islands=before))

    def patch(islands):
        body = json.dumps({"spec": {"islands": islands}})
        return control_plane.kubectl(
            "-n", "default", "patch", "dj", "volumes", "--type", "merge", "-p", body, check=False
        )

    try:
        for islands in (
            [{"name": "a", "checkpoint": {**volume, "size": "2Gi"}}, {"name": "b"}],
            [{"name": "a", "checkpoint": {**volume, "storageClassName": "ssd"}}, {"name": "b"}],
            [{"name": "a"}, {"name": "b"}],
            [{"name": "a", "checkpoint": volume}, {"name": "b", "checkpoint": volume}],
        ):
            result = patch(islands)
            assert result.returncode != 0 and "spec.islands[].checkpoint cannot be added" in result.stderr, islands
        accepted = [{"name": "a", "checkpoint": {**volume, "checkpointEvery": 5}}, {"name": "c", "checkpoint": volume}]
        result = patch(accepted)
        assert result.returncode == 0, result.stderr
    finally:
        control_plane.kubectl("-n", "default", "delete", "dj", "volumes", "--wait=true", timeout=120)


# --- the API layer -------------------------------------------------------------------------------


def config_map(name, data, owner_uid=None):
    meta = {"name": name, "namespace": "api", "labels": {"diloco.dev/job": "x"}}
    if owner_uid:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": owner_uid, "controller": True}
        ]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def test_kube_applies_lists_gets_and_deletes(control_plane, kube):
    namespace(control_plane, "api")
    kube.apply(config_map("one", {"k": "1"}), force=False)
    kube.apply(config_map("one", {"k": "2"}), force=True)
    assert kube.get("ConfigMap", "api", "one")["data"] == {"k": "2"}
    assert [o["metadata"]["name"] for o in kube.list("ConfigMap", "api", {"diloco.dev/job": "x"})] == ["one"]
    assert kube.list("ConfigMap", "api", {"diloco.dev/job": "y"}) == []
    kube.delete("ConfigMap", "api", "one")
    kube.delete("ConfigMap", "api", "one")
    assert kube.get("ConfigMap", "api", "one") is None
    assert kube.get("Node", None, "no-such-node") is None


def test_kube_never_takes_over_fields_someone_else_set(control_plane, kube):
    control_plane.kubectl("-n", "api", "create", "configmap", "theirs", "--from-literal=k=mine")
    with pytest.raises(ApiError) as refused:
        kube.apply(config_map("theirs", {"k": "ours"}), force=False)
    assert refused.value.status == 409
    assert kube.get("ConfigMap", "api", "theirs")["data"] == {"k": "mine"}


def test_every_call_is_told_to_the_observer_with_its_verb_kind_and_status(control_plane):
    seen = []
    kube = Kube(
        kube_config.new_client_from_config(config_file=str(control_plane.admin_kubeconfig)),
        observe=lambda *call: seen.append(call),
    )
    namespace(control_plane, "observed")
    kube.apply({**config_map("seen", {"k": "1"}), "metadata": {"name": "seen", "namespace": "observed"}}, force=False)
    kube.list("ConfigMap", "observed", {})
    kube.get("Node", None, "no-such-node")
    kube.delete("ConfigMap", "observed", "seen")
    assert seen == [
        ("apply", "ConfigMap", 201),
        ("list", "ConfigMap", 200),
        ("get", "Node", 404),
        ("delete", "ConfigMap", 200),
    ]


def test_the_same_event_posted_five_times_is_one_event_counted_five_under_the_operators_rbac(control_plane, kube):
    ns = namespace(control_plane, "events")
    as_operator = Kube(kube_config.new_client_from_config(config_file=str(install(control_plane))))
    job = JobRef(name="repeats", namespace=ns, uid="5f0c4a52-0000-4000-8000-000000000001")
    failed = Event("Warning", "ApplyFailed", "StatefulSet/repeats-a: forbidden")
    start = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    recorder = EventRecorder(as_operator)
    for minute in range(3):
        recorder.post(job, failed, start + datetime.timedelta(minutes=minute))
    restarted = EventRecorder(as_operator)
    for minute in (3, 4):
        restarted.post(job, failed, start + datetime.timedelta(minutes=minute))
    listed = json.loads(control_plane.kubectl("-n", ns, "get", "events", "-o", "json").stdout)["items"]
    assert [(e["reason"], e["count"]) for e in listed] == [("ApplyFailed", 5)]
    (event,) = listed
    assert event["firstTimestamp"] == "2025-01-01T00:00:00Z" and event["lastTimestamp"] == "2025-01-01T00:04:00Z"
    assert event["involvedObject"]["kind"] == "DiLoCoJob" and event["involvedObject"]["uid"] == job.uid


# --- the operator --------------------------------------------------------------------------------


def test_an_operator_watching_named_namespaces_leaves_the_others_alone_and_answers_its_liveness_probe(
    control_plane, kube, tmp_path
):
    watched, ignored = namespace(control_plane, "watched"), namespace(control_plane, "ignored")
    scoped = OperatorProcess(
        install(control_plane), tmp_path / "operator.log", RESYNC, ["--namespace", watched, "--standalone"]
    )
    scoped.start()
    try:
        for ns in (watched, ignored):
            control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("demo"))
        wait_until(lambda: len(children(kube, watched, "demo")) == CHILDREN)
        with urllib.request.urlopen(f"http://127.0.0.1:{scoped.liveness_port}/healthz", timeout=5) as reply:
            assert reply.status == 200
        passes = scoped.metric("diloco_operator_reconciles_total")
        wait_until(lambda: scoped.metric("diloco_operator_reconciles_total") >= passes + 3)
        assert children(kube, ignored, "demo") == {} and "status" not in kube.get("DiLoCoJob", ignored, "demo")
        for ns in (watched, ignored):
            control_plane.kubectl("-n", ns, "delete", "dj", "demo", "--wait=false")
        wait_until(lambda: kube.get("DiLoCoJob", watched, "demo") is None)
    finally:
        scoped.stop()


def without_pod_rights(plane):
    """A kubeconfig for an operator whose ClusterRole is deploy/rbac.yaml's without the right to list pods, as
    a hand-edited RBAC may leave it: every pass of its jobs fails when it lists their pods."""
    install(plane)
    name = "diloco-operator-no-pods"
    (role,) = [d for d in yaml.safe_load_all((ROOT / "deploy" / "rbac.yaml").read_text()) if d["kind"] == "ClusterRole"]
    role["metadata"]["name"] = name
    role["rules"] = [rule for rule in role["rules"] if "pods" not in rule["resources"]]
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": NAMESPACE}}
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}],
    }
    plane.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([account, role, binding]))
    return plane.service_account_kubeconfig(NAMESPACE, name)


def test_passes_that_fail_alike_are_one_aggregated_event_and_kopf_posts_none(control_plane, kube, tmp_path):
    ns = namespace(control_plane, "failing")
    failing = OperatorProcess(
        without_pod_rights(control_plane), tmp_path / "operator.log", RESYNC, ["--namespace", ns, "--standalone"]
    )
    failing.start()
    try:
        control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("demo"))

        def events():
            return json.loads(control_plane.kubectl("-n", ns, "get", "events", "-o", "json").stdout)["items"]

        wait_until(lambda: any(e["reason"] == "ReconcileFailed" and e["count"] >= 2 for e in events()))
        assert failing.metric("diloco_operator_errors_total", kind="reconcile") >= 2
        (event,) = events()  # kopf's own reports of the failures are not posted
        assert (event["type"], event["reason"]) == ("Warning", "ReconcileFailed")
        assert "pods is forbidden" in event["message"] and event["involvedObject"]["name"] == "demo"
        control_plane.kubectl("-n", ns, "delete", "dj", "demo", "--timeout=60s")
    finally:
        failing.stop()


def test_a_pass_over_a_job_whose_namespace_is_being_deleted_charges_nothing_and_posts_nothing(control_plane, kube):
    """This control plane runs no namespace controller: a deleted namespace stays Terminating with what is in it,
    and the test removes the job's pods as that controller would. The pass that follows charges no failure and
    posts no Event (the API server refuses new ones there), where one in a live namespace would."""
    ns = namespace(control_plane, "dying")
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("gone", islands=[{"name": "a"}]))
    job = kube.get("DiLoCoJob", ns, "gone")
    ref = JobRef(name="gone", namespace=ns, uid=job["metadata"]["uid"])
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "gone-a-0",
            "labels": {"diloco.dev/job": "gone", "diloco.dev/island": "a", "apps.kubernetes.io/pod-index": "0"},
        },
        "spec": {"containers": [{"name": "trainer", "image": "diloco-trainer:dev"}]},
    }
    control_plane.kubectl("-n", ns, "create", "serviceaccount", "default")  # no controller-manager makes it here
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=yaml.safe_dump(pod))
    reconciler = Reconciler(
        kube,
        None,
        poll_shards=lambda targets, ready, tokens, security, timeout: [
            ShardObservation(shard=s, ready=False) for s in range(len(targets))
        ],
        scrape_trainers=lambda urls, timeout: {},
        token_key=bytes(32),
    )
    now = datetime.datetime.now(datetime.UTC)
    first = reconciler.reconcile(ref, 1, job["spec"], None, now)
    assert [r["uid"] for r in first.status["islands"][0]["pods"]], "the pod is on record"
    control_plane.kubectl("delete", "namespace", ns, "--wait=false")
    wait_until(lambda: kube.get("Namespace", None, ns)["status"].get("phase") == "Terminating")
    control_plane.kubectl("-n", ns, "delete", "pod", "gone-a-0", "--grace-period=0", "--force")
    later = reconciler.reconcile(ref, 1, job["spec"], first.status, now + datetime.timedelta(seconds=10))
    assert later.events == (), "no IslandFailed for the pod the namespace controller removed, and no Event at all"
    assert later.status is None and later.applied == ()


@pytest.fixture(scope="module")
def operator(control_plane, tmp_path_factory):
    running = OperatorProcess(install(control_plane), tmp_path_factory.mktemp("operator") / "operator.log", RESYNC)
    running.start()
    yield running
    running.stop()
    log = running.log.read_text()
    assert "Forbidden" not in log and " 403" not in log, log[-4000:]


CHILDREN = 14
"""Of `job_manifest`'s job: the training ConfigMap, the token and TLS Secrets, the NetworkPolicy, and per syncer
shard a PVC, Service and Deployment, per island a headless Service and a StatefulSet."""


def children(kube, ns, job):
    kinds = ("ConfigMap", "Secret", "NetworkPolicy", "PersistentVolumeClaim", "Service", "Deployment", "StatefulSet")
    return {(k, o["metadata"]["name"]): o for k in kinds for o in kube.list(k, ns, {"diloco.dev/job": job})}


def test_the_operator_creates_every_child_and_keeps_status(control_plane, kube, operator):
    ns = namespace(control_plane, "e2e-create")
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("demo"))
    found = wait_until(lambda: (c := children(kube, ns, "demo")) and len(c) == CHILDREN and c)
    job = kube.get("DiLoCoJob", ns, "demo")
    for obj in found.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "diloco-operator"
    assert found[("StatefulSet", "demo-a")]["spec"]["replicas"] == 2
    status = wait_until(
        lambda: (
            (kube.get("DiLoCoJob", ns, "demo").get("status") or {}).get("phase")
            and kube.get("DiLoCoJob", ns, "demo")["status"]
        )
    )
    assert status["phase"] == "Pending" and status["islandsReady"] == "0/2" and status["observedGeneration"] == 1
    assert {c["type"] for c in status["conditions"]} == {
        "Ready",
        "Degraded",
        "Suspended",
        "Complete",
        "Failed",
        "SyncerStateLost",
    }
    assert "diloco.dev/finalizer" in job["metadata"]["finalizers"]
    control_plane.kubectl("-n", ns, "delete", "dj", "demo", "--timeout=60s")


def test_suspend_and_removing_an_island(control_plane, kube, operator):
    ns = namespace(control_plane, "e2e-change")
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("demo"))
    wait_until(lambda: len(children(kube, ns, "demo")) == CHILDREN)
    control_plane.kubectl("-n", ns, "patch", "dj", "demo", "--type", "merge", "-p", '{"spec": {"suspend": true}}')
    wait_until(lambda: all(kube.get("StatefulSet", ns, f"demo-{i}")["spec"]["replicas"] == 0 for i in "ab"))
    wait_until(lambda: kube.get("DiLoCoJob", ns, "demo")["status"]["phase"] == "Suspended")
    assert kube.get("Deployment", ns, "demo-syncer-0")["spec"]["replicas"] == 1
    events = wait_until(
        lambda: (
            control_plane.kubectl("-n", ns, "get", "events", "-o", "json").stdout.count('"reason": "Suspended"')
            and control_plane.kubectl("-n", ns, "get", "events").stdout
        )
    )
    assert "spec.suspend is true" in events
    control_plane.kubectl(
        "-n",
        ns,
        "patch",
        "dj",
        "demo",
        "--type",
        "json",
        "-p",
        '[{"op": "remove", "path": "/spec/islands/1"}, {"op": "replace", "path": "/spec/suspend", "value": false}]',
    )
    wait_until(lambda: kube.get("StatefulSet", ns, "demo-b") is None and kube.get("Service", ns, "demo-b") is None)
    wait_until(lambda: kube.get("StatefulSet", ns, "demo-a")["spec"]["replicas"] == 2)


def force_status(plane, kube, ns, name, status):
    """Writes a status over the operator's until the operator has read it (it rewrites status every pass)."""
    patch = json.dumps({"status": status})

    def took():
        plane.kubectl(
            "-n", ns, "patch", "dj", name, "--subresource=status", "--type", "merge", "-p", patch, check=False
        )
        time.sleep(3 * RESYNC)
        current = kube.get("DiLoCoJob", ns, name)
        return current is None or current.get("status", {}).get("phase") == status["phase"]

    wait_until(took, timeout=60, interval=0)


def test_a_failed_job_stays_failed_and_a_finished_one_goes_after_its_ttl(control_plane, kube, operator):
    ns = namespace(control_plane, "e2e-final")
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("broken"))
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("done", ttlSecondsAfterFinished=2))
    wait_until(lambda: len(children(kube, ns, "broken")) == CHILDREN and len(children(kube, ns, "done")) == CHILDREN)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    force_status(control_plane, kube, ns, "broken", {"phase": "Failed", "completionTime": now})
    wait_until(
        lambda: (
            kube.get("StatefulSet", ns, "broken-a")["spec"]["replicas"] == 0
            and kube.get("Deployment", ns, "broken-syncer-1")["spec"]["replicas"] == 0
        )
    )
    time.sleep(4 * RESYNC)
    assert kube.get("DiLoCoJob", ns, "broken")["status"]["phase"] == "Failed"
    assert kube.get("StatefulSet", ns, "broken-b")["spec"]["replicas"] == 0
    force_status(control_plane, kube, ns, "done", {"phase": "Succeeded", "completionTime": now})
    wait_until(lambda: kube.get("DiLoCoJob", ns, "done") is None, timeout=60)


def test_a_restarted_operator_changes_nothing(control_plane, kube, operator):
    ns = namespace(control_plane, "e2e-restart")
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("steady"))
    wait_until(lambda: len(children(kube, ns, "steady")) == CHILDREN)
    wait_until(lambda: (kube.get("DiLoCoJob", ns, "steady").get("status") or {}).get("phase") == "Pending")
    operator.stop()
    operator.start()
    wait_until(lambda: operator.metric("diloco_operator_reconciles_total", trigger="timer", result="ok") >= 5)
    assert operator.metric("diloco_operator_applied_objects_total") == 0
    assert operator.metric("diloco_operator_deleted_objects_total") == 0


def tokens_of(kube, ns, job):
    return JobTokens.from_secret(kube.get("Secret", ns, f"diloco-{job}-token"))


def token_hashes(kube, ns, names):
    return {
        kind: kube.get(kind, ns, name)["spec"]["template"]["metadata"]["annotations"].get("diloco.dev/token-hash")
        for kind, name in names
    }


def test_a_deleted_token_secret_comes_back_with_the_same_token_and_a_rotation_waits_on_the_shards(
    control_plane, kube, operator
):
    """No pod runs here, so no shard answers: a rotation gives the shards the new token beside the old and goes
    no further, the islands presenting the old one (tests/e2e/test_rotating_a_token.py follows a whole one)."""
    ns = namespace(control_plane, "e2e-token")
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("keep"))
    wait_until(lambda: len(children(kube, ns, "keep")) == CHILDREN)
    token = tokens_of(kube, ns, "keep").presented
    holders = (("StatefulSet", "keep-a"), ("StatefulSet", "keep-b"))
    hashes = token_hashes(kube, ns, holders)
    control_plane.kubectl("-n", ns, "delete", "secret", "diloco-keep-token")
    assert wait_until(lambda: tokens_of(kube, ns, "keep")) == JobTokens.only(token)
    assert token_hashes(kube, ns, holders) == hashes and len(set(hashes.values())) == 1
    syncer = kube.get("Deployment", ns, "keep-syncer-0")["spec"]["template"]["metadata"]["annotations"]
    assert "diloco.dev/token-hash" not in syncer, "shards re-read the tokens they accept: a new one rolls none"
    control_plane.kubectl("-n", ns, "annotate", "dj", "keep", "diloco.dev/rotate-token=1")
    rotating = wait_until(lambda: (t := tokens_of(kube, ns, "keep")) and len(t.accepted) == 2 and t)
    assert rotating.presented == token and rotating.accepted[0] == token
    assert token_hashes(kube, ns, holders) == hashes, "no island rolls before every shard takes the new token"


def test_jobs_whose_child_names_would_collide_each_keep_their_own(control_plane, kube, operator):
    ns = namespace(control_plane, "e2e-names")
    small = {"syncer": {"shards": 1}, "training": {"innerSteps": 20, "fragments": 1, "overlapSteps": 1}}
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("a", islands=[{"name": "b-x"}], **small))
    control_plane.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("a-b", islands=[{"name": "x"}], **small))
    wait_until(lambda: len(children(kube, ns, "a")) == len(children(kube, ns, "a-b")) == 9)  # 1 island, 1 shard
    passes = operator.metric("diloco_operator_reconciles_total")
    wait_until(lambda: operator.metric("diloco_operator_reconciles_total") >= passes + 4)
    for job in ("a", "a-b"):
        uid = kube.get("DiLoCoJob", ns, job)["metadata"]["uid"]
        found = children(kube, ns, job)
        assert len(found) == 9
        assert all(obj["metadata"]["ownerReferences"][0]["uid"] == uid for obj in found.values())
    assert not set(children(kube, ns, "a")) & set(children(kube, ns, "a-b"))
    assert "ApplyFailed" not in control_plane.kubectl("-n", ns, "get", "events").stdout
