"""The kopf wiring: which events start a reconcile pass, and how its outcome reaches the job (status patch,
Events) and the metrics. Every trigger runs the same level-based pass; kopf runs one handler at a time
per job, so passes over a job never overlap.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import kopf
from pydantic import ValidationError

from diloco.operator.metrics import OperatorMetrics
from diloco.operator.naming import JobRef
from diloco.operator.reconcile import Reconciler
from diloco.spec import API_GROUP, API_VERSION, PLURAL

log = logging.getLogger("diloco.operator")

RESOURCE = (API_GROUP, API_VERSION, PLURAL)
FINALIZER = f"{API_GROUP}/finalizer"


def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Kopf's bookkeeping under the project's own annotation prefix, no CRD or namespace scanning (so the
    RBAC needs no access to either), and only warnings posted as Events."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.scanning.disabled = True
    settings.posting.level = logging.WARNING


def _handler(reconciler: Reconciler, metrics: OperatorMetrics, trigger: str) -> Callable[..., None]:
    def reconcile_job(
        body: kopf.Body,
        meta: kopf.Meta,
        spec: kopf.Spec,
        status: kopf.Status,
        name: str,
        namespace: str,
        uid: str,
        patch: kopf.Patch,
        **_: Any,
    ) -> None:
        started = time.perf_counter()
        try:
            outcome = reconciler.reconcile(
                JobRef(name=name, namespace=namespace, uid=uid),
                meta.get("generation"),
                dict(spec),
                dict(status),
                datetime.datetime.now(datetime.UTC),
            )
        except ValidationError as error:
            metrics.reconciles.labels(trigger, "invalid").inc()
            kopf.warn(body, reason="InvalidSpec", message=str(error))
            raise kopf.PermanentError(f"the spec is invalid: {error}") from error
        except Exception:
            metrics.reconciles.labels(trigger, "error").inc()
            metrics.errors.labels("reconcile").inc()
            raise
        finally:
            metrics.seconds.observe(time.perf_counter() - started)
        metrics.reconciles.labels(trigger, "ok").inc()
        for item in outcome.applied:
            metrics.applied.labels(item.split("/", 1)[0]).inc()
        for item in outcome.deleted:
            metrics.deleted.labels(item.split("/", 1)[0]).inc()
        for event in outcome.events:
            if event.reason in ("ApplyFailed", "DeleteFailed"):
                metrics.errors.labels(event.reason).inc()
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
            log.log(logging.WARNING if event.type == "Warning" else logging.INFO, event.message,
                    extra={"job": f"{namespace}/{name}", "reason": event.reason})
        if not outcome.job_deleted:
            patch["status"] = outcome.status

    return reconcile_job


def register(
    registry: kopf.OperatorRegistry, reconciler: Reconciler, metrics: OperatorMetrics, interval: float
) -> None:
    """Reconcile on resume (operator start), create, spec update, and every `interval` seconds; log in
    with the `kubernetes` client's credentials (in-cluster service account or kubeconfig)."""
    kopf.on.login(registry=registry)(kopf.login_via_client)
    kopf.on.startup(registry=registry)(configure)
    kopf.on.resume(*RESOURCE, id="reconcile-on-resume", registry=registry)(_handler(reconciler, metrics, "resume"))
    kopf.on.create(*RESOURCE, id="reconcile-on-create", registry=registry)(_handler(reconciler, metrics, "create"))
    kopf.on.update(*RESOURCE, id="reconcile-on-update", registry=registry)(_handler(reconciler, metrics, "update"))
    kopf.timer(*RESOURCE, id="reconcile-on-timer", interval=interval, registry=registry)(
        _handler(reconciler, metrics, "timer")
    )
