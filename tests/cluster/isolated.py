"""A whole test cluster (control plane, KWOK, pod runner and every pod it runs: `python -m cluster.up`) in a
PID namespace of its own, so that it can be stopped whole as a datacenter goes dark: one SIGKILL to the
namespace's init, on which the kernel kills every process in it, with no chance to clean up. Its pod
network's namespaces go with their last process; what it wrote stays in `workdir`. Needs root
(`unshare --pid`), as tests/e2e's second cluster does (test_two_clusters.py).

    other = start_isolated(workdir)     # other.kubeconfig: its admin kubeconfig
    other.get("http://10.244.0.5:9090/metrics")   # from its node namespace, where its pod IPs are
    other.stop()                         # SIGKILL; returns once no process of it is left
    other.restart()                      # the same cluster again, on the data it left in `workdir`
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.pod_network import NODE, holders, http_get, namespace

TESTS = Path(__file__).resolve().parents[1]
READY_LINE = "export KUBECONFIG="
"""What `python -m cluster.up` prints once its cluster and pod runner run."""


@dataclass
class IsolatedCluster:
    process: subprocess.Popen
    """`unshare`, whose one child is the namespace's init (`python -m cluster.up`)."""
    workdir: Path
    kubeconfig: Path
    pid_namespace: str

    @property
    def init(self) -> int:
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return int(children[0])

    def node_holder(self) -> int:
        """The pid of the holder of its pod network's node namespace (for cluster_link.join)."""
        for pid, holder in holders():
            if holder.role == NODE and namespace(pid, "pid") == self.pid_namespace:
                return pid
        raise LookupError(f"no pod network's node namespace in the cluster of {self.workdir}")

    def get(self, url: str) -> str:
        """The body of an HTTP GET of `url` from its node namespace, where its pod IPs are reachable."""
        return http_get(["nsenter", f"--target={self.node_holder()}", "--net", "--"], url)

    def members(self) -> list[int]:
        """Every live process of the cluster (in its PID namespace)."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and namespace(entry.name, "pid") == self.pid_namespace:
                found.append(int(entry.name))
        return found

    def restart(self) -> None:
        """Starts the stopped cluster again on its own data, as a datacenter comes back after going dark: its
        etcd, certificates, tokens, kubeconfig, ports and nodes are those it had, so every object it held is
        there, and its pod runner restarts the pods on its nodes as kubelets do after a reboot. Links to other
        clusters went with its node namespace: join them again (cluster_link.join)."""
        again = start_isolated(self.workdir)
        self.process, self.kubeconfig, self.pid_namespace = again.process, again.kubeconfig, again.pid_namespace

    def stop(self) -> None:
        """SIGKILL to the namespace's init: the kernel kills every other process in the namespace. Returns once
        none is left."""
        if self.process.poll() is None:
            os.kill(self.init, signal.SIGKILL)
        self.process.wait(60)
        deadline = time.monotonic() + 60
        while self.members():
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of the stopped cluster left: {self.members()}")
            time.sleep(0.2)


def start_isolated(workdir: Path, timeout: float = 180.0) -> IsolatedCluster:
    """Starts `python -m cluster.up` in `workdir` in a PID (and mount, for its /proc) namespace of its own and
    returns once it runs: a new cluster, or, in the workdir of one that was stopped, that cluster again on its
    own data (cluster.up). `unshare --kill-child` takes the namespace down should this process die first."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "up.log"
    up = [sys.executable, "-m", "cluster.up", "--workdir", str(workdir)]
    seen = log.stat().st_size if log.exists() else 0
    with open(log, "ab") as out:
        process = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *up],
            cwd=workdir,
            env={**os.environ, "PYTHONPATH": str(TESTS)},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout

    def output() -> str:
        """What this start has written so far."""
        with open(log, "rb") as f:
            f.seek(seen)
            return f.read().decode(errors="replace")

    while READY_LINE not in output():
        if time.monotonic() > deadline or process.poll() is not None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(60)
            raise RuntimeError(f"the isolated cluster did not start; see {log}")
        time.sleep(0.5)
    line = next(x for x in output().splitlines() if x.startswith(READY_LINE))
    cluster = IsolatedCluster(process, workdir, Path(line.removeprefix(READY_LINE)), "")
    cluster.pid_namespace = namespace(cluster.init, "pid") or ""
    return cluster
