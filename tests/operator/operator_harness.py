"""`diloco-operator` as a real process under its own ServiceAccount, with exactly the rights deploy/rbac.yaml
grants it: used by the API-server and cluster tiers and by bench/operator_scale.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import support
import yaml
from cluster.controlplane import ControlPlane, free_port
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "diloco-system"
SERVICE_ACCOUNT = "diloco-operator"


def install(plane: ControlPlane) -> Path:
    """The operator's namespace, ServiceAccount and RBAC (deploy/rbac.yaml) and its peering object
    (deploy/operator.yaml); returns a kubeconfig that authenticates as the ServiceAccount."""
    plane.kubectl(
        "apply",
        "-f",
        "-",
        stdin=yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}),
    )
    plane.kubectl("apply", "-f", str(ROOT / "deploy" / "rbac.yaml"))
    peering = [
        d
        for d in yaml.safe_load_all((ROOT / "deploy" / "operator.yaml").read_text())
        if d["kind"] == "ClusterKopfPeering"
    ]
    plane.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(peering))
    return plane.service_account_kubeconfig(NAMESPACE, SERVICE_ACCOUNT)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of Prometheus text named `name` that carry (at least) `labels`."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


class OperatorProcess:
    """One replica: `diloco-operator` with the ServiceAccount's kubeconfig, its log in `log`, watching every
    namespace unless `args` names some."""

    def __init__(self, kubeconfig: Path, log: Path, resync: float = 1.0, args: Sequence[str] = ()) -> None:
        self.kubeconfig, self.log, self.resync = kubeconfig, log, resync
        scoped = any(a in ("-n", "--namespace") or a.startswith("--namespace=") for a in args)
        self.args = [*([] if scoped else ["--all-namespaces"]), *args]
        self.process: subprocess.Popen | None = None
        self.metrics_port, self.liveness_port = free_port(), free_port()

    def start(self, timeout: float = 60) -> None:
        """Starts the process and returns once it serves metrics."""
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "POD_NAMESPACE": NAMESPACE,
            "PYTHONWARNINGS": "ignore",
            "DILOCO_LOG_LEVEL": "INFO",
        }
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "diloco.operator.main",
                    f"--resync-seconds={self.resync}",
                    f"--metrics-port={self.metrics_port}",
                    f"--liveness-port={self.liveness_port}",
                    "--probe-timeout=0.5",
                    *self.args,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        support.wait_until(lambda: self.metrics() is not None, timeout=timeout, interval=0.2)

    def stop(self) -> None:
        """SIGTERM, as a Deployment's rollout does; kopf says goodbye to its peers."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)

    def kill(self) -> None:
        """SIGKILL, as a lost node or an OOM kill does: no goodbye, no cleanup."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def metrics(self) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as reply:
                return reply.read().decode()
        except OSError:
            return None

    def metric(self, name: str, **labels: str) -> float | None:
        """The sum of the samples named `name` with `labels`, None when the process does not answer."""
        text = self.metrics()
        return None if text is None else metric_value(text, name, **labels)
