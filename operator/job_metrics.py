"""Per-job gauges from the status each reconcile pass writes, so that an alert can say "job X has been Degraded
for 10 minutes" and a dashboard can show every job without reading its status by hand.

The series are collected from the last status of each job the operator holds: a job's series go when the job
does (`forget`), and an island's with the island, so the number of series is bounded by the jobs and islands
that exist."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import kopf
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from diloco.api.job import DiLoCoJobStatus, Phase

JOB = ["namespace", "job"]


class JobMetrics(Collector):
    """Collects `diloco_job_*` gauges, labelled by namespace and job (and island, phase or condition type), from
    the statuses `observe` was given."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._lock = threading.Lock()
        self._statuses: dict[tuple[str, str], DiLoCoJobStatus] = {}
        if registry is not None:
            registry.register(self)

    def observe(self, namespace: str, job: str, status: Mapping[str, Any]) -> None:
        """The status a pass wrote (its JSON, camelCase, as patched): what the job's series report from now."""
        parsed = DiLoCoJobStatus.model_validate({k: v for k, v in status.items() if v is not None})
        with self._lock:
            self._statuses[(namespace, job)] = parsed

    def forget(self, namespace: str, job: str) -> None:
        """The job is gone: its series with it."""
        with self._lock:
            self._statuses.pop((namespace, job), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            statuses = dict(self._statuses)
        phase = GaugeMetricFamily("diloco_job_phase", "1 for the job's phase, 0 for the others", labels=[*JOB, "phase"])
        condition = GaugeMetricFamily(
            "diloco_job_condition", "1 while the condition is True, else 0", labels=[*JOB, "type"]
        )
        job_gauges = {
            "islands_desired": "Islands that should run",
            "islands_ready": "Islands with every pod ready",
            "restarts": "Island failures counted against the restart budget, over all islands",
            "preemptions": "Island pods preempted or lost with their node, over all islands",
            "outer_step": "Outer steps every fragment has reached (the minimum)",
            "tokens": "Tokens every fragment's merges account for (the minimum)",
            "goodput": "Ready island pod-seconds over desired island pod-seconds while training",
            "loss": "Mean of the islands' last reported training losses",
            "syncer_shards_ready": "Syncer shards whose Deployment reports a ready pod",
        }
        island_gauges = {
            "pods_desired": "Pods the island should have now",
            "pods_ready": "Pods of the island ready",
            "restarts": "Failures of the island counted against the restart budget",
            "preemptions": "Pods of the island preempted or lost with their node",
            "loss": "Training loss last reported by the island's rank-0 pod",
        }
        jobs = {key: GaugeMetricFamily(f"diloco_job_{key}", text, labels=JOB) for key, text in job_gauges.items()}
        islands = {
            key: GaugeMetricFamily(f"diloco_job_island_{key}", text, labels=[*JOB, "island"])
            for key, text in island_gauges.items()
        }
        for (namespace, name), status in sorted(statuses.items()):
            for value in Phase:
                phase.add_metric([namespace, name, value.value], float(status.phase == value))
            for c in status.conditions:
                condition.add_metric([namespace, name, c.type], float(c.status == "True"))
            ready, _, desired = status.islands_ready.partition("/")
            values: dict[str, float | None] = {
                "islands_desired": float(desired or 0),
                "islands_ready": float(ready or 0),
                "restarts": float(sum(i.restarts for i in status.islands)),
                "preemptions": float(sum(i.preemptions for i in status.islands)),
                "outer_step": float(status.outer_step),
                "tokens": float(status.tokens),
                "goodput": status.goodput,
                "loss": status.loss,
                "syncer_shards_ready": float(status.syncer.ready),
            }
            for key, value in values.items():
                if value is not None:
                    jobs[key].add_metric([namespace, name], value)
            for island in status.islands:
                labels = [namespace, name, island.name]
                islands["pods_desired"].add_metric(labels, island.desired)
                islands["pods_ready"].add_metric(labels, island.ready)
                islands["restarts"].add_metric(labels, island.restarts)
                islands["preemptions"].add_metric(labels, island.preemptions)
                if island.loss is not None:
                    islands["loss"].add_metric(labels, island.loss)
        yield phase
        yield condition
        yield from jobs.values()
        yield from islands.values()


def register(registry: kopf.OperatorRegistry, jobs: JobMetrics, resource: tuple[str, str, str]) -> None:
    """Forget a job's series when the API server reports it deleted, however it went (a pass sees only the jobs
    that are still there, and none at all of one deleted without a grace period)."""

    def on_event(event: kopf.RawEvent, namespace: str, name: str, **_: Any) -> None:
        if event["type"] == "DELETED":
            jobs.forget(namespace, name)

    kopf.on.event(*resource, id="job-metrics", registry=registry)(on_event)
