"""On a real node, pods are real containers: the kubelet runs each one through containerd and runc as the user
its image or pod names, probes it over its own network namespace, and pods reach each other by IP and by
Service name (kube-proxy, CoreDNS), as far as NetworkPolicies let them (kube-network-policies). Stopping the
node leaves nothing behind on the machine.

Opt-in (DILOCO_REALNODE=1, `make test-realnode`), as root, after tests/cluster/realnode/build.sh and
`apt-get install` of node.DEBIAN_PACKAGES; skipped otherwise, CI included (docs/real-nodes.md)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support import wait_until

from cluster.cluster import Cluster, MissingBinaries, start_cluster
from cluster.realnode.node import POD_SUBNET, MissingToolchain, RealNode, not_enabled, start_real_node
from diloco.api.job import DiLoCoJobSpec
from diloco.operator import naming
from diloco.operator.children import OperatorRef, network_policy

pytestmark = pytest.mark.process
HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[2] / "deploy" / "examples" / "tiny-cpu.yaml"
IMAGE = "diloco.local/busybox:test"
USER = 65532


@pytest.fixture(scope="module")
def real_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, RealNode]]:
    """A control plane with no KWOK node and one real node, its busybox image preloaded; checks on the way out
    that the node left nothing behind."""
    if reason := not_enabled():
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("realnode")
    image = workdir / "busybox.tar"
    subprocess.run(
        ["python3", str(HERE / "ociimage.py"), IMAGE, str(image), "--add", "/bin/busybox:/bin/busybox"],
        check=True,
    )
    (workdir / "cluster").mkdir()
    try:
        cluster = start_cluster(workdir / "cluster", pools=())
    except MissingBinaries as error:
        pytest.skip(str(error))
    try:
        node = start_real_node(cluster, workdir / "node", images=(image,))
    except MissingToolchain as error:
        cluster.stop()
        pytest.skip(str(error))
    try:
        yield cluster, node
    finally:
        node.stop()
        cluster.stop()
    mounts = Path("/proc/mounts").read_text()
    assert not node.leftovers(), node.leftovers()
    assert str(workdir) not in mounts


def web_pod(name: str, fetch: str = "", probe: str = "", labels: dict[str, str] | None = None, port: int = 8080) -> str:
    """A pod serving /srv over HTTP on `port`, with `uid` (its user id) and, given `fetch` (a URL), what that
    URL answered; given `probe` (a URL), it tries that URL every second and keeps in `probe` how the last try
    went: `TRY reached` or `TRY blocked` (no answer within 2 s). Ready once `uid` is served."""
    script = ["id -u > /srv/uid"]
    if fetch:
        script.append(f"until wget -q -O /srv/fetched {fetch}; do sleep 1; done")
    if probe:
        # timeout, not wget's -T: that crashes Debian's static busybox (1.35).
        outcome = f"if timeout 2 wget -q -O /dev/null {probe}; then echo $n reached; else echo $n blocked; fi"
        record = "mv /srv/probe.new /srv/probe"  # whole: the test never reads half a line
        script.append(f"n=0; while true; do n=$((n + 1)); {outcome} > /srv/probe.new; {record}; sleep 1; done &")
    script.append(f"exec httpd -f -p {port} -h /srv")
    container = {
        "name": "web",
        "image": IMAGE,
        "imagePullPolicy": "Never",
        "command": ["/bin/busybox", "sh", "-c", "\n".join(script)],
        "env": [{"name": "PATH", "value": "/bin"}],
        "readinessProbe": {"httpGet": {"path": "/uid", "port": port}, "periodSeconds": 1},
        "livenessProbe": {"tcpSocket": {"port": port}, "initialDelaySeconds": 30},
        "resources": {"limits": {"memory": "32Mi", "cpu": "100m"}},
        "volumeMounts": [{"name": "srv", "mountPath": "/srv"}],
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": USER, "fsGroup": USER},
            "containers": [container],
            "volumes": [{"name": "srv", "emptyDir": {}}],
        },
    }
    return yaml.safe_dump(pod)


def running(cluster: Cluster, namespace: str, manifest: str) -> dict:
    """Applies `manifest` (one pod), waits until it is Ready and returns it."""
    name = yaml.safe_load(manifest)["metadata"]["name"]
    cluster.kubectl("-n", namespace, "apply", "-f", "-", stdin=manifest)
    cluster.kubectl("-n", namespace, "wait", "--for=condition=Ready", f"pod/{name}", "--timeout=120s", timeout=150)
    return json.loads(cluster.kubectl("-n", namespace, "get", "pod", name, "-o", "json").stdout)


def served(pod: dict, path: str) -> str:
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/{path}", timeout=10) as reply:
        return reply.read().decode().strip()


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
    grpc_port = f"http://{syncer['status']['podIP']}:{spec.syncer.port}/uid"
    stranger = running(cluster, namespace, web_pod("stranger", probe=grpc_port))
    island_labels = naming.island_labels(job.name, spec.islands[0].name)
    island = running(cluster, namespace, web_pod("island", probe=grpc_port, labels=island_labels))

    def last_try(pod: dict) -> tuple[int, str]:
        tried, outcome = served(pod, "probe").split()
        return int(tried), outcome

    wait_until(lambda: last_try(stranger)[1] == "reached" and last_try(island)[1] == "reached", 60, 1)
    cluster.kubectl("-n", namespace, "apply", "-f", "-", stdin=yaml.safe_dump(policy))
    wait_until(lambda: last_try(stranger)[1] == "blocked", 60, 1)
    since, _ = last_try(island)
    tried, outcome = wait_until(lambda: (now := last_try(island))[0] > since and now, 60, 1)
    assert outcome == "reached", f"the job's island pod was blocked too (try {tried})"
