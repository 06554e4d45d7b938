"""The cluster the e2e suite runs against: any kubeconfig in DILOCO_E2E_KUBECONFIG (a kind cluster with the
project's images loaded, `make e2e-kind`); with DILOCO_E2E_REALNODE=1, the test cluster's control plane with
real nodes (tests/cluster/realnode: kubelets running the project's images, an on-demand pool and a spot pool;
`make e2e-realnode`); else the KWOK test cluster (tests/cluster) with the pod runner standing in for kubelets,
so the chart's operator Deployment and the job's syncers and workers really run, as local processes, from this
checkout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from cluster.cluster import Cluster
from cluster.controlplane import binaries_dir
from cluster.isolated import IsolatedCluster, start_isolated
from cluster.pod_runner import PodRunner
from cluster.realnode import archives
from cluster.realnode.node import MISSING, ON_DEMAND, SPOT, RealNodes, kill_container, real_cluster
from kubernetes import config as kube_config
from support import missing_binary

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE = "diloco-system"
RESYNC_SECONDS = 2  # the operator's reconcile interval here (the chart's resyncSeconds, 10 by default)


@dataclass
class Target:
    """A cluster and what the suite may do to it. `cluster` exists for the session's test cluster (its volumes
    are folders of this machine), `runner` only when KWOK's nodes run it, `nodes` only when real nodes do,
    `isolated` only for a second KWOK cluster run whole in a PID namespace (`other_clusters`)."""

    kubeconfig: Path
    bin: Path
    image_tag: str
    cluster: Cluster | None = None
    runner: PodRunner | None = None
    nodes: RealNodes | None = None
    isolated: IsolatedCluster | None = None

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        return self._run("kubectl", args, stdin, check, timeout)

    def helm(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return self._run("helm", args, None, True, timeout)

    def _run(
        self, tool: str, args: tuple[str, ...], stdin: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(self.bin / tool), "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} failed: {result.stderr}")
        return result

    def get(self, pod: Mapping[str, Any], port: int, path: str) -> str:
        """The body of an HTTP GET of `path` on the pod's IP and `port`: from the pod network on the KWOK
        cluster, else through the API server's proxy to the pod. An OSError while it does not answer."""
        url = f"http://{pod['status']['podIP']}:{port}{path}"
        if self.runner is not None:
            return self.runner.get(url)
        if self.isolated is not None:
            return self.isolated.get(url)
        meta = pod["metadata"]
        proxy = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}:{port}/proxy{path}"
        result = self.kubectl("get", "--raw", proxy, check=False)
        if result.returncode != 0:
            raise OSError(f"GET {proxy} failed: {result.stderr.strip()}")
        return result.stdout

    def crash(self, namespace: str, pod: str) -> None:
        """Makes the pod's main process die as a crash would: SIGKILL, from the pod runner on the KWOK cluster or
        from the host on real nodes. (From inside a container no signal can do it: PID 1 ignores those it has no
        handler for, and the trainer's handlers for SIGTERM and SIGINT stop it gracefully, exit code 0.)"""
        if self.runner is not None:
            assert self.runner.kill(namespace, pod, signal.SIGKILL) == 1
        elif self.nodes is not None:
            found = self.kubectl("-n", namespace, "get", "pod", pod, "-o", "json").stdout
            (container,) = json.loads(found)["status"]["containerStatuses"]
            kill_container(container["containerID"].removeprefix("containerd://"))
        else:
            pytest.skip("crashing a container needs the KWOK test cluster's pod runner or real nodes on this host")

    def lose_node(self, name: str) -> None:
        """A spot node preempted: its pods evicted, the Node gone (and a real node's machine with it)."""
        if self.nodes is not None:
            self.nodes.lose(name)
        elif self.cluster is not None:
            self.cluster.delete_node(name)
        else:
            self.kubectl("cordon", name)
            self.kubectl("taint", "node", name, "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute")
            self.kubectl("delete", "node", name, timeout=120)

    def restore_node(self, name: str) -> None:
        """Brings a lost node's pool back to size (on kind, the kubelet re-registers the node by itself)."""
        if self.nodes is not None:
            self.nodes.restore(name)
        elif self.cluster is not None:
            assert self.cluster.add_node(name.rsplit("-", 1)[0]) == name


def _external(kubeconfig: Path) -> Target:
    found = {tool: shutil.which(tool) for tool in ("kubectl", "helm")}
    cached = binaries_dir(("kubectl", "helm"))
    if cached is not None:
        return Target(kubeconfig, cached, os.environ.get("DILOCO_E2E_IMAGE_TAG", "e2e"))
    if not all(found.values()):
        missing_binary("kubectl and helm are needed on PATH for DILOCO_E2E_KUBECONFIG")
    return Target(kubeconfig, Path(found["kubectl"]).parent, os.environ.get("DILOCO_E2E_IMAGE_TAG", "e2e"))


@pytest.fixture(scope="session")
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    external = os.environ.get("DILOCO_E2E_KUBECONFIG")
    if external:
        yield _external(Path(external))
        return
    if os.environ.get("DILOCO_E2E_REALNODE") == "1":
        yield from _real_nodes(tmp_path_factory)
        return
    cluster: Cluster = request.getfixturevalue("kwok_cluster")
    if binaries_dir(("helm",)) is None:
        missing_binary("no cached helm (run tests/cluster/build.sh)")
    runner = PodRunner(kube_config.new_client_from_config(str(cluster.kubeconfig)), tmp_path_factory.mktemp("pods"))
    runner.start()
    try:
        yield Target(cluster.kubeconfig, cluster.bin, "dev", cluster, runner)
    finally:
        runner.stop()
    assert not runner.leftovers(), f"pod processes left running: {runner.leftovers()}"


REAL_POOLS = (replace(ON_DEMAND, count=3), replace(SPOT, count=2))
"""Three on-demand nodes, as the README's example needs (three island pods of a CPU each, two CPUs a node), and
two spot nodes, so that a spot island has somewhere to go when its node is lost."""


def _real_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    if os.geteuid() != 0:
        pytest.skip("DILOCO_E2E_REALNODE=1: real nodes need root (docs/real-nodes.md)")
    for image in ("operator", "trainer"):
        if reason := archives.unusable(image):
            pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("e2e-realnode")
    images = (archives.archive("operator"), archives.archive("trainer"))
    # test_diloco_job.py rolls its job onto another image: the same one, by another name.
    tags = {"diloco-trainer:dev-rolled": "diloco-trainer:dev"}
    try:
        with real_cluster(workdir, REAL_POOLS, images, tags, timeout=1200) as (cluster, nodes):
            yield Target(cluster.kubeconfig, cluster.bin, "dev", cluster=cluster, nodes=nodes)
    except MISSING as error:
        pytest.skip(str(error))


def install_operator(target: Target) -> None:
    """`helm install` of charts/diloco into OPERATOR_NAMESPACE, waiting until its Deployment is available. On
    the KWOK cluster the chart's Deployment runs through the pod runner like any pod (its image is this
    checkout); elsewhere the image is one loaded onto the nodes (kind, the real node), never pulled: no
    registry holds diloco-operator."""
    target.helm(
        "install",
        "diloco",
        str(ROOT / "charts" / "diloco"),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--wait",
        "--timeout",
        "120s",
        "--set",
        f"image.tag={target.image_tag}",
        "--set",
        "image.pullPolicy=Never",
        "--set",
        "replicaCount=1",
        "--set",
        f"resyncSeconds={RESYNC_SECONDS}",
    )


@pytest.fixture(scope="session")
def resync_seconds() -> float:
    """The installed operator's seconds between reconcile passes over a job."""
    return RESYNC_SECONDS


@pytest.fixture(scope="session")
def operator(target: Target) -> Iterator[str]:
    """The operator installed (`install_operator`); yields the release's namespace."""
    install_operator(target)
    try:
        yield OPERATOR_NAMESPACE
    finally:
        uninstall_operator(target)


def uninstall_operator(target: Target) -> None:
    """`helm uninstall` of what `install_operator` installed, waiting until its objects are gone."""
    target.helm("uninstall", "diloco", "--namespace", OPERATOR_NAMESPACE, "--wait", "--timeout", "120s")


@pytest.fixture
def other_clusters(target: Target, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Target]]:
    """Starts more KWOK clusters on this machine beside the session's, each whole in a PID namespace of its own
    (tests/cluster/isolated.py) with the operator installed: each call returns a new one. Every one still
    running is stopped (SIGKILL) at the end. Needs the session's cluster to be the KWOK one, and root."""
    if target.runner is None:
        pytest.skip("a second cluster is started only beside the KWOK test cluster")
    if os.geteuid() != 0:
        pytest.skip("a cluster in a PID namespace of its own needs root")
    started: list[IsolatedCluster] = []

    def start() -> Target:
        isolated = start_isolated(tmp_path_factory.mktemp("other-cluster"))
        started.append(isolated)
        other = Target(isolated.kubeconfig, target.bin, target.image_tag, isolated=isolated)
        install_operator(other)
        return other

    try:
        yield start
    finally:
        for isolated in started:
            isolated.stop()
