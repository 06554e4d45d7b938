"""etcd and kube-apiserver on loopback from the binaries tests/cluster/build.sh caches: the one place that knows
how to start them. RBAC and the default admission chain are on, clients authenticate with static bearer
tokens (one per control-plane identity, see TOKENS), and service-account tokens are signed by a key made
here. On its own this is a store that validates objects and runs nothing; cluster.py adds the controllers,
the scheduler and KWOK's nodes on top.

Every process runs in its own session (process group) so that stopping kills everything it forked.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().parent / "build.sh"
ADMIN_TOKEN = "admin-token"
TOKENS = {
    # token: (user, groups); the user names are those the API server's bootstrap RBAC policy grants to.
    ADMIN_TOKEN: ("admin", "system:masters"),
    "kube-controller-manager-token": ("system:kube-controller-manager", ""),
    "kube-scheduler-token": ("system:kube-scheduler", ""),
    # KWOK stands in for every kubelet and the node lifecycle: it writes node and pod status everywhere.
    "kwok-token": ("kwok", "system:masters"),
}
KUBELET_CLIENT = ("kube-apiserver-kubelet-client", "system:masters")
"""Who the API server is to the kubelets of real nodes (logs, exec, port-forward): a client certificate signed by
the cluster's client CA, which realnode/node.py's kubelets trust, as kubeadm sets it up."""
BINARIES = ("etcd", "kube-apiserver", "kubectl")
PORTS = "ports.json"
SERVICE_CIDR = "10.96.0.0/16"


def pinned_version(name: str, script: Path = BUILD_SCRIPT) -> str:
    """A version pinned in a build script (e.g. build.sh's `K8S_VERSION`), read from it so it is written once."""
    match = re.search(rf"^{name}=(\S+)", script.read_text(), re.MULTILINE)
    if match is None:
        raise LookupError(f"{name} is not set in {script}")
    return match.group(1)


def binaries_dir(binaries: tuple[str, ...] = BINARIES) -> Path | None:
    """$DILOCO_CLUSTER_BIN, else the newest cached directory of symlinks that has every one of `binaries`."""
    named = os.environ.get("DILOCO_CLUSTER_BIN")
    cache = os.environ.get("DILOCO_CLUSTER_CACHE", os.path.expanduser("~/.cache/diloco-cluster"))
    candidates = [named] if named else sorted(glob.glob(f"{cache}/bin-*"), key=os.path.getmtime, reverse=True)
    for candidate in candidates:
        if candidate and all(os.access(Path(candidate, b), os.X_OK) for b in binaries):
            return Path(candidate)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kubeconfig(server: str, credentials: str | tuple[Path, Path], ca: Path, server_name: str = "") -> str:
    """A kubeconfig that trusts the API server's certificate (`ca`: its self-signed bundle) and sends
    `credentials`: a token, or a client certificate and its key. `server_name`, when the server's address is not
    one its certificate names (a relay's), is the name to check instead."""
    cluster = f"server: '{server}', certificate-authority: '{ca}'" + (
        f", tls-server-name: '{server_name}'" if server_name else ""
    )
    if isinstance(credentials, str):
        user = f"token: '{credentials}'"
    else:
        user = f"client-certificate: '{credentials[0]}', client-key: '{credentials[1]}'"
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: t, cluster: {{{cluster}}}}}]\n"
        f"users: [{{name: u, user: {{{user}}}}}]\n"
        "contexts: [{name: t, context: {cluster: t, user: u}}]\ncurrent-context: t\n"
    )


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A process in a new session, its output appended to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )


def stop_group(process: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM to the process's whole group, SIGKILL to it after `grace` s; returns once the leader is reaped
    and no member of the group is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        if not group_alive(process.pid):
            break
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(10)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class ControlPlane:
    bin: Path
    workdir: Path
    server: str
    admin_kubeconfig: Path
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def ca(self) -> Path:
        """The CA of the API server's self-signed serving certificate (what pods get as ca.crt)."""
        return self.workdir / "ca.crt"

    @property
    def client_ca(self) -> Path:
        """The CA whose client certificates the API server accepts (kubelets of real nodes authenticate so), and
        that those kubelets trust for the API server's own calls to them."""
        return self.workdir / "client-ca.crt"

    def client_certificate(self, user: str, group: str, name: str) -> tuple[Path, Path]:
        """A client certificate and key for `user` in `group`, signed by the client CA, as `name`.crt/.key."""
        return _signed(self.workdir, name, user, group)

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (cluster-admin through `system:masters`)."""
        return self.admin_kubeconfig

    def kubectl(
        self,
        *args: str,
        stdin: str | None = None,
        kubeconfig: Path | None = None,
        check: bool = True,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(self.bin / "kubectl"), "--kubeconfig", str(kubeconfig or self.admin_kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def token_kubeconfig(self, token: str, name: str) -> Path:
        path = self.workdir / f"kubeconfig-{name}"
        path.write_text(kubeconfig(self.server, token, self.ca))
        return path

    def service_account_token(self, namespace: str, name: str) -> str:
        return self.kubectl("-n", namespace, "create", "token", name, "--duration", "2h").stdout.strip()

    def service_account_kubeconfig(self, namespace: str, name: str) -> Path:
        return self.token_kubeconfig(self.service_account_token(namespace, name), f"{namespace}-{name}")

    def stop(self) -> None:
        """Stops every process, last started first, and their process groups with them."""
        for process in reversed(self.processes):
            stop_group(process)

    def leftovers(self) -> list[int]:
        """Process groups of this control plane that still have a live member (empty after `stop`)."""
        return [p.pid for p in self.processes if group_alive(p.pid)]


EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")
"""Certificates' keys: P-256, as fast to make as a cluster start should be."""


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _signed(workdir: Path, name: str, user: str, group: str) -> tuple[Path, Path]:
    """`name`.crt and .key in `workdir`: a client certificate for `user` (CN) in `group` (O) from the client CA."""
    key, request, cert = (workdir / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
    _openssl(
        "req", "-new", *EC_KEY, "-nodes", "-subj", f"/O={group}/CN={user}", "-keyout", str(key), "-out", str(request)
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(request),
        "-CA",
        str(workdir / "client-ca.crt"),
        "-CAkey",
        str(workdir / "client-ca.key"),
        "-CAcreateserial",
        "-days",
        "30",
        "-out",
        str(cert),
    )
    request.unlink()
    return cert, key


def _ready(server: str) -> bool:
    request = urllib.request.Request(f"{server}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    try:
        with urllib.request.urlopen(request, context=ssl._create_unverified_context(), timeout=2) as reply:
            return reply.read().strip() == b"ok"
    except OSError:
        return False


def ports(workdir: Path) -> tuple[int, int, int]:
    """etcd's client and peer ports and the API server's: free ones on a first start, kept in `workdir` for a
    restart on the same data, so that kubeconfigs stay valid and etcd's member keeps its peer URL."""
    path = workdir / PORTS
    if not path.exists():
        path.write_text(json.dumps([free_port(), free_port(), free_port()]))
    client, peer, secure = json.loads(path.read_text())
    return client, peer, secure


def start_control_plane(bin_dir: Path, workdir: Path, timeout: float = 120.0) -> ControlPlane:
    """Starts etcd and kube-apiserver in `workdir` and waits until the API server is ready. A workdir they
    ran in before, stopped or killed, is started again on its own data: etcd's, the API server's certificates,
    the service-account signing key, the ports."""
    if not (workdir / "client-ca.crt").exists():
        _openssl(
            "req",
            "-x509",
            *EC_KEY,
            "-nodes",
            "-days",
            "30",
            "-subj",
            "/CN=diloco-test-client-ca",
            "-keyout",
            str(workdir / "client-ca.key"),
            "-out",
            str(workdir / "client-ca.crt"),
        )
        _signed(workdir, "kubelet-client", *KUBELET_CLIENT)
    if not (workdir / "sa.key").exists():
        _openssl("genrsa", "-out", str(workdir / "sa.key"), "2048")
        _openssl("rsa", "-in", str(workdir / "sa.key"), "-pubout", "-out", str(workdir / "sa.pub"))
    (workdir / "tokens.csv").write_text(
        "".join(f'{token},{user},{user},"{groups}"\n' for token, (user, groups) in TOKENS.items())
    )
    client, peer, secure = ports(workdir)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    server = f"https://127.0.0.1:{secure}"
    plane = ControlPlane(bin_dir, workdir, server, workdir / "kubeconfig-admin")
    plane.admin_kubeconfig.write_text(kubeconfig(server, ADMIN_TOKEN, plane.ca))
    plane.processes.append(
        spawn(
            [
                str(bin_dir / "etcd"),
                "--name",
                "t",
                "--data-dir",
                str(workdir / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{client}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{client}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"t=http://127.0.0.1:{peer}",
                "--log-level",
                "error",
            ],
            logs / "etcd.log",
        )
    )
    plane.processes.append(
        spawn(
            [
                str(bin_dir / "kube-apiserver"),
                "--etcd-servers",
                f"http://127.0.0.1:{client}",
                "--secure-port",
                str(secure),
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
                # The `kubernetes` Service would point at 127.0.0.1, which Endpoints refuse: leave it without any.
                "--endpoint-reconciler-type",
                "none",
                "--cert-dir",
                str(workdir / "certs"),
                "--token-auth-file",
                str(workdir / "tokens.csv"),
                "--client-ca-file",
                str(workdir / "client-ca.crt"),
                # How it reaches real nodes' kubelets: by their address (they have no DNS name), with this client
                # certificate; their serving certificates are self-signed, as kubeadm's are by default.
                "--kubelet-preferred-address-types",
                "InternalIP,Hostname",
                "--kubelet-client-certificate",
                str(workdir / "kubelet-client.crt"),
                "--kubelet-client-key",
                str(workdir / "kubelet-client.key"),
                "--authorization-mode",
                "Node,RBAC",
                # The default admission chain (NamespaceLifecycle, ServiceAccount, PodSecurity, quotas, webhooks,
                # ...) plus NodeRestriction, and ExtendedResourceToleration as GKE runs it (GPU pods tolerate GPU
                # taints).
                "--enable-admission-plugins",
                "NodeRestriction,ExtendedResourceToleration",
                "--service-account-issuer",
                "https://kubernetes.default.svc",
                "--service-account-key-file",
                str(workdir / "sa.pub"),
                "--service-account-signing-key-file",
                str(workdir / "sa.key"),
                "--service-cluster-ip-range",
                SERVICE_CIDR,
            ],
            logs / "kube-apiserver.log",
        )
    )
    deadline = time.monotonic() + timeout
    while not _ready(server):
        if time.monotonic() > deadline or any(p.poll() is not None for p in plane.processes):
            plane.stop()
            raise RuntimeError(f"the API server did not become ready; logs in {logs}")
        time.sleep(0.5)
    # The API server writes its serving certificate followed by the CA that signed it.
    bundle = (workdir / "certs" / "apiserver.crt").read_text()
    plane.ca.write_text("-----BEGIN CERTIFICATE-----" + bundle.split("-----BEGIN CERTIFICATE-----")[-1])
    return plane
