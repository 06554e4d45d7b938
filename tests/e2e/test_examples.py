"""The examples in deploy/examples as written. tiny-cpu.yaml, applied as the README does, trains: its island of
two pods forms one torch.distributed world across them. spot-h100-ondemand-a100.yaml, on a cluster with its
GPU pools: islands of mixed generations land on their own pools, spot pods on spot nodes, every pod on a
node with GPUs free for it."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import support
import yaml
from test_ranks_per_pod import metric

pytestmark = [pytest.mark.process, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "e2e-mixed"
wait_until = partial(support.wait_until, timeout=120.0, interval=1.0)

PREREQUISITES = [  # what the example's header comment says it assumes
    {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": "training-high"},
        "value": 100000,
    },
    {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": "premium-rwo"},
        "provisioner": "diloco.dev/test-provisioner",
        "volumeBindingMode": "Immediate",
    },
    {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "corpus", "namespace": NAMESPACE},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "10Gi"}}},
    },
]


def nodes(target):
    return {n["metadata"]["name"]: n for n in json.loads(target.kubectl("get", "nodes", "-o", "json").stdout)["items"]}


def island_pods(target, island):
    out = target.kubectl(
        "-n", NAMESPACE, "get", "pods", "-l", f"diloco.dev/job=llm-mixed,diloco.dev/island={island}", "-o", "json"
    ).stdout
    return json.loads(out)["items"]


def running(pods, count):
    return len(pods) == count and all(p["status"].get("phase") == "Running" for p in pods) and pods


@pytest.mark.timeout(1800)
def test_tiny_cpu_trains_with_its_island_of_two_pods(target, operator):
    """`kubectl apply -f deploy/examples/tiny-cpu.yaml`: both islands Ready, the `pair` island's two ranks, one
    in each of its pods, both step, and the job's outer step rises. The example's trainers take every core and
    50 inner steps per round: on a busy machine its rounds take minutes."""
    if target.image_tag != "dev":
        pytest.skip(f"the example runs diloco-trainer:dev; this cluster's images are tagged {target.image_tag}")
    namespace = "e2e-tiny-cpu"
    target.kubectl("create", "namespace", namespace)
    try:
        target.kubectl("-n", namespace, "apply", "-f", str(ROOT / "deploy" / "examples" / "tiny-cpu.yaml"))

        def status():
            found = target.kubectl("-n", namespace, "get", "dilocojob", "tiny-cpu", "-o", "json").stdout
            return json.loads(found).get("status") or {}

        def steps():
            """Each rank of the pair island's inner step, its pods in ordinal order, once both have stepped."""
            selector = "diloco.dev/job=tiny-cpu,diloco.dev/island=pair"
            out = target.kubectl("-n", namespace, "get", "pods", "-l", selector, "-o", "json").stdout
            pods = sorted(json.loads(out)["items"], key=lambda p: p["metadata"]["name"])
            found = [metric(target, pod, 0, "diloco_worker_step", rank=str(rank)) for rank, pod in enumerate(pods)]
            return len(found) == 2 and all(found) and found

        wait_until(lambda: status().get("islandsReady") == "2/2", timeout=300)
        before = wait_until(steps, timeout=600)
        first = wait_until(lambda: status().get("outerStep", 0), timeout=900)
        wait_until(lambda: status()["outerStep"] > first, timeout=900)
        wait_until(lambda: (now := steps()) and all(a > b for a, b in zip(now, before, strict=True)))
    finally:
        target.kubectl("delete", "namespace", namespace, "--wait=true", timeout=180)


def test_mixed_generations_land_on_their_pools(target, operator):
    found = nodes(target)
    if not any("nvidia.com/gpu" in (n["status"].get("allocatable") or {}) for n in found.values()):
        pytest.skip("this cluster has no GPU nodes (the KWOK test cluster has H100 and A100 pools)")
    target.kubectl("create", "namespace", NAMESPACE)
    try:
        target.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(PREREQUISITES))
        target.kubectl(
            "-n", NAMESPACE, "apply", "-f", str(ROOT / "deploy" / "examples" / "spot-h100-ondemand-a100.yaml")
        )
        h100 = wait_until(lambda: running(island_pods(target, "h100-spot"), 2))
        a100 = wait_until(lambda: running(island_pods(target, "a100"), 4))
        for pod in h100:
            labels = found[pod["spec"]["nodeName"]]["metadata"]["labels"]
            assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
            assert labels["cloud.google.com/gke-spot"] == "true"
        for pod in a100:
            labels = found[pod["spec"]["nodeName"]]["metadata"]["labels"]
            assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
            assert "cloud.google.com/gke-spot" not in labels
            assert pod["spec"]["priority"] == 100000
        assert len({p["spec"]["nodeName"] for p in h100 + a100}) == 6, "8 GPUs per pod: one pod per node"
        status = wait_until(
            lambda: (
                (
                    s := json.loads(
                        target.kubectl("-n", NAMESPACE, "get", "dilocojob", "llm-mixed", "-o", "json").stdout
                    ).get("status")
                    or {}
                ).get("islandsReady")
                == "2/2"
                and s
            )
        )
        assert [i["ready"] for i in status["islands"]] == [2, 4]
    finally:
        target.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=180)
        target.kubectl("delete", "-f", "-", "--ignore-not-found", stdin=yaml.safe_dump_all(PREREQUISITES[:2]))
