"""Islands behind shaped links on one machine: each island in a network namespace of its own, joined by a veth
pair to a bridge in a hub namespace, with a token bucket (`tc` tbf) on both ends of the pair, so every byte an
island sends or receives crosses its own link at the link's rate. The syncers stay on the host's loopback;
the delay proxy listens in the hub (`listen`) and relays to them. Islands reach one another across the bridge
(data-parallel's all-reduce), and nothing is created outside the namespaces made here, all deleted on exit.
Needs root (CAP_NET_ADMIN) and iproute2: `check_available` says so up front where they are missing.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import socket
import subprocess
from pathlib import Path
from types import TracebackType

from diloco.local.wan import Link, tbf

HUB_ADDRESS = "10.77.0.1"
"""The bridge's address in the hub namespace, where islands find the syncers (through the delay proxy)."""
ISLAND_DEVICE = "eth0"
"""An island's end of its link, inside its namespace: the interface its gloo traffic must use."""
_PREFIX = 24
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = Path("/var/run/netns")
_sequence = itertools.count()


class WanUnavailable(OSError):
    """This machine cannot build the links: not root, no iproute2, or namespaces forbidden (a container)."""


def island_address(island: int) -> str:
    """An island's address on the hub's bridge."""
    if not 0 <= island < 240:
        raise ValueError(f"a shaped run has at most 240 islands, got island {island}")
    return f"10.77.0.{10 + island}"


def _ip(*args: str, namespace: str | None = None) -> None:
    argv = ["ip", *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise WanUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")


def _tc(namespace: str, device: str, mbps: float) -> None:
    argv = ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf(mbps).tc_args()]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise WanUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")


def check_available() -> None:
    """Raises WanUnavailable, saying why, where network namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise WanUnavailable("shaped links need network namespaces, which need root (CAP_NET_ADMIN)")
    with IslandNetwork(1, Link(mbps=1.0)) as network:
        network.shape()


class IslandNetwork:
    """The namespaces and links of `islands` islands, made on entry and deleted on exit (also after a failure
    part-way through making them)."""

    def __init__(self, islands: int, link: Link) -> None:
        tag = f"diloco-{os.getpid()}-{next(_sequence)}"
        self.link = link
        self.hub = f"{tag}-hub"
        self.islands = [f"{tag}-i{i}" for i in range(islands)]
        self._made: list[str] = []
        self.shaped = False

    def namespace(self, island: int) -> str:
        return self.islands[island]

    def command(self, island: int, argv: list[str]) -> list[str]:
        """`argv` run inside the island's namespace (the same process: `ip netns exec` execs it)."""
        return ["ip", "netns", "exec", self.islands[island], *argv]

    def __enter__(self) -> IslandNetwork:
        try:
            self._add_namespace(self.hub)
            _ip("link", "add", "br0", "type", "bridge", namespace=self.hub)
            _ip("addr", "add", f"{HUB_ADDRESS}/{_PREFIX}", "dev", "br0", namespace=self.hub)
            _ip("link", "set", "br0", "up", namespace=self.hub)
            for island, name in enumerate(self.islands):
                self._add_island(island, name)
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("link", "set", "lo", "up", namespace=name)

    def _add_island(self, island: int, name: str) -> None:
        """The island's namespace and its veth pair: `eth0` inside, `i<n>` on the hub's bridge."""
        self._add_namespace(name)
        hub_end = f"i{island}"
        _ip("link", "add", ISLAND_DEVICE, "netns", name, "type", "veth", "peer", "name", hub_end, "netns", self.hub)
        _ip("addr", "add", f"{island_address(island)}/{_PREFIX}", "dev", ISLAND_DEVICE, namespace=name)
        _ip("link", "set", ISLAND_DEVICE, "up", namespace=name)
        _ip("link", "set", hub_end, "master", "br0", "up", namespace=self.hub)

    def shape(self) -> None:
        """Holds every island's link to its rate from now on, both ways: tbf on the island's end (its upload)
        and on the hub's (its download). Until then the links run at memory speed."""
        if self.link.mbps is not None and not self.shaped:
            for island, name in enumerate(self.islands):
                _tc(name, ISLAND_DEVICE, self.link.mbps)
                _tc(self.hub, f"i{island}", self.link.mbps)
        self.shaped = True

    def listen(self, port: int) -> socket.socket:
        """A listening TCP socket on the hub's bridge at `port`, made inside the hub namespace from this thread
        (a socket keeps the namespace it was made in), for the delay proxy that serves it from the host."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/thread-self/ns/net") as own, open(_NETNS_DIR / self.hub) as hub:
            if libc.setns(hub.fileno(), _CLONE_NEWNET) != 0:
                raise WanUnavailable(ctypes.get_errno(), f"cannot enter the namespace {self.hub}")
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((HUB_ADDRESS, port))
                sock.listen(64)
            finally:
                if libc.setns(own.fileno(), _CLONE_NEWNET) != 0:
                    raise WanUnavailable(ctypes.get_errno(), "cannot return to this process's network namespace")
        return sock

    def close(self) -> None:
        """Deletes every namespace made (their veths, bridge and qdiscs go with them)."""
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
