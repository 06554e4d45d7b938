"""Two clusters on this machine, as two datacenters joined by a WAN (docs/multi-cluster.md, done as a user
would with kubectl and helm): cluster A (the session's) runs a job with its own syncer shards, exposed as
NodePort at A's node address; cluster B (a second KWOK cluster with its own operator, run whole in a PID
namespace of its own) runs a job that names A's shards in spec.remoteSyncers, with copies of A's token and
CA. The clusters' node namespaces are joined by a link held to LINK's rate by tc tbf both ways, its round
trip added where B's connections enter A (A's node ports, through the delay proxy). Every channel is TLS
with the job's token.

The job trains with both clusters' islands (A's shards report B's island live: A's status.remoteIslands);
B is stopped whole (SIGKILL to its PID namespace's init: API server, etcd, controllers, KWOK, pod runner,
operator and every pod), and A's island keeps merging. B comes back on its own data, as a datacenter that
went dark does: the same etcd, certificates and nodes, its end of the link plugged in again, nothing applied
again; its pod runner restarts the pods on its nodes as kubelets do after a reboot, its operator resumes
and counts the island's pod lost with its node (a preemption, not a failure against the restart budget),
and its island rejoins with the current global fragments (the versions it adopts are those A's shards hold
by then, not those of before the outage), A's shards count it live again and B's job status shows the
progress made while it was away.
"""

from __future__ import annotations

import base64
import datetime
import json
import re
import shutil
from functools import partial
from pathlib import Path

import pytest
import support
import yaml
from cluster.cluster_link import NEAR_ADDRESS, join
from test_diloco_job import CHEAP

from diloco.local.wan import Link

pytestmark = [pytest.mark.process, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "wan"
JOB = "wide"
NEAR, FAR = "near", "far"
"""The islands of A and of B: names distinct across the clusters, as the shards know islands by name."""
LINK = Link(mbps=20.0, rtt_ms=40.0)
ISLAND_TIMEOUT = 15.0
"""Seconds after which the shards no longer count an island they have not heard from live."""
wait_until = partial(support.wait_until, timeout=240.0, interval=1.0)
SMALL = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}
VERSION = re.compile(r'^diloco_worker_fragment_version\{.*fragment="(\d+)".*\} (\S+)$', re.MULTILINE)


def job_manifest(image_tag: str, island: str, syncer: dict, remote: dict | None = None) -> str:
    """deploy/examples/tiny-cpu.yaml with one island of one pod, H=10, and a stop condition far away."""
    job = yaml.safe_load((ROOT / "deploy" / "examples" / "tiny-cpu.yaml").read_text())
    job["metadata"] = {"name": JOB}
    spec = job["spec"]
    spec["image"] = f"diloco-trainer:{image_tag}"
    spec["imagePullPolicy"] = "IfNotPresent"
    spec["training"] |= {
        "innerSteps": 10,
        "fragments": 2,
        "overlapSteps": 1,
        "graceSeconds": 0.5,
        "islandTimeoutSeconds": ISLAND_TIMEOUT,
    }
    template = {"spec": {"containers": [{"name": "trainer", "env": CHEAP}]}}
    spec["islands"] = [{"name": island, "replicas": 1, "resources": SMALL, "podTemplate": template}]
    spec["syncer"] = syncer
    spec["failurePolicy"] = {"restartBudget": 5, "backoffSeconds": 1}
    spec["stopCondition"] = {"outerSteps": 100000}
    del spec["ttlSecondsAfterFinished"]
    if remote is not None:
        spec["remoteSyncers"] = remote
    return yaml.safe_dump(job)


def status(cluster, namespace: str = NAMESPACE) -> dict:
    result = cluster.kubectl("-n", namespace, "get", "dilocojob", JOB, "-o", "json", check=False)
    return (json.loads(result.stdout).get("status") or {}) if result.returncode == 0 else {}


def last_seen(cluster, island: str) -> datetime.datetime | None:
    """When the job's shards last reported `island` (of the other cluster) live, as its status says."""
    for remote in status(cluster).get("remoteIslands", ()):
        if remote["name"] == island:
            return datetime.datetime.fromisoformat(remote["lastSync"])
    return None


def seen_since(cluster, island: str, since: datetime.datetime) -> bool:
    return (last_seen(cluster, island) or since) > since


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def versions(cluster) -> dict[int, int]:
    """fragment -> the global version the job's shards hold."""
    return {f["fragment"]: f["version"] for f in status(cluster).get("fragments", ())}


def adopted(cluster, island: str) -> dict[int, int]:
    """fragment -> the global version the island's rank-0 pod last adopted (its metrics)."""
    selector = f"diloco.dev/job={JOB},diloco.dev/island={island}"
    pods = json.loads(cluster.kubectl("-n", NAMESPACE, "get", "pods", "-l", selector, "-o", "json").stdout)["items"]
    if not pods or not pods[0]["status"].get("podIP"):
        return {}
    try:
        text = cluster.get(pods[0], 9090, "/metrics")
    except OSError:
        return {}
    return {int(f): int(float(v)) for f, v in VERSION.findall(text)}


def secret_value(cluster, secret: str, key: str, namespace: str = NAMESPACE) -> str:
    """One key of a Secret, as `kubectl get secret -o jsonpath=... | base64 -d` reads it."""
    jsonpath = "{.data." + key.replace(".", "\\.") + "}"
    data = cluster.kubectl("-n", namespace, "get", "secret", secret, "-o", f"jsonpath={jsonpath}").stdout
    return base64.b64decode(data).decode()


def copy_secrets(near, far) -> dict:
    """What a user copies from A to B (docs/multi-cluster.md): the job's token, and the CA certificate alone
    (never its key) of the Secret that holds the shards' TLS; returns spec.remoteSyncers for B's job."""
    far.kubectl("create", "namespace", NAMESPACE)
    copies = ((f"diloco-{JOB}-token", "token", "syncers-token"), (f"diloco-{JOB}-tls", "ca.crt", "syncers-ca"))
    for secret, key, copy in copies:
        value = secret_value(near, secret, key)
        far.kubectl("-n", NAMESPACE, "create", "secret", "generic", copy, f"--from-literal={key}={value}")
    endpoints = status(near)["syncer"]["endpoints"]
    return {"endpoints": endpoints, "tokenSecret": "syncers-token", "caSecret": "syncers-ca"}


def link(near, far) -> None:
    """The WAN link between A's and B's node namespaces (B's end goes with B when it goes dark)."""
    join(near.runner.network.processes[0].pid, far.isolated.node_holder(), LINK)


def far_cluster(target, other_clusters):
    """A new cluster B linked to A, running the job's islands against A's shards."""
    far = other_clusters()
    link(target, far)
    remote = copy_secrets(target, far)
    syncer = {"shards": len(remote["endpoints"])}
    far.kubectl("-n", NAMESPACE, "apply", "-f", "-", stdin=job_manifest(far.image_tag, FAR, syncer, remote))
    return far


@pytest.fixture
def link_tools():
    """The link's tools (root's iproute2, tc and iptables) are here, else the test cannot run."""
    missing = [tool for tool in ("ip", "tc", "iptables", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        support.missing_binary(f"the link between two clusters needs {', '.join(missing)}")


@pytest.fixture
def near_job(target, operator):
    """The job in A, its shards exposed at A's node address, B's connections delayed at A's node ports."""
    if target.runner is None:
        pytest.skip("the link's delay is the KWOK test cluster's pod runner's, at its node ports")
    target.runner.node_port_delay = LINK.one_way_seconds
    target.kubectl("create", "namespace", NAMESPACE)
    expose = {"type": "NodePort", "nodeAddress": NEAR_ADDRESS}
    syncer = {"shards": 2, "resources": SMALL, "expose": expose}
    target.kubectl("-n", NAMESPACE, "apply", "-f", "-", stdin=job_manifest(target.image_tag, NEAR, syncer))
    try:
        yield JOB
    finally:
        target.runner.node_port_delay = 0.0
        target.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=180)


def test_islands_in_two_clusters_train_and_one_cluster_goes_dark_and_comes_back(
    target, link_tools, near_job, other_clusters
):
    endpoints = wait_until(lambda: status(target).get("syncer", {}).get("endpoints"))
    assert [e.rsplit(":", 1)[0] for e in endpoints] == [NEAR_ADDRESS, NEAR_ADDRESS]

    started = now()
    far = far_cluster(target, other_clusters)
    # B's island trains against A's shards: A's shards report it live, B's job reads progress from them.
    wait_until(lambda: seen_since(target, FAR, started))
    wait_until(lambda: seen_since(far, NEAR, started))
    wait_until(lambda: status(far).get("phase") == "Running")
    assert status(far)["syncer"]["endpoints"] == endpoints
    assert adopted(far, FAR), "B's island adopted global fragments over the link"

    # B goes dark: every process of it SIGKILLed at once. A's island merges on alone, and A's shards stop
    # counting B's island live once it has been silent for ISLAND_TIMEOUT.
    far.isolated.stop()
    before, step = versions(target), status(target)["outerStep"]
    wait_until(lambda: status(target)["outerStep"] >= step + 2)
    grown = versions(target)
    assert all(grown[f] > before[f] for f in before), (before, grown)
    silent = datetime.timedelta(seconds=2 * ISLAND_TIMEOUT)
    gone = wait_until(lambda: now() - last_seen(target, FAR) > silent and last_seen(target, FAR))
    away = status(target)["outerStep"]

    # B comes back on its own data, its end of the link plugged in again, nothing applied again: its island
    # pulls the current global model and is live again.
    far.isolated.restart()
    link(target, far)
    wait_until(lambda: seen_since(target, FAR, gone))
    rejoined = wait_until(lambda: adopted(far, FAR))
    assert all(rejoined[f] >= grown[f] for f in grown), (grown, rejoined)
    # B's pod runner restarted the island's pod as a kubelet does after a reboot (its container lost with the
    # node): B's operator counts a preemption, not a failure against the restart budget.
    island = wait_until(
        lambda: next((i for i in status(far)["islands"] if i["name"] == FAR and i["preemptions"]), None)
    )
    assert (island["preemptions"], island.get("restarts", 0)) == (1, 0), island
    # B's job status reads the shards' progress again, that made while B was away included.
    wait_until(lambda: status(far).get("outerStep", 0) >= away)
