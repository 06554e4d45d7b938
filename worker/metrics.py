"""Prometheus metrics of a `diloco-worker`, on their own port (DILOCO_METRICS_PORT), read at scrape time
from the trainer's own counters, so there is one source of truth and nothing to keep in step.

The operator scrapes `diloco_worker_loss` from each island's rank 0 for the job's status; the rest is for
dashboards: steps, tokens, pushes and pulls with their bytes, sync outcomes, time blocked on syncs, the
fragment versions held and when a sync last brought global values. Steps, pushes and
bytes are per process: a restarted worker starts them again, as Prometheus counters expect.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from diloco.worker.stats import LearnerStats


@dataclass(frozen=True)
class WorkerSnapshot:
    """What one worker rank has done so far; `learner` is None in the data-parallel baseline."""

    island: str
    rank: int
    mode: str
    step: int = 0
    tokens: int = 0  # trained on by this process
    loss: float = math.nan  # latest training loss
    eval_loss: float = math.nan  # latest held-out loss
    last_sync_unix: float = 0.0  # when a sync last brought global values (0: never)
    learner: LearnerStats | None = field(default=None)


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
            "diloco_worker_last_sync_timestamp_seconds",
            "Unix time a sync last brought global values (0: none yet)",
            s.last_sync_unix,
        )
        learner = s.learner
        if learner is None:
            return
        yield counter("diloco_worker_pushes", "Fragment deltas pushed to syncer shards", learner.syncs_pushed)
        yield counter("diloco_worker_pushed_bytes", "Encoded bytes of the deltas pushed", learner.bytes_pushed)
        yield counter("diloco_worker_pulled_bytes", "Bytes of global fragment values pulled", learner.bytes_pulled)
        yield counter(
            "diloco_worker_blocked_seconds", "Seconds the training thread spent on sync work", learner.blocked_seconds
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


def serve_metrics(snapshot: Callable[[], WorkerSnapshot], port: int, addr: str = "0.0.0.0") -> CollectorRegistry:
    """Serves /metrics on `port` from a registry of its own (a daemon thread: it never holds the exit)."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(snapshot))
    start_http_server(port, addr=addr, registry=registry)
    return registry
