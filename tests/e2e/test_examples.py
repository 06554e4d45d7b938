"""deploy/examples/spot-h100-ondemand-a100.yaml as written, on a cluster with its GPU pools: islands of mixed
generations land on their own pools, spot pods on spot nodes, every pod on a node with GPUs free for it."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import support
import yaml

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
