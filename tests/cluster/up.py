"""Starts the test cluster by hand (`make cluster-up`), with the pod runner, so that `kubectl apply` of a
DiLoCoJob (and `helm install` of charts/diloco) really runs: prints the kubeconfig, runs until Ctrl-C or
SIGTERM, then stops everything it started."""

from __future__ import annotations

import argparse
import logging
import signal
import tempfile
import threading
from pathlib import Path

from kubernetes import config as kube_config

from cluster.cluster import start_cluster
from cluster.pod_runner import PodRunner


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m cluster.up", description=__doc__)
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="state and logs (default: a new temporary directory); a cluster that ran there before starts again "
        "on its data",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="diloco-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = start_cluster(workdir, pod_runner=True)
    runner = PodRunner(kube_config.new_client_from_config(str(cluster.kubeconfig)), workdir / "pods")
    try:
        runner.start()
        print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
        print(f"# logs in {workdir / 'logs'}, pods in {workdir / 'pods'}; Ctrl-C stops the cluster", flush=True)
        stop.wait()
    finally:
        runner.stop()
        cluster.stop()


if __name__ == "__main__":
    main()
