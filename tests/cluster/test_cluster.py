"""The test cluster is a real one: the API server is the pinned Kubernetes release, controllers create pods, the
scheduler places them by selectors, taints, tolerations and extended resources, and a node taken away has
its pods evicted and replaced elsewhere."""

from __future__ import annotations

import ipaddress
import json
from functools import partial

import pytest
import support
import yaml

from cluster.controlplane import pinned_version

pytestmark = pytest.mark.process
wait_until = partial(support.wait_until, timeout=60.0, interval=0.5)

PAUSE = "registry.k8s.io/pause:3.10"
SPOT_TOLERATION = {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}


@pytest.fixture
def namespace(kwok_cluster):
    """Creates the test's namespaces and deletes them after it, pods and all: the cluster is shared by the whole
    session, and a test that leaves its 8-GPU pods behind leaves no GPU for the end-to-end suite's jobs."""
    created = []

    def create(name):
        kwok_cluster.kubectl("create", "namespace", name)
        created.append(name)
        return name

    yield create
    for name in created:
        kwok_cluster.kubectl("delete", "namespace", name, "--wait=true", "--timeout=120s", timeout=150)


def pods(cluster, ns, selector):
    out = cluster.kubectl("-n", ns, "get", "pods", "-l", selector, "-o", "json").stdout
    return json.loads(out)["items"]


def nodes(cluster):
    return {n["metadata"]["name"]: n for n in json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]}


def ready(pod):
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", ()))


def statefulset(name, replicas, node_selector, tolerations=(), resources=None):
    container = {"name": "main", "image": PAUSE}
    if resources:
        container["resources"] = resources
    return yaml.safe_dump(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "serviceName": name,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {
                        "nodeSelector": node_selector,
                        "tolerations": list(tolerations),
                        "containers": [container],
                    },
                },
            },
        }
    )


def test_the_api_server_is_the_pinned_kubernetes_release(kwok_cluster):
    version = json.loads(kwok_cluster.kubectl("get", "--raw", "/version").stdout)
    assert version["gitVersion"] == pinned_version("K8S_VERSION")


def test_nodes_come_in_realistic_pools(kwok_cluster):
    found = nodes(kwok_cluster)
    spot = found["cpu-spot-0"]
    assert spot["metadata"]["labels"]["cloud.google.com/gke-spot"] == "true"
    assert {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"} in spot["spec"]["taints"]
    h100, a100 = found["h100-spot-0"], found["a100-0"]
    assert h100["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert a100["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert a100["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert all(ready(n) for n in found.values()), "KWOK keeps every node Ready"


def test_a_scaled_statefulset_gets_pods_placed_by_selector_and_toleration(kwok_cluster, namespace):
    ns = namespace("realness-sts")
    kwok_cluster.kubectl(
        "-n",
        ns,
        "apply",
        "-f",
        "-",
        stdin=statefulset("spot", 0, {"cloud.google.com/gke-spot": "true"}, [SPOT_TOLERATION]),
    )
    assert pods(kwok_cluster, ns, "app=spot") == []
    kwok_cluster.kubectl("-n", ns, "scale", "statefulset", "spot", "--replicas=3")
    created = wait_until(lambda: (p := pods(kwok_cluster, ns, "app=spot")) and len(p) == 3 and all(map(ready, p)) and p)
    found = nodes(kwok_cluster)
    for pod in created:
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("StatefulSet", "spot", True)
        node = found[pod["spec"]["nodeName"]]
        # cpu-spot only: the H100 spot nodes also carry the GPU taint, which this pod does not tolerate.
        assert node["metadata"]["labels"]["cloud.google.com/gke-nodepool"] == "cpu-spot"
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(node["spec"]["podCIDR"])
    events = kwok_cluster.kubectl("-n", ns, "get", "events", "-o", "json").stdout
    assert '"reportingComponent": "default-scheduler"' in events and '"reason": "Scheduled"' in events


def test_a_pod_without_the_toleration_stays_off_spot_nodes(kwok_cluster, namespace):
    ns = namespace("realness-taint")
    kwok_cluster.kubectl(
        "-n", ns, "apply", "-f", "-", stdin=statefulset("intolerant", 1, {"cloud.google.com/gke-nodepool": "cpu-spot"})
    )
    pending = wait_until(
        lambda: (p := pods(kwok_cluster, ns, "app=intolerant")) and p[0]["status"].get("conditions") and p[0]
    )
    scheduled = next(c for c in pending["status"]["conditions"] if c["type"] == "PodScheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    # The cpu-spot nodes match the selector: the scheduler's taint filter is what turns them down.
    tainted = sum(1 for n in nodes(kwok_cluster).values() if n["spec"].get("taints"))
    assert f"{tainted} node(s) had untolerated taint(s)" in scheduled["message"]
    assert any(name.startswith("cpu-spot-") for name, n in nodes(kwok_cluster).items() if n["spec"].get("taints"))
    assert not pending["spec"].get("nodeName")


def test_gpu_pods_land_on_their_generation_and_are_counted_against_its_gpus(kwok_cluster, namespace):
    ns = namespace("realness-gpu")
    a100_nodes = [n for n in nodes(kwok_cluster) if n.startswith("a100-")]
    whole_node = {"limits": {"nvidia.com/gpu": "8"}}
    kwok_cluster.kubectl(
        "-n",
        ns,
        "apply",
        "-f",
        "-",
        stdin=statefulset(
            "a100", len(a100_nodes) + 1, {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}, resources=whole_node
        ),
    )

    def settled():
        found = pods(kwok_cluster, ns, "app=a100")
        placed = [p for p in found if p["spec"].get("nodeName") and ready(p)]
        return len(found) == len(a100_nodes) + 1 and len(placed) == len(a100_nodes) and found

    found = wait_until(settled)
    placed = sorted(p["spec"]["nodeName"] for p in found if p["spec"].get("nodeName"))
    assert placed == sorted(a100_nodes), "one 8-GPU pod per A100 node, the last one waits for GPUs"
    # The GPU taint was tolerated through the ExtendedResourceToleration admission plugin.
    tolerations = found[0]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    waiting = next(p for p in found if not p["spec"].get("nodeName"))
    message = next(c["message"] for c in waiting["status"]["conditions"] if c["type"] == "PodScheduled")
    assert "Insufficient nvidia.com/gpu" in message


def test_a_deleted_spot_node_has_its_pods_evicted_and_replaced(kwok_cluster, namespace):
    ns = namespace("realness-preempt")
    kwok_cluster.kubectl(
        "-n",
        ns,
        "apply",
        "-f",
        "-",
        stdin=statefulset("victim", 1, {"cloud.google.com/gke-spot": "true"}, [SPOT_TOLERATION]),
    )
    before = wait_until(lambda: (p := pods(kwok_cluster, ns, "app=victim")) and ready(p[0]) and p[0])
    lost = before["spec"]["nodeName"]
    kwok_cluster.delete_node(lost)
    try:
        assert lost not in nodes(kwok_cluster)
        after = wait_until(
            lambda: (
                (p := pods(kwok_cluster, ns, "app=victim"))
                and ready(p[0])
                and p[0]["metadata"]["uid"] != before["metadata"]["uid"]
                and p[0]
            )
        )
        assert after["metadata"]["name"] == "victim-0"
        assert after["spec"]["nodeName"] != lost
        assert after["spec"]["nodeName"].startswith("cpu-spot-")
    finally:
        assert kwok_cluster.add_node("cpu-spot") == lost
