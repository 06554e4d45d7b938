"""Prometheus metrics of the operator itself, on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reconciles = Counter("diloco_operator_reconciles", "Reconcile passes, by trigger and result",
                                  ["trigger", "result"], registry=r)
        self.seconds = Histogram("diloco_operator_reconcile_seconds", "Duration of a reconcile pass",
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.errors = Counter("diloco_operator_errors", "Failed passes and refused API calls, by kind",
                              ["kind"], registry=r)
        self.applied = Counter("diloco_operator_applied_objects", "Children created or patched, by kind",
                               ["kind"], registry=r)
        self.deleted = Counter("diloco_operator_deleted_objects", "Children deleted, by kind", ["kind"], registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
