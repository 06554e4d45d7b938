"""The pod network of the test cluster: one network namespace, made here, shared by every pod the pod runner
runs. Pod IPs (nodes.POD_NETWORK, handed out by KWOK) are local addresses in it, so a process binds and is
reached at its pod's real IP, and nothing a pod sends leaves it; the `kubernetes` Service's ClusterIP
(KUBERNETES_SERVICE, which the API server's certificate names) leads to the API server through a relay: a
process inside the namespace accepts there and hands each connection over a Unix socket (which crosses
network namespaces) to a thread outside that connects to the API server on loopback.

Pods share the namespace's ports, so a pod's process must bind its own IP rather than 0.0.0.0
(pod_runner.BIND_ENV).

Run as a module, this is the inside half of the relay: `python -m cluster.podnet HOST:PORT UNIX_PATH`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path

from cluster.controlplane import stop_group
from cluster.nodes import POD_NETWORK

KUBERNETES_SERVICE = ("10.96.0.1", 443)


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


class PodNetwork:
    """`start` makes the namespace and the relay to the API server at `api_server` (https://host:port);
    `enter` wraps a command to run inside; `stop` ends everything started here."""

    def __init__(self, workdir: Path, api_server: str) -> None:
        self.workdir = workdir
        url = urllib.parse.urlsplit(api_server)
        self.api = (url.hostname or "127.0.0.1", url.port or 443)
        self.socket_path = workdir / "kubernetes.sock"
        self.processes: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]

    def enter(self, command: Sequence[str]) -> list[str]:
        """`command` run inside the namespace (through its user namespace when not root)."""
        holder = self.processes[0].pid
        user = ["--user", "--preserve-credentials"] if self._user else []
        return ["nsenter", f"--target={holder}", "--net", *user, "--", *command]

    def start(self) -> None:
        """Makes the namespace and the relay; on any failure stops what it started and raises."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        holder = subprocess.Popen(
            ["unshare", *self._user, "--net", "--", "sleep", "infinity"],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        self.processes.append(holder)
        own = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{holder.pid}/ns/net") == own:
            if time.monotonic() > deadline or holder.poll() is not None:
                raise RuntimeError("could not make a network namespace for the pods (unshare --net)")
            time.sleep(0.01)
        host, port = KUBERNETES_SERVICE
        subprocess.run(
            self.enter(
                [
                    "sh",
                    "-c",
                    f"ip link set lo up && ip route add local {POD_NETWORK} dev lo && ip address add {host}/32 dev lo",
                ]
            ),
            check=True,
            capture_output=True,
        )
        outside = socket.socket(socket.AF_UNIX)
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
        self.processes.append(
            subprocess.Popen(
                self.enter([sys.executable, "-m", "cluster.podnet", f"{host}:{port}", str(self.socket_path)]),
                env={**os.environ, "PYTHONPATH": str(tests)},
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        )
        probe = f"import socket; socket.create_connection(('{host}', {port}), timeout=1).close()"
        deadline = time.monotonic() + 30
        while subprocess.run(self.enter([sys.executable, "-c", probe]), capture_output=True).returncode != 0:
            if time.monotonic() > deadline or self.processes[1].poll() is not None:
                raise RuntimeError("the relay to the API server did not come up in the pod network")
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        for process in reversed(self.processes):
            stop_group(process, grace=5)
        for thread in self._threads:
            thread.join(5)

    def leftovers(self) -> list[int]:
        return [p.pid for p in self.processes if p.poll() is None]


def main(argv: Sequence[str]) -> None:
    """Inside the namespace: accept on HOST:PORT, relay every connection to the Unix socket UNIX_PATH."""
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
