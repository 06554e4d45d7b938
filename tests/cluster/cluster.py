"""A real Kubernetes cluster on loopback for the cluster tier (DESIGN.md section 8): etcd and kube-apiserver
(controlplane.py), kube-controller-manager (every default controller, each with its own service-account
credentials), kube-scheduler, KWOK keeping fake nodes of realistic pools alive (nodes.py) and a local-path
volume provisioner (volumes.py). Pods are scheduled, get IPs and become Ready as on a real cluster, but no
container runs: tests/cluster/pod_runner.py runs this project's containers as local processes (and, on a
cluster started for it, says when a probed container is ready).

    cluster = start_cluster(workdir)          # the default pools of nodes.py
    cluster.kubectl("get", "nodes")
    cluster.add_node("cpu-spot"); cluster.delete_node("cpu-spot-0")
    cluster.stop()                            # nothing left running

By hand: `make cluster-up` (python -m cluster.up) prints a kubeconfig and runs until Ctrl-C.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kubernetes import config as kube_config

from cluster.controlplane import ControlPlane, binaries_dir, free_port, spawn, start_control_plane
from cluster.nodes import (
    DEFAULT_POOLS,
    KWOK_ANNOTATION,
    POD_NETWORK,
    Pool,
    cidr_index,
    node_manifest,
    pod_cidr,
)
from cluster.volumes import Provisioner

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok")
KWOK_STAGES = "kwok-stages.yaml"
"""KWOK's own stages (nodes Ready with a lease heartbeat; pods Running and Ready with an IP from their node's
CIDR, deleted at once when deleted), which build.sh takes from the KWOK release it builds."""
LEFT_TO_THE_POD_RUNNER = frozenset({"pod-complete"})
"""KWOK stages not used: `pod-complete` marks every Job's pod Succeeded at once, but the pod runner runs this
project's Job pods (a job's model export) and reports how they exit, as a kubelet does."""
OUT_OF_SERVICE_TAINT = {"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"}
"""What a cloud's node-termination handling amounts to: pods are evicted at once (DisruptionTarget set) and
force-deleted by the pod garbage collector, so their controllers replace them elsewhere."""


PROBED_CONTAINERS_NOT_READY = (
    # (what KWOK's pod-ready template says, what it says here): a pod is Ready only if no container is probed,
    (
        "{{ $now := Now }}\n",
        '{{ $now := Now }}\n{{ $ready := "True" }}{{ range .spec.containers }}'
        '{{ if .readinessProbe }}{{ $ready = "False" }}{{ end }}{{ end }}\n',
    ),
    ('status: "True"\n  type: Ready\n', "status: {{ $ready | Quote }}\n  type: Ready\n"),
    ('status: "True"\n  type: ContainersReady\n', "status: {{ $ready | Quote }}\n  type: ContainersReady\n"),
    # and a probed container starts not ready (the init containers' statuses, after these, are left as they are).
    (
        "  ready: true\n  restartCount: 0\n  state:\n",
        "  ready: {{ not .readinessProbe }}\n  restartCount: 0\n  state:\n",
    ),
)


def probes_left_to_the_runner(stage: dict) -> dict:
    """KWOK's `pod-ready` stage made to start a container that has a readinessProbe not ready, and its pod
    with it, as a kubelet does until the probe passes; the pod runner then reports it ready as its probe says
    (or at once, for a container it does not run). As KWOK has it, a probed pod is Ready from the moment it
    is bound until the runner starts its process: long enough for `helm install --wait`, a Deployment's
    availability or a test's wait for Ready to take a pod whose process has not started for one that is up."""
    template = stage["spec"]["next"]["statusTemplate"]
    for was, becomes in PROBED_CONTAINERS_NOT_READY:
        if template.count(was) != 1:
            raise ValueError(f"KWOK's pod-ready stage has changed: {was!r} is not in it once")
        template = template.replace(was, becomes)
    return {**stage, "spec": {**stage["spec"], "next": {**stage["spec"]["next"], "statusTemplate": template}}}


def kwok_stages(source: Path, workdir: Path, pod_runner: bool = False) -> Path:
    """KWOK's stages less those left to the pod runner, written into `workdir`; with `pod_runner` (one runs
    this cluster's pods), probed containers' readiness is left to it too (`probes_left_to_the_runner`)."""
    kept = [
        d for d in yaml.safe_load_all(source.read_text()) if d and d["metadata"]["name"] not in LEFT_TO_THE_POD_RUNNER
    ]
    if pod_runner:
        kept = [probes_left_to_the_runner(d) if d["metadata"]["name"] == "pod-ready" else d for d in kept]
    path = workdir / KWOK_STAGES
    path.write_text(yaml.safe_dump_all(kept))
    return path


@dataclass
class Cluster(ControlPlane):
    pools: dict[str, Pool] = field(default_factory=dict)
    nodes_created: int = 0
    provisioner: Provisioner | None = None

    def add_node(self, pool: str, index: int | None = None) -> str:
        """Creates one more node of `pool` (the next free index by default) and waits until KWOK has made it
        Ready; returns its name."""
        existing = set(self.node_names())
        if index is None:
            index = next(i for i in range(len(existing) + 1) if f"{pool}-{i}" not in existing)
        manifest = node_manifest(self.pools[pool], index, pod_cidr(self.nodes_created))
        self.nodes_created += 1
        self.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
        name = manifest["metadata"]["name"]
        self.wait_nodes_ready([name])
        return name

    def delete_node(self, name: str, evict: bool = True) -> None:
        """Takes a node away as a spot preemption does. With `evict`, first cordons it and taints it
        out-of-service, as a cloud's node-termination handling does, so its pods are evicted (DisruptionTarget)
        and removed now; without, only the Node object goes and the pod garbage collector deletes its pods
        after its usual quarantine (about a minute)."""
        if evict:
            self.evict_node(name)
        self.kubectl("delete", "node", name, "--wait=true")

    def evict_node(self, name: str) -> None:
        """Cordons the node and taints it out-of-service, as a cloud's node-termination handling does, and waits
        (a minute at most) until its pods are gone."""
        self.kubectl("cordon", name)
        taint = OUT_OF_SERVICE_TAINT
        self.kubectl("taint", "node", name, f"{taint['key']}={taint['value']}:{taint['effect']}")
        deadline = time.monotonic() + 60
        while self.pods_on(name) and time.monotonic() < deadline:
            time.sleep(0.5)

    def node_names(self) -> list[str]:
        out = self.kubectl("get", "nodes", "-o", "jsonpath={.items[*].metadata.name}").stdout
        return out.split()

    def node_cidrs(self) -> list[str]:
        """The pod CIDR of every node."""
        return self.kubectl("get", "nodes", "-o", "jsonpath={.items[*].spec.podCIDR}").stdout.split()

    def pods_on(self, node: str) -> list[str]:
        """`namespace/name` of every pod bound to `node`."""
        out = self.kubectl(
            "get",
            "pods",
            "-A",
            "--field-selector",
            f"spec.nodeName={node}",
            "-o",
            "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name} {end}",
        ).stdout
        return out.split()

    def wait_nodes_ready(self, names: Iterable[str], timeout: float = 60) -> None:
        wanted = set(names)

        def ready() -> bool:
            items = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]
            return wanted <= {
                n["metadata"]["name"]
                for n in items
                if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", ()))
            }

        _wait(self, f"nodes {sorted(wanted)} did not become Ready", ready, timeout)

    def stop(self) -> None:
        if self.provisioner is not None:
            self.provisioner.stop()
        super().stop()


def _control_plane_process(cluster: Cluster, name: str, args: list[str], token: str) -> None:
    config = cluster.token_kubeconfig(token, name)
    cluster.processes.append(
        spawn([str(cluster.bin / name), "--kubeconfig", str(config), *args], cluster.workdir / "logs" / f"{name}.log")
    )


def _wait(cluster: Cluster, what: str, ready: Callable[[], bool], timeout: float) -> None:
    """Polls `ready`; raises when it is not true within `timeout` s or a component has exited."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline or any(p.poll() is not None for p in cluster.processes):
            raise RuntimeError(f"{what} within {timeout} s; logs in {cluster.workdir / 'logs'}")
        time.sleep(0.5)


class MissingBinaries(RuntimeError):
    """tests/cluster/build.sh has not been run on this machine."""


def start_cluster(
    workdir: Path,
    pools: Iterable[Pool] = DEFAULT_POOLS,
    bin_dir: Path | None = None,
    timeout: float = 120.0,
    pod_runner: bool = False,
) -> Cluster:
    """Starts every component in `workdir` (binaries from `bin_dir`, else build.sh's cache), creates `count`
    nodes of each pool, and returns once the nodes are Ready and the `default` namespace can run pods (its
    service account exists). In a workdir a cluster ran in before, it starts again on its own data (see
    start_control_plane) with the nodes it had, creating none. `pod_runner`: a pod runner will run its pods,
    and report their probed containers ready (`kwok_stages`); without one, KWOK reports every pod Ready."""
    bin_dir = bin_dir or binaries_dir(BINARIES)
    stages = (bin_dir / KWOK_STAGES) if bin_dir else None
    if stages is None or not stages.exists():
        raise MissingBinaries(f"no cached {', '.join(BINARIES)} and {KWOK_STAGES}: run tests/cluster/build.sh")
    plane = start_control_plane(bin_dir, workdir, timeout)
    cluster = Cluster(
        plane.bin,
        plane.workdir,
        plane.server,
        plane.admin_kubeconfig,
        plane.processes,
        pools={p.name: p for p in pools},
    )
    try:
        _control_plane_process(
            cluster,
            "kube-controller-manager",
            [
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                str(free_port()),
                "--leader-elect=false",
                "--use-service-account-credentials",
                "--controllers",
                "*",
                "--service-account-private-key-file",
                str(workdir / "sa.key"),
                "--root-ca-file",
                str(cluster.ca),
                # Node IPAM stays off: nodes come with their pod CIDRs (nodes.py), as on clouds with native routing.
                "--allocate-node-cidrs=false",
                "--cluster-cidr",
                str(POD_NETWORK),
            ],
            "kube-controller-manager-token",
        )
        _control_plane_process(
            cluster,
            "kube-scheduler",
            [
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                str(free_port()),
                "--leader-elect=false",
            ],
            "kube-scheduler-token",
        )
        _control_plane_process(
            cluster,
            "kwok",
            [
                "--config",
                str(kwok_stages(stages, cluster.workdir, pod_runner)),
                "--node-lease-duration-seconds",
                "40",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
                "--cidr",
                str(POD_NETWORK),
                "--node-ip",
                "10.0.0.1",
            ],
            "kwok-token",
        )
        cluster.provisioner = Provisioner(
            kube_config.new_client_from_config(str(cluster.admin_kubeconfig)), workdir / "volumes"
        )
        cluster.provisioner.start()
        existing = cluster.node_cidrs()
        if existing:
            # A restart on its own data: the nodes are there, as a datacenter's are after it comes back.
            cluster.nodes_created = 1 + max(cidr_index(cidr) for cidr in existing)
        else:
            for pool in cluster.pools.values():
                for index in range(pool.count):
                    manifest = node_manifest(pool, index, pod_cidr(cluster.nodes_created))
                    cluster.nodes_created += 1
                    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
        _wait(
            cluster,
            "the default service account did not appear",
            lambda: cluster.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
            timeout,
        )
        cluster.wait_nodes_ready(cluster.node_names(), timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster
