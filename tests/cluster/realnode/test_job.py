"""The project's images on real nodes: the operator, installed with helm from charts/diloco, runs in the
cluster as the chart's Deployment, under the chart's own RBAC, as the image's non-root user with its probes
passing. The README's example job, as it is, trains on three on-demand nodes. Its islands (the
two-pod one included) and syncer shards are real containers of diloco-trainer, running as the image's non-root
user with their probes passing; the islands find the shards and each other by their Service names (CoreDNS,
kube-proxy), become Ready, and the job's outer step, which the operator reads from the shards, rises. A shard's
checkpoint, on its volume, outlives its pod: a new pod resumes from it. An island pod that outgrows its memory
limit is killed by the kernel, and the job counts that as a failure. The operator's NetworkPolicy keeps pods
outside the job off the shards' gRPC port.

Needs, beside test_node.py's opt-in, both images built from this checkout, as archives:
tests/cluster/realnode/images.sh operator trainer (skipped otherwise, with the command for the stale one)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from e2e.conftest import OPERATOR_NAMESPACE, Target, install_operator, uninstall_operator
from support import wait_until

from cluster.cluster import Cluster
from cluster.realnode import archives, busybox
from cluster.realnode.busybox import last_probe, running, web_pod
from cluster.realnode.node import MISSING, ON_DEMAND, RealNodes, container_processes, not_enabled, real_cluster
from diloco.api.conditions import ConditionType, Reason
from diloco.api.job import DiLoCoJobSpec
from diloco.operator import naming
from diloco.operator.children import OperatorRef
from diloco.syncer.checkpoint import checkpoint_path

ROOT = Path(__file__).resolve().parents[3]
CONTAINERS = (
    "NAMESPACE:.metadata.namespace,NAME:.metadata.name,NODE:.spec.nodeName,IP:.status.podIP,"
    "CONTAINER:.status.containerStatuses[*].containerID"
)
EXAMPLE = ROOT / "deploy" / "examples" / "tiny-cpu.yaml"
TRAINER_UID = 10001  # deploy/Dockerfile.trainer's USER
IMAGES = ("operator", "trainer")
# Importing the 6 GB image alone takes minutes on a loaded machine, then the job has to form and train.
pytestmark = [pytest.mark.process, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def cluster_with_operator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, RealNodes]]:
    """A control plane and three on-demand real nodes (the example's three island pods ask for a CPU each, and
    each node has this machine's two) with diloco-operator:dev, diloco-trainer:dev and busybox preloaded,
    the operator installed there with helm as the e2e suite installs it (the chart's CRDs, Deployment and
    RBAC); uninstalled with helm on the way out."""
    if reason := not_enabled():
        pytest.skip(reason)
    for image in IMAGES:
        if reason := archives.unusable(image):
            pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("realnode-job")
    images = (*(archives.archive(image) for image in IMAGES), busybox.image(workdir))
    try:
        with real_cluster(workdir, (replace(ON_DEMAND, count=3),), images, timeout=1200) as (cluster, nodes):
            target = Target(cluster.kubeconfig, cluster.bin, "dev")
            install_operator(target)
            try:
                yield cluster, nodes
                restarted = {p["metadata"]["name"]: p["status"]["containerStatuses"] for p in operator_pods(cluster)}
                assert all(c["restartCount"] == 0 for cs in restarted.values() for c in cs), f"liveness: {restarted}"
            finally:
                uninstall_operator(target)
    except MISSING as error:
        pytest.skip(str(error))


def operator_pods(cluster: Cluster) -> list[dict]:
    """The pods of the chart's operator Deployment."""
    return pods(cluster, OPERATOR_NAMESPACE, OperatorRef(OPERATOR_NAMESPACE).pod_labels)


def container_uids(container_id: str) -> set[int]:
    """The real uids of a container's processes, as the host sees them."""
    return {int(status["Uid"].split()[0]) for status in container_processes(container_id).values()}


def test_the_operator_runs_in_the_cluster_as_the_images_user_with_its_probes_passing(cluster_with_operator):
    """helm's operator pod is a real container of diloco-operator:dev on a real node, Ready and never restarted
    (its probes pass), its processes running as the user the image names, not root."""
    cluster, nodes = cluster_with_operator
    user = archives.config(archives.archive("operator"))["User"]
    image_uid = int(user.split(":")[0])
    operators = operator_pods(cluster)
    assert operators
    for pod in operators:
        assert pod["spec"]["nodeName"] in nodes.names
        (container,) = pod["status"]["containerStatuses"]
        assert container["image"].endswith("diloco-operator:dev") and container["imageID"], container
        assert container["ready"] and container["restartCount"] == 0, container
        assert container["containerID"].startswith("containerd://")
        assert image_uid != 0 and container_uids(container["containerID"].removeprefix("containerd://")) == {image_uid}
    print(cluster.kubectl("-n", OPERATOR_NAMESPACE, "get", "pods", "-o", f"custom-columns={CONTAINERS}").stdout)


def job_status(cluster: Cluster, namespace: str = "readme") -> dict:
    return get(cluster, namespace, "dj", "tiny-cpu").get("status", {})


def get(cluster: Cluster, namespace: str, *what: str) -> dict:
    return json.loads(cluster.kubectl("-n", namespace, "get", *what, "-o", "json").stdout)


def pods(cluster: Cluster, namespace: str, selector: dict[str, str]) -> list[dict]:
    labels = ",".join(f"{key}={value}" for key, value in selector.items())
    return get(cluster, namespace, "pods", "-l", labels)["items"]


def wait_for(
    cluster: Cluster, what: str, done: Callable[[dict], bool], timeout: float, namespace: str = "readme"
) -> dict:
    """Polls the job's status until `done` holds; fails with the pods and the last status otherwise."""
    deadline = time.monotonic() + timeout
    while not done(status := job_status(cluster, namespace)):
        if time.monotonic() > deadline:
            listed = cluster.kubectl("-n", namespace, "get", "pods", "-o", "wide").stdout
            pytest.fail(f"{what} within {timeout} s; status {status}\n{listed}")
        time.sleep(3)
    return status


@pytest.fixture(scope="module")
def readme_job(cluster_with_operator) -> dict:
    """The README's example, applied in namespace `readme`: its status once both islands are Ready, both shards
    answer and the job's outer step is above zero."""
    cluster, _ = cluster_with_operator
    cluster.kubectl("create", "namespace", "readme")
    cluster.kubectl("-n", "readme", "apply", "-f", "-", stdin=EXAMPLE.read_text())
    return wait_for(
        cluster,
        "the islands did not become Ready and train",
        lambda s: s.get("islandsReady") == "2/2" and s.get("syncer", {}).get("reachable") == 2 and s.get("outerStep"),
        timeout=900,
    )


def test_the_readme_example_trains_on_real_containers(cluster_with_operator, readme_job):
    cluster, nodes = cluster_with_operator
    wait_for(cluster, "the outer step did not rise", lambda s: s.get("outerStep", 0) > readme_job["outerStep"], 600)
    print(cluster.kubectl("get", "nodes", "-o", "wide").stdout)
    print(cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout)
    print(cluster.kubectl("get", "pods", "-A", "-o", f"custom-columns={CONTAINERS}").stdout)

    pair = pods(cluster, "readme", naming.island_selector("tiny-cpu", "pair"))
    assert len(pair) == 2
    for pod in pair + pods(cluster, "readme", {naming.LABEL_ROLE: "syncer"}):
        assert pod["spec"]["nodeName"] in nodes.names
        (container,) = pod["status"]["containerStatuses"]
        assert container["ready"] and container["containerID"].startswith("containerd://")
        assert pod["spec"]["securityContext"].get("runAsUser", TRAINER_UID) == TRAINER_UID


def test_a_pod_outside_the_job_cannot_reach_its_syncers(cluster_with_operator, readme_job):
    """The NetworkPolicy the operator wrote for the example, enforced by kube-network-policies: a pod outside the
    job gets no answer on a shard's gRPC port (the job's islands, which train through it, do), while the same
    kind of pod reaches the same shard's metrics port, which the policy leaves open to scrapers: the policy
    closes the gRPC port, not a broken network."""
    cluster, _ = cluster_with_operator
    spec = DiLoCoJobSpec.model_validate(yaml.safe_load(EXAMPLE.read_text())["spec"])
    (shard,) = pods(cluster, "readme", naming.shard_selector("tiny-cpu", 1))  # shard 0's pod is deleted below
    address = shard["status"]["podIP"]
    names = {port: f"stranger-{port}" for port in (spec.syncer.port, spec.syncer.metrics_port)}
    try:
        strangers = {
            port: running(cluster, "readme", web_pod(name, probe=f"{address} {port}")) for port, name in names.items()
        }
        tried = {
            port: wait_until(lambda pod=pod: (last := last_probe(pod))[0] >= 3 and last, 60, 1)
            for port, pod in strangers.items()
        }
    finally:
        cluster.kubectl("-n", "readme", "delete", "pod", *names.values(), "--ignore-not-found", "--wait=false")
    assert tried[spec.syncer.metrics_port][1] == "reached", tried
    assert tried[spec.syncer.port][1] == "blocked", tried
    print(f"a pod outside the job, to shard 1 at {address}: {tried}")


def shard_versions(status: dict, shard: int) -> dict[int, int]:
    """The versions of `shard`'s fragments, as the job's status last reported them."""
    return {f["fragment"]: f["version"] for f in status.get("fragments", ()) if f["shard"] == shard}


def ready_replacement(cluster: Cluster, old: dict) -> dict | None:
    """The Ready pod of the same shard that replaced the pod `old`, once there is one."""
    selector = naming.shard_selector("tiny-cpu", int(old["metadata"]["labels"][naming.LABEL_SHARD]))
    for pod in pods(cluster, "readme", selector):
        statuses = pod["status"].get("containerStatuses") or [{}]
        if pod["metadata"]["uid"] != old["metadata"]["uid"] and statuses[0].get("ready"):
            return pod
    return None


def test_a_deleted_syncer_pod_resumes_from_its_checkpoint(cluster_with_operator, readme_job):
    """The shard's checkpoint is written by the shard's non-root user on its volume; a new pod of the shard
    resumes from it: its fragments' versions do not go back to zero."""
    cluster, _ = cluster_with_operator
    shards = yaml.safe_load(EXAMPLE.read_text())["spec"]["syncer"]["shards"]
    volume = get(cluster, "readme", "pvc", naming.syncer_name("tiny-cpu", 0))["spec"]["volumeName"]
    folder = Path(get(cluster, "default", "pv", volume)["spec"]["hostPath"]["path"])
    saved = checkpoint_path(folder, 0, shards)
    deadline = time.monotonic() + 300
    while not saved.exists():
        assert time.monotonic() < deadline, f"shard 0 wrote no checkpoint to {folder}: {os.listdir(folder)}"
        time.sleep(3)
    assert saved.stat().st_uid == TRAINER_UID

    wait_for(cluster, "shard 0 did not merge", lambda s: any(shard_versions(s, 0).values()), 600)
    before = shard_versions(job_status(cluster), 0)
    (old,) = pods(cluster, "readme", naming.shard_selector("tiny-cpu", 0))
    cluster.kubectl("-n", "readme", "delete", "pod", old["metadata"]["name"], "--wait=true", timeout=120)
    new = wait_until(lambda: ready_replacement(cluster, old), timeout=600, interval=3)
    log = cluster.kubectl("-n", "readme", "logs", new["metadata"]["name"]).stdout
    resumed = [json.loads(line) for line in log.splitlines() if "resumed from checkpoint" in line]
    assert resumed, log[-3000:]
    print(f"before deleting {old['metadata']['name']}: {before}; {new['metadata']['name']}: {resumed[0]}")
    versions = {int(fragment): version for fragment, version in resumed[0]["versions"].items()}
    assert versions.keys() == before.keys() and all(versions[f] >= before[f] for f in before), (versions, before)

    def merged_on(status: dict) -> bool:
        now = shard_versions(status, 0)
        assert all(now[f] >= before[f] for f in before), f"shard 0 went back from {before} to {now}"
        return all(now[f] > versions[f] for f in before)

    wait_for(cluster, "the resumed shard did not merge again", merged_on, 600)


def test_a_container_killed_by_its_memory_limit_is_a_failure_not_a_preemption(cluster_with_operator):
    """An island whose memory limit is below what the trainer needs: the kernel kills its container (the
    kubelet reports OOMKilled), and the operator charges that to the restart budget (0 here: the job fails,
    saying why), never as a preemption."""
    cluster, _ = cluster_with_operator
    job = yaml.safe_load(EXAMPLE.read_text())
    solo = job["spec"]["islands"][0]
    solo["resources"] = {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "64Mi"}}
    job["spec"]["islands"] = [solo]
    job["spec"]["syncer"]["shards"] = 1
    job["spec"]["failurePolicy"] = {"restartBudget": 0}
    cluster.kubectl("create", "namespace", "oom")
    try:
        cluster.kubectl("-n", "oom", "apply", "-f", "-", stdin=yaml.safe_dump(job))
        status = wait_for(cluster, "the job did not fail", lambda s: s.get("phase") == "Failed", 600, namespace="oom")
        events = get(cluster, "oom", "events")["items"]
    finally:
        cluster.kubectl("delete", "namespace", "oom", "--wait=false")
    (island,) = status["islands"]
    assert island["restarts"] >= 1 and island["preemptions"] == 0, island
    (failed,) = [c for c in status["conditions"] if c["type"] == ConditionType.FAILED]
    assert failed["reason"] == Reason.RESTART_BUDGET_EXHAUSTED and "OOMKilled" in failed["message"], failed
    reasons = [e["reason"] for e in events]
    assert Reason.ISLAND_FAILED in reasons and Reason.ISLAND_PREEMPTED not in reasons, reasons
    print(f"{failed['type']}: {failed['reason']}: {failed['message']}")
