"""The operator's calls into a job: a real syncer shard's Status RPC (with the job's token, or during a rotation
with the new one first) and a trainer's Prometheus endpoint, both on loopback."""

import socket
from concurrent import futures
from functools import partial

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from support import TEST_PKI

from diloco.core.config import TrainingConfig
from diloco.operator.policies.island_training import TrainerReport
from diloco.operator.probes import (
    LAST_REFUSAL_METRIC,
    LAST_SYNC_METRIC,
    LOSS_METRIC,
    ROUND_STEPS_METRIC,
    STEP_SECONDS_METRIC,
    shard_status,
    shard_statuses,
    trainer_report,
    trainer_reports,
)
from diloco.operator.tokens import fingerprint
from diloco.syncer.server import SyncerServer
from diloco.transport import tls
from diloco.transport.client import SyncerClient
from diloco.transport.tls import throwaway_pki

TOKEN = "probe-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def shard_server():
    config = TrainingConfig(fragments=2, inner_steps=10, overlap_steps=1, block_size=32)
    server = SyncerServer(
        config,
        shard_index=0,
        num_shards=1,
        token=TOKEN,
        security=TEST_PKI.server,
        host="127.0.0.1",
        port=free_port(),
    )
    server.start()
    with SyncerClient(
        f"127.0.0.1:{server.port}", TOKEN, security=TEST_PKI.client, island_id="island-a", timeout=5, retry_for=5
    ) as client:
        client.join(2)
        client.seed(0, [("w", torch.zeros(4, 4))])
    yield server
    server.stop(grace=0)


@pytest.fixture
def shard(shard_server):
    return f"127.0.0.1:{shard_server.port}"


def test_shard_status_reports_seeded_fragments_and_live_islands(shard):
    observed = shard_status(0, True, shard, [TOKEN], TEST_PKI.client, timeout=5)
    assert observed.ready and observed.fragments is not None
    assert observed.accepts == frozenset({fingerprint(TOKEN)}), "the tokens it accepts, by fingerprint"
    assert [(f.fragment, f.version, f.tokens) for f in observed.fragments] == [(0, 0, 0)]
    assert observed.live_islands == frozenset({"island-a"})


def test_a_refused_or_absent_shard_is_unreachable_not_an_error(shard):
    assert shard_status(0, True, shard, ["wrong-token"], TEST_PKI.client, timeout=5).fragments is None
    assert shard_status(1, True, f"127.0.0.1:{free_port()}", [TOKEN], TEST_PKI.client, timeout=0.5).fragments is None


def test_the_tokens_are_tried_in_order_and_the_shard_says_which_it_accepts_without_a_refused_call(shard_server, shard):
    """The operator calls with the token the islands present first, which the shard accepts, and learns from the
    reply whether it takes the rotation's new one yet: no call of its is refused, as no island's may be."""
    server, target = shard_server, shard
    refused = partial(server.metrics.registry.get_sample_value, "diloco_syncer_rejected_pushes_total")
    before = refused({"reason": "unauthenticated"}) or 0.0
    waiting = shard_status(0, True, target, [TOKEN, "new-token"], TEST_PKI.client, timeout=5)
    assert waiting.fragments is not None and waiting.accepts == frozenset({fingerprint(TOKEN)})
    assert (refused({"reason": "unauthenticated"}) or 0.0) == before
    late = shard_status(0, True, target, ["lost-token", TOKEN], TEST_PKI.client, timeout=5)
    assert late.fragments is not None and late.error is None, "a refused token is followed by the next"


def test_a_shard_not_ready_is_not_called():
    observed = shard_status(3, False, "unresolvable.invalid:1", [TOKEN], TEST_PKI.client, timeout=5)
    assert (observed.shard, observed.ready, observed.fragments) == (3, False, None)


def test_shards_are_polled_in_index_order(shard):
    observed = shard_statuses([shard, shard], [True, False], [TOKEN], TEST_PKI.client, timeout=5)
    assert [(o.shard, o.ready, o.fragments is not None) for o in observed] == [(0, True, True), (1, False, False)]


def test_a_trainers_report_from_prometheus_text():
    registry = CollectorRegistry()
    Gauge(LOSS_METRIC, "training loss", registry=registry).set(2.75)
    Gauge(LAST_SYNC_METRIC, "last sync", registry=registry).set(1_800_000_000.5)
    Gauge(LAST_REFUSAL_METRIC, "last refusal", registry=registry).set(1_700_000_000.0)
    Gauge(STEP_SECONDS_METRIC, "step time", registry=registry).set(0.25)
    Gauge(ROUND_STEPS_METRIC, "round steps", registry=registry).set(40)
    Counter("diloco_worker_pushes", "pushes", registry=registry).inc(3)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        report = TrainerReport(
            loss=2.75,
            last_sync_unix=1_800_000_000.5,
            last_refusal_unix=1_700_000_000.0,
            step_seconds=0.25,
            round_steps=40,
        )
        assert trainer_report(url, timeout=5) == report
        silent = f"http://127.0.0.1:{free_port()}/metrics"
        assert trainer_reports({"a": url, "b": silent}, timeout=1) == {"a": report}
    finally:
        server.shutdown()
        thread.join(5)


def test_an_endpoint_without_the_gauges_reports_nothing_known():
    registry = CollectorRegistry()
    Gauge("something_else", "x", registry=registry).set(1)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        assert trainer_report(f"http://127.0.0.1:{port}/metrics", timeout=5) == TrainerReport()
    finally:
        server.shutdown()
        thread.join(5)


def test_a_refused_or_absent_shard_says_why_and_only_a_refusal_makes_it_unserving(shard):
    refused = shard_status(0, True, shard, ["wrong-token"], TEST_PKI.client, timeout=5)
    assert refused.error and refused.error.startswith("UNAUTHENTICATED: ") and not refused.serving
    absent = shard_status(1, True, f"127.0.0.1:{free_port()}", [TOKEN], TEST_PKI.client, timeout=0.5)
    assert absent.error and absent.error.startswith(("UNAVAILABLE: ", "DEADLINE_EXCEEDED: ")) and absent.serving


def test_a_shard_refusing_the_handshake_says_why_and_stays_serving():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    target = f"127.0.0.1:{tls.add_port(server, '127.0.0.1:0', throwaway_pki().server)}"  # another CA's certificate
    server.start()
    try:
        observed = shard_status(0, True, target, [TOKEN], TEST_PKI.client, timeout=5)
    finally:
        server.stop(None)
    assert observed.error and observed.error.startswith("UNAVAILABLE: TLS handshake with")
    assert "certificate failed verification" in observed.error and observed.serving
