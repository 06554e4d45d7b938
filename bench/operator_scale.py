"""Operator reconcile time at scale (DESIGN.md section 7): on the simulated cluster (tests/cluster: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler and KWOK nodes, so 800 pods are cheap), the time from
`kubectl apply` of a DiLoCoJob with 100 islands of 8 pods to every child present and the job's status
current (observedGeneration == generation, all 100 islands counted with their desired pods), with the
number of API calls the operator made meanwhile.

API calls are counted by the API server itself: a FlowSchema classifies every request of the operator's
ServiceAccount (kopf's watches, patches, Events and peering included) and the API server's
`apiserver_flowcontrol_dispatched_requests_total` counts them; the operator's own
`diloco_operator_api_requests_total` gives the reconcile passes' share by verb.

Measured in the same run, on the same cluster:
- the same pass for a 1-island job, so that the cost per island shows;
- the baseline: `kubectl apply --server-side` of the very objects the operator renders for the 100-island job
  (what a person or a CD tool creating them without an operator would wait for), under a ServiceAccount
  of its own, counted the same way.
Also printed: how long until the 800 pods are Ready and the status says so, and the cost of one
steady-state pass over the running job. Writes out/bench/operator_scale.png.

    python bench/operator_scale.py [--islands 100] [--pods 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "operator")]

import figures  # noqa: E402
import yaml  # noqa: E402
from cluster.cluster import Cluster, MissingBinaries, start_cluster  # noqa: E402
from cluster.nodes import Pool  # noqa: E402
from kubernetes import config as kube_config  # noqa: E402
from operator_harness import NAMESPACE, SERVICE_ACCOUNT, OperatorProcess, install, metric_value  # noqa: E402

from diloco.api.job import DiLoCoJobSpec  # noqa: E402
from diloco.operator import naming  # noqa: E402
from diloco.operator.children import Scale, render_children  # noqa: E402
from diloco.operator.job_tls import job_tls  # noqa: E402
from diloco.operator.kube import Kube  # noqa: E402
from diloco.operator.tokens import JobTokens, ca_key  # noqa: E402

OUT = ROOT / "out" / "bench"
PODS_PER_NODE = 110
BASELINE_ACCOUNT = "bench-kubectl"
IMAGE = "bench.invalid/diloco-trainer-kwok:bench"
"""No pod runner here, and none would pick this image: KWOK alone makes the pods Running and Ready."""


def flow_schema(name: str, account: str, precedence: int) -> dict[str, Any]:
    """A FlowSchema matching every request of one ServiceAccount, so the API server counts them apart."""
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": name},
        "spec": {
            "matchingPrecedence": precedence,
            "priorityLevelConfiguration": {"name": "workload-high"},
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [
                {
                    "subjects": [
                        {"kind": "ServiceAccount", "serviceAccount": {"name": account, "namespace": NAMESPACE}}
                    ],
                    "resourceRules": [
                        {
                            "verbs": ["*"],
                            "apiGroups": ["*"],
                            "resources": ["*"],
                            "clusterScope": True,
                            "namespaces": ["*"],
                        }
                    ],
                    "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                }
            ],
        },
    }


def dispatched(cluster: Cluster, schema: str) -> float:
    """Requests the API server has dispatched for `schema` so far."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    return metric_value(text, "apiserver_flowcontrol_dispatched_requests_total", flow_schema=schema)


def job_spec(islands: int, pods: int) -> dict[str, Any]:
    return {
        "image": IMAGE,
        "training": {"innerSteps": 20, "fragments": 2, "overlapSteps": 1},
        "syncer": {"shards": 2},
        "islands": [
            {"name": f"i{k:03d}", "replicas": pods, "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}
            for k in range(islands)
        ],
    }


def manifest(name: str, spec: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {"apiVersion": "diloco.dev/v1alpha1", "kind": "DiLoCoJob", "metadata": {"name": name}, "spec": spec}
    )


def expected_children(spec: dict[str, Any]) -> int:
    """ConfigMap, Secret, NetworkPolicy; Service, Deployment and PVC per shard; Service and StatefulSet per island."""
    return 3 + 3 * spec["syncer"]["shards"] + 2 * len(spec["islands"])


def children(kube: Kube, namespace: str, job: str) -> int:
    kinds = ("ConfigMap", "Secret", "NetworkPolicy", "PersistentVolumeClaim", "Service", "Deployment", "StatefulSet")
    return sum(len(kube.list(kind, namespace, naming.job_selector(job))) for kind in kinds)


def status_current(job: dict[str, Any] | None, islands: int, pods: int) -> bool:
    status = (job or {}).get("status") or {}
    return bool(status) and (
        status.get("observedGeneration") == job["metadata"]["generation"]
        and len(status.get("islands") or []) == islands
        and all(i.get("desired") == pods for i in status["islands"])
        and str(status.get("islandsReady", "")).endswith(f"/{islands}")
    )


def poll(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout} s")
        time.sleep(interval)
    return value


@dataclass
class Measure:
    label: str
    seconds: float
    calls: float
    pass_calls: float = 0.0


class Bench:
    def __init__(self, cluster: Cluster, operator: OperatorProcess) -> None:
        self.cluster, self.operator = cluster, operator
        self.kube = Kube(kube_config.new_client_from_config(str(cluster.admin_kubeconfig)))

    def operator_calls(self) -> tuple[float, float]:
        """(every request of the operator's ServiceAccount, the reconcile passes' own). The passes' count is
        read first: a pass under way may add calls between the two reads, and those then count in both."""
        passes = self.operator.metric("diloco_operator_api_requests_total") or 0.0
        return dispatched(self.cluster, "bench-operator"), passes

    def converge(self, name: str, islands: int, pods: int) -> Measure:
        """Applies a job and times it until every child exists and the status is current."""
        spec = job_spec(islands, pods)
        self.cluster.kubectl("create", "namespace", name)
        before = self.operator_calls()
        started = time.monotonic()
        self.cluster.kubectl("-n", name, "apply", "-f", "-", stdin=manifest(name, spec))
        poll(
            lambda: status_current(self.kube.get("DiLoCoJob", name, name), islands, pods),
            300,
            f"{name}: status current",
        )
        poll(lambda: children(self.kube, name, name) == expected_children(spec), 60, f"{name}: every child")
        seconds = time.monotonic() - started
        after = self.operator_calls()
        return Measure(
            f"operator\n{islands} island{'s' * (islands > 1)}", seconds, after[0] - before[0], after[1] - before[1]
        )

    def all_ready(self, name: str, islands: int, pods: int) -> float:
        """Seconds until the status counts every island ready (every pod scheduled, Running and Ready)."""
        started = time.monotonic()
        poll(
            lambda: (
                ((self.kube.get("DiLoCoJob", name, name) or {}).get("status") or {}).get("islandsReady")
                == f"{islands}/{islands}"
            ),
            600,
            f"{name}: every island ready",
            interval=1.0,
        )
        return time.monotonic() - started

    def steady_pass(self, passes: int = 2) -> tuple[float, float]:
        """(API calls, seconds) of one timer pass over the running job, averaged over `passes` passes."""

        def totals() -> tuple[float, float, float]:
            text = self.operator.metrics() or ""
            return (
                metric_value(text, "diloco_operator_reconciles_total", trigger="timer", result="ok"),
                metric_value(text, "diloco_operator_api_requests_total"),
                metric_value(text, "diloco_operator_reconcile_seconds_sum"),
            )

        start = totals()
        poll(lambda: totals()[0] >= start[0] + passes, 120, "steady-state passes", interval=0.5)
        end = totals()
        done = end[0] - start[0]
        return (end[1] - start[1]) / done, (end[2] - start[2]) / done

    def delete(self, name: str) -> None:
        """The job first (the operator stands back, the garbage collector takes its children), then its
        namespace: deleting the namespace alone removes the pods under a live job, which reads as failures."""
        self.cluster.kubectl("-n", name, "delete", "dj", name, "--wait=true", timeout=300)
        self.cluster.kubectl("delete", "namespace", name, "--wait=true", timeout=300)

    def kubectl_baseline(self, islands: int, pods: int, kubeconfig: Path) -> Measure:
        """`kubectl apply --server-side` of the objects the operator renders for the same job."""
        name = "baseline"
        self.cluster.kubectl("create", "namespace", name)
        spec = DiLoCoJobSpec.model_validate(job_spec(islands, pods))
        job = naming.JobRef(name=name, namespace=name, uid="none")
        objects = render_children(
            job,
            spec,
            JobTokens.only("token"),
            Scale(islands={i.name: i.replicas for i in spec.islands}, syncers=1),
            None,
            tls=job_tls(job, spec, None, {}, datetime.datetime.now(datetime.UTC), ca_key=ca_key(os.urandom(32), job)),
        )
        for obj in objects:
            obj["metadata"].pop("ownerReferences", None)
        before = dispatched(self.cluster, "bench-kubectl")
        started = time.monotonic()
        self.cluster.kubectl(
            "-n",
            name,
            "apply",
            "--server-side",
            "-f",
            "-",
            kubeconfig=kubeconfig,
            stdin=yaml.safe_dump_all(objects),
            timeout=300,
        )
        seconds = time.monotonic() - started
        assert children(self.kube, name, name) == len(objects) == expected_children(job_spec(islands, pods))
        return Measure(
            f"kubectl apply --server-side\n{islands} islands' objects",
            seconds,
            dispatched(self.cluster, "bench-kubectl") - before,
        )


def plot(measures: list[Measure], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [m.label for m in measures]
    colors = ["tab:blue", "tab:blue", "tab:gray"][: len(measures)]
    left.bar(labels, [m.seconds for m in measures], color=colors)
    left.set_ylabel("seconds: apply to children present and status current")
    right.bar(labels, [m.calls for m in measures], color=colors)
    right.set_ylabel("API calls (API server's count)")
    for axis in (left, right):
        axis.tick_params(axis="x", labelsize=8)
    fig.suptitle("diloco operator at scale on the KWOK cluster (same run)")
    figures.save(fig, path)


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args.add_argument("--islands", type=int, default=100)
    args.add_argument("--pods", type=int, default=8, help="pods per island")
    args.add_argument("--resync-seconds", type=float, default=10.0, help="the operator's timer (its default)")
    opts = args.parse_args()

    total = opts.islands * opts.pods
    nodes = -(-total // (PODS_PER_NODE - 10)) + 1
    pool = Pool("bench", nodes, "n2-standard-64", {"cpu": "64", "memory": "256Gi", "pods": str(PODS_PER_NODE)})
    workdir = Path(tempfile.mkdtemp(prefix="operator-scale-"))
    print(f"starting the cluster ({nodes} KWOK nodes) in {workdir}", flush=True)
    try:
        cluster = start_cluster(workdir, pools=(pool,))
    except MissingBinaries as error:
        sys.exit(f"operator_scale: {error}")
    operator = None
    try:
        cluster.kubectl(
            "apply",
            "--server-side",
            "-f",
            str(ROOT / "deploy" / "crd.yaml"),
            "-f",
            str(ROOT / "deploy" / "peering-crds.yaml"),
        )
        cluster.kubectl("wait", "--for", "condition=established", "--timeout", "60s", "crd/dilocojobs.diloco.dev")
        kubeconfig = install(cluster)
        cluster.kubectl("-n", NAMESPACE, "create", "serviceaccount", BASELINE_ACCOUNT)
        cluster.kubectl(
            "create",
            "clusterrolebinding",
            BASELINE_ACCOUNT,
            "--clusterrole=cluster-admin",
            f"--serviceaccount={NAMESPACE}:{BASELINE_ACCOUNT}",
        )
        baseline_kubeconfig = cluster.service_account_kubeconfig(NAMESPACE, BASELINE_ACCOUNT)
        cluster.kubectl(
            "apply",
            "-f",
            "-",
            stdin=yaml.safe_dump_all(
                [
                    flow_schema("bench-operator", SERVICE_ACCOUNT, 500),
                    flow_schema("bench-kubectl", BASELINE_ACCOUNT, 501),
                ]
            ),
        )
        operator = OperatorProcess(kubeconfig, workdir / "operator.log", opts.resync_seconds)
        operator.start()
        bench = Bench(cluster, operator)

        print("1 island ...", flush=True)
        one = bench.converge("one", 1, opts.pods)
        bench.delete("one")
        print(f"{opts.islands} islands of {opts.pods} pods ...", flush=True)
        many = bench.converge("many", opts.islands, opts.pods)
        print(f"waiting for the {total} pods to be Ready ...", flush=True)
        ready_after = many.seconds + bench.all_ready("many", opts.islands, opts.pods)
        steady_calls, steady_seconds = bench.steady_pass()
        bench.delete("many")
        print("baseline: kubectl apply ...", flush=True)
        baseline = bench.kubectl_baseline(opts.islands, opts.pods, baseline_kubeconfig)
    finally:
        if operator is not None:
            operator.stop()
        cluster.stop()

    objects = expected_children(job_spec(opts.islands, opts.pods))
    per_island_s = (many.seconds - one.seconds) / (opts.islands - 1)
    per_island_calls = (many.calls - one.calls) / (opts.islands - 1)
    lines = [
        f"operator_scale: job of {opts.islands} islands x {opts.pods} pods = {objects} children, {total} pods, "
        f"{nodes} KWOK nodes",
        f"ours     : {many.seconds:.2f} s from kubectl apply to every child present and status current, "
        f"{many.calls:.0f} API calls by the operator's ServiceAccount ({many.pass_calls:.0f} by reconcile passes)",
        f"baseline : kubectl apply --server-side of the same {objects} objects: {baseline.seconds:.2f} s, "
        f"{baseline.calls:.0f} API calls",
        f"ratio    : {many.seconds / baseline.seconds:.2f}x the time, {many.calls / baseline.calls:.2f}x the calls "
        "(ours / baseline)",
        f"1 island : {one.seconds:.2f} s, {one.calls:.0f} calls -> {1000 * per_island_s:.1f} ms and "
        f"{per_island_calls:.2f} calls per extra island",
        f"all {total} pods Ready and counted in status: {ready_after:.1f} s after kubectl apply",
        f"steady state: {steady_calls:.1f} API calls and {steady_seconds:.2f} s per timer pass over the running job",
    ]
    print("\n".join(lines))
    plot([one, many, baseline], OUT / "operator_scale.png")
    (OUT / "operator_scale.json").write_text(
        json.dumps(
            {
                "islands": opts.islands,
                "pods": opts.pods,
                "children": objects,
                "ours": vars(many),
                "one_island": vars(one),
                "baseline": vars(baseline),
                "ready_after_s": ready_after,
                "steady_pass": {"calls": steady_calls, "seconds": steady_seconds},
            },
            indent=2,
        )
    )
    print(f"wrote {OUT / 'operator_scale.png'}")


if __name__ == "__main__":
    main()
