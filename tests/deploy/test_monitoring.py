"""The dashboard and the Prometheus rules: rendered from deploy/monitoring.py and fresh, and every query names
series that the operator, a syncer shard or a worker exports."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from diloco.operator.metrics import OperatorMetrics
from diloco.syncer.metrics import SyncerMetrics
from diloco.worker.metrics import WorkerCollector, WorkerSnapshot

ROOT = Path(__file__).resolve().parents[2]
_loader = importlib.util.spec_from_file_location("monitoring", ROOT / "deploy" / "monitoring.py")
monitoring = importlib.util.module_from_spec(_loader)
sys.modules["monitoring"] = monitoring  # its dataclasses look their module up there
_loader.loader.exec_module(monitoring)

STATUS = {"phase": "Running", "islandsReady": "1/1", "islands": [{"name": "a", "loss": 3.0}], "goodput": 0.9}


SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported() -> set[str]:
    """Every sample name the three components serve (a labelled family's before its first series too)."""
    operator = OperatorMetrics()
    operator.jobs.observe("ml", "demo", {**STATUS, "loss": 3.0})
    worker = CollectorRegistry()
    worker.register(WorkerCollector(lambda: WorkerSnapshot(island="a", rank=0, mode="diloco", loss=3.0)))
    registries = (operator.registry, SyncerMetrics().registry, worker)
    families = [family for r in registries for family in r.collect()]
    return {family.name + suffix for family in families for suffix in SUFFIXES[family.type]}


def named(expr: str) -> set[str]:
    return set(re.findall(r"\bdiloco_[a-z_]+\b", expr))


def queries() -> list[str]:
    panels = [target["expr"] for panel in monitoring.dashboard()["panels"] for target in panel["targets"]]
    rules = [rule["expr"] for group in monitoring.rules()["groups"] for rule in group["rules"]]
    return panels + rules


def test_committed_files_are_fresh():
    result = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "monitoring.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert monitoring.stale() == []


def test_check_names_a_stale_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(monitoring, "ROOT", tmp_path)
    monkeypatch.setattr(monitoring, "outputs", lambda: {tmp_path / "diloco.json": "{}\n"})
    assert monitoring.main(["--check"]) == 1
    assert "diloco.json" in capsys.readouterr().err


def test_every_query_names_only_series_the_components_export():
    served = exported()
    for expr in queries():
        assert named(expr) or "diloco:" in expr, f"{expr}: neither a series nor a recorded rule"
        assert named(expr) <= served, f"{expr}: {named(expr) - served} not exported"


def test_alerts_read_only_rules_that_are_recorded():
    spec = monitoring.rules()
    recorded = {rule["record"] for group in spec["groups"] for rule in group["rules"] if "record" in rule}
    for group in spec["groups"]:
        for rule in group["rules"]:
            assert set(re.findall(r"\bdiloco:[a-z_:0-9]+", rule["expr"])) <= recorded, rule


def test_the_dashboard_shows_what_an_operator_watches():
    titles = {panel["title"] for panel in monitoring.dashboard()["panels"]}
    assert {"Job phase", "Islands", "Goodput", "Refusals by reason", "TLS handshakes"} <= titles
    alerts = {rule.name for rule in monitoring.ALERTS}
    assert alerts == {
        "DiLoCoJobDegraded",
        "DiLoCoJobGoodputLow",
        "DiLoCoShardRefusingPushes",
        "DiLoCoCertificateExpiring",
    }
