"""One reconcile pass against an in-memory API: converges, is idempotent, keeps the token, prunes what the
spec no longer has, never touches what the job does not own, and honours the TTL."""

import base64
import copy
import datetime

import pytest
import torch
from cluster.controlplane import free_port
from pydantic import ValidationError
from support import TEST_PKI

from diloco.api.job import DiLoCoJobSpec, DiLoCoJobStatus, ExportPhase, ExportStatus
from diloco.operator import naming as n
from diloco.operator.children import OperatorRef
from diloco.operator.job_status import FragmentReport, ShardObservation
from diloco.operator.job_tls import secret_bytes
from diloco.operator.kube import ApiError
from diloco.operator.probes import shard_statuses
from diloco.operator.reconcile import LEFT_ALONE, Reconciler, status_patch
from diloco.operator.tokens import JobTokens, fingerprint
from diloco.syncer.server import SyncerServer
from diloco.transport import certificates
from diloco.transport.client import SyncerClient
from diloco.transport.tls import Tls

JOB = n.JobRef(name="demo", namespace="ml", uid="job-uid")
NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
SPEC = {
    "image": "img",
    "training": {"innerSteps": 20, "fragments": 2, "overlapSteps": 1},
    "islands": [{"name": "a", "replicas": 2}, {"name": "b"}],
    "syncer": {"shards": 2},
}


class FakeKube:
    """Objects by (kind, namespace, name); records every write."""

    def __init__(self):
        self.objects = {}
        self.writes = []
        self.refuse = set()

    def list(self, kind, namespace, labels):
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in self.objects.items()
            if k == kind and ns == namespace and labels.items() <= o["metadata"].get("labels", {}).items()
        ]

    def get(self, kind, namespace, name):
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def apply(self, obj, force):
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key[2] in self.refuse:
            raise ApiError(409, "conflict with another manager")
        self.writes.append(("apply", key[0], key[2], force))
        stored = copy.deepcopy(obj)
        old = self.objects.get(key)
        stored["metadata"]["generation"] = (old["metadata"]["generation"] + 1) if old else 1
        if old and "status" in old:
            stored["status"] = old["status"]
        self.objects[key] = stored
        return stored

    def delete(self, kind, namespace, name):
        self.writes.append(("delete", kind, name))
        self.objects.pop((kind, namespace, name), None)

    def add(self, obj):
        meta = obj["metadata"]
        self.objects[(obj["kind"], meta.get("namespace"), meta["name"])] = obj


def probes(calls):
    def poll(targets, ready, tokens, security, timeout):
        calls.append((list(targets), list(ready), list(tokens), security))
        return [
            ShardObservation(
                shard=i,
                ready=r,
                fragments=(FragmentReport(i, 4, 100, 0.0),) if r else None,
                accepts=frozenset(map(fingerprint, tokens)) if r else frozenset(),
                lineage=0xA0 + i if r else 0,
            )
            for i, r in enumerate(ready)
        ]

    return poll


def presented(kube, job="demo"):
    """The token the job's islands present, as its token Secret holds it."""
    tokens = JobTokens.from_secret(kube.get("Secret", "ml", n.token_secret_name(job)))
    return tokens.presented if tokens else None


@pytest.fixture
def setup():
    kube, calls = FakeKube(), []
    reconciler = Reconciler(
        kube, OperatorRef("ops"), poll_shards=probes(calls), scrape_trainers=lambda urls, t: {}, token_key=bytes(32)
    )
    return kube, reconciler, calls


def island_pod(island, ordinal, uid, node="n1", ready=True):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"demo-{island}-{ordinal}",
            "namespace": "ml",
            "uid": uid,
            "labels": {
                "diloco.dev/job": "demo",
                "diloco.dev/island": island,
                "apps.kubernetes.io/pod-index": str(ordinal),
            },
        },
        "spec": {"nodeName": node},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_first_pass_creates_every_child_and_a_token(setup):
    kube, reconciler, calls = setup
    outcome = reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    assert len(outcome.applied) == 4 + 3 * 2 + 2 * 2  # config, token, TLS, policy; per shard; per island
    assert all(force is False for *_, force in kube.writes)
    token = presented(kube)
    assert token and len(token) >= 32
    made = secret_bytes(kube.get("Secret", "ml", "diloco-demo-tls"))
    assert calls == [
        (["demo-syncer-0.ml.svc:50051", "demo-syncer-1.ml.svc:50051"], [False, False], [token], Tls(ca=made["ca.crt"]))
    ]
    assert outcome.status["phase"] == "Pending" and outcome.status["islandsReady"] == "0/2"
    assert kube.get("StatefulSet", "ml", "demo-a")["spec"]["replicas"] == 2
    kinds = [kind for _, kind, *_ in kube.writes]
    assert max(i for i, k in enumerate(kinds) if k not in ("Deployment", "StatefulSet")) < min(
        i for i, k in enumerate(kinds) if k in ("Deployment", "StatefulSet")
    ), "workloads go last"
    (created,) = [e for e in outcome.events if e.reason == "Created"]
    assert created.message.startswith("created 14: ConfigMap/demo-config, ") and created.message.endswith(" and 6 more")


def test_a_second_pass_changes_nothing_and_keeps_the_token_and_certificates(setup):
    kube, reconciler, _ = setup
    reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    token = presented(kube)
    certificates = kube.get("Secret", "ml", "diloco-demo-tls")["data"]
    kube.writes.clear()
    outcome = reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    assert outcome.applied == () and outcome.deleted == () and kube.writes == []
    assert presented(kube) == token
    assert kube.get("Secret", "ml", "diloco-demo-tls")["data"] == certificates


def test_an_upgrade_deletes_the_jobs_secrets_under_their_earlier_names_which_any_override_could_name(setup):
    """An operator before the diloco-* names made `<job>-token` (the same derived token) and `<job>-tls` (with
    the CA's key): left behind, another job's override could mount them, so the first pass deletes them."""
    kube, reconciler, _ = setup
    labels = n.common_labels("demo", None, "token")
    for name in ("demo-token", "demo-tls"):
        kube.add(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": name,
                    "namespace": "ml",
                    "labels": labels,
                    "ownerReferences": [JOB.owner_reference()],
                },
                "data": {"token": base64.b64encode(b"t").decode(), "ca.key": base64.b64encode(b"k").decode()},
            }
        )
    outcome = reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    assert {"Secret/demo-token", "Secret/demo-tls"} <= set(outcome.deleted)
    assert kube.get("Secret", "ml", "demo-token") is None and kube.get("Secret", "ml", "demo-tls") is None
    assert presented(kube) and kube.get("Secret", "ml", "diloco-demo-tls") is not None


def test_mutual_tls_has_the_operator_probe_with_the_islands_client_certificate(setup):
    kube, reconciler, calls = setup
    reconciler.reconcile(JOB, 1, {**SPEC, "tls": {"mutual": True}}, None, NOW)
    made = secret_bytes(kube.get("Secret", "ml", "diloco-demo-tls"))
    assert calls[-1][3] == Tls(ca=made["ca.crt"], cert=made["client.crt"], key=made["client.key"], mutual=True)


def test_named_tls_secrets_are_read_and_a_missing_one_leaves_the_shards_unreachable(setup):
    kube, reconciler, calls = setup
    named = {**SPEC, "tls": {"serverSecret": "syncer-cert", "caSecret": "our-ca"}}
    for name, data in (("our-ca", {"ca.crt": TEST_PKI.ca.cert}), ("syncer-cert", {"tls.crt": b"c", "tls.key": b"k"})):
        kube.add(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": name, "namespace": "ml"},
                "data": {key: base64.b64encode(value).decode() for key, value in data.items()},
            }
        )
    reconciler.reconcile(JOB, 1, named, None, NOW)
    assert kube.get("Secret", "ml", "diloco-demo-tls") is None, "the job brings its own certificates"
    assert calls[-1][3] == Tls(ca=TEST_PKI.ca.cert)

    kube.delete("Secret", "ml", "our-ca")
    for shard in (0, 1):
        kube.objects[("Deployment", "ml", f"demo-syncer-{shard}")]["status"] = {"readyReplicas": 1}
    calls.clear()
    outcome = reconciler.reconcile(JOB, 1, named, None, NOW)
    assert calls == [], "nothing to call the shards with"
    assert outcome.status["syncer"] == {
        "shards": 2,
        "ready": 2,
        "reachable": 0,
        "lastStateLoss": None,
        "lineages": [],
        "endpoints": [],
    }
    assert any("Secret our-ca not found" in c.get("message", "") for c in outcome.status["conditions"])


def test_a_spec_change_patches_only_what_it_touches_with_force(setup):
    kube, reconciler, _ = setup
    reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    kube.writes.clear()
    bigger = {**SPEC, "islands": [{"name": "a", "replicas": 3}, {"name": "b"}]}
    outcome = reconciler.reconcile(JOB, 2, bigger, None, NOW)
    assert outcome.applied == ("StatefulSet/demo-a",)
    assert kube.writes == [("apply", "StatefulSet", "demo-a", True)]
    assert [(e.reason, e.message) for e in outcome.events] == [("Updated", "updated 1: StatefulSet/demo-a")]


def serving(kube, shard):
    """The shard's Deployment as its controller reports it once its one pod runs its latest template."""
    deployment = kube.objects[("Deployment", "ml", f"demo-syncer-{shard}")]
    generation = deployment["metadata"]["generation"]
    deployment["status"] = {"observedGeneration": generation, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}


def test_shards_take_a_template_change_one_at_a_time_each_after_the_last_serves_again(setup):
    kube, reconciler, _ = setup
    reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    for shard in (0, 1):
        serving(kube, shard)
    newer = {**SPEC, "image": "diloco-trainer:v2"}
    assert "Deployment/demo-syncer-1" not in reconciler.reconcile(JOB, 2, newer, None, NOW).applied
    assert (
        kube.objects[("Deployment", "ml", "demo-syncer-1")]["spec"]["template"]["spec"]["containers"][0]["image"]
        == SPEC["image"]
    )
    assert reconciler.reconcile(JOB, 2, newer, None, NOW).applied == (), "shard 0 does not serve yet"
    serving(kube, 0)
    assert reconciler.reconcile(JOB, 2, newer, None, NOW).applied == ("Deployment/demo-syncer-1",)
    serving(kube, 1)
    assert reconciler.reconcile(JOB, 2, newer, None, NOW).applied == ()


def test_an_island_only_knob_leaves_the_shards_running(setup):
    _, reconciler, _ = setup
    reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    training = {"innerSteps": 40, "fragments": 2, "overlapSteps": 2, "inner": {"lr": 0.01}}
    applied = reconciler.reconcile(JOB, 2, {**SPEC, "training": training}, None, NOW).applied
    assert {"ConfigMap/demo-config", "StatefulSet/demo-a", "StatefulSet/demo-b"} <= set(applied)
    assert not any(key.startswith("Deployment/") for key in applied)


def test_drift_is_corrected_but_server_defaults_are_not_drift(setup):
    kube, reconciler, _ = setup
    reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    sts = kube.objects[("StatefulSet", "ml", "demo-a")]
    sts["spec"]["revisionHistoryLimit"] = 10
    sts["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    kube.objects[("Deployment", "ml", "demo-syncer-0")]["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "requests": {"cpu": "2000m"}
    }
    kube.writes.clear()
    wider = {**SPEC, "syncer": {"shards": 2, "resources": {"requests": {"cpu": 2}}}}
    assert reconciler.reconcile(JOB, 1, wider, None, NOW).applied == ("Deployment/demo-syncer-0",)
    serving(kube, 0)
    assert reconciler.reconcile(JOB, 1, wider, None, NOW).applied == ("Deployment/demo-syncer-1",)
    kube.objects[("Deployment", "ml", "demo-syncer-0")]["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "requests": {"cpu": "2000m"}
    }
    assert (
        reconciler.reconcile(
            JOB, 1, {**SPEC, "syncer": {"shards": 2, "resources": {"requests": {"cpu": 2}}}}, None, NOW
        ).applied
        == ()
    )
    sts["spec"]["replicas"] = 5
    kube.objects[("ConfigMap", "ml", "demo-config")]["data"]["training.json"] = "{}"
    outcome = reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    assert set(outcome.applied) >= {"StatefulSet/demo-a", "ConfigMap/demo-config"}
    assert kube.objects[("StatefulSet", "ml", "demo-a")]["spec"]["replicas"] == 2


def test_a_removed_island_loses_its_children(setup):
    kube, reconciler, _ = setup
    reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    outcome = reconciler.reconcile(JOB, 2, {**SPEC, "islands": [{"name": "a", "replicas": 2}]}, None, NOW)
    assert set(outcome.deleted) == {"StatefulSet/demo-b", "Service/demo-b"}
    deleted = [e for e in outcome.events if e.reason == "Deleted"]
    assert len(deleted) == 1 and "StatefulSet/demo-b" in deleted[0].message
    assert kube.get("StatefulSet", "ml", "demo-b") is None
    # The island left reads the whole training set now: its share of the data is cut anew, which rolls it.
    (trainer,) = kube.get("StatefulSet", "ml", "demo-a")["spec"]["template"]["spec"]["containers"]
    env = {v["name"]: v.get("value") for v in trainer["env"]}
    assert (env["DILOCO_DATA_SHARD"], env["DILOCO_DATA_SHARDS"]) == ("0", "1")
    assert [e.reason for e in outcome.events if e.reason != "Deleted"] == ["Updated"]


def test_objects_the_job_does_not_own_are_neither_deleted_nor_forced(setup):
    kube, reconciler, _ = setup
    foreign = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "demo-notes", "namespace": "ml", "labels": {"diloco.dev/job": "demo"}},
    }
    kube.add(foreign)
    clash = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "demo-config",
            "namespace": "ml",
            "labels": {"diloco.dev/job": "demo"},
            "ownerReferences": [{"uid": "someone-else", "controller": True}],
        },
    }
    kube.add(clash)
    kube.refuse.add("demo-config")
    outcome = reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    assert kube.get("ConfigMap", "ml", "demo-notes") == foreign
    # Another controller's object is not even tried (an apply under the shared field manager would succeed).
    assert ("Warning", "NameConflict") in [(e.type, e.reason) for e in outcome.events]
    assert not any(write[2] == "demo-config" for write in kube.writes)
    assert "ConfigMap/demo-config" not in outcome.applied and len(outcome.applied) == 13


def test_a_child_name_held_by_another_jobs_object_is_left_alone_and_reported(setup):
    kube, reconciler, _ = setup
    theirs = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "demo-a",
            "namespace": "ml",
            "labels": {"diloco.dev/job": "demo-x"},
            "ownerReferences": [{"kind": "DiLoCoJob", "name": "demo-x", "uid": "other-job", "controller": True}],
        },
    }
    kube.add(copy.deepcopy(theirs))
    outcome = reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    assert kube.get("Service", "ml", "demo-a") == theirs and "Service/demo-a" not in outcome.applied
    (conflict,) = [e for e in outcome.events if e.reason == "NameConflict"]
    assert conflict.message == "Service/demo-a is controlled by DiLoCoJob/demo-x: left alone"


def test_observed_pods_and_syncers_reach_the_status(setup):
    kube, reconciler, calls = setup
    reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    for shard in (0, 1):
        kube.objects[("Deployment", "ml", f"demo-syncer-{shard}")]["status"] = {"readyReplicas": 1}
    for island, ordinal in (("a", 0), ("a", 1), ("b", 0)):
        kube.add(island_pod(island, ordinal, f"{island}{ordinal}"))
    outcome = reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    assert calls[-1][1] == [True, True]
    status = outcome.status
    assert status["phase"] == "Running" and status["islandsReady"] == "2/2"
    assert status["outerStep"] == 4
    lineages = status["syncer"].pop("lineages")
    assert status["syncer"] == {"shards": 2, "ready": 2, "reachable": 2, "lastStateLoss": None, "endpoints": []}
    assert [(s["shard"], s["lineage"], s["carriedOuterSteps"]) for s in lineages] == [
        (0, "00000000000000a0", 0),
        (1, "00000000000000a1", 0),
    ], "each shard's state as first seen: nothing lost"
    assert [i["ready"] for i in status["islands"]] == [2, 1]


def test_a_vanished_pod_is_judged_by_looking_its_node_up(setup):
    kube, reconciler, _ = setup
    first = reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    for island, ordinal in (("a", 0), ("a", 1), ("b", 0)):
        kube.add(island_pod(island, ordinal, f"{island}{ordinal}", node=f"node-{island}{ordinal}"))
    second = reconciler.reconcile(JOB, 1, SPEC, first.status, NOW)
    del kube.objects[("Pod", "ml", "demo-a-1")]
    lookups = []
    kube.get = lambda kind, ns, name: lookups.append((kind, name))
    third = reconciler.reconcile(JOB, 1, SPEC, second.status, NOW + datetime.timedelta(seconds=10))
    assert lookups == [("Namespace", "ml"), ("Node", "node-a1")]
    island = third.status["islands"][0]
    assert island["preemptions"] == 1 and island["restarts"] == 0
    assert kube.objects[("StatefulSet", "ml", "demo-a")]["spec"]["replicas"] == 0


def test_an_expired_ttl_deletes_the_job(setup):
    kube, reconciler, _ = setup
    done = DiLoCoJobStatus(phase="Succeeded", completion_time=NOW).model_dump(mode="json", by_alias=True)
    outcome = reconciler.reconcile(JOB, 1, {**SPEC, "ttlSecondsAfterFinished": 0}, done, NOW)
    assert outcome.job_deleted and ("delete", "DiLoCoJob", "demo") in kube.writes
    assert kube.get("StatefulSet", "ml", "demo-a")["spec"]["replicas"] == 0


def test_an_invalid_spec_is_refused_before_anything_is_written(setup):
    kube, reconciler, _ = setup
    with pytest.raises(ValidationError, match="spec.training.quorum"):
        reconciler.reconcile(JOB, 1, {**SPEC, "training": {**SPEC["training"], "quorum": 3}}, None, NOW)
    assert kube.writes == []


def test_status_patch_clears_unset_fields():
    patch = status_patch(DiLoCoJobStatus())
    assert patch["phase"] == "Pending" and patch["startTime"] is None and patch["goodput"] is None
    assert set(patch) == {f.alias for f in DiLoCoJobStatus.model_fields.values()}


def test_status_patch_clears_unset_fields_of_nested_objects_too():
    """An export that succeeded has no message: the patch says so, or the one of while it waited would stay."""
    done = DiLoCoJobStatus(export=ExportStatus(phase=ExportPhase.SUCCEEDED, location="models:/demo"))
    patch = status_patch(done)
    assert patch["export"] == {
        "phase": "Succeeded",
        "location": "models:/demo",
        "message": None,
        "completionTime": None,
    }
    assert patch["syncer"]["lastStateLoss"] is None and patch["syncer"]["endpoints"] == []


def secret(name, **data):
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": "ml"},
        "data": {key: base64.b64encode(value).decode() for key, value in data.items()},
    }


def test_exposed_shards_report_their_endpoints_and_their_certificate_names_them(setup):
    kube, reconciler, _ = setup
    exposed = {**SPEC, "syncer": {"shards": 2, "expose": {"type": "LoadBalancer"}}}
    outcome = reconciler.reconcile(JOB, 1, exposed, None, NOW)
    assert kube.get("Service", "ml", "demo-syncer-0")["spec"]["type"] == "LoadBalancer"
    assert outcome.status["syncer"]["endpoints"] == [], "no address published yet"
    for shard in (0, 1):  # what a cloud controller does
        kube.objects[("Service", "ml", f"demo-syncer-{shard}")]["status"] = {
            "loadBalancer": {"ingress": [{"ip": f"127.0.0.{5 + shard}"}]}
        }
    outcome = reconciler.reconcile(JOB, 1, exposed, outcome.status, NOW)
    assert outcome.status["syncer"]["endpoints"] == ["127.0.0.5:50051", "127.0.0.6:50051"]
    names = certificates.names_of(secret_bytes(kube.get("Secret", "ml", "diloco-demo-tls"))["tls.crt"])
    assert {"127.0.0.5", "127.0.0.6", "demo-syncer-0.ml.svc"} <= names
    assert "Secret/diloco-demo-tls" in outcome.applied and "Deployment/demo-syncer-0" in outcome.applied, "pods roll"


REMOTE = {"endpoints": ["127.0.0.5:31000", "127.0.0.5:31001"], "tokenSecret": "far-token", "caSecret": "far-ca"}


def test_a_job_against_remote_shards_runs_only_islands_and_reads_its_progress_from_them(setup):
    kube, reconciler, calls = setup
    kube.add(secret("far-token", token=b"their-token"))
    kube.add(secret("far-ca", **{"ca.crt": TEST_PKI.ca.cert}))
    outcome = reconciler.reconcile(JOB, 1, {**SPEC, "remoteSyncers": REMOTE}, None, NOW)
    assert sorted(k for k in outcome.applied) == [
        "ConfigMap/demo-config",
        "Service/demo-a",
        "Service/demo-b",
        "StatefulSet/demo-a",
        "StatefulSet/demo-b",
    ]
    assert kube.get("Secret", "ml", "diloco-demo-token") is None, "the islands mount the Secret the job names"
    assert calls == [(REMOTE["endpoints"], [True, True], ["their-token"], Tls(ca=TEST_PKI.ca.cert))]
    syncer = outcome.status["syncer"]
    assert [s["lineage"] for s in syncer.pop("lineages")] == ["00000000000000a0", "00000000000000a1"]
    assert syncer == {"shards": 2, "ready": 2, "reachable": 2, "lastStateLoss": None, "endpoints": REMOTE["endpoints"]}
    assert outcome.status["outerStep"] == 4


def test_remote_shards_that_do_not_answer_are_not_ready(setup):
    kube, _, _ = setup
    kube.add(secret("far-token", token=b"their-token"))
    kube.add(secret("far-ca", **{"ca.crt": TEST_PKI.ca.cert}))

    def unreachable(targets, ready, token, security, timeout):
        return [ShardObservation(shard=i, ready=True, error="UNAVAILABLE: down") for i in range(len(targets))]

    reconciler = Reconciler(kube, None, poll_shards=unreachable, scrape_trainers=lambda u, t: {}, token_key=bytes(32))
    outcome = reconciler.reconcile(JOB, 1, {**SPEC, "remoteSyncers": REMOTE}, None, NOW)
    assert outcome.status["syncer"]["ready"] == 0 and outcome.status["syncer"]["reachable"] == 0


def test_without_the_remote_token_the_shards_are_not_called_and_the_status_says_why(setup):
    kube, reconciler, calls = setup
    kube.add(secret("far-ca", **{"ca.crt": TEST_PKI.ca.cert}))
    outcome = reconciler.reconcile(JOB, 1, {**SPEC, "remoteSyncers": REMOTE}, None, NOW)
    assert calls == []
    assert any("spec.remoteSyncers.tokenSecret" in c.get("message", "") for c in outcome.status["conditions"])


def test_islands_the_shards_report_live_that_the_spec_lacks_appear_as_remote_islands(setup):
    kube, _, _ = setup

    def live(targets, ready, token, security, timeout):
        return [
            ShardObservation(shard=i, ready=r, fragments=(), live_islands=frozenset({"a", "far-1"}))
            for i, r in enumerate(ready)
        ]

    reconciler = Reconciler(kube, None, poll_shards=live, scrape_trainers=lambda u, t: {}, token_key=bytes(32))
    reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    for shard in (0, 1):
        kube.objects[("Deployment", "ml", f"demo-syncer-{shard}")]["status"] = {"readyReplicas": 1}
    outcome = reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    assert outcome.status["remoteIslands"] == [{"name": "far-1", "lastSync": "2026-01-01T00:00:00Z"}]


def test_islands_of_another_cluster_train_against_exposed_shards_over_tls_and_each_cluster_sees_the_other():
    """Cluster A exposes its shard through a LoadBalancer (the test publishes 127.0.0.5, as a cloud controller
    would); a real shard serves the certificate A's operator made; cluster B's job names that endpoint, A's
    token and A's CA. B's island verifies the shard's certificate at the exposed address, B's operator reads
    its progress from the shard, and A's lists B's island among its remote islands."""
    port = free_port()
    spec_a = {
        **SPEC,
        "islands": [{"name": "a"}],
        "syncer": {"shards": 1, "port": port, "expose": {"type": "LoadBalancer"}},
    }
    cluster_dns = {f"demo-syncer-0.ml.svc:{port}": f"127.0.0.5:{port}"}
    kube_a = FakeKube()
    operator_a = Reconciler(
        kube_a,
        None,
        poll_shards=lambda targets, *rest: shard_statuses([cluster_dns[t] for t in targets], *rest),
        scrape_trainers=lambda urls, t: {},
        token_key=bytes(32),
    )
    status_a = operator_a.reconcile(JOB, 1, spec_a, None, NOW).status
    kube_a.objects[("Service", "ml", "demo-syncer-0")]["status"] = {"loadBalancer": {"ingress": [{"ip": "127.0.0.5"}]}}
    status_a = operator_a.reconcile(JOB, 1, spec_a, status_a, NOW).status
    assert status_a["syncer"]["endpoints"] == [f"127.0.0.5:{port}"]

    token = presented(kube_a)
    made = secret_bytes(kube_a.get("Secret", "ml", "diloco-demo-tls"))
    config = DiLoCoJobSpec.model_validate(spec_a).training
    shard = SyncerServer(
        config,
        shard_index=0,
        num_shards=1,
        token=token,
        security=Tls(ca=made["ca.crt"], cert=made["tls.crt"], key=made["tls.key"]),
        host="127.0.0.5",
        port=port,
    )
    shard.start()
    try:
        for island in ("a", "far"):
            with SyncerClient(
                status_a["syncer"]["endpoints"][0], token, security=Tls(ca=made["ca.crt"]), island_id=island, timeout=5
            ) as client:
                client.join(2)
                if island == "a":
                    client.seed(0, [("w", torch.zeros(2))])

        kube_b = FakeKube()
        kube_b.add(secret("far-token", token=token.encode()))
        kube_b.add(secret("far-ca", **{"ca.crt": made["ca.crt"]}))
        remote = {"endpoints": status_a["syncer"]["endpoints"], "tokenSecret": "far-token", "caSecret": "far-ca"}
        spec_b = {**SPEC, "islands": [{"name": "far"}], "syncer": {"shards": 1}, "remoteSyncers": remote}
        job_b = n.JobRef(name="demo", namespace="ml", uid="another-cluster's-uid")
        operator_b = Reconciler(kube_b, None, scrape_trainers=lambda urls, t: {}, token_key=bytes([1] * 32))
        status_b = operator_b.reconcile(job_b, 1, spec_b, None, NOW).status
        assert [s["lineage"] for s in status_b["syncer"].pop("lineages")] == [f"{shard.state.lineage:016x}"]
        assert status_b["syncer"] == {
            "shards": 1,
            "ready": 1,
            "reachable": 1,
            "lastStateLoss": None,
            "endpoints": remote["endpoints"],
        }
        assert [f["fragment"] for f in status_b["fragments"]] == [0]
        assert status_b["islands"][0]["name"] == "far" and status_b["islands"][0]["lastSync"] == "2026-01-01T00:00:00Z"
        assert [r["name"] for r in status_b["remoteIslands"]] == ["a"], "cluster A's island, seen from B"
        assert kube_b.get("Deployment", "ml", "demo-syncer-0") is None

        kube_a.objects[("Deployment", "ml", "demo-syncer-0")]["status"] = {"readyReplicas": 1}
        status_a = operator_a.reconcile(JOB, 1, spec_a, status_a, NOW).status
        assert status_a["syncer"]["reachable"] == 1
        assert [r["name"] for r in status_a["remoteIslands"]] == ["far"]
    finally:
        shard.stop(grace=0)


def test_a_pass_in_a_namespace_being_deleted_does_nothing(setup):
    """The namespace controller removes the job's pods: none is charged as a failure, no Event is posted where
    the API server refuses new ones, no child is applied again, and the status is left as it was."""
    kube, reconciler, _ = setup
    kube.add(
        {"kind": "Node", "metadata": {"name": "n1"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    )
    kube.add(island_pod("a", 0, "pod-a0"))
    first = reconciler.reconcile(JOB, 1, SPEC, None, NOW)
    kube.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}, "status": {"phase": "Terminating"}})
    kube.objects.pop(("Pod", "ml", "demo-a-0"))
    writes = len(kube.writes)
    later = NOW + datetime.timedelta(seconds=10)
    assert reconciler.reconcile(JOB, 1, SPEC, first.status, later) == LEFT_ALONE
    assert len(kube.writes) == writes
    kube.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}, "status": {"phase": "Active"}})
    charged = reconciler.reconcile(JOB, 1, SPEC, first.status, later)
    assert "IslandFailed" in [e.reason for e in charged.events], "the same loss in a live namespace is a failure"


def test_a_pass_whose_namespace_begins_going_midway_stops_and_says_nothing(setup):
    """The namespace was live when the pass looked and is being deleted when it applies: the API server refuses
    anything new there, and the pass ends as one that had seen it from the start."""
    kube, reconciler, _ = setup

    def refused(obj, force):
        raise ApiError(
            403,
            f"{obj['kind']} is forbidden: unable to create new content in namespace ml because it is being terminated",
        )

    kube.apply = refused
    assert reconciler.reconcile(JOB, 1, SPEC, None, NOW) == LEFT_ALONE
