"""Prometheus metrics of the operator itself and of the jobs it reconciles (job_metrics), on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from diloco.operator.job_metrics import JobMetrics


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reconciles = Counter(
            "diloco_operator_reconciles", "Reconcile passes, by trigger and result", ["trigger", "result"], registry=r
        )
        self.seconds = Histogram(
            "diloco_operator_reconcile_seconds",
            "Duration of a reconcile pass",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.errors = Counter(
            "diloco_operator_errors", "Failed passes and refused API calls, by kind", ["kind"], registry=r
        )
        self.applied = Counter(
            "diloco_operator_applied_objects", "Children created or patched, by kind", ["kind"], registry=r
        )
        self.deleted = Counter("diloco_operator_deleted_objects", "Children deleted, by kind", ["kind"], registry=r)
        self.api_requests = Counter(
            "diloco_operator_api_requests",
            "Kubernetes API calls of reconcile passes (kopf's own watches and patches not included), by verb, "
            "kind and HTTP status",
            ["verb", "kind", "code"],
            registry=r,
        )
        self.jobs = JobMetrics(r)

    def api_request(self, verb: str, kind: str, status: int) -> None:
        """A `kube.RequestObserver` counting every call into `api_requests`."""
        self.api_requests.labels(verb, kind, str(status)).inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
