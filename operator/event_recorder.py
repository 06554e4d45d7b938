"""Posting the operator's Events on a job, a repeated one aggregated (`events.py` says how): a create for the
first occurrence, a merge patch of `count` and `lastTimestamp` for each next one."""

from __future__ import annotations

import datetime
import logging
import threading

from diloco.operator.events import Event, RecentEvents, count_of, event_name, first_occurrence, repetition
from diloco.operator.kube import ApiError, Kube
from diloco.operator.naming import JobRef

log = logging.getLogger("diloco.operator")


class EventRecorder:
    """Posts Events through `kube`, remembering the counts of the recent ones (so a repetition costs one
    patch) and reading back any other that exists already (after a restart, or once forgotten)."""

    def __init__(self, kube: Kube, recent: RecentEvents | None = None) -> None:
        self.kube = kube
        self.recent = recent or RecentEvents()
        self._guard = threading.Lock()

    def post(self, job: JobRef, event: Event, now: datetime.datetime) -> None:
        """A refused call is logged, never raised: an Event explains a pass, it does not decide it."""
        try:
            self._post(job, event, now)
        except ApiError as error:
            if error.namespace_terminating:  # nobody will read it: the namespace and the job are going
                return
            log.warning("event not posted", extra={"job": job.name, "reason": event.reason, "error": str(error)})

    def _post(self, job: JobRef, event: Event, now: datetime.datetime) -> None:
        name = event_name(job, event)
        with self._guard:
            count = self.recent.count(name)
        if count is None:
            if self.kube.create(first_occurrence(job, event, now)) is not None:
                self._remember(name, 1)
                return
            live = self.kube.get("Event", job.namespace, name)
            count = count_of(live) if live is not None else None
        if count is not None and self.kube.patch("Event", job.namespace, name, repetition(count, now)) is not None:
            self._remember(name, count + 1)
            return
        # Gone meanwhile (the API server's Event TTL): this occurrence starts a new one.
        self.kube.create(first_occurrence(job, event, now))
        self._remember(name, 1)

    def _remember(self, name: str, count: int) -> None:
        with self._guard:
            self.recent.remember(name, count)
