"""On real nodes, pods are real containers: the kubelet runs each one through containerd and runc as the user
its image or pod names, probes it over its own network namespace, and pods reach each other by IP and by
Service name (kube-proxy, CoreDNS), on one node or across two, as far as NetworkPolicies let them
(kube-network-policies). A spot node carries its pool's labels and taint; `kubectl logs` and `exec` reach every
node. Stopping the nodes leaves nothing behind on the machine.

Opt-in (DILOCO_REALNODE=1, `make test-realnode`), as root, after tests/cluster/realnode/build.sh and
`apt-get install` of node.DEBIAN_PACKAGES; skipped otherwise. CI runs it after `make test` (.ci/realnode)."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support import wait_until

from cluster.cluster import Cluster
from cluster.nodes import SPOT_TAINT
from cluster.realnode import busybox
from cluster.realnode.busybox import USER, last_probe, running, served, web_pod
from cluster.realnode.node import MISSING, NETWORK, ON_DEMAND, SPOT, RealNodes, not_enabled, real_cluster
from diloco.api.job import DiLoCoJobSpec
from diloco.operator import naming
from diloco.operator.children import OperatorRef, network_policy

pytestmark = pytest.mark.process
EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "examples" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def real_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, RealNodes]]:
    """A control plane with no KWOK node and two real nodes, an on-demand one and a spot one (`cpu-0`,
    `cpu-spot-0`), the busybox image preloaded; checks on the way out that they left nothing behind."""
    if reason := not_enabled():
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("realnode")
    try:
        with real_cluster(workdir, (ON_DEMAND, SPOT), images=(busybox.image(workdir),)) as (cluster, nodes):
            yield cluster, nodes
    except MISSING as error:
        pytest.skip(str(error))


@pytest.fixture
def namespace(real_nodes: tuple[Cluster, RealNodes], request: pytest.FixtureRequest) -> Iterator[str]:
    cluster, _ = real_nodes
    name = request.node.name.replace("_", "-")[:50].rstrip("-")
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=true", "--timeout=120s", timeout=150)


def test_a_pod_is_a_real_container_running_as_its_user_with_its_probes_passing(real_nodes, namespace):
    cluster, nodes = real_nodes
    pod = running(cluster, namespace, web_pod("web"))

    node = nodes["cpu-0"]  # the spot node's taint keeps pods that do not tolerate it off it
    assert pod["spec"]["nodeName"] == node.name
    (status,) = pod["status"]["containerStatuses"]
    assert status["containerID"].startswith("containerd://") and status["ready"]
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(node.pod_subnet)
    assert served(pod, "uid") == str(USER)


def test_each_node_has_an_address_and_its_pools_labels_and_taints(real_nodes):
    cluster, nodes = real_nodes
    listed = {
        n["metadata"]["name"]: n for n in json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    }

    assert sorted(listed) == ["cpu-0", "cpu-spot-0"]
    for name, node in listed.items():
        (internal,) = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
        assert internal == nodes[name].address and ipaddress.ip_address(internal) in NETWORK
    spot = listed["cpu-spot-0"]
    assert spot["metadata"]["labels"]["cloud.google.com/gke-spot"] == "true"
    assert spot["metadata"]["labels"]["cloud.google.com/gke-nodepool"] == "cpu-spot"
    assert [{k: t[k] for k in ("key", "value", "effect")} for t in spot["spec"]["taints"]] == [SPOT_TAINT]
    assert "cloud.google.com/gke-spot" not in listed["cpu-0"]["metadata"]["labels"]
    assert not listed["cpu-0"]["spec"].get("taints")


def test_pods_on_two_nodes_reach_each_other_and_kubectl_reaches_both(real_nodes, namespace):
    """A pod on the spot node serves pods on the on-demand node, by IP and by Service name (the cluster's DNS
    resolves the short name through the pod's search path to the ClusterIP, kube-proxy routes that to the pod);
    the API server reaches both kubelets at their addresses, so `kubectl logs` and `exec` work as anywhere."""
    cluster, nodes = real_nodes
    server = running(cluster, namespace, web_pod("server", node="cpu-spot-0"))
    cluster.kubectl("-n", namespace, "expose", "pod", "server", "--port", "80", "--target-port", "8080")
    by_ip = running(cluster, namespace, web_pod("by-ip", fetch=f"http://{server['status']['podIP']}:8080/uid"))
    by_name = running(cluster, namespace, web_pod("by-name", fetch="http://server/uid"))

    assert ipaddress.ip_address(server["status"]["podIP"]) in ipaddress.ip_network(nodes["cpu-spot-0"].pod_subnet)
    assert by_ip["spec"]["nodeName"] == by_name["spec"]["nodeName"] == "cpu-0"
    assert served(by_ip, "fetched") == served(by_name, "fetched") == str(USER)
    for pod in (server, by_ip):
        name = pod["metadata"]["name"]
        assert f"as uid {USER}" in cluster.kubectl("-n", namespace, "logs", name).stdout
        assert cluster.kubectl(
            "-n", namespace, "exec", name, "--", "/bin/busybox", "cat", "/srv/uid"
        ).stdout.strip() == str(USER)


def test_pods_reach_each_other_by_ip(real_nodes, namespace):
    cluster, _ = real_nodes
    server = running(cluster, namespace, web_pod("server"))
    client = running(cluster, namespace, web_pod("client", fetch=f"http://{server['status']['podIP']}:8080/uid"))

    assert client["status"]["podIP"] != server["status"]["podIP"]
    assert served(client, "fetched") == str(USER)


def test_a_pod_outside_the_job_cannot_reach_a_syncer(real_nodes, namespace):
    """The NetworkPolicy the operator writes for the README's example job, enforced by kube-network-policies:
    a pod outside the job gets no answer on a syncer's gRPC port, while an island pod of the job connects.
    Before the policy, the same pod reaches the same port: the network works and the policy is what closes it.
    (Generic pods with the job's labels stand in for its syncer and island; no DiLoCoJob owns the policy here.)"""
    cluster, _ = real_nodes
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
