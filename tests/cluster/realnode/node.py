"""One real node joined to the test cluster: the kubelet, kube-proxy and the NetworkPolicy controller
(kube-network-policies, as kind's kindnetd runs it) that realnode/build.sh builds, Debian's containerd with runc
and the CNI bridge plugin, so that pods run as real containers with their own network namespace and IP, reach
Services by their ClusterIP, resolve their names through the cluster's CoreDNS, and are fenced by
NetworkPolicies.

    cluster = start_cluster(workdir, pools=())
    node = start_real_node(cluster, workdir / "node", images=(archive,))    # OCI archives to preload
    ...
    node.stop()          # nothing left: no process, mount, netns, cgroup, bridge, nftables table, sysctl or images

node.sh runs containerd, kube-proxy, the policy controller and the kubelet in a PID and mount namespace of their
own (see there). What outlives them in the host is removed by `stop`: the kubelet's cgroups (all under one cgroup
root named after this node), kube-proxy's nftables tables (`kube-proxy --cleanup`), the policy controller's
(NETPOL_TABLE: it deletes it itself only when interrupted, never when killed), the node's own nftables table (which
masquerades the pods' traffic leaving the host), the CNI bridge, and the sysctls the bridge plugin or kube-proxy
may set. Nothing writes iptables: kube-proxy runs in nftables mode, the bridge plugin does no masquerading, and
the kubelet's utility chains are off.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import string
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cluster.controlplane import SERVICE_CIDR, ControlPlane, free_port, kubeconfig, pinned_version, spawn, stop_group

HERE = Path(__file__).resolve().parent
NODE_NAME = "realnode-0"
NODE_TOKEN = "realnode-token"
POD_SUBNET = "10.250.0.0/24"
"""The pods' addresses on this node, apart from the KWOK nodes' 10.244.0.0/16 (cluster/nodes.py)."""
GATEWAY = str(ipaddress.ip_network(POD_SUBNET)[1])
"""The host's address on the pods' bridge: their default route, and where they reach the API server."""
CLUSTER_DOMAIN = "cluster.local"
DNS_IP = str(ipaddress.ip_network(SERVICE_CIDR)[10])
"""The kube-dns Service's ClusterIP, as kubeadm and kind choose it."""
CGROUP_HIERARCHIES = Path("/sys/fs/cgroup")
DEBIAN_PACKAGES = (
    "containerd",
    "runc",
    "containernetworking-plugins",
    "iptables",
    "nftables",
    "socat",
    "busybox-static",
)
"""What node.sh and the tests' busybox pods run from Debian (`apt-get install` them; .ci/realnode reads this
list); the kubelet, kube-proxy, kube-network-policies and the other images come from build.sh."""
CNI_PLUGINS = Path("/usr/lib/cni")
KUBE_PROXY_TABLE = "kube-proxy"
"""The nftables table (in the ip and ip6 families) that kube-proxy's nftables mode writes all its rules into."""
NETPOL_TABLE = ("inet", "kube-network-policies")
"""The nftables table that kube-network-policies writes all its rules into: the first packet of each connection
to or from a pod that a NetworkPolicy selects goes to its nfqueue, which accepts or drops it."""
HOST_SYSCTLS = tuple(
    Path("/proc/sys/net", name)
    for name in (
        "ipv4/ip_forward",  # the bridge plugin turns it on for its gateway
        "ipv4/conf/all/route_localnet",  # kube-proxy, for NodePorts on loopback
        "netfilter/nf_conntrack_max",  # kube-proxy's conntrack settings (node.py sets them to leave these be)
        "netfilter/nf_conntrack_tcp_timeout_established",
        "netfilter/nf_conntrack_tcp_timeout_close_wait",
    )
)
"""Host settings that the node may change, put back by `stop`."""
ADDONS = HERE / "addons.yaml"


def not_enabled() -> str | None:
    """Why the real-node tier may not run here, or None: it is opt-in (it changes the host: cgroups, a bridge,
    nftables), and needs root."""
    if os.environ.get("DILOCO_REALNODE") != "1" or os.geteuid() != 0:
        return "real-node tier: opt-in with DILOCO_REALNODE=1, as root (docs/real-nodes.md)"
    return None


class MissingToolchain(RuntimeError):
    """realnode/build.sh has not been run, or Debian's packages (DEBIAN_PACKAGES) are not installed."""


@dataclass
class RealNode:
    name: str
    workdir: Path
    process: subprocess.Popen
    cgroup_root: str
    bridge: str
    kube_proxy: Path
    sysctls: dict[Path, str]
    """HOST_SYSCTLS as they were before the node started, restored by stop."""

    @property
    def containerd_root(self) -> Path:
        return self.workdir / "containerd"

    def logs(self, pod: dict) -> str:
        """What `pod`'s containers wrote to stdout and stderr, from the kubelet's log files. (`kubectl logs`
        cannot reach this node: the kubelet refuses the loopback address it listens on as the node's IP,
        "nodeIP can't be loopback address", so the Node publishes no address for the API server to call.)"""
        meta = pod["metadata"]
        folder = self.workdir / "pod-logs" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
        # Each line as the CRI writes it: TIME STREAM TAG MESSAGE.
        lines = (line.split(" ", 3) for log in sorted(folder.glob("*/*.log")) for line in log.read_text().splitlines())
        return "\n".join(fields[3] for fields in lines if len(fields) == 4)

    def stop(self) -> None:
        """Stops the kubelet (and with it every container, kube-proxy, the policy controller and the relay), then
        removes its cgroups, the rules of kube-proxy and the policy controller, the bridge and containerd's store,
        and puts back the host's sysctls."""
        stop_group(self.process)
        # The images imported and unpacked there (12 GB with the trainer's) would outlive the run in pytest's
        # kept folders; the logs beside them are what is worth keeping.
        shutil.rmtree(self.containerd_root, ignore_errors=True)
        _remove_cgroups(self.cgroup_root)
        subprocess.run([str(self.kube_proxy), "--cleanup"], capture_output=True)
        subprocess.run(["nft", "delete", "table", *NETPOL_TABLE], capture_output=True)
        _remove_bridge(self.bridge)
        for path, value in self.sysctls.items():
            if path.read_text() != value:
                path.write_text(value)

    def leftovers(self) -> list[str]:
        """What of this node is still there (empty after `stop`)."""
        left = [f"cgroup {d}" for d in _cgroup_dirs(self.cgroup_root)]
        if self.containerd_root.exists():
            left.append(f"containerd store {self.containerd_root}")
        if self.process.poll() is None:
            left.append(f"process {self.process.pid}")
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode == 0:
            left.append(f"bridge {self.bridge}")
        left += [f"iptables {rule}" for rule in self.iptables_rules()]
        ours = (f" {KUBE_PROXY_TABLE}", f" {self.bridge}", " ".join(NETPOL_TABLE))
        left += [f"nftables table {table}" for table in nftables_tables() if table.endswith(ours)]
        left += [f"sysctl {path} changed" for path, value in self.sysctls.items() if path.read_text() != value]
        return left

    def iptables_rules(self) -> list[str]:
        """Host iptables rules that a kubelet, kube-proxy, the CNI plugins or this node's pods would have
        written."""
        saved = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
        marks = (self.bridge, POD_SUBNET.rsplit(".", 1)[0] + ".", "KUBE-", "CNI-")
        return [line for line in saved.splitlines() if any(mark in line for mark in marks)]


def nftables_tables() -> list[str]:
    """The host's nftables tables, as `FAMILY NAME`."""
    listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    return [line.removeprefix("table ") for line in listed.splitlines()]


def _remove_cgroups(root: str) -> None:
    deadline = time.monotonic() + 30
    while _cgroup_dirs(root) and time.monotonic() < deadline:
        for directory in _cgroup_dirs(root):  # deepest first: rmdir needs empty children
            try:
                directory.rmdir()
            except OSError:
                time.sleep(0.2)  # its last task is still exiting


def _remove_bridge(bridge: str) -> None:
    """The bridge and its masquerading table (_bridge_up)."""
    subprocess.run(["nft", "delete", "table", "ip", bridge], capture_output=True)
    subprocess.run(["ip", "link", "delete", bridge], capture_output=True)


def _cgroup_dirs(root: str) -> list[Path]:
    """Every directory of the cgroup `root`, in every hierarchy, deepest first."""
    found = []
    for hierarchy in CGROUP_HIERARCHIES.iterdir():
        top = hierarchy / root.strip("/")
        if top.is_dir():
            found += [Path(d) for d, _, _ in os.walk(top)]
    return sorted(found, key=lambda d: len(d.parts), reverse=True)


@dataclass(frozen=True)
class Image:
    archive: Path
    name: str


def node_binaries() -> tuple[dict[str, Path], dict[str, Image]]:
    """The kubelet, kube-proxy and kube-network-policies, and the pause and CoreDNS images from build.sh's cache;
    raises MissingToolchain without them or without Debian's packages."""
    cache = Path(os.environ.get("DILOCO_CLUSTER_CACHE", os.path.expanduser("~/.cache/diloco-cluster")))
    versions = {
        "kubelet": pinned_version("K8S_VERSION"),
        "kube-proxy": pinned_version("K8S_VERSION"),
        "kube-network-policies": pinned_version("NETPOL_VERSION", HERE / "build.sh"),
    }
    binaries = {name: cache / f"{name}-{version}" / name for name, version in versions.items()}
    images = {name: sorted(cache.glob(f"{name}-*/{name}.tar")) for name in ("pause", "coredns")}
    missing = [p for p in ("containerd", "ctr", "runc", "nft", "socat", "busybox") if not _on_path(p)]
    if not (CNI_PLUGINS / "bridge").exists():
        missing.append("CNI plugins")
    missing += [name for name, path in binaries.items() if not path.exists()]
    missing += [f"{name} image" for name, found in images.items() if not found]
    if missing:
        raise MissingToolchain(
            f"no real-node toolchain ({', '.join(missing)}): "
            f"apt-get install {' '.join(DEBIAN_PACKAGES)} and run tests/cluster/realnode/build.sh"
        )
    return binaries, {
        name: Image(found[-1], (found[-1].parent / "name").read_text().strip()) for name, found in images.items()
    }


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
        "clusterDNS": [DNS_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        # The disk and memory of a shared test machine are not this node's to defend.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
    }


def _kube_proxy_config(kubeconfig_path: Path) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        # All its rules in one table per family, which `kube-proxy --cleanup` deletes whole.
        "mode": "nftables",
        "hostnameOverride": NODE_NAME,
        "clientConnection": {"kubeconfig": str(kubeconfig_path)},
        "clusterCIDR": POD_SUBNET,
        # NodePorts on the node's own address only, not on every address of the shared host.
        "nodePortAddresses": ["primary"],
        "healthzBindAddress": f"127.0.0.1:{free_port()}",
        "metricsBindAddress": f"127.0.0.1:{free_port()}",
        # Zero leaves the host's conntrack table size and timeouts as they are: they are not this node's.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def _addons(plane: ControlPlane, coredns: Image) -> str:
    """addons.yaml for this cluster: the service accounts of kube-proxy and the policy controller, the API
    server's endpoint at the gateway (on its own port, see node.sh's relay), CoreDNS as kube-dns."""
    return string.Template(ADDONS.read_text()).substitute(
        gateway=GATEWAY,
        api_port=urlsplit(plane.server).port,
        cluster_domain=CLUSTER_DOMAIN,
        coredns_image=coredns.name,
        dns_ip=DNS_IP,
    )


def _service_account_files(plane: ControlPlane, name: str, folder: Path) -> None:
    """What a pod of kube-system's service account `name` finds in /var/run/secrets/kubernetes.io/serviceaccount:
    for a process that, like kube-network-policies, knows only the in-cluster configuration (node.sh binds
    `folder` there)."""
    folder.mkdir(exist_ok=True)
    (folder / "token").write_text(plane.service_account_token("kube-system", name))
    (folder / "ca.crt").write_bytes(plane.ca.read_bytes())
    (folder / "namespace").write_text("kube-system")


def _bridge_up(bridge: str) -> None:
    """The pods' bridge with its gateway address, made before the first pod (the bridge plugin adopts it) so
    that the API server relay can listen there from the start; and an nftables table of the same name that
    masquerades what pods send off the node, so that answers find their way back: CoreDNS forwards names
    outside the cluster to the host's resolver, which knows no route to the pods' subnet."""
    prefix = ipaddress.ip_network(POD_SUBNET).prefixlen
    for command in (
        ["ip", "link", "add", bridge, "type", "bridge"],
        ["ip", "addr", "add", f"{GATEWAY}/{prefix}", "dev", bridge],
        ["ip", "link", "set", bridge, "up"],
    ):
        subprocess.run(command, check=True, capture_output=True)
    masquerade = f"""table ip {bridge} {{
        chain postrouting {{
            type nat hook postrouting priority srcnat; policy accept;
            ip saddr {POD_SUBNET} ip daddr != {POD_SUBNET} masquerade
        }}
    }}"""
    subprocess.run(["nft", "-f", "-"], input=masquerade, text=True, check=True, capture_output=True)


def start_real_node(
    plane: ControlPlane, workdir: Path, images: tuple[Path, ...] = (), timeout: float = 180.0
) -> RealNode:
    """Starts containerd, kube-proxy, the policy controller and the kubelet for NODE_NAME in `workdir`, preloads
    the pause and CoreDNS images and `images` (OCI archives), installs the add-ons (addons.yaml), and returns once
    the node is Ready and the cluster's DNS answers."""
    binaries, node_images = node_binaries()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "logs").mkdir(exist_ok=True)
    (workdir / "cni").mkdir(exist_ok=True)
    suffix = f"{os.getpid() % 0x10000:04x}"
    bridge, cgroup_root = f"rn{suffix}", f"/diloco-realnode-{suffix}"
    sysctls = {path: path.read_text() for path in HOST_SYSCTLS if path.exists()}
    plane.kubectl("apply", "-f", "-", stdin=_addons(plane, node_images["coredns"]))
    proxy_kubeconfig = plane.service_account_kubeconfig("kube-system", "kube-proxy")
    _service_account_files(plane, "kube-network-policies", workdir / "netpol-account")
    (workdir / "containerd.toml").write_text(_containerd_config(workdir, node_images["pause"].name))
    (workdir / "cni" / "10-realnode.conflist").write_text(json.dumps(_cni_config(bridge, workdir)))
    (workdir / "kubelet.yaml").write_text(json.dumps(_kubelet_config(workdir, cgroup_root)))
    (workdir / "kube-proxy.yaml").write_text(json.dumps(_kube_proxy_config(proxy_kubeconfig)))
    (workdir / "kubeconfig").write_text(kubeconfig(plane.server, NODE_TOKEN, plane.ca))
    node = None
    try:
        for hierarchy in CGROUP_HIERARCHIES.iterdir():  # the kubelet wants its cgroup root to exist
            if hierarchy.is_dir() and (hierarchy / "cgroup.procs").exists():
                (hierarchy / cgroup_root.strip("/")).mkdir(exist_ok=True)
        _bridge_up(bridge)
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
                str(binaries["kube-proxy"]),
                str(binaries["kube-network-policies"]),
                f"127.0.0.1:{free_port()}",
                str(workdir),
                NODE_NAME,
                urlsplit(plane.server).netloc,
                GATEWAY,
                *(str(image.archive) for image in node_images.values()),
                *map(str, images),
            ],
            workdir / "logs" / "node.log",
        )
        node = RealNode(NODE_NAME, workdir, process, cgroup_root, bridge, binaries["kube-proxy"], sysctls)
        deadline = time.monotonic() + timeout
        while not _ready(plane):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node {NODE_NAME} did not become Ready; logs in {workdir / 'logs'}")
            time.sleep(1)
        left = max(deadline - time.monotonic(), 1.0)
        plane.kubectl(
            "-n", "kube-system", "rollout", "status", "deployment/coredns", f"--timeout={left:.0f}s", timeout=left + 30
        )
    except BaseException:
        if node is not None:
            node.stop()
        else:
            _remove_cgroups(cgroup_root)
            _remove_bridge(bridge)
        raise
    return node


def _ready(plane: ControlPlane) -> bool:
    out = plane.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
    if out.returncode != 0:
        return False
    conditions = json.loads(out.stdout)["status"].get("conditions", ())
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
