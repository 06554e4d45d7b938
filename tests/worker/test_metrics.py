"""`diloco-worker` serves Prometheus metrics while it trains: a real worker process against a real shard,
scraped over HTTP the way the operator scrapes it (with the operator's own probe for the loss)."""

import math
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from learner_harness import make_config
from prometheus_client.parser import text_string_to_metric_families
from support import wait_until
from worker_process import start_worker

from diloco.local.launcher import free_port
from diloco.operator.probes import trainer_report
from diloco.worker.metrics import READY_STALENESS_SECONDS, WorkerSnapshot, serve_metrics

pytestmark = pytest.mark.process


def scrape(url: str) -> dict[str, float]:
    """Every sample of the endpoint, by name plus its `outcome`/`fragment` label when it has one."""
    try:
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return {}
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = s.labels.get("outcome") or s.labels.get("fragment")
            samples[f"{s.name}{{{extra}}}" if extra else s.name] = s.value
    return samples


def test_a_training_worker_serves_its_progress_on_the_metrics_port(start_shards, tmp_path):
    config = make_config(encoding="int4")
    shards = start_shards(config)
    port = free_port()
    worker = start_worker(
        tmp_path,
        config,
        shards.targets[0],
        "island-7",
        "--eval-every",
        "5",
        env={"DILOCO_METRICS_PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        first = wait_until(lambda: (m := scrape(url)) and m["diloco_worker_step"] >= 1 and m, timeout=120)
        ready = get(f"http://127.0.0.1:{port}/readyz")
        later = wait_until(
            lambda: (
                (m := scrape(url))
                and m["diloco_worker_syncs_total{merged}"] >= 2
                and m["diloco_worker_step"] >= first["diloco_worker_step"] + 8
                and m
            ),
            timeout=120,
        )
    finally:
        worker.send_signal(signal.SIGKILL)
        _, _stderr = worker.communicate(timeout=30)
    assert math.isfinite(first["diloco_worker_loss"]) and first["diloco_worker_loss"] > 0
    assert ready[0] == 200, ready
    assert later["diloco_worker_tokens_total"] > first["diloco_worker_tokens_total"]
    assert later["diloco_worker_pushes_total"] >= 2 and later["diloco_worker_pushed_bytes_total"] > 0
    assert later["diloco_worker_pulled_bytes_total"] > 0
    assert later["diloco_worker_last_sync_timestamp_seconds"] > 0
    assert later["diloco_worker_fragment_version{0}"] >= 1 or later["diloco_worker_fragment_version{1}"] >= 1
    assert math.isfinite(later["diloco_worker_eval_loss"])
    assert "diloco_worker_blocked_seconds_total" in later
    assert later["diloco_worker_tokens_per_second"] > 0
    assert later["diloco_worker_island_tokens_per_second"] == later["diloco_worker_tokens_per_second"], "one rank"
    assert "diloco_worker_mfu" not in later, "a CPU has no known peak: no MFU rather than a guess"


def test_the_operator_reads_the_loss_a_worker_serves(start_shards, tmp_path):
    """The operator's probe parses the same endpoint: the contract between diloco-worker and the operator."""
    config = make_config()
    shards = start_shards(config)
    port = free_port()
    worker = start_worker(
        tmp_path,
        config,
        shards.targets[0],
        "island-0",
        "--metrics-port",
        str(port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        loss = wait_until(lambda: (report := trainer_report(url, 2.0)) and report.loss, timeout=120)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
    assert 0 < loss < 2 * math.log(256)


def get(url: str) -> tuple[int, str]:
    """Status and body of a GET, whatever the status."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture
def served():
    """A metrics server on a free loopback port answering from a snapshot the test sets."""
    current = {"snapshot": WorkerSnapshot(island="island-0", rank=0, mode="diloco")}
    _, server = serve_metrics(lambda: current["snapshot"], 0, "127.0.0.1")
    yield current, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_readyz_answers_503_until_the_rank_has_joined_its_shards_and_finished_a_step(served):
    current, base = served
    status, body = get(f"{base}/readyz")
    assert status == 503 and "not joined" in body
    current["snapshot"] = WorkerSnapshot(island="island-0", rank=0, mode="diloco", synced=True)
    status, body = get(f"{base}/readyz")
    assert status == 503 and "no step" in body
    current["snapshot"] = WorkerSnapshot(
        island="island-0", rank=0, mode="diloco", synced=True, step=3, loss=2.5, last_step_monotonic=time.monotonic()
    )
    status, body = get(f"{base}/readyz")
    assert status == 200 and "step 3" in body


def test_readyz_answers_503_once_the_last_step_is_stale(served):
    current, base = served
    stale = time.monotonic() - READY_STALENESS_SECONDS - 60
    current["snapshot"] = WorkerSnapshot(
        island="island-0", rank=0, mode="diloco", synced=True, step=9, last_step_monotonic=stale
    )
    status, body = get(f"{base}/readyz")
    assert status == 503 and "last step" in body


def test_the_readiness_server_still_serves_the_metrics(served):
    current, base = served
    current["snapshot"] = WorkerSnapshot(island="island-0", rank=0, mode="diloco", step=4, loss=1.5)
    samples = scrape(f"{base}/metrics")
    assert samples["diloco_worker_step"] == 4 and samples["diloco_worker_loss"] == 1.5


def test_throughput_and_mfu_are_served_when_known(served):
    current, base = served
    current["snapshot"] = WorkerSnapshot(
        island="island-0", rank=1, mode="diloco", tokens_per_second=5e4, island_tokens_per_second=1e5, mfu=0.41
    )
    samples = scrape(f"{base}/metrics")
    assert samples["diloco_worker_tokens_per_second"] == 5e4
    assert samples["diloco_worker_island_tokens_per_second"] == 1e5
    assert samples["diloco_worker_mfu"] == 0.41
