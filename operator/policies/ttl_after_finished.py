"""spec.ttlSecondsAfterFinished: a finished job deletes itself once its TTL has passed."""

from __future__ import annotations

import datetime

from diloco.api.conditions import Reason
from diloco.api.job import DiLoCoJobStatus
from diloco.operator.events import Event


def ttl_expires_at(status: DiLoCoJobStatus, ttl_seconds: int | None) -> datetime.datetime | None:
    """When a finished job is to be deleted, or None (not finished, or no TTL)."""
    if ttl_seconds is None or not status.phase.finished or status.completion_time is None:
        return None
    return status.completion_time + datetime.timedelta(seconds=ttl_seconds)


def deletion_due(status: DiLoCoJobStatus, ttl_seconds: int | None, now: datetime.datetime) -> Event | None:
    """The Event announcing the job's deletion once its TTL has expired, or None while it is to be kept."""
    expires = ttl_expires_at(status, ttl_seconds)
    if expires is None or now < expires:
        return None
    return Event(
        "Normal",
        Reason.TTL_EXPIRED,
        f"deleting the job ttlSecondsAfterFinished={ttl_seconds}s after it {status.phase.value.lower()}",
    )
