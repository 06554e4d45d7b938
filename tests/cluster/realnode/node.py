"""One real node joined to the test cluster: the kubelet that realnode/build.sh builds, Debian's containerd with
runc and the CNI bridge plugin, so that pods run as real containers with their own network namespace and IP.

    cluster = start_cluster(workdir, pools=())
    node = start_real_node(cluster, workdir / "node", images=(archive,))    # OCI archives to preload
    ...
    node.stop()          # nothing left: no process, mount, netns, cgroup, bridge or iptables rule

node.sh runs containerd and the kubelet in a PID and mount namespace of their own (see there). What outlives
them in the host is removed by `stop`: the kubelet's cgroups (all under one cgroup root named after this node)
and the CNI bridge; net.ipv4.ip_forward, which the bridge plugin turns on, is put back. Nothing writes
iptables: no masquerading (pods only talk to each other and to the host), no kubelet utility chains.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.controlplane import ControlPlane, free_port, kubeconfig, pinned_version, spawn, stop_group

HERE = Path(__file__).resolve().parent
NODE_NAME = "realnode-0"
NODE_TOKEN = "realnode-token"
POD_SUBNET = "10.250.0.0/24"
"""The pods' addresses on this node, apart from the KWOK nodes' 10.244.0.0/16 (cluster/nodes.py)."""
CGROUP_HIERARCHIES = Path("/sys/fs/cgroup")
DEBIAN_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "iptables")
"""What node.sh runs from Debian (`apt-get install` them); the kubelet and the pause image come from build.sh."""
CNI_PLUGINS = Path("/usr/lib/cni")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


def not_enabled() -> str | None:
    """Why the real-node tier may not run here, or None: it is opt-in (it changes the host: cgroups, a bridge),
    and needs root."""
    if os.environ.get("DILOCO_REALNODE") != "1" or os.geteuid() != 0:
        return "real-node tier: opt-in with DILOCO_REALNODE=1, as root (docs/real-nodes.md)"
    return None


class MissingToolchain(RuntimeError):
    """realnode/build.sh has not been run, or Debian's containerd, runc or CNI plugins are not installed."""


@dataclass
class RealNode:
    name: str
    workdir: Path
    process: subprocess.Popen
    cgroup_root: str
    bridge: str
    ip_forward: str
    """The host's net.ipv4.ip_forward before the bridge plugin turned it on for its gateway, restored by stop."""

    def stop(self) -> None:
        """Stops the kubelet (and with it every container), then removes its cgroups and the bridge."""
        stop_group(self.process)
        deadline = time.monotonic() + 30
        while _cgroup_dirs(self.cgroup_root) and time.monotonic() < deadline:
            for directory in _cgroup_dirs(self.cgroup_root):  # deepest first: rmdir needs empty children
                try:
                    directory.rmdir()
                except OSError:
                    time.sleep(0.2)  # its last task is still exiting
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
        IP_FORWARD.write_text(self.ip_forward)

    def leftovers(self) -> list[str]:
        """What of this node is still there (empty after `stop`)."""
        left = [f"cgroup {d}" for d in _cgroup_dirs(self.cgroup_root)]
        if self.process.poll() is None:
            left.append(f"process {self.process.pid}")
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode == 0:
            left.append(f"bridge {self.bridge}")
        left += [f"iptables {rule}" for rule in self.iptables_rules()]
        return left

    def iptables_rules(self) -> list[str]:
        """Host iptables rules that a kubelet, the CNI plugins or this node's pods would have written."""
        saved = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
        marks = (self.bridge, POD_SUBNET.rsplit(".", 1)[0] + ".", "KUBE-", "CNI-")
        return [line for line in saved.splitlines() if any(mark in line for mark in marks)]


def _cgroup_dirs(root: str) -> list[Path]:
    """Every directory of the cgroup `root`, in every hierarchy, deepest first."""
    found = []
    for hierarchy in CGROUP_HIERARCHIES.iterdir():
        top = hierarchy / root.strip("/")
        if top.is_dir():
            found += [Path(d) for d, _, _ in os.walk(top)]
    return sorted(found, key=lambda d: len(d.parts), reverse=True)


def node_binaries() -> dict[str, Path]:
    """The kubelet and the pause image archive from build.sh's cache; raises MissingToolchain without them."""
    cache = Path(os.environ.get("DILOCO_CLUSTER_CACHE", os.path.expanduser("~/.cache/diloco-cluster")))
    kubelet = cache / f"kubelet-{pinned_version('K8S_VERSION')}" / "kubelet"
    pauses = sorted(cache.glob("pause-*/pause.tar"))
    missing = [p for p in ("containerd", "ctr", "runc") if not _on_path(p)]
    if not (CNI_PLUGINS / "bridge").exists():
        missing.append("CNI plugins")
    if not kubelet.exists() or not pauses or missing:
        raise MissingToolchain(
            f"no real-node toolchain ({', '.join(missing) or 'kubelet/pause'}): "
            f"apt-get install {' '.join(DEBIAN_PACKAGES)} and run tests/cluster/realnode/build.sh"
        )
    return {"kubelet": kubelet, "pause": pauses[-1]}


def _on_path(name: str) -> bool:
    return any(os.access(Path(d, name), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))


def _containerd_config(workdir: Path, pause_image: str) -> str:
    # restrict_oom_score_adj: the VM withholds CAP_SYS_RESOURCE, so no container may lower its OOM score below
    # containerd's own (the sandbox asks for -998); containerd clamps it, as it does when rootless.
    return f"""version = 2
root = "{workdir}/containerd/root"
state = "/run/containerd/state"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause_image}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_PLUGINS}"
    conf_dir = "{workdir}/cni"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
"""


def _cni_config(bridge: str, workdir: Path) -> dict:
    return {
        "cniVersion": "0.4.0",
        "name": "realnode",
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge,
                "isGateway": True,
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "subnet": POD_SUBNET,
                    "dataDir": str(workdir / "ipam"),
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "loopback"},
        ],
    }


def _kubelet_config(workdir: Path, cgroup_root: str) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This VM has cgroup v1 (with a v2 hierarchy beside it); v1.37 refuses v1 unless told.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,
        "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
        "address": "127.0.0.1",
        "port": free_port(),
        "readOnlyPort": 0,
        "healthzPort": 0,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True}, "x509": {}},
        "authorization": {"mode": "Webhook"},
        "podLogsDir": str(workdir / "pod-logs"),
        "resolvConf": "/etc/resolv.conf",
        # The disk and memory of a shared test machine are not this node's to defend.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
    }


def start_real_node(
    plane: ControlPlane, workdir: Path, images: tuple[Path, ...] = (), timeout: float = 180.0
) -> RealNode:
    """Starts containerd and the kubelet for NODE_NAME in `workdir`, preloads the pause image and `images`
    (OCI archives), and returns once the node is Ready."""
    binaries = node_binaries()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "logs").mkdir(exist_ok=True)
    (workdir / "cni").mkdir(exist_ok=True)
    suffix = f"{os.getpid() % 0x10000:04x}"
    bridge, cgroup_root = f"rn{suffix}", f"/diloco-realnode-{suffix}"
    for hierarchy in CGROUP_HIERARCHIES.iterdir():  # the kubelet wants its cgroup root to exist
        if hierarchy.is_dir() and (hierarchy / "cgroup.procs").exists():
            (hierarchy / cgroup_root.strip("/")).mkdir(exist_ok=True)
    ip_forward = IP_FORWARD.read_text()
    pause_image = (binaries["pause"].parent / "name").read_text().strip()
    (workdir / "containerd.toml").write_text(_containerd_config(workdir, pause_image))
    (workdir / "cni" / "10-realnode.conflist").write_text(json.dumps(_cni_config(bridge, workdir)))
    (workdir / "kubelet.yaml").write_text(json.dumps(_kubelet_config(workdir, cgroup_root)))
    (workdir / "kubeconfig").write_text(kubeconfig(plane.server, NODE_TOKEN, plane.ca))
    process = spawn(
        [
            "unshare",
            "--mount",
            "--pid",
            "--fork",
            "--mount-proc",
            "--propagation",
            "private",
            str(HERE / "node.sh"),
            str(binaries["kubelet"]),
            str(workdir),
            NODE_NAME,
            str(binaries["pause"]),
            *map(str, images),
        ],
        workdir / "logs" / "node.log",
    )
    node = RealNode(NODE_NAME, workdir, process, cgroup_root, bridge, ip_forward)
    deadline = time.monotonic() + timeout
    try:
        while not _ready(plane):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node {NODE_NAME} did not become Ready; logs in {workdir / 'logs'}")
            time.sleep(1)
    except BaseException:
        node.stop()
        raise
    return node


def _ready(plane: ControlPlane) -> bool:
    out = plane.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
    if out.returncode != 0:
        return False
    conditions = json.loads(out.stdout)["status"].get("conditions", ())
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
