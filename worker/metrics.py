"""Prometheus metrics of a `diloco-worker`, on their own port (DILOCO_METRICS_PORT), read at scrape time
from the trainer's own counters, so there is one source of truth and nothing to keep in step.

The operator scrapes `diloco_worker_loss` from each island's rank 0 for the job's status; the rest is for
dashboards: steps, tokens, tokens per second and MFU, pushes and pulls with their bytes, sync outcomes,
time blocked on syncs, the fragment versions held and when a sync last brought global values. Steps, pushes
and bytes are per process: a restarted worker starts them again, as Prometheus counters expect.

The same port answers the kubelet's readiness probe on /readyz: 200 while this rank trains as part of the
job (it has joined every syncer shard and taken the global model from them, and has finished a step within
READY_STALENESS_SECONDS since), 503 otherwise, so that an island that cannot reach its shards, crash-loops
or hangs is never Ready. The built-in worker and any loop with a `Learner` serve it alike.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from diloco.worker.stats import LearnerStats


@dataclass(frozen=True)
class WorkerSnapshot:
    """What one worker rank has done so far; `learner` is None in the data-parallel baseline."""

    island: str
    rank: int
    mode: str
    synced: bool = False  # joined every shard and holds the global model (the data-parallel baseline: always)
    step: int = 0
    tokens: int = 0  # trained on by this process
    loss: float = math.nan  # latest training loss
    eval_loss: float = math.nan  # latest held-out loss
    last_sync_unix: float = 0.0  # when a sync last brought global values (0: never)
    step_seconds: float = 0.0  # the island's seconds per inner step, smoothed (0: not measured yet)
    last_step_monotonic: float | None = None  # time.monotonic() when this process last finished a step
    tokens_per_second: float = 0.0  # this rank (one accelerator), over its last steps
    island_tokens_per_second: float = 0.0
    mfu: float | None = None  # model FLOPs utilisation of this rank's accelerator (None: peak unknown)
    learner: LearnerStats | None = field(default=None)


READINESS_PATH = "/readyz"

READY_STALENESS_SECONDS = 900.0
"""A rank whose last step finished longer ago than this is not training (a hung peer or syncer): longer than
the slowest legitimate step, a sync-diloco barrier that waits up to 600 s, plus an evaluation."""


def readiness(snapshot: WorkerSnapshot, now: float) -> tuple[bool, str]:
    """Whether this rank trains (see the module docstring), and why in words; `now` is time.monotonic()."""
    if not snapshot.synced:
        return False, "not joined to the syncer shards yet"
    if snapshot.last_step_monotonic is None:
        return False, "no step finished yet"
    age = now - snapshot.last_step_monotonic
    if age > READY_STALENESS_SECONDS:
        return False, f"last step {age:.0f}s ago (limit {READY_STALENESS_SECONDS:.0f}s)"
    return True, f"step {snapshot.step}, {age:.0f}s ago"


class WorkerCollector(Collector):
    """Turns the trainer's current snapshot into metric families on every scrape."""

    def __init__(self, snapshot: Callable[[], WorkerSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        labels = ["island", "rank", "mode"]
        ident = [s.island, str(s.rank), s.mode]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(ident, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(ident, value)
            return family

        # No loss before there is one: a NaN would reach the job's status, which is JSON.
        if math.isfinite(s.loss):
            yield gauge("diloco_worker_loss", "Latest training loss of this rank", s.loss)
        if math.isfinite(s.eval_loss):
            yield gauge("diloco_worker_eval_loss", "Latest held-out loss of this rank", s.eval_loss)
        yield gauge("diloco_worker_step", "Inner step this rank has reached (a restart resumes its job's)", s.step)
        yield counter("diloco_worker_tokens", "Tokens trained on by this process", s.tokens)
        yield gauge(
            "diloco_worker_tokens_per_second", "Tokens per second of this rank (one accelerator)", s.tokens_per_second
        )
        yield gauge(
            "diloco_worker_island_tokens_per_second",
            "Tokens per second of this rank's island (every rank takes the same steps)",
            s.island_tokens_per_second,
        )
        if s.mfu is not None:
            yield gauge("diloco_worker_mfu", "Model FLOPs utilisation of this rank's accelerator (0-1)", s.mfu)
        yield gauge(
            "diloco_worker_last_sync_timestamp_seconds",
            "Unix time a sync last brought global values (0: none yet)",
            s.last_sync_unix,
        )
        if s.step_seconds:
            yield gauge(
                "diloco_worker_step_seconds",
                "Seconds per inner step of this rank's island, smoothed (what its pushes tell the shards)",
                s.step_seconds,
            )
        learner = s.learner
        if learner is None:
            return
        yield counter("diloco_worker_pushes", "Fragment deltas pushed to syncer shards", learner.syncs_pushed)
        yield counter("diloco_worker_pushed_bytes", "Encoded bytes of the deltas pushed", learner.bytes_pushed)
        yield counter("diloco_worker_pulled_bytes", "Bytes of global fragment values pulled", learner.bytes_pulled)
        yield counter(
            "diloco_worker_error_feedback_lost_values",
            "Error-feedback values (what the sparse encoding held back) a restart dropped, not restored",
            learner.feedback_lost_values,
        )
        yield counter(
            "diloco_worker_blocked_seconds", "Seconds the training thread spent on sync work", learner.blocked_seconds
        )
        yield gauge(
            "diloco_worker_round_steps",
            "Inner steps per round the island runs: H, fewer on a speed-aware island slower than the fastest",
            learner.round_steps,
        )
        yield gauge(
            "diloco_worker_phase_offset_seconds",
            "How late the island's last push came after its round opened on the shard (negative: early); the "
            "island steers its next push by it, so it stays near 0 while islands keep in phase",
            learner.phase_offset_seconds,
        )
        yield counter(
            "diloco_worker_refused_syncs",
            "Fragment rounds a shard refused for the island's token (UNAUTHENTICATED), counted among the failed",
            learner.syncs_refused,
        )
        yield gauge(
            "diloco_worker_last_refusal_timestamp_seconds",
            "Unix time a shard last refused the island's token (0: never); after the last sync, pushes are refused",
            learner.last_refusal_unix,
        )
        syncs = CounterMetricFamily(
            "diloco_worker_syncs", "Fragment rounds by how they ended", labels=[*labels, "outcome"]
        )
        for outcome, value in (
            ("merged", learner.syncs_merged),
            ("resynced", learner.syncs_resynced),
            ("abandoned", learner.syncs_abandoned),
            ("failed", learner.syncs_failed),
        ):
            syncs.add_metric([*ident, outcome], value)
        yield syncs
        versions = GaugeMetricFamily(
            "diloco_worker_fragment_version", "Global fragment version last adopted", labels=[*labels, "fragment"]
        )
        for fragment, version in sorted(learner.versions.items()):
            versions.add_metric([*ident, str(fragment)], version.version)
        yield versions


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes and scrapes come every few seconds: not worth a log line each."""


def _app(registry: CollectorRegistry, snapshot: Callable[[], WorkerSnapshot]) -> Callable[..., Iterable[bytes]]:
    """/readyz answers the readiness probe; every other path is Prometheus's."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != READINESS_PATH:
            return metrics(environ, start_response)
        ready, why = readiness(snapshot(), time.monotonic())
        start_response("200 OK" if ready else "503 Service Unavailable", [("Content-Type", "text/plain")])
        return [why.encode() + b"\n"]

    return app


def serve_metrics(
    snapshot: Callable[[], WorkerSnapshot], port: int, addr: str = "0.0.0.0"
) -> tuple[CollectorRegistry, WSGIServer]:
    """Serves /metrics and /readyz on `port` (0: any free one, the server says which) from a registry of its
    own, in a daemon thread: it never holds the exit."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(snapshot))
    server = make_server(addr, port, _app(registry, snapshot), _Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="worker-metrics", daemon=True).start()
    return registry, server
