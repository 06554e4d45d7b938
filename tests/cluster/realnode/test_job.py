"""The project's image on a real node: the README's example job (CPU requests cut to fit one 2-core node)
trains there. Its islands (the two-pod one included) and syncer shards are real containers of diloco-trainer,
running as the image's non-root user with their probes passing; the islands find the shards and each other by
their Service names (CoreDNS, kube-proxy), become Ready, and the job's outer step, which the operator reads
from the shards, rises.

Needs, beside test_node.py's opt-in, the trainer image built from this checkout, as an archive:
tests/cluster/realnode/images.sh trainer (skipped otherwise, with that command)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from cluster.cluster import Cluster, start_cluster
from cluster.controlplane import spawn, stop_group
from cluster.realnode import archives
from cluster.realnode.node import RealNode, not_enabled, start_real_node
from diloco.operator import naming

ROOT = Path(__file__).resolve().parents[3]
CONTAINERS = (
    "NAME:.metadata.name,NODE:.spec.nodeName,IP:.status.podIP,CONTAINER:.status.containerStatuses[*].containerID"
)
EXAMPLE = ROOT / "deploy" / "examples" / "tiny-cpu.yaml"
TRAINER_UID = 10001  # deploy/Dockerfile.trainer's USER
# Importing the 6 GB image alone takes minutes on a loaded machine, then the job has to form and train.
pytestmark = [pytest.mark.process, pytest.mark.timeout(2400)]


def fitted(example: Path) -> dict:
    """The example with every CPU request cut to 100m: its three island pods ask for a CPU each, and the one
    real node has the two of this machine, so neither the third island pod nor the syncers would be
    scheduled. (Requests only: no CPU limit is set, so the pods still share both cores.)"""
    job = yaml.safe_load(example.read_text())
    for part in [*job["spec"]["islands"], job["spec"]["syncer"]]:
        part["resources"]["requests"]["cpu"] = "100m"
    return job


@pytest.fixture(scope="module")
def cluster_with_operator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, RealNode]]:
    """A control plane, one real node with diloco-trainer:dev preloaded, the CRD and the operator (a local
    process, as the cluster's administrator, resolving the shards' Service names as a pod would)."""
    if reason := not_enabled():
        pytest.skip(reason)
    if reason := archives.unusable("trainer"):
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("realnode-job")
    (workdir / "cluster").mkdir()
    cluster = start_cluster(workdir / "cluster", pools=())
    node = operator = None
    try:
        # The CRD first: kubectl wait fails on a CRD whose status is still empty, and the node takes minutes.
        cluster.kubectl("apply", "-f", str(ROOT / "deploy" / "crd.yaml"))
        node = start_real_node(cluster, workdir / "node", images=(archives.archive("trainer"),), timeout=900)
        cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/dilocojobs.diloco.dev")
        cluster.kubectl("create", "namespace", "diloco-system")
        operator = spawn(
            node.with_cluster_dns(
                [
                    str(Path(sys.executable).parent / "diloco-operator"),
                    "--all-namespaces",
                    "--standalone",
                    "--metrics-port=0",
                    "--liveness-port=0",
                ]
            ),
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


def job_status(cluster: Cluster) -> dict:
    return json.loads(cluster.kubectl("-n", "readme", "get", "dj", "tiny-cpu", "-o", "json").stdout).get("status", {})


def wait_for(cluster: Cluster, what: str, done: Callable[[dict], bool], timeout: float) -> dict:
    """Polls the job's status until `done` holds; fails with the pods and the last status otherwise."""
    deadline = time.monotonic() + timeout
    while not done(status := job_status(cluster)):
        if time.monotonic() > deadline:
            pods = cluster.kubectl("-n", "readme", "get", "pods", "-o", "wide").stdout
            pytest.fail(f"{what} within {timeout} s; status {status}\n{pods}")
        time.sleep(3)
    return status


def test_the_readme_example_trains_on_real_containers(cluster_with_operator):
    cluster, node = cluster_with_operator
    cluster.kubectl("create", "namespace", "readme")
    cluster.kubectl("-n", "readme", "apply", "-f", "-", stdin=yaml.safe_dump(fitted(EXAMPLE)))

    first = wait_for(
        cluster,
        "the islands did not become Ready and train",
        lambda s: s.get("islandsReady") == "2/2" and s.get("syncer", {}).get("reachable") == 2 and s.get("outerStep"),
        timeout=900,
    )
    wait_for(cluster, "the outer step did not rise", lambda s: s.get("outerStep", 0) > first["outerStep"], 600)
    print(cluster.kubectl("-n", "readme", "get", "pods", "-o", "wide").stdout)
    print(cluster.kubectl("-n", "readme", "get", "pods", "-o", f"custom-columns={CONTAINERS}").stdout)

    pods = json.loads(cluster.kubectl("-n", "readme", "get", "pods", "-o", "json").stdout)["items"]
    pair = [p for p in pods if p["metadata"]["labels"].get(naming.LABEL_ISLAND) == "pair"]
    assert len(pair) == 2
    for pod in pair + [p for p in pods if p["metadata"]["labels"].get(naming.LABEL_ROLE) == "syncer"]:
        assert pod["spec"]["nodeName"] == node.name
        (container,) = pod["status"]["containerStatuses"]
        assert container["ready"] and container["containerID"].startswith("containerd://")
        assert pod["spec"]["securityContext"].get("runAsUser", TRAINER_UID) == TRAINER_UID
