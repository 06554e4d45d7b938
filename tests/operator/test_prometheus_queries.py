"""A real Prometheus (tests/cluster/build.sh builds it from the Go module proxy) scrapes the operator reconciling a
job on the test cluster and a `diloco run` (its shards and islands on loopback), with the chart's rules loaded;
then every dashboard panel's query and every rule's query, both taken from deploy/monitoring.py, must return
series, and the panels' data is plotted from the same queries (with DILOCO_DOCS_PNG=path, after a minute more of
data, to that path too: docs/monitoring-panels.png is made so).

The dashboard's `$namespace` and `$job` are the operator's job's; the run's targets carry the pod names a job of
that name would have (the operator's names, see LocalJob's prometheus-targets.json), so one
selection shows the operator's and the run's series together, as on a cluster.

Alerts fire only on trouble, which a healthy run has none of: an alert's expression is evaluated whole (it must
be valid PromQL), and each series or recorded rule it reads must return series, so that a renamed metric or label
cannot leave an alert silently unable to fire. Recording rules are read through the series Prometheus records.
A call with a wrong token is refused by the run's shard, so that the refusals panel and rule have a reason to show
(a healthy run refuses nothing, and a reason's series exists only once it was counted).

Only loopback is used: Prometheus listens on 127.0.0.1 and scrapes static targets there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import support
import yaml
from cluster.controlplane import binaries_dir, free_port, spawn, stop_group
from operator_harness import OperatorProcess, install

from diloco.local.launcher import SCRAPE_JOB
from diloco.operator import naming

ROOT = Path(__file__).resolve().parents[2]
_loader = importlib.util.spec_from_file_location("monitoring", ROOT / "deploy" / "monitoring.py")
assert _loader is not None and _loader.loader is not None
monitoring = importlib.util.module_from_spec(_loader)
sys.modules["monitoring"] = monitoring  # its dataclasses look their module up there
_loader.loader.exec_module(monitoring)

pytestmark = [pytest.mark.process, pytest.mark.filterwarnings("ignore:Unverified HTTPS request")]

NAMESPACE = "watched"
JOB = SCRAPE_JOB  # the `diloco run`'s pods are named as this job's would be
WINDOW = 60.0  # seconds of data the plot shows


def substituted(expr: str) -> str:
    return expr.replace("$namespace", NAMESPACE).replace("$job", JOB)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        return self.api("query_range", query=expr, start=str(start), end=str(end), step="1")["result"]


def job_manifest(metrics_port: int) -> str:
    spec = {
        "trainer": {"metricsPort": metrics_port},
        "image": "test.invalid/diloco-trainer-kwok:test",
        "training": {"innerSteps": 20, "fragments": 2, "overlapSteps": 1},
        "islands": [{"name": "island-0", "replicas": 1}, {"name": "island-1", "replicas": 1}],
        "syncer": {"shards": 1},
    }
    return yaml.safe_dump(
        {"apiVersion": "diloco.dev/v1alpha1", "kind": "DiLoCoJob", "metadata": {"name": JOB}, "spec": spec}
    )


def selectors(expr: str) -> set[str]:
    """The series and recorded rules an expression reads."""
    return set(re.findall(r"\bdiloco[_:][a-z_:0-9]+\b(?:\{[^}]*\})?", expr))


def refused(address: str, ca: Path) -> bool:
    """Whether a Status call with a wrong token to the shard at `address` was refused as `unauthenticated` (it is
    not while the shard is still starting)."""
    import grpc

    from diloco.transport.auth import bearer_metadata
    from diloco.transport.v1 import syncer_pb2 as pb
    from diloco.transport.v1 import syncer_pb2_grpc as pb_grpc

    with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.read_bytes())) as channel:
        try:
            pb_grpc.SyncerStub(channel).Status(pb.StatusRequest(), metadata=bearer_metadata("wrong"), timeout=5)
        except grpc.RpcError as error:
            return isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.UNAUTHENTICATED
    raise AssertionError("a wrong token was taken")


def loopback_trainers(cluster) -> bool:
    """Whether every rank-0 island pod of the job runs with 127.0.0.1 as its IP (set here once KWOK has run it)."""
    listing = cluster.kubectl("-n", NAMESPACE, "get", "pods", "-l", f"diloco.dev/job={JOB}", "-o", "json").stdout
    pods = [
        p
        for p in json.loads(listing)["items"]
        if p["metadata"]["name"].endswith("-0") and "-syncer-" not in p["metadata"]["name"]
    ]
    for pod in pods:
        if pod["status"].get("phase") == "Running" and pod["status"].get("podIP") != "127.0.0.1":
            patch = {"status": {"podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}}
            name = pod["metadata"]["name"]
            cluster.kubectl(
                "-n", NAMESPACE, "patch", "pod", name, "--subresource=status", "--type=merge", "-p", json.dumps(patch)
            )
    return len(pods) == 2 and all(p["status"].get("podIP") == "127.0.0.1" for p in pods)


@pytest.fixture(scope="module")
def prometheus_bin():
    found = binaries_dir(("prometheus",))
    if found is None:
        support.missing_binary("no cached prometheus (run tests/cluster/build.sh)")
    return found / "prometheus"


def test_every_panel_and_rule_query_returns_series(operator_cluster, prometheus_bin, tmp_path):
    started = time.monotonic()
    operator = OperatorProcess(install(operator_cluster), tmp_path / "operator.log", 1.0, ["--priority=500"])
    operator.start()
    operator_cluster.kubectl("create", "namespace", NAMESPACE)

    out = tmp_path / "run"
    # Steps enough to outlast the test: the run is stopped once Prometheus has what it needs.
    args = ["run", "--islands", "2", "--steps", "100000", "--inner-steps", "10", "--eval-every", "20"]
    diloco = Path(sys.executable).parent / "diloco"
    run = spawn([str(diloco), *args, "--quiet", "--out", str(out)], tmp_path / "run.log")
    prometheus = None
    try:
        targets = out / "diloco" / "prometheus-targets.json"
        support.wait_until(targets.exists, timeout=120, interval=0.2)
        groups = json.loads(targets.read_text())
        static = [
            {"targets": group["targets"], "labels": {**group["labels"], "namespace": NAMESPACE}} for group in groups
        ]
        # The job's island pods are KWOK's, with nothing behind their IPs: each rank 0 is given the address of the
        # run's island-0 (status.podIP 127.0.0.1, as for a host-network pod, and the job's trainer.metricsPort),
        # so the operator reads a training loss from a real trainer, as it does on a cluster.
        island = next(g for g in groups if g["labels"]["pod"] == f"{naming.island_name(JOB, 'island-0')}-0")
        trainer_port = int(island["targets"][0].rpartition(":")[2])
        operator_cluster.kubectl("-n", NAMESPACE, "apply", "-f", "-", stdin=job_manifest(trainer_port))
        support.wait_until(lambda: loopback_trainers(operator_cluster), timeout=120, interval=0.5)
        shard = next(g["labels"]["__meta_diloco_address"] for g in groups if g["labels"]["component"] == "syncer")
        rules = tmp_path / "rules.yaml"
        rules.write_text(yaml.safe_dump(monitoring.rules()))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {  # the operator's series carry the job's namespace and name: kept, as the chart's ServiceMonitor does
                    "job_name": "diloco-operator",
                    "honor_labels": True,
                    "static_configs": [{"targets": [f"127.0.0.1:{operator.metrics_port}"]}],
                },
                {"job_name": "diloco-run", "static_configs": static},
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        prometheus = spawn(
            [
                str(prometheus_bin),
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            tmp_path / "prometheus.log",
        )
        api = Prometheus(f"http://127.0.0.1:{port}")

        panels = [
            (panel["title"], target["legendFormat"], substituted(target["expr"]))
            for panel in monitoring.dashboard()["panels"]
            for target in panel["targets"]
        ]
        records = [r for g in monitoring.rules()["groups"] for r in g["rules"] if "record" in r]
        alerts = [r for g in monitoring.rules()["groups"] for r in g["rules"] if "alert" in r]
        expected = [expr for _, _, expr in panels] + [r["expr"] for r in records] + [r["record"] for r in records]
        expected += [s for a in alerts for s in selectors(a["expr"])]

        support.wait_until(lambda: refused(shard, out / "diloco" / "tls" / "ca.crt"), timeout=180, interval=1.0)

        def empty() -> list[str]:
            try:
                return [expr for expr in expected if not api.query(expr)]
            except OSError:
                return expected

        # Goodput needs two operator passes with the job training; a busy machine's passes come slowly.
        deadline = time.monotonic() + 180
        while (missing := empty()) and time.monotonic() < deadline:
            time.sleep(1.0)
        if missing:
            job = operator_cluster.kubectl("-n", NAMESPACE, "get", "dilocojob", JOB, "-o", "json", check=False).stdout
            status = json.loads(job or "{}").get("status", {})
            log = operator.log.read_text().splitlines()[-30:]
            pytest.fail(
                "no series for:\n" + "\n".join(missing) + f"\nthe job's phase: {status.get('phase')}, "
                f"conditions: {status.get('conditions')}\nthe operator's log ends:\n" + "\n".join(log)
            )
        for alert in alerts:
            api.query(alert["expr"])  # valid, evaluated (a healthy run fires none)

        docs = os.environ.get("DILOCO_DOCS_PNG")
        if docs:  # a minute of data for the docs' plot, with a refusal now and then (CI stops at the first series)
            for _ in range(int(WINDOW / 5)):
                time.sleep(5.0)
                refused(shard, out / "diloco" / "tls" / "ca.crt")
        now = time.time()
        plot(api, panels, now - WINDOW, now, tmp_path / "monitoring-panels.png")
        if docs:
            plot(api, panels, now - WINDOW, now, Path(docs))
    finally:
        for process in (prometheus, run):
            if process is not None:
                stop_group(process)
        operator.stop()
        print(f"wall time: {time.monotonic() - started:.1f} s")


def plot(api: Prometheus, panels: list[tuple[str, str, str]], start: float, end: float, path: Path) -> None:
    """Each panel's queries over [start, end], one subplot per panel in the dashboard's order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = list(dict.fromkeys(title for title, _, _ in panels))
    columns = 2
    rows = -(-len(titles) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(12, 2.6 * rows), squeeze=False)
    for ax, title in zip(axes.flat, titles):
        for _, legend, expr in (p for p in panels if p[0] == title):
            for series in api.query_range(expr, start, end):
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                label = re.sub(r"\{\{(\w+)\}\}", lambda m: series["metric"].get(m.group(1), ""), legend)
                ax.plot(xs, ys, label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("seconds", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(titles) :]:
        ax.axis("off")
    figure.suptitle(f"DiLoCo dashboard's queries: last {WINDOW:.0f} s of a `diloco run` and the operator", fontsize=10)
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
