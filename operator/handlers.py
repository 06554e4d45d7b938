"""The kopf wiring: which events start a reconcile pass, and how its outcome reaches the job (status patch,
Events) and the metrics. Every trigger runs the same level-based pass; kopf runs a job's change handlers
one at a time but its timer apart from them, so a lock per job keeps passes from overlapping (PassLocks).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import kopf
from pydantic import ValidationError

from diloco.api.job import API_GROUP, API_VERSION, PLURAL
from diloco.operator import job_metrics
from diloco.operator.events import Event, reconcile_failed
from diloco.operator.kube import ApiError
from diloco.operator.metrics import OperatorMetrics
from diloco.operator.naming import JobRef
from diloco.operator.reconcile import Reconciler
from diloco.operator.tokens import rotation_of

log = logging.getLogger("diloco.operator")

RESOURCE = (API_GROUP, API_VERSION, PLURAL)
FINALIZER = f"{API_GROUP}/finalizer"


PASSES_AT_ONCE = 8
"""Reconcile passes kopf runs at once (its threads for sync handlers), each over one job; the API client's pool
holds connections for every call they make at once (`connections_needed`)."""


def connections_needed(parallel_calls: int) -> int:
    """API connections the operator may use at once: each of PASSES_AT_ONCE passes makes up to `parallel_calls`
    calls in parallel, and one more of its own (an Event, a get). A pool smaller than this discards the
    connections it has no room for, with a urllib3 warning each ("connection pool is full")."""
    return PASSES_AT_ONCE * (parallel_calls + 1)


PEERING_LIFETIME = 60
"""Seconds a replica's peering record lives without a keep-alive: how long the others wait before taking
over from a replica that died without saying goodbye (SIGKILL, a lost node)."""


def configure(settings: kopf.OperatorSettings, peering_lifetime: int = PEERING_LIFETIME, **_: Any) -> None:
    """Kopf's bookkeeping under the project's own annotation prefix, no CRD or namespace scanning (so the
    RBAC needs no access to either), the peering record's lifetime, and how many passes run at once (the API
    client's pool is sized for them: `connections_needed`). Kopf posts no Events of its own: it
    would post one new object per failed pass; the handler posts the failure through the operator's
    recorder instead, aggregated as every other Event (`events.reconcile_failed`)."""
    settings.peering.lifetime = peering_lifetime
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.scanning.disabled = True
    settings.posting.enabled = False
    settings.execution.max_workers = PASSES_AT_ONCE


class PassLocks:
    """One lock per job. Kopf runs a job's timer apart from its change handlers, so without these a timer
    pass and a create or update pass could run over one job at once, applying the same children twice and
    posting the same Events twice."""

    def __init__(self) -> None:
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def of(self, uid: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(uid, threading.Lock())

    def forget(self, uid: str) -> None:
        with self._guard:
            self._locks.pop(uid, None)


def _handler(
    reconciler: Reconciler, metrics: OperatorMetrics, trigger: str, locks: PassLocks | None = None
) -> Callable[..., None]:
    """A pass per call. A timer finding a pass under way skips its turn (the pass under way does the work);
    a change waits for it, then reconciles what it changed."""
    locks = locks or PassLocks()

    def reconcile_job(meta: kopf.Meta, uid: str, **kwargs: Any) -> None:
        if meta.get("deletionTimestamp"):
            # The job is going: the garbage collector removes its children (foreground deletion: before the
            # job itself), and a pass now would apply them again and post Events into a dying namespace.
            locks.forget(uid)
            metrics.jobs.forget(kwargs["namespace"], kwargs["name"])
            return
        lock = locks.of(uid)
        if not lock.acquire(blocking=trigger != "timer"):
            metrics.reconciles.labels(trigger, "skipped").inc()
            return
        try:
            _reconcile(meta=meta, uid=uid, **kwargs)
        finally:
            lock.release()

    def _failed(job: JobRef, error: Exception, now: datetime.datetime) -> None:
        metrics.reconciles.labels(trigger, "error").inc()
        metrics.errors.labels("reconcile").inc()
        reconciler.events.post(job, reconcile_failed(error), now)

    def _reconcile(
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
        job = JobRef(name=name, namespace=namespace, uid=uid, token_rotation=rotation_of(meta))
        now = datetime.datetime.now(datetime.UTC)
        try:
            outcome = reconciler.reconcile(job, meta.get("generation"), dict(spec), dict(status), now)
        except ValidationError as error:
            metrics.reconciles.labels(trigger, "invalid").inc()
            reconciler.events.post(job, Event("Warning", "InvalidSpec", str(error)), now)
            raise kopf.PermanentError(f"the spec is invalid: {error}") from error
        except ApiError as error:
            if not error.namespace_terminating:
                _failed(job, error, now)
                raise
            metrics.reconciles.labels(trigger, "skipped").inc()
            return
        except Exception as error:
            _failed(job, error, now)
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
            reconciler.events.post(job, event, now)
            log.log(
                logging.WARNING if event.type == "Warning" else logging.INFO,
                event.message,
                extra={"job": f"{namespace}/{name}", "reason": event.reason},
            )
        if outcome.status is not None and not outcome.job_deleted:
            patch["status"] = outcome.status
            metrics.jobs.observe(namespace, name, outcome.status)
        elif outcome.job_deleted:
            metrics.jobs.forget(namespace, name)

    return reconcile_job


def register(
    registry: kopf.OperatorRegistry,
    reconciler: Reconciler,
    metrics: OperatorMetrics,
    interval: float,
    peering_lifetime: int = PEERING_LIFETIME,
) -> None:
    """Reconcile on resume (operator start), create, spec update, and every `interval` seconds; log in
    with the `kubernetes` client's credentials (in-cluster service account or kubeconfig)."""

    def configure_operator(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings, peering_lifetime)

    locks = PassLocks()
    kopf.on.login(registry=registry)(kopf.login_via_client)
    kopf.on.startup(registry=registry)(configure_operator)
    for trigger, on in (("resume", kopf.on.resume), ("create", kopf.on.create), ("update", kopf.on.update)):
        on(*RESOURCE, id=f"reconcile-on-{trigger}", registry=registry)(_handler(reconciler, metrics, trigger, locks))
    kopf.timer(*RESOURCE, id="reconcile-on-timer", interval=interval, registry=registry)(
        _handler(reconciler, metrics, "timer", locks)
    )
    job_metrics.register(registry, metrics.jobs, RESOURCE)
