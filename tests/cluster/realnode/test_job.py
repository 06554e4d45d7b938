"""The project's image on a real node: the README's example job (CPU requests cut to fit one 2-core node),
reconciled by the operator, gets its syncer shards as real containers of diloco-trainer, running as the
image's non-root user with their probes passing and their checkpoint volume mounted.

Needs, beside test_node.py's opt-in, the trainer image as an archive: tests/cluster/realnode/images.sh."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cluster.cluster import Cluster, start_cluster
from cluster.controlplane import spawn, stop_group
from cluster.realnode.node import RealNode, not_enabled, start_real_node
from diloco.operator import naming

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "deploy" / "examples" / "tiny-cpu.yaml"
TRAINER_UID = 10001  # deploy/Dockerfile.trainer's USER
pytestmark = pytest.mark.process


def fitted(example: Path) -> dict:
    """The example with every CPU request cut to 100m: its three island pods ask for a CPU each, and the one
    real node has the two of this machine, so the syncers would never be scheduled."""
    job = yaml.safe_load(example.read_text())
    for part in [*job["spec"]["islands"], job["spec"]["syncer"]]:
        part["resources"]["requests"]["cpu"] = "100m"
    return job


def trainer_archive() -> Path:
    cache = Path(os.environ.get("DILOCO_CLUSTER_CACHE", os.path.expanduser("~/.cache/diloco-cluster")))
    return cache / "images" / "diloco-trainer-dev.tar"


@pytest.fixture(scope="module")
def cluster_with_operator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, RealNode]]:
    """A control plane, one real node with diloco-trainer:dev preloaded, the CRD and the operator (a local
    process, as the cluster's administrator)."""
    if reason := not_enabled():
        pytest.skip(reason)
    if not trainer_archive().exists():
        pytest.skip(f"no {trainer_archive()}: run tests/cluster/realnode/images.sh trainer")
    workdir = tmp_path_factory.mktemp("realnode-job")
    (workdir / "cluster").mkdir()
    cluster = start_cluster(workdir / "cluster", pools=())
    node = operator = None
    try:
        node = start_real_node(cluster, workdir / "node", images=(trainer_archive(),), timeout=900)
        cluster.kubectl("apply", "-f", str(ROOT / "deploy" / "crd.yaml"))
        cluster.kubectl("create", "namespace", "diloco-system")
        operator = spawn(
            [
                str(Path(sys.executable).parent / "diloco-operator"),
                "--all-namespaces",
                "--standalone",
                "--metrics-port=0",
                "--liveness-port=0",
            ],
            workdir / "operator.log",
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
        )
        yield cluster, node
    finally:
        if operator is not None:
            stop_group(operator)
        if node is not None:
            node.stop()
        cluster.stop()
    assert node is None or not node.leftovers()


def test_the_readme_example_runs_its_syncers_as_real_containers(cluster_with_operator):
    cluster, node = cluster_with_operator
    cluster.kubectl("create", "namespace", "readme")
    cluster.kubectl("-n", "readme", "apply", "-f", "-", stdin=yaml.safe_dump(fitted(EXAMPLE)))
    selector = f"{naming.LABEL_JOB}=tiny-cpu,{naming.LABEL_ROLE}=syncer"

    deadline = time.monotonic() + 600
    while True:
        pods = json.loads(cluster.kubectl("-n", "readme", "get", "pods", "-l", selector, "-o", "json").stdout)["items"]
        ready = [p for p in pods if all(s["ready"] for s in p["status"].get("containerStatuses", [{"ready": False}]))]
        if ready or time.monotonic() > deadline:
            break
        time.sleep(2)
    print(cluster.kubectl("-n", "readme", "get", "pods", "-o", "wide").stdout)

    assert ready, f"no syncer became Ready: {[p['status'] for p in pods]}"
    pod = ready[0]
    assert pod["spec"]["nodeName"] == node.name
    assert pod["status"]["containerStatuses"][0]["containerID"].startswith("containerd://")
    assert pod["spec"]["securityContext"].get("runAsUser", TRAINER_UID) == TRAINER_UID
