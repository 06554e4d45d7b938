"""A real control plane for the operator's API-server tests: etcd and kube-apiserver (RBAC on, static
admin token, service-account tokens signed by a key of our own) from the binaries tests/cluster/build.sh
caches, plus kubectl. No controllers, scheduler or nodes: objects are stored and validated, nothing runs.
"""

from __future__ import annotations

import glob
import os
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ADMIN_TOKEN = "admin-token"
BINARIES = ("etcd", "kube-apiserver", "kubectl")


def binaries_dir() -> Path | None:
    """$DILOCO_CLUSTER_BIN, else the newest cached directory of symlinks that has every binary."""
    named = os.environ.get("DILOCO_CLUSTER_BIN")
    cache = os.environ.get("DILOCO_CLUSTER_CACHE", os.path.expanduser("~/.cache/diloco-cluster"))
    candidates = [named] if named else sorted(glob.glob(f"{cache}/bin-*"), key=os.path.getmtime, reverse=True)
    for candidate in candidates:
        if candidate and all(os.access(Path(candidate, b), os.X_OK) for b in BINARIES):
            return Path(candidate)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kubeconfig(server: str, token: str) -> str:
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: t, cluster: {{server: '{server}', insecure-skip-tls-verify: true}}}}]\n"
        f"users: [{{name: u, user: {{token: '{token}'}}}}]\n"
        "contexts: [{name: t, context: {cluster: t, user: u}}]\ncurrent-context: t\n"
    )


@dataclass
class ControlPlane:
    bin: Path
    workdir: Path
    server: str
    admin_kubeconfig: Path
    processes: list[subprocess.Popen]

    def kubectl(self, *args: str, stdin: str | None = None, kubeconfig: Path | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(self.bin / "kubectl"), "--kubeconfig", str(kubeconfig or self.admin_kubeconfig), *args],
            input=stdin, capture_output=True, text=True, timeout=60,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def service_account_kubeconfig(self, namespace: str, name: str) -> Path:
        token = self.kubectl("-n", namespace, "create", "token", name, "--duration", "2h").stdout.strip()
        path = self.workdir / f"kubeconfig-{namespace}-{name}"
        path.write_text(kubeconfig(self.server, token))
        return path

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def _ready(server: str) -> bool:
    request = urllib.request.Request(f"{server}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    try:
        with urllib.request.urlopen(request, context=ssl._create_unverified_context(), timeout=2) as reply:
            return reply.read().strip() == b"ok"
    except OSError:
        return False


def start(bin_dir: Path, workdir: Path, timeout: float = 120.0) -> ControlPlane:
    """Starts etcd and kube-apiserver in `workdir` and waits until the API server is ready."""
    subprocess.run(["openssl", "genrsa", "-out", str(workdir / "sa.key"), "2048"], check=True, capture_output=True)
    subprocess.run(["openssl", "rsa", "-in", str(workdir / "sa.key"), "-pubout", "-out", str(workdir / "sa.pub")],
                   check=True, capture_output=True)
    (workdir / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin,"system:masters"\n')
    client, peer, secure = free_port(), free_port(), free_port()
    logs = workdir / "logs"
    logs.mkdir()
    processes = [
        subprocess.Popen(
            [str(bin_dir / "etcd"), "--name", "t", "--data-dir", str(workdir / "etcd"),
             "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls",
             f"http://127.0.0.1:{client}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--log-level", "error"],
            stdout=open(logs / "etcd.log", "w"), stderr=subprocess.STDOUT,
        )
    ]
    processes.append(
        subprocess.Popen(
            [str(bin_dir / "kube-apiserver"), "--etcd-servers", f"http://127.0.0.1:{client}",
             "--secure-port", str(secure), "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
             "--endpoint-reconciler-type", "none", "--cert-dir", str(workdir / "certs"),
             "--token-auth-file", str(workdir / "tokens.csv"), "--authorization-mode", "RBAC",
             "--service-account-issuer", "https://kubernetes.default.svc",
             "--service-account-key-file", str(workdir / "sa.pub"),
             "--service-account-signing-key-file", str(workdir / "sa.key"),
             "--service-cluster-ip-range", "10.96.0.0/16"],
            stdout=open(logs / "kube-apiserver.log", "w"), stderr=subprocess.STDOUT,
        )
    )
    server = f"https://127.0.0.1:{secure}"
    plane = ControlPlane(bin_dir, workdir, server, workdir / "kubeconfig-admin", processes)
    plane.admin_kubeconfig.write_text(kubeconfig(server, ADMIN_TOKEN))
    deadline = time.monotonic() + timeout
    while not _ready(server):
        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
            plane.stop()
            raise RuntimeError(f"the API server did not become ready; logs in {logs}")
        time.sleep(0.5)
    return plane
