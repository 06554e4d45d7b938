"""Real nodes joined to the test cluster: for each, the kubelet, kube-proxy and the NetworkPolicy controller
(kube-network-policies, as kind's kindnetd runs it) that realnode/build.sh builds, Debian's containerd with runc
and the CNI bridge plugin, so that pods run as real containers with their own network namespace and IP, reach
Services by their ClusterIP, resolve their names through the cluster's CoreDNS, and are fenced by
NetworkPolicies.

    with real_cluster(workdir, pools=(Pool(...), ...), images=(archive,)) as (cluster, nodes):
        nodes.lose("cpu-spot-0"); nodes.restore("cpu-spot-0")   # a spot node preempted, and its pool back
    # stopped: no process, mount, netns, cgroup, bridge, route, nftables table or images left

Each node is what a kind node is, without the container: a network namespace of its own (NETWORK's address on
eth0, a veth to the host's bridge, so the API server reaches its kubelet for logs and exec), in which node.sh
runs containerd, kube-proxy, the policy controller and the kubelet in a PID and mount namespace of their own
(see there). Its pods' subnet is a /24 of POD_NETWORK, routed by the host to the node. Everything the node
writes to the network (its bridge, kube-proxy's and the policy controller's nftables tables, sysctls) lives in
its namespace and goes with it. The host keeps only what `stop` removes: the bridge, the routes, a relay of the
API server's port from the bridge to loopback, one nftables table masquerading what nodes send off the host,
and the kubelets' cgroups (each node's under one cgroup root named after it).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import string
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from cluster.cluster import Cluster, MissingBinaries, start_cluster
from cluster.controlplane import SERVICE_CIDR, ControlPlane, kubeconfig, pinned_version, spawn, stop_group
from cluster.nodes import SPOT_LABELS, SPOT_TAINT, Pool, pool_labels

HERE = Path(__file__).resolve().parent
NETWORK = ipaddress.ip_network("10.251.0.0/24")
"""The nodes' addresses, on the host's bridge; apart from the KWOK clusters' (cluster/nodes.py, pod_network.py)."""
HOST_ADDRESS = str(NETWORK[1])
"""The host's address on the nodes' network: where they and their pods reach the API server (relayed)."""
FIRST_NODE = 10
"""The first node's address is NETWORK[FIRST_NODE]; the k-th node's the k-th after it."""
POD_NETWORK = ipaddress.ip_network("10.250.0.0/16")
"""The pods' addresses: a /24 per node, in the order the nodes were first started."""
POD_PREFIX = 24
API_SERVER_NAME = "kubernetes.default.svc"
"""A name in the API server's self-signed certificate, checked instead of the relay's address."""
CLUSTER_DOMAIN = "cluster.local"
DNS_IP = str(ipaddress.ip_network(SERVICE_CIDR)[10])
"""The kube-dns Service's ClusterIP, as kubeadm and kind choose it."""
KUBERNETES_SERVICE = str(ipaddress.ip_network(SERVICE_CIDR)[1])
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
HOST_SYSCTLS = (Path("/proc/sys/net/ipv4/ip_forward"),)
"""Host settings the nodes change (the host routes between them), put back by `stop`."""
ADDONS = HERE / "addons.yaml"
ON_DEMAND = Pool("cpu", 1, "n2-standard-2", {})
SPOT = Pool("cpu-spot", 1, "n2-standard-2", {}, labels=SPOT_LABELS, taints=(SPOT_TAINT,), zone="us-central1-b")
"""Pools as cluster/nodes.py's default ones label and taint them (GKE's), sized by the caller: capacity is what
each kubelet finds on this machine."""


def not_enabled() -> str | None:
    """Why the real-node tier may not run here, or None: it is opt-in (it changes the host: cgroups, a bridge,
    routes, nftables), and needs root."""
    if os.environ.get("DILOCO_REALNODE") != "1" or os.geteuid() != 0:
        return "real-node tier: opt-in with DILOCO_REALNODE=1, as root (docs/real-nodes.md)"
    return None


class MissingToolchain(RuntimeError):
    """realnode/build.sh has not been run, or Debian's packages (DEBIAN_PACKAGES) are not installed."""


MISSING = (MissingBinaries, MissingToolchain)
"""What real_cluster raises when a build or package it needs is not there (each says the command to run)."""


@dataclass(frozen=True)
class Image:
    archive: Path
    name: str


@dataclass
class RealNode:
    """One node of a RealNodes: where it lives on the host. Its containerd store (its images) outlives `kill`, as
    a rebooted machine's disk does, and goes with RealNodes.stop."""

    name: str
    index: int
    pool: Pool
    workdir: Path
    suffix: str
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """Its InternalIP: its eth0's on the nodes' network, where the API server reaches its kubelet."""
        return str(NETWORK[FIRST_NODE + self.index])

    @property
    def pod_subnet(self) -> str:
        return str(list(POD_NETWORK.subnets(new_prefix=POD_PREFIX))[self.index])

    @property
    def netns(self) -> str:
        return f"rn{self.suffix}-{self.index}"

    @property
    def cgroup_root(self) -> str:
        return f"/diloco-realnode-{self.suffix}-{self.index}"

    @property
    def containerd_root(self) -> Path:
        return self.workdir / "containerd"

    def kill(self) -> None:
        """The node gone as a machine goes, all at once: the kubelet stopped (and with it every container,
        kube-proxy and the policy controller), its network namespace (its bridge, rules and link) and cgroups
        removed, the host's route to its pods deleted."""
        if self.process is not None:
            stop_group(self.process)
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True)
        subprocess.run(["ip", "route", "delete", self.pod_subnet], capture_output=True)
        _remove_cgroups(self.cgroup_root)

    def leftovers(self) -> list[str]:
        """What of this node outlived `kill` (empty after it), its files apart."""
        left = [f"cgroup {d}" for d in _cgroup_dirs(self.cgroup_root)]
        if self.process is not None and self.process.poll() is None:
            left.append(f"process {self.process.pid}")
        if self.netns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split():
            left.append(f"netns {self.netns}")
        if self.pod_subnet in subprocess.run(["ip", "route", "show"], capture_output=True, text=True).stdout:
            left.append(f"route to {self.pod_subnet}")
        return left


@dataclass
class RealNodes:
    """Real nodes of one cluster, on one bridge of the host, each started and stopped on its own."""

    plane: Cluster
    workdir: Path
    suffix: str
    binaries: dict[str, Path]
    pause_image: str
    sysctls: dict[Path, str]
    """HOST_SYSCTLS as they were before the first node started, restored by stop."""
    nodes: dict[str, RealNode] = field(default_factory=dict)
    relay: subprocess.Popen | None = None

    @property
    def bridge(self) -> str:
        return f"rn{self.suffix}"

    @property
    def store(self) -> Path:
        """The containerd store that every node's is a copy of (hard links: the trainer's image alone is 12 GB
        imported, and the disk holds one): the pause and CoreDNS images and the caller's, imported and unpacked."""
        return _containerd_root(self.workdir / "images")

    @property
    def server(self) -> str:
        """The API server as the nodes reach it: relayed from the host's address to loopback."""
        return f"https://{HOST_ADDRESS}:{urlsplit(self.plane.server).port}"

    def __getitem__(self, name: str) -> RealNode:
        return self.nodes[name]

    @property
    def names(self) -> list[str]:
        return list(self.nodes)

    def add(self, pool: Pool, index: int) -> RealNode:
        """Starts node `<pool>-<index>` (the next /24 of POD_NETWORK, the next address); returns at once."""
        name = f"{pool.name}-{index}"
        node = RealNode(name, len(self.nodes), pool, self.workdir / name, self.suffix)
        self.nodes[name] = node
        self._start(node)
        return node

    def lose(self, name: str) -> None:
        """A spot node preempted, as a cloud does it: cordoned and tainted out-of-service (its pods evicted, so
        they stop as on a graceful node shutdown), then the machine gone and its Node object deleted."""
        self.plane.evict_node(name)
        self.nodes[name].kill()
        self.plane.kubectl("delete", "node", name, "--wait=true", timeout=120)

    def restore(self, name: str, timeout: float = 300.0) -> None:
        """Brings a lost node back (a new machine of its pool under the same name) and waits until it is Ready."""
        node = self.nodes[name]
        self._start(node)
        self.wait_ready([node], timeout)

    def wait_ready(self, nodes: Iterable[RealNode], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for node in nodes:
            while not _ready(self.plane, node.name):
                if node.process is None or node.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"node {node.name} did not become Ready; logs in {node.workdir / 'logs'}")
                time.sleep(1)

    def stop(self) -> None:
        """Kills every node and deletes the containerd stores, then removes what the host kept for them."""
        for node in self.nodes.values():
            node.kill()
            # The images there (12 GB with the trainer's) would outlive the run in pytest's kept folders; the logs
            # beside them are what is worth keeping.
            shutil.rmtree(node.containerd_root, ignore_errors=True)
        shutil.rmtree(self.store, ignore_errors=True)
        if self.relay is not None:
            stop_group(self.relay)
        subprocess.run(["nft", "delete", "table", "ip", self.bridge], capture_output=True)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
        for path, value in self.sysctls.items():
            if path.read_text() != value:
                path.write_text(value)

    def leftovers(self) -> list[str]:
        """What of these nodes is still there (empty after `stop`)."""
        left = [item for node in self.nodes.values() for item in node.leftovers()]
        stores = [self.store, *(node.containerd_root for node in self.nodes.values())]
        left += [f"containerd store {store}" for store in stores if store.exists()]
        if self.relay is not None and self.relay.poll() is None:
            left.append(f"relay {self.relay.pid}")
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode == 0:
            left.append(f"bridge {self.bridge}")
        left += [f"nftables table {table}" for table in nftables_tables() if table == f"ip {self.bridge}"]
        left += [f"iptables {rule}" for rule in self.iptables_rules()]
        left += [f"sysctl {path} changed" for path, value in self.sysctls.items() if path.read_text() != value]
        return left

    def iptables_rules(self) -> list[str]:
        """Host iptables rules that a kubelet, kube-proxy, the CNI plugins or the nodes' pods would have written."""
        saved = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
        marks = (self.bridge, "10.250.", "10.251.", "KUBE-", "CNI-")
        return [line for line in saved.splitlines() if any(mark in line for mark in marks)]

    def _start(self, node: RealNode) -> None:
        node.workdir.mkdir(parents=True, exist_ok=True)
        for folder in ("logs", "cni", "kubelet"):
            (node.workdir / folder).mkdir(exist_ok=True)
        cert, key = self.plane.client_certificate(f"system:node:{node.name}", "system:nodes", f"node-{node.name}")
        (node.workdir / "kubeconfig").write_text(kubeconfig(self.server, (cert, key), self.plane.ca, API_SERVER_NAME))
        (node.workdir / "kubelet.yaml").write_text(json.dumps(_kubelet_config(self.plane, node)))
        (node.workdir / "kube-proxy.yaml").write_text(json.dumps(_kube_proxy_config(self.workdir, node)))
        (node.workdir / "containerd.toml").write_text(_containerd_config(node.workdir, self.pause_image))
        (node.workdir / "cni" / "10-realnode.conflist").write_text(json.dumps(_cni_config(node)))
        for hierarchy in CGROUP_HIERARCHIES.iterdir():  # the kubelet wants its cgroup root to exist
            if hierarchy.is_dir() and (hierarchy / "cgroup.procs").exists():
                (hierarchy / node.cgroup_root.strip("/")).mkdir(exist_ok=True)
        if not node.containerd_root.exists():  # else a lost node come back: its images are still there
            _copy_store(self.store, _containerd_root(node.workdir))
        _node_network_up(node, self.bridge)
        labels = ",".join(f"{key}={value}" for key, value in pool_labels(node.pool).items())
        node.process = spawn(
            [
                "nsenter",
                f"--net=/run/netns/{node.netns}",
                "unshare",
                "--mount",
                "--pid",
                "--fork",
                "--mount-proc",
                "--propagation",
                "private",
                str(HERE / "node.sh"),
                str(self.binaries["kubelet"]),
                str(self.binaries["kube-proxy"]),
                str(self.binaries["kube-network-policies"]),
                str(node.workdir),
                str(self.workdir / "netpol-account"),
                node.name,
                node.address,
                labels,
                f"{KUBERNETES_SERVICE}:443",
            ],
            node.workdir / "logs" / "node.log",
        )


def start_real_nodes(
    plane: Cluster,
    workdir: Path,
    pools: Sequence[Pool] = (ON_DEMAND,),
    images: tuple[Path, ...] = (),
    tags: Mapping[str, str] | None = None,
    timeout: float = 180.0,
) -> RealNodes:
    """Starts `pool.count` nodes of each pool in `workdir` (named `<pool>-<index>`, labelled and tainted as the
    pool says), each with the pause and CoreDNS images and `images` (OCI archives) preloaded, and more names for
    them in `tags` (new name: image); installs the add-ons (addons.yaml) and returns once every node is Ready and
    the cluster's DNS answers."""
    binaries, node_images = node_binaries()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "logs").mkdir(exist_ok=True)
    nodes = RealNodes(
        plane,
        workdir,
        f"{os.getpid() % 0x10000:04x}",
        binaries,
        node_images["pause"].name,
        {path: path.read_text() for path in HOST_SYSCTLS},
    )
    try:
        plane.kubectl("apply", "-f", "-", stdin=_addons(plane, node_images["coredns"]))
        token = plane.service_account_token("kube-system", "kube-proxy")
        (workdir / "kube-proxy.kubeconfig").write_text(kubeconfig(nodes.server, token, plane.ca, API_SERVER_NAME))
        _service_account_files(plane, "kube-network-policies", workdir / "netpol-account")
        archives = (*(image.archive for image in node_images.values()), *images)
        _import(workdir / "images", nodes.pause_image, archives, tags or {})
        nodes.relay = _host_network_up(nodes, workdir / "logs" / "relay.log")
        started = [nodes.add(pool, index) for pool in pools for index in range(pool.count)]
        deadline = time.monotonic() + timeout
        nodes.wait_ready(started, timeout)
        left = max(deadline - time.monotonic(), 1.0)
        plane.kubectl(
            "-n", "kube-system", "rollout", "status", "deployment/coredns", f"--timeout={left:.0f}s", timeout=left + 30
        )
    except BaseException:
        nodes.stop()
        raise
    return nodes


@contextmanager
def real_cluster(
    workdir: Path,
    pools: Sequence[Pool],
    images: tuple[Path, ...] = (),
    tags: Mapping[str, str] | None = None,
    timeout: float = 180.0,
) -> Iterator[tuple[Cluster, RealNodes]]:
    """The test control plane with no KWOK node and real nodes of `pools` (start_real_nodes), in `workdir`; both
    stopped on the way out, which then checks that the nodes left nothing behind. Raises MISSING without the
    builds or packages."""
    (workdir / "cluster").mkdir(parents=True, exist_ok=True)
    cluster = start_cluster(workdir / "cluster", pools=())
    try:
        nodes = start_real_nodes(cluster, workdir / "nodes", pools, images, tags, timeout)
        try:
            yield cluster, nodes
        finally:
            nodes.stop()
    finally:
        cluster.stop()
    assert not nodes.leftovers(), nodes.leftovers()
    assert str(workdir) not in Path("/proc/mounts").read_text(), f"mounts left under {workdir}"


def container_processes(container_id: str) -> dict[int, dict[str, str]]:
    """The host's view of a container's processes: pid to the fields of /proc/PID/status. The nodes' PID
    namespaces are children of the host's, and each container's processes sit in a cgroup named after its ID."""
    found = {}
    for process in Path("/proc").iterdir():
        try:
            if process.name.isdigit() and container_id in (process / "cgroup").read_text():
                lines = (process / "status").read_text().splitlines()
                found[int(process.name)] = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def kill_container(container_id: str, sig: int = signal.SIGKILL) -> int:
    """Sends `sig` to the container's main process (PID 1 in its namespace) from the host, as the kernel's OOM
    killer or a crash would end it: from inside the container, its PID 1 ignores every signal it has no handler
    for, SIGKILL included. Returns the host pid signalled."""
    (pid,) = [pid for pid, status in container_processes(container_id).items() if status["NSpid"].split()[-1] == "1"]
    os.kill(pid, sig)
    return pid


def _import(workdir: Path, pause_image: str, archives: Sequence[Path], tags: Mapping[str, str]) -> None:
    """Imports `archives` into a containerd store in `workdir` (import.sh), configured as the nodes' are, and
    gives the images in `tags` their other names."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "containerd.toml").write_text(_containerd_config(workdir, pause_image))
    subprocess.run(
        [
            *("unshare", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private"),
            str(HERE / "import.sh"),
            str(workdir / "containerd.toml"),
            str(workdir / "import.log"),
            ",".join(f"{_qualified(image)}={_qualified(name)}" for name, image in tags.items()),
            *map(str, archives),
        ],
        check=True,
        capture_output=True,
    )


def _qualified(image: str) -> str:
    """An image's name as containerd keeps it: `busybox:1` is `docker.io/library/busybox:1` (other names are
    passed whole)."""
    return image if "/" in image else f"docker.io/library/{image}"


def _copy_store(store: Path, root: Path) -> None:
    """A node's own containerd store (`root`), the same as `store`: every file a hard link to the store's (blobs
    and unpacked layers are never written again, and a container writes to a layer of its own), but the bolt
    databases, which containerd writes in place, copied."""
    root.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(store), str(root)], check=True, capture_output=True)
    for database in store.rglob("*.db"):
        copy = root / database.relative_to(store)
        copy.unlink()
        shutil.copy2(database, copy)


def nftables_tables(netns: str | None = None) -> list[str]:
    """The nftables tables of the host, or of network namespace `netns`, as `FAMILY NAME`."""
    listed = subprocess.run([*_inside(netns), "nft", "list", "tables"], capture_output=True, text=True, check=True)
    return [line.removeprefix("table ") for line in listed.stdout.splitlines()]


def _inside(netns: str | None) -> list[str]:
    """The command prefix that runs a command in network namespace `netns` (the host's for None). Not `ip netns
    exec`, which remounts /sys and would hide the cgroup hierarchies from the kubelet."""
    return [] if netns is None else ["nsenter", f"--net=/run/netns/{netns}"]


def _host_network_up(nodes: RealNodes, relay_log: Path) -> subprocess.Popen:
    """The host's side of the nodes' network: the bridge at HOST_ADDRESS; an nftables table named after it that
    masquerades what nodes send off the host (CoreDNS forwards names outside the cluster to the host's resolver,
    which knows no route back to them); and the relay of the API server's port from HOST_ADDRESS to loopback,
    where it listens (the `kubernetes` Service's endpoint is there too: addons.yaml)."""
    bridge = nodes.bridge
    for command in (
        ["ip", "link", "add", bridge, "type", "bridge"],
        ["ip", "addr", "add", f"{HOST_ADDRESS}/{NETWORK.prefixlen}", "dev", bridge],
        ["ip", "link", "set", bridge, "up"],
    ):
        subprocess.run(command, check=True, capture_output=True)
    masquerade = f"""table ip {bridge} {{
        chain postrouting {{
            type nat hook postrouting priority srcnat; policy accept;
            ip saddr {NETWORK} oifname != "{bridge}" masquerade
        }}
    }}"""
    subprocess.run(["nft", "-f", "-"], input=masquerade, text=True, check=True, capture_output=True)
    for path in HOST_SYSCTLS:
        path.write_text("1")
    port = urlsplit(nodes.plane.server).port
    return spawn(["socat", f"TCP-LISTEN:{port},bind={HOST_ADDRESS},reuseaddr,fork", f"TCP:127.0.0.1:{port}"], relay_log)


def _node_network_up(node: RealNode, bridge: str) -> None:
    """The node's network namespace: eth0 at its address, a veth to the host's `bridge`, its default route through
    the host (which routes each node's pod subnet to it), forwarding on, and a table masquerading what its pods
    send off the pod network, as kindnetd does."""
    ns = node.netns
    host_end = f"{bridge}v{node.index}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    for command in (
        ["ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns],
        ["ip", "link", "set", host_end, "master", bridge, "up"],
        ["ip", "-n", ns, "addr", "add", f"{node.address}/{NETWORK.prefixlen}", "dev", "eth0"],
        ["ip", "-n", ns, "link", "set", "eth0", "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "route", "add", "default", "via", HOST_ADDRESS],
        ["ip", "route", "replace", node.pod_subnet, "via", node.address, "dev", bridge],
        [*_inside(ns), "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
    ):
        subprocess.run(command, check=True, capture_output=True)
    masquerade = f"""table ip realnode {{
        chain postrouting {{
            type nat hook postrouting priority srcnat; policy accept;
            ip saddr {node.pod_subnet} ip daddr != {POD_NETWORK} oifname "eth0" masquerade
        }}
    }}"""
    subprocess.run([*_inside(ns), "nft", "-f", "-"], input=masquerade, text=True, check=True, capture_output=True)


def _remove_cgroups(root: str) -> None:
    deadline = time.monotonic() + 30
    while _cgroup_dirs(root) and time.monotonic() < deadline:
        for directory in _cgroup_dirs(root):  # deepest first: rmdir needs empty children
            try:
                directory.rmdir()
            except OSError:
                time.sleep(0.2)  # its last task is still exiting


def _cgroup_dirs(root: str) -> list[Path]:
    """Every directory of the cgroup `root`, in every hierarchy, deepest first."""
    found = []
    for hierarchy in CGROUP_HIERARCHIES.iterdir():
        top = hierarchy / root.strip("/")
        if top.is_dir():
            found += [Path(d) for d, _, _ in os.walk(top)]
    return sorted(found, key=lambda d: len(d.parts), reverse=True)


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
    missing = [p for p in ("containerd", "ctr", "runc", "nft", "socat", "busybox", "nsenter") if not _on_path(p)]
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


def _containerd_root(workdir: Path) -> Path:
    return workdir / "containerd" / "root"


def _containerd_config(workdir: Path, pause_image: str) -> str:
    # restrict_oom_score_adj: the VM withholds CAP_SYS_RESOURCE, so no container may lower its OOM score below
    # containerd's own (the sandbox asks for -998); containerd clamps it, as it does when rootless.
    return f"""version = 2
root = "{_containerd_root(workdir)}"
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


def _cni_config(node: RealNode) -> dict:
    return {
        "cniVersion": "0.4.0",
        "name": "realnode",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "subnet": node.pod_subnet,
                    "dataDir": str(node.workdir / "ipam"),
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "loopback"},
        ],
    }


def _kubelet_config(plane: ControlPlane, node: RealNode) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This VM has cgroup v1 (with a v2 hierarchy beside it); v1.37 refuses v1 unless told.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": node.cgroup_root,
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,
        "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
        "address": node.address,
        "readOnlyPort": 0,
        "healthzPort": 0,
        # The API server's calls (logs, exec, port-forward) come with its client certificate (controlplane.py).
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(plane.client_ca)},
        },
        "authorization": {"mode": "Webhook"},
        "registerWithTaints": [dict(taint) for taint in node.pool.taints],
        "podLogsDir": str(node.workdir / "pod-logs"),
        "resolvConf": "/etc/resolv.conf",
        "clusterDNS": [DNS_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        # The disk and memory of a shared test machine are not this node's to defend.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
    }


def _kube_proxy_config(workdir: Path, node: RealNode) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "nftables",
        "hostnameOverride": node.name,
        "clientConnection": {"kubeconfig": str(workdir / "kube-proxy.kubeconfig")},
        "clusterCIDR": str(POD_NETWORK),
        "nodePortAddresses": ["primary"],
        # Zero: conntrack's table size and timeouts are the host's, not settable from the node's namespace.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def _addons(plane: ControlPlane, coredns: Image) -> str:
    """addons.yaml for this cluster: the service accounts of kube-proxy and the policy controller, the API
    server's endpoint at the host's address (relayed), CoreDNS as kube-dns."""
    return string.Template(ADDONS.read_text()).substitute(
        host_address=HOST_ADDRESS,
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


def _ready(plane: ControlPlane, name: str) -> bool:
    out = plane.kubectl("get", "node", name, "-o", "json", check=False)
    if out.returncode != 0:
        return False
    conditions = json.loads(out.stdout)["status"].get("conditions", ())
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
