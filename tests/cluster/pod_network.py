"""The pod network of the test cluster, as a bridge CNI plugin makes it on a node: every pod the pod runner
runs gets a network namespace of its own, held by a pause process as a kubelet's pause container holds it,
whose `eth0` (one end of a veth pair, the other on a bridge) carries the pod's IP: status.podIP, which KWOK
hands out from its node's CIDR in nodes.POD_NETWORK. Pods reach each other across the bridge, on one subnet,
and Service ClusterIPs through GATEWAY, the bridge's address. Nothing else is routed: a pod reaches nothing
outside the test cluster, and an address it has no route to (the machine's DNS server, say) fails at once
rather than after a timeout.

The bridge is not on this machine's network but in a namespace made here, the *node namespace*, which
stands for the host network of every node at once: nothing is added to the shared machine's own network,
and two test clusters on it never see each other's pods. The `kubernetes` Service's ClusterIP
(KUBERNETES_SERVICE, which the API server's certificate names) is a local address there, where a relay
accepts and hands each connection over a Unix socket (which crosses network namespaces) to a thread outside
that connects to the API server on loopback. Probes and `PodRunner.get` run in the node namespace, so they
reach pod IPs as a kubelet does. Other Services resolve to their pods' IPs through each pod's /etc/hosts
(podspec.render_hosts), so no ClusterIP but the `kubernetes` one is needed.

NODE_NETWORK holds the node namespaces' own addresses on links between test clusters (cluster_link.py):
pods reach it through their gateway, as pods reach other clusters' nodes through their node, and the node
namespace serves NodePort Services there (node_ports.py).

A pod's namespace and its veth pair go when the pod does (`remove_pod`), all of them with the node
namespace (`stop`). Each namespace's holder is named for the process that owns the network (`Holder`), so
that a network left behind by a run that crashed is found when the next one starts and every process in it
killed (`remove_stale`); its namespaces, veths and bridge vanish with their last process.

Run as a module, this is the inside half of the relay: `python -m cluster.pod_network HOST:PORT UNIX_PATH`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cluster.controlplane import SERVICE_CIDR, stop_group
from cluster.nodes import POD_NETWORK

KUBERNETES_SERVICE = ("10.96.0.1", 443)
BRIDGE = "diloco0"
GATEWAY = "169.254.1.1"
"""The bridge's address and every pod's gateway to Service ClusterIPs: link-local, so it is no pod's IP (KWOK
hands out every address of a node's CIDR, the first included)."""
NODE_NETWORK = ipaddress.ip_network("10.79.0.0/24")
"""The node namespaces' addresses on links between test clusters: routed from every pod through GATEWAY."""
HOLDER_PREFIX = "diloco-pod-network"
NODE = "node"
"""The role of the node namespace's holder; a pod's holder has the pod's UID as its role."""


# --- pure: names and addresses ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """The process holding one namespace of a pod network: which process owns the network (its pid and its
    start time in clock ticks since boot, so a recycled pid is not taken for it) and which namespace this is
    (NODE, or a pod's UID). `name` is the holder's argv[0], `parse` reads it back from /proc."""

    owner_pid: int
    owner_start: int
    role: str

    @property
    def name(self) -> str:
        return f"{HOLDER_PREFIX}:{self.owner_pid}:{self.owner_start}:{self.role}"

    @classmethod
    def parse(cls, argv0: str) -> Holder | None:
        prefix, _, rest = argv0.partition(":")
        pid, _, rest = rest.partition(":")
        start, _, role = rest.partition(":")
        if prefix != HOLDER_PREFIX or not pid.isdigit() or not start.isdigit() or not role:
            return None
        return cls(int(pid), int(start), role)

    def stale(self, owner_start_now: int | None) -> bool:
        """Whether the owner is gone: no process has its pid now (None), or another one does."""
        return owner_start_now != self.owner_start


def holder_command(holder: Holder) -> list[str]:
    """A process that does nothing until killed, named `holder.name` for `remove_stale` to find."""
    return ["bash", "-c", 'exec -a "$0" sleep infinity', holder.name]


def veth_names(uid: str) -> tuple[str, str]:
    """(node end, pod end before it is renamed eth0) of a pod's veth pair: unique per pod, short enough for
    Linux's 15 characters."""
    digest = hashlib.sha256(uid.encode()).hexdigest()[:12]
    return f"dv{digest}", f"dp{digest}"


def node_setup() -> list[str]:
    """The node namespace's links and addresses: the bridge at GATEWAY routing POD_NETWORK, and the
    `kubernetes` Service's ClusterIP."""
    return [
        "ip link set lo up",
        f"ip link add {BRIDGE} type bridge",
        f"ip address add {GATEWAY}/32 dev {BRIDGE}",
        f"ip link set {BRIDGE} up",
        f"ip route add {POD_NETWORK} dev {BRIDGE} scope link src {GATEWAY}",
        f"ip address add {KUBERNETES_SERVICE[0]}/32 dev lo",
    ]


def attach(uid: str, holder_pid: int) -> list[str]:
    """In the node namespace: a pod's veth pair, its pod end moved into the namespace `holder_pid` holds."""
    node_end, pod_end = veth_names(uid)
    return [
        f"ip link add {node_end} type veth peer name {pod_end}",
        f"ip link set {pod_end} netns {holder_pid}",
        f"ip link set {node_end} master {BRIDGE} up",
    ]


def pod_setup(uid: str, ip: str) -> list[str]:
    """In a pod's namespace: loopback, `eth0` at the pod's IP on POD_NETWORK, Service ClusterIPs and NODE_NETWORK
    via GATEWAY."""
    _, pod_end = veth_names(uid)
    return [
        "ip link set lo up",
        f"ip link set {pod_end} name eth0",
        f"ip address add {ip}/{POD_NETWORK.prefixlen} dev eth0",
        "ip link set eth0 up",
        f"ip route add {GATEWAY} dev eth0 scope link",
        f"ip route add {SERVICE_CIDR} via {GATEWAY} dev eth0",
        f"ip route add {NODE_NETWORK} via {GATEWAY} dev eth0",
    ]


# --- the relay to the API server ----------------------------------------------------------------------------


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copies one direction; its end is passed on as a half-close, an error closes both sides."""
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        source.close()
        sink.close()


def relay(listener: socket.socket, connect: Callable[[], socket.socket], stop: threading.Event) -> None:
    """Accepts on `listener` until `stop`, joining each connection to a new one from `connect`."""
    listener.settimeout(0.5)
    while not stop.is_set():
        try:
            client, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        try:
            upstream = connect()
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


# --- processes and namespaces -------------------------------------------------------------------------------


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None when there is none."""
    try:
        # After the command's name in parentheses, the start time is the 20th field.
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def namespace(pid: int | str, kind: str) -> str | None:
    """The namespace of `kind` (net, pid, ...) process `pid` is in, None when there is no such process."""
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _net_namespace(pid: int | str) -> str | None:
    return namespace(pid, "net")


def _argv0(pid: int | str) -> str | None:
    """Process `pid`'s argv[0], None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return None


def _processes() -> Iterator[tuple[int, str]]:
    """(pid, argv[0]) of every process this user can see."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (argv0 := _argv0(entry.name)) is not None:  # None: it ended while we looked
            yield int(entry.name), argv0


def holders() -> Iterator[tuple[int, Holder]]:
    """(pid, what it holds) of every holder of a pod network's namespace this user can see."""
    for pid, argv0 in _processes():
        holder = Holder.parse(argv0)
        if holder is not None:
            yield pid, holder


def remove_stale() -> int:
    """Kills every process in the namespaces of pod networks whose owner is gone (a run that crashed, or was
    killed before it could stop its network), which takes those namespaces away; returns how many. A holder
    in another PID namespace (a cluster run whole in one: isolated.py) names its
    owner by a pid only that namespace knows: it is left to its own."""
    own, own_pids = _net_namespace("self"), namespace("self", "pid")
    stale: set[str] = set()
    for pid, holder in holders():
        if namespace(pid, "pid") == own_pids and holder.stale(process_start(holder.owner_pid)):
            held = _net_namespace(pid)
            if held not in (None, own):
                stale.add(held)
    killed = 0
    for pid, _ in _processes():
        if stale and _net_namespace(pid) in stale:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                continue
    return killed


@dataclass
class _Pod:
    holder: subprocess.Popen
    ip: str


class PodNetwork:
    """`start` makes the node namespace, its bridge and the relay to the API server at `api_server`
    (https://host:port); `add_pod` and `remove_pod` make and take away a pod's namespace; `enter` and
    `enter_pod` wrap a command to run in the node's or a pod's namespace; `stop` ends everything started
    here."""

    def __init__(self, workdir: Path, api_server: str) -> None:
        self.workdir = workdir
        url = urllib.parse.urlsplit(api_server)
        self.api = (url.hostname or "127.0.0.1", url.port or 443)
        self.socket_path = workdir / "kubernetes.sock"
        self.processes: list[subprocess.Popen] = []
        self.pods: dict[str, _Pod] = {}
        self._owner = (os.getpid(), process_start(os.getpid()) or 0)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]

    def _nsenter(self, pid: int, command: Sequence[str]) -> list[str]:
        user = ["--user", "--preserve-credentials"] if self._user else []
        return ["nsenter", f"--target={pid}", "--net", *user, "--", *command]

    def enter(self, command: Sequence[str]) -> list[str]:
        """`command` run in the node namespace (through its user namespace when not root)."""
        return self._nsenter(self.processes[0].pid, command)

    def enter_pod(self, uid: str, command: Sequence[str]) -> list[str]:
        """`command` run in the namespace of pod `uid` (added first)."""
        return self._nsenter(self.pods[uid].holder.pid, command)

    def _holder(self, role: str) -> Holder:
        return Holder(*self._owner, role)

    def _run(self, command: Sequence[str], what: str) -> None:
        """Runs `command`; a failure is an OSError naming `what`, with the command's own words."""
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise OSError(f"{what}: {result.stderr.strip()[-400:]}")

    def start(self) -> None:
        """Removes stale networks, makes the node namespace and the relay; on any failure stops what it
        started and raises."""
        try:
            remove_stale()
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        holder = subprocess.Popen(
            ["unshare", *self._user, "--net", "--", *holder_command(self._holder(NODE))],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        self.processes.append(holder)
        _wait_for_holder(holder, self._holder(NODE), "the node namespace (unshare --net)")
        self._run(self.enter(["sh", "-c", " && ".join(node_setup())]), "the node namespace's bridge")
        outside = socket.socket(socket.AF_UNIX)
        self.socket_path.unlink(missing_ok=True)  # left by a run that was killed, in a workdir started again
        outside.bind(str(self.socket_path))
        outside.listen(64)
        thread = threading.Thread(
            target=relay,
            args=(outside, lambda: socket.create_connection(self.api), self._stop),
            name="kubernetes-relay",
            daemon=True,
        )
        thread.start()
        self._threads.append(thread)
        tests = Path(__file__).resolve().parents[1]
        host, port = KUBERNETES_SERVICE
        self.processes.append(
            subprocess.Popen(
                self.enter([sys.executable, "-m", "cluster.pod_network", f"{host}:{port}", str(self.socket_path)]),
                env={**os.environ, "PYTHONPATH": str(tests)},
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        )
        probe = f"import socket; socket.create_connection(('{host}', {port}), timeout=1).close()"
        deadline = time.monotonic() + 30
        while subprocess.run(self.enter([sys.executable, "-c", probe]), capture_output=True).returncode != 0:
            if time.monotonic() > deadline or self.processes[1].poll() is not None:
                raise RuntimeError("the relay to the API server did not come up in the node namespace")
            time.sleep(0.2)

    def add_pod(self, uid: str, ip: str) -> None:
        """Gives pod `uid` its namespace with `eth0` at `ip` on the bridge (nothing when it has one); an
        OSError when that fails, with nothing of it left."""
        if uid in self.pods:
            return
        holder = subprocess.Popen(
            self.enter(["unshare", "--net", "--", *holder_command(self._holder(uid))]),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        self.pods[uid] = _Pod(holder, ip)
        try:
            _wait_for_holder(holder, self._holder(uid), f"pod {uid}'s namespace")
            self._run(self.enter(["sh", "-c", " && ".join(attach(uid, holder.pid))]), f"pod {uid}'s veth")
            self._run(self.enter_pod(uid, ["sh", "-c", " && ".join(pod_setup(uid, ip))]), f"pod {uid}'s eth0")
        except BaseException:
            self.remove_pod(uid)
            raise

    def add_address(self, ip: str) -> None:
        """Gives the node namespace one more address of its own (a load balancer's ingress IP); nothing when
        it has it."""
        result = subprocess.run(self.enter(["ip", "address", "replace", f"{ip}/32", "dev", "lo"]), capture_output=True)
        if result.returncode != 0:
            raise OSError(f"address {ip} in the node namespace: {result.stderr.decode().strip()[-400:]}")

    def remove_pod(self, uid: str) -> None:
        """Takes pod `uid`'s veth pair and namespace away (its processes should be gone first)."""
        pod = self.pods.pop(uid, None)
        if pod is None:
            return
        node_end, _ = veth_names(uid)
        subprocess.run(self.enter(["ip", "link", "delete", node_end]), capture_output=True)
        stop_group(pod.holder, grace=1)

    def stop(self) -> None:
        for uid in list(self.pods):
            self.remove_pod(uid)
        self._stop.set()
        for process in reversed(self.processes):
            stop_group(process, grace=5)
        for thread in self._threads:
            thread.join(5)

    def leftovers(self) -> list[int]:
        processes = [*self.processes, *(pod.holder for pod in self.pods.values())]
        return [p.pid for p in processes if p.poll() is None]


def http_get(enter: Sequence[str], url: str) -> str:
    """The body of an HTTP GET of `url` from the namespace `enter` (an nsenter prefix, `PodNetwork.enter([])`)
    leads into; an OSError when it fails."""
    fetch = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
    command = [*enter, sys.executable, "-c", fetch, url]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/")
    if result.returncode != 0:
        raise OSError(f"GET {url} in the node namespace failed: {result.stderr.strip()[-400:]}")
    return result.stdout


def _wait_for_holder(holder: subprocess.Popen, expected: Holder, what: str) -> None:
    """Waits until process `holder` runs as the holder `expected` names: it has then entered the node
    namespace (a pod's holder, through nsenter), unshared its own and exec'd. A namespace that merely differs
    from the node's is no sign of it: a pod's holder starts in this process's own namespace, and one moved a
    veth into it there, or into the node's, before its unshare (eth0 in the node namespace, the pod with no
    route: "Network is unreachable")."""
    deadline = time.monotonic() + 10
    while _argv0(holder.pid) != expected.name:
        if time.monotonic() > deadline or holder.poll() is not None:
            raise OSError(f"could not make {what}")
        time.sleep(0.01)


def main(argv: Sequence[str]) -> None:
    """In the node namespace: accept on HOST:PORT, relay every connection to the Unix socket UNIX_PATH."""
    host, port = argv[0].rsplit(":", 1)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, int(port)))
    listener.listen(64)

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.connect(argv[1])
        return s

    relay(listener, connect, threading.Event())


if __name__ == "__main__":
    main(sys.argv[1:])
