"""On a whole cluster (kube-controller-manager, kube-scheduler, KWOK nodes in GKE-shaped pools), with the
operator running as its own ServiceAccount: island pods really scheduled where each island asks, the garbage
collector really collecting a deleted job, preemptions (eviction, a lost spot node) told apart from failures,
two replicas of which only one acts, and an operator SIGKILLed in the middle of a pass changing nothing once
restarted.

Pods here use an image no pod runner picks up: KWOK alone makes them Running and Ready, which is all the
operator observes."""

from __future__ import annotations

import json
from collections import Counter
from functools import partial

import pytest
import support
import yaml
from kubernetes import config as kube_config
from operator_harness import OperatorProcess, install

from diloco.operator.kube import Kube
from diloco.operator.reconcile import CHILD_KINDS

wait_until = partial(support.wait_until, timeout=90.0, interval=0.25)

pytestmark = [pytest.mark.process, pytest.mark.filterwarnings("ignore:Unverified HTTPS request")]

RESYNC = 1.0
PEERING_LIFETIME = 6
IMAGE = "test.invalid/diloco-trainer-kwok:test"
H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"


def job_manifest(name: str, islands: list[dict], **spec) -> str:
    body = {
        "image": IMAGE,
        "training": {"innerSteps": 20, "fragments": 2, "overlapSteps": 1},
        "islands": islands,
        "syncer": {"shards": 1},
        **spec,
    }
    return yaml.safe_dump(
        {"apiVersion": "diloco.dev/v1alpha1", "kind": "DiLoCoJob", "metadata": {"name": name}, "spec": body}
    )


class Operators:
    """The replicas of this module, each with its own peering priority, and their logs."""

    def __init__(self, cluster, tmp_path_factory):
        self.kubeconfig = install(cluster)
        self.dir = tmp_path_factory.mktemp("operators")
        self.started: list[OperatorProcess] = []

    def start(self, priority: int) -> OperatorProcess:
        replica = OperatorProcess(
            self.kubeconfig,
            self.dir / f"operator-{priority}.log",
            RESYNC,
            [f"--priority={priority}", f"--peering-lifetime={PEERING_LIFETIME}"],
        )
        replica.start()
        self.started.append(replica)
        return replica


@pytest.fixture(scope="module")
def operators(operator_cluster, tmp_path_factory):
    found = Operators(operator_cluster, tmp_path_factory)
    yield found
    for replica in found.started:
        replica.stop()
    for replica in found.started:
        log = replica.log.read_text()
        assert "Forbidden" not in log and " 403" not in log, log[-4000:]


@pytest.fixture(scope="module")
def operator(operators):
    """The one replica that the first tests rely on (the replica tests stop it)."""
    replica = operators.start(priority=1000)
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def kube(operator_cluster):
    return Kube(kube_config.new_client_from_config(config_file=str(operator_cluster.admin_kubeconfig)))


def namespace(cluster, name):
    cluster.kubectl("create", "namespace", name)
    return name


def status(kube, ns, name):
    return (kube.get("DiLoCoJob", ns, name) or {}).get("status") or {}


def island_pods(kube, ns, job, island):
    return kube.list("Pod", ns, {"diloco.dev/job": job, "diloco.dev/island": island})


def owned(kube, ns, job):
    """Every object labelled as the job's, pods included: (kind, name) -> object."""
    return {
        (kind, o["metadata"]["name"]): o
        for kind in (*CHILD_KINDS, "Pod")
        for o in kube.list(kind, ns, {"diloco.dev/job": job})
    }


def events(cluster, ns, reason):
    listing = json.loads(cluster.kubectl("-n", ns, "get", "events", "-o", "json").stdout)["items"]
    return [e for e in listing if e["reason"] == reason]


def test_island_pods_are_scheduled_onto_the_nodes_each_island_asks_for(operator_cluster, kube, operator):
    ns = namespace(operator_cluster, "placement")
    islands = [
        {
            "name": "h100-spot",
            "replicas": 2,
            "acceleratorsPerPod": 8,
            "spot": True,
            "nodeSelector": {"nvidia.com/gpu.product": H100},
        },
        {"name": "a100", "replicas": 3, "acceleratorsPerPod": 8, "nodeSelector": {"nvidia.com/gpu.product": A100}},
        {"name": "cpu-spot", "replicas": 2, "spot": True, "nodeSelector": {"cloud.google.com/gke-spot": "true"}},
        {"name": "cpu", "replicas": 2},
    ]
    operator_cluster.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("mixed", islands))
    wait_until(lambda: status(kube, ns, "mixed").get("islandsReady") == "4/4")
    nodes = {
        n["metadata"]["name"]: n["metadata"]["labels"]
        for n in json.loads(operator_cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    }
    placed = {
        island["name"]: [nodes[p["spec"]["nodeName"]] for p in island_pods(kube, ns, "mixed", island["name"])]
        for island in islands
    }
    assert {name: len(found) for name, found in placed.items()} == {"h100-spot": 2, "a100": 3, "cpu-spot": 2, "cpu": 2}
    assert all(
        n["nvidia.com/gpu.product"] == H100 and n["cloud.google.com/gke-spot"] == "true" for n in placed["h100-spot"]
    )
    assert all(n["nvidia.com/gpu.product"] == A100 and "cloud.google.com/gke-spot" not in n for n in placed["a100"])
    # Three pods of eight GPUs each fill three A100 nodes: the scheduler really counts the extended resource.
    assert len({n["kubernetes.io/hostname"] for n in placed["a100"]}) == 3
    assert all(n["cloud.google.com/gke-nodepool"] == "cpu-spot" for n in placed["cpu-spot"])
    # Without the spot flag no toleration is added: the tainted spot and GPU pools are out of reach.
    assert all(n["cloud.google.com/gke-nodepool"] == "cpu" for n in placed["cpu"])
    assert wait_until(lambda: status(kube, ns, "mixed").get("phase") == "Running")


def test_deleting_the_job_garbage_collects_every_child(operator_cluster, kube, operator):
    ns = namespace(operator_cluster, "collect")
    operator_cluster.kubectl(
        "-n", ns, "apply", "-f", "-", stdin=job_manifest("doomed", [{"name": "a", "replicas": 2}, {"name": "b"}])
    )
    wait_until(lambda: status(kube, ns, "doomed").get("phase") == "Running")
    kinds = Counter(kind for kind, _ in owned(kube, ns, "doomed"))
    assert kinds == {
        "ConfigMap": 1,
        "Secret": 2,  # the token and the TLS certificates
        "NetworkPolicy": 1,
        "PersistentVolumeClaim": 1,
        "Service": 3,
        "Deployment": 1,
        "StatefulSet": 2,
        "Pod": 4,
    }
    operator_cluster.kubectl("-n", ns, "delete", "dj", "doomed", "--wait=true", timeout=90)
    wait_until(lambda: not owned(kube, ns, "doomed"))
    assert kube.list("Pod", ns, {}) == [] and kube.list("PersistentVolumeClaim", ns, {}) == []


HOLD = "test.diloco.dev/hold"
"""A finalizer that keeps an evicted pod Terminating until the operator has seen it, as a kubelet's grace
period does (KWOK removes a deleted pod at once); the loss is judged when the pod is gone."""


def test_preemptions_are_not_charged_to_the_restart_budget_but_failures_are(operator_cluster, kube, operator):
    ns = namespace(operator_cluster, "preempt")
    operator_cluster.kubectl(
        "-n",
        ns,
        "apply",
        "-f",
        "-",
        stdin=job_manifest(
            "spotty",
            [{"name": "spot", "replicas": 2, "spot": True, "nodeSelector": {"cloud.google.com/gke-spot": "true"}}],
            failurePolicy={"restartBudget": 0, "backoffSeconds": 0},
        ),
    )

    def island():
        return (status(kube, ns, "spotty").get("islands") or [{}])[0]

    def formed():
        pods = island_pods(kube, ns, "spotty", "spot")
        ready = [
            p
            for p in pods
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", ()))
        ]
        return status(kube, ns, "spotty").get("islandsReady") == "1/1" and len(ready) == len(pods) == 2 and pods

    # Evicted through the Eviction API, on a healthy node: the pod carries the DisruptionTarget condition.
    victim = wait_until(formed)[0]["metadata"]["name"]
    operator_cluster.kubectl(
        "-n", ns, "patch", "pod", victim, "--type", "merge", "-p", json.dumps({"metadata": {"finalizers": [HOLD]}})
    )
    operator_cluster.kubectl(
        "create",
        "--raw",
        f"/api/v1/namespaces/{ns}/pods/{victim}/eviction",
        "-f",
        "-",
        stdin=json.dumps(
            {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": victim, "namespace": ns}}
        ),
    )
    wait_until(lambda: any(r["disrupted"] for r in island().get("pods", ())))
    operator_cluster.kubectl(
        "-n", ns, "patch", "pod", victim, "--type", "json", "-p", '[{"op": "remove", "path": "/metadata/finalizers"}]'
    )
    wait_until(lambda: island().get("preemptions") == 1)
    assert island()["restarts"] == 0 and events(operator_cluster, ns, "IslandPreempted")

    # A spot node taken away with its pods: cordoned, its pods evicted by the out-of-service taint, deleted.
    node = wait_until(formed)[0]["spec"]["nodeName"]
    operator_cluster.delete_node(node)
    try:
        wait_until(lambda: island().get("preemptions") == 2)
        assert island()["restarts"] == 0 and status(kube, ns, "spotty")["phase"] != "Failed"
        assert all(p["spec"]["nodeName"] != node for p in wait_until(formed))
    finally:
        operator_cluster.add_node("cpu-spot")

    # The same loss on a healthy node without a disruption is a failure: over a budget of 0, the job fails.
    operator_cluster.kubectl("-n", ns, "delete", "pod", wait_until(formed)[0]["metadata"]["name"])
    wait_until(lambda: status(kube, ns, "spotty").get("phase") == "Failed")
    assert island()["restarts"] == 1 and island()["preemptions"] == 2
    assert events(operator_cluster, ns, "RestartBudgetExhausted")
    # Failed is final: the island is scaled to zero and stays there.
    wait_until(lambda: not island_pods(kube, ns, "spotty", "spot"))
    assert kube.get("StatefulSet", ns, "spotty-spot")["spec"]["replicas"] == 0


def test_a_statefulset_deleted_by_hand_is_recreated_and_its_pods_are_not_charged(operator_cluster, kube, operator):
    ns = namespace(operator_cluster, "handdelete")
    operator_cluster.kubectl(
        "-n",
        ns,
        "apply",
        "-f",
        "-",
        stdin=job_manifest("manual", [{"name": "a", "replicas": 2}], failurePolicy={"restartBudget": 0}),
    )

    def formed(uid=None):
        """The StatefulSet's UID once it is not `uid` and the status has recorded its two pods, ready."""
        sts = kube.get("StatefulSet", ns, "manual-a")
        pods = {p["metadata"]["uid"] for p in island_pods(kube, ns, "manual", "a")}
        now = status(kube, ns, "manual")
        recorded = {r["uid"] for i in now.get("islands") or () for r in i.get("pods") or ()}
        whole = now.get("islandsReady") == "1/1" and len(pods) == 2 and recorded == pods
        return whole and sts is not None and sts["metadata"]["uid"] != uid and sts["metadata"]["uid"]

    first = wait_until(formed)
    operator_cluster.kubectl("-n", ns, "delete", "statefulset", "manual-a", "--wait=true", timeout=90)
    second = wait_until(lambda: formed(first))
    assert second != first
    island = status(kube, ns, "manual")["islands"][0]
    assert island["restarts"] == 0 and status(kube, ns, "manual")["phase"] != "Failed"
    assert not events(operator_cluster, ns, "IslandFailed")


def identities(objects):
    """What must not change when nothing is re-done: every object's UID; the resourceVersion of those only the
    operator writes (ConfigMap, Secret, Service, NetworkPolicy); the spec generation of the workloads."""
    return {
        key: (
            o["metadata"]["uid"],
            o["metadata"]["resourceVersion"]
            if key[0] in ("ConfigMap", "Secret", "Service", "NetworkPolicy")
            else o["metadata"].get("generation"),
        )
        for key, o in objects.items()
    }


def test_an_operator_killed_mid_pass_and_restarted_changes_nothing(operator_cluster, kube, operators, operator):
    ns = namespace(operator_cluster, "killed")
    islands = [{"name": f"i{k:02d}"} for k in range(60)]
    operator_cluster.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("big", islands))
    wait_until(lambda: kube.list("StatefulSet", ns, {"diloco.dev/job": "big"}), interval=0.02)
    operator.kill()
    at_kill = owned(kube, ns, "big")
    made = sum(1 for kind, _ in at_kill if kind == "StatefulSet")
    assert made < len(islands), "the pass was over before the kill: nothing was interrupted"

    restarted = operators.start(priority=1001)
    wait_until(lambda: status(kube, ns, "big").get("islandsReady") == f"{len(islands)}/{len(islands)}")
    converged = owned(kube, ns, "big")
    survivors = [key for key in at_kill if key[0] != "Pod"]
    assert {key: converged[key]["metadata"]["uid"] for key in survivors} == {
        key: at_kill[key]["metadata"]["uid"] for key in survivors
    }, "a child was recreated"

    passes = restarted.metric("diloco_operator_reconciles_total", trigger="timer", result="ok")
    applied = restarted.metric("diloco_operator_applied_objects_total")
    wait_until(lambda: restarted.metric("diloco_operator_reconciles_total", trigger="timer", result="ok") >= passes + 3)
    assert identities(owned(kube, ns, "big")) == identities(converged)
    assert restarted.metric("diloco_operator_applied_objects_total") == applied
    assert restarted.metric("diloco_operator_deleted_objects_total") == 0


def test_of_two_replicas_only_one_acts_and_the_other_takes_over_when_it_dies(operator_cluster, kube, operators):
    for replica in operators.started:
        replica.stop()
    high = operators.start(priority=20)
    low = operators.start(priority=10)
    ns = namespace(operator_cluster, "replicas")
    operator_cluster.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("shared", [{"name": "a"}]))
    wait_until(lambda: status(kube, ns, "shared").get("islandsReady") == "1/1")
    wait_until(lambda: high.metric("diloco_operator_reconciles_total", trigger="timer", result="ok") >= 3)
    assert high.metric("diloco_operator_applied_objects_total") > 0
    assert low.metric("diloco_operator_reconciles_total") == 0

    high.kill()
    operator_cluster.kubectl(
        "-n",
        ns,
        "patch",
        "dj",
        "shared",
        "--type",
        "json",
        "-p",
        '[{"op": "add", "path": "/spec/islands/-", "value": {"name": "b"}}]',
    )
    wait_until(lambda: kube.get("StatefulSet", ns, "shared-b") is not None, timeout=PEERING_LIFETIME + 60)
    wait_until(lambda: low.metric("diloco_operator_applied_objects_total") > 0)
    wait_until(lambda: status(kube, ns, "shared").get("islandsReady") == "2/2")


def test_an_island_the_scheduler_cannot_place_says_what_the_scheduler_says(operator_cluster, kube, operator):
    """Sixteen GPUs a pod where the nodes have eight: the scheduler's own words reach the island's status (its
    start: an island's message is short), the job's Ready condition and a Warning Event (whole), not only "0/1
    pods ready"."""
    ns = namespace(operator_cluster, "unplaceable")
    islands = [{"name": "huge", "acceleratorsPerPod": 16, "nodeSelector": {"nvidia.com/gpu.product": A100}}]
    operator_cluster.kubectl("-n", ns, "apply", "-f", "-", stdin=job_manifest("huge", islands))
    island = wait_until(lambda: (s := status(kube, ns, "huge").get("islands")) and s[0].get("reason") and s[0])
    assert island["reason"] == "Unschedulable" and island["message"].startswith("pod huge-huge-0: 0/")
    ready = next(c for c in status(kube, ns, "huge")["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "Unschedulable"
    assert "island huge: Unschedulable: pod huge-huge-0: 0/" in ready["message"]
    assert "Insufficient nvidia.com/gpu" in ready["message"] and status(kube, ns, "huge")["phase"] == "Pending"
    (event,) = events(operator_cluster, ns, "Unschedulable")
    assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "DiLoCoJob"
    operator_cluster.kubectl("-n", ns, "delete", "dj", "huge", "--wait=true", timeout=120)
