"""On a real node, pods are real containers: the kubelet runs each one through containerd and runc as the user
its image or pod names, probes it over its own network namespace, and pods reach each other by IP and by
Service name (kube-proxy, CoreDNS), as far as NetworkPolicies let them (kube-network-policies). Stopping the
node leaves nothing behind on the machine.

Opt-in (DILOCO_REALNODE=1, `make test-realnode`), as root, after tests/cluster/realnode/build.sh and
`apt-get install` of node.DEBIAN_PACKAGES; skipped otherwise. CI runs it after `make test` (.ci/realnode)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support import wait_until

from cluster.cluster import Cluster, MissingBinaries, start_cluster
from cluster.realnode import busybox
from cluster.realnode.busybox import USER, last_probe, running, served, web_pod
from cluster.realnode.node import POD_SUBNET, MissingToolchain, RealNode, not_enabled, start_real_node
from diloco.api.job import DiLoCoJobSpec
from diloco.operator import naming
from diloco.operator.children import OperatorRef, network_policy

pytestmark = pytest.mark.process
EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "examples" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def real_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, RealNode]]:
    """A control plane with no KWOK node and one real node, its busybox image preloaded; checks on the way out
    that the node left nothing behind."""
    if reason := not_enabled():
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("realnode")
    image = busybox.image(workdir)
    (workdir / "cluster").mkdir()
    try:
        cluster = start_cluster(workdir / "cluster", pools=())
    except MissingBinaries as error:
        pytest.skip(str(error))
    try:
        node = start_real_node(cluster, workdir / "node", images=(image,))
    except BaseException as error:
        cluster.stop()
        if isinstance(error, MissingToolchain):
            pytest.skip(str(error))
        raise
    try:
        yield cluster, node
    finally:
        node.stop()
        cluster.stop()
    mounts = Path("/proc/mounts").read_text()
    assert not node.leftovers(), node.leftovers()
    assert str(workdir) not in mounts


@pytest.fixture
def namespace(real_node: tuple[Cluster, RealNode], request: pytest.FixtureRequest) -> Iterator[str]:
    cluster, _ = real_node
    name = request.node.name.replace("_", "-")[:50].rstrip("-")
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=true", "--timeout=120s", timeout=150)


def test_a_pod_is_a_real_container_running_as_its_user_with_its_probes_passing(real_node, namespace):
    cluster, node = real_node
    pod = running(cluster, namespace, web_pod("web"))

    assert pod["spec"]["nodeName"] == node.name
    (status,) = pod["status"]["containerStatuses"]
    assert status["containerID"].startswith("containerd://") and status["ready"]
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(POD_SUBNET)
    assert served(pod, "uid") == str(USER)


def test_pods_reach_each_other_by_ip(real_node, namespace):
    cluster, _ = real_node
    server = running(cluster, namespace, web_pod("server"))
    client = running(cluster, namespace, web_pod("client", fetch=f"http://{server['status']['podIP']}:8080/uid"))

    assert client["status"]["podIP"] != server["status"]["podIP"]
    assert served(client, "fetched") == str(USER)


def test_pods_reach_a_service_by_its_name(real_node, namespace):
    """The cluster's DNS resolves the Service's short name (the pod's search path) to its ClusterIP, and
    kube-proxy routes that to the server pod."""
    cluster, _ = real_node
    running(cluster, namespace, web_pod("server"))
    cluster.kubectl("-n", namespace, "expose", "pod", "server", "--port", "80", "--target-port", "8080")
    client = running(cluster, namespace, web_pod("client", fetch="http://server/uid"))

    assert served(client, "fetched") == str(USER)


def test_a_pod_outside_the_job_cannot_reach_a_syncer(real_node, namespace):
    """The NetworkPolicy the operator writes for the README's example job, enforced by kube-network-policies:
    a pod outside the job gets no answer on a syncer's gRPC port, while an island pod of the job connects.
    Before the policy, the same pod reaches the same port: the network works and the policy is what closes it.
    (Generic pods with the job's labels stand in for its syncer and island; no DiLoCoJob owns the policy here.)"""
    cluster, _ = real_node
    example = yaml.safe_load(EXAMPLE.read_text())
    spec = DiLoCoJobSpec.model_validate(example["spec"])
    job = naming.JobRef(name=example["metadata"]["name"], namespace=namespace, uid="")
    policy = network_policy(job, spec, OperatorRef("diloco-system"))
    policy["metadata"].pop("ownerReferences", None)
    syncer = running(
        cluster, namespace, web_pod("syncer", labels=naming.shard_labels(job.name, 0), port=spec.syncer.port)
    )
    grpc_port = f"{syncer['status']['podIP']} {spec.syncer.port}"
    stranger = running(cluster, namespace, web_pod("stranger", probe=grpc_port))
    island_labels = naming.island_labels(job.name, spec.islands[0].name)
    island = running(cluster, namespace, web_pod("island", probe=grpc_port, labels=island_labels))

    wait_until(lambda: last_probe(stranger)[1] == "reached" and last_probe(island)[1] == "reached", 60, 1)
    cluster.kubectl("-n", namespace, "apply", "-f", "-", stdin=yaml.safe_dump(policy))
    wait_until(lambda: last_probe(stranger)[1] == "blocked", 60, 1)
    since, _ = last_probe(island)
    tried, outcome = wait_until(lambda: (now := last_probe(island))[0] > since and now, 60, 1)
    assert outcome == "reached", f"the job's island pod was blocked too (try {tried})"
