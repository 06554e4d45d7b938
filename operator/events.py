"""A Kubernetes Event the operator posts on the job to explain a decision, and how a repeated one is
aggregated: pure, the calls are in `event_recorder.py`.

The same Event (job, type, reason, message) posted again is one core/v1 Event whose `count` and
`lastTimestamp` grow, as client-go's event recorder does, not a new object per pass. Its name is derived from
what it says, so an operator that restarted (or forgot it) finds it again; it lives as long as the API
server keeps Events (`--event-ttl`, an hour by default) after its last occurrence, and the next occurrence
after that starts a new one.
"""

from __future__ import annotations

import datetime
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from diloco.api.conditions import Reason
from diloco.api.job import API_GROUP, API_VERSION, KIND
from diloco.operator.naming import MANAGER, JobRef

RECENT_EVENTS = 4096
"""Event names whose count the operator remembers (client-go's cache size): beyond it, the oldest is read back
from the API server on its next occurrence instead."""
MAX_FAILURE_DETAIL = 1024
"""Characters of an error an Event quotes: client-go's recorder cuts an Event's note to as many."""


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def reconcile_failed(error: BaseException) -> Event:
    """The Event of a pass that raised: the error's type and first line, the same for every pass that fails
    alike, so repeated failures aggregate into one Event (a traceback belongs in the log)."""
    detail = (str(error).strip().splitlines() or [""])[0]
    detail = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
    if len(detail) > MAX_FAILURE_DETAIL:
        detail = detail[: MAX_FAILURE_DETAIL - 1] + "…"
    return Event("Warning", Reason.RECONCILE_FAILED, f"a reconcile pass failed and will be retried: {detail}")


def event_name(job: JobRef, event: Event) -> str:
    """`<job>.<digest of the job's uid, type, reason and message>`: the same Event always has the same name."""
    key = "\0".join((job.uid, event.type, event.reason, event.message))
    return f"{job.name}.{hashlib.sha256(key.encode()).hexdigest()[:20]}"


def _time(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def first_occurrence(job: JobRef, event: Event, now: datetime.datetime) -> dict[str, Any]:
    """The Event to create when none of its name exists: count 1."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name(job, event), "namespace": job.namespace},
        "involvedObject": {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "name": job.name,
            "namespace": job.namespace,
            "uid": job.uid,
        },
        "type": event.type,
        "reason": event.reason,
        "message": event.message,
        "count": 1,
        "firstTimestamp": _time(now),
        "lastTimestamp": _time(now),
        "source": {"component": MANAGER},
        "reportingComponent": MANAGER,
    }


def repetition(count: int, now: datetime.datetime) -> dict[str, Any]:
    """The merge patch of an Event seen `count` times so far that occurs once more."""
    return {"count": count + 1, "lastTimestamp": _time(now)}


def count_of(live: dict[str, Any]) -> int:
    """How many times a stored Event occurred (an Event without a count occurred once)."""
    return max(1, int(live.get("count") or 1))


class RecentEvents:
    """The last count written of the `size` most recently posted Event names (least recently used dropped):
    None for a name not held, whose Event is then created, or read back when it exists already."""

    def __init__(self, size: int = RECENT_EVENTS) -> None:
        self.size = size
        self._counts: OrderedDict[str, int] = OrderedDict()

    def count(self, name: str) -> int | None:
        if name in self._counts:
            self._counts.move_to_end(name)
        return self._counts.get(name)

    def remember(self, name: str, count: int) -> None:
        self._counts[name] = count
        self._counts.move_to_end(name)
        while len(self._counts) > self.size:
            self._counts.popitem(last=False)

    def forget(self, name: str) -> None:
        self._counts.pop(name, None)

    def __len__(self) -> int:
        return len(self._counts)
