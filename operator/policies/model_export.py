"""spec.export: a job that succeeds writes its trained model to the volume its spec names.

The export reads the shards' final checkpoints, so it starts only once no shard pod is left: each wrote a
clean checkpoint on SIGTERM and released its volume (ReadWriteOnce) for the export pod. It runs as a batch
Job of the job's own; its outcome, and where the model went, are in status.export.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from diloco.api.job import MAX_CONDITION_MESSAGE, DiLoCoJobSpec, ExportPhase, ExportStatus, Phase

WAITING_FOR_SHARDS = "waiting for the syncer shards to stop and write their final checkpoints"


def export_location(spec: DiLoCoJobSpec, job: str) -> str | None:
    """`<claim>:/<path>`, where the model goes; None when the spec names no export."""
    if spec.export is None:
        return None
    return f"{spec.export.claim_name}:/{spec.export.path or job}"


def export_due(spec: DiLoCoJobSpec, phase: Phase, *, shards_stopped: bool, started: bool) -> bool:
    """Whether the export Job is to exist: the job succeeded and names an export, and its shards have
    stopped, none to come back (or the export has `started`: it is kept until the job goes)."""
    return spec.export is not None and phase is Phase.SUCCEEDED and (started or shards_stopped)


def export_status(
    spec: DiLoCoJobSpec,
    job: str,
    phase: Phase,
    batch_job: Mapping[str, Any] | None,
    previous: ExportStatus | None,
    now: datetime.datetime,
) -> ExportStatus | None:
    """status.export from the export Job as observed (None: none exists yet); None unless the job succeeded
    and names an export. A finished export keeps its outcome."""
    location = export_location(spec, job)
    if location is None or phase is not Phase.SUCCEEDED:
        return None
    if previous is not None and previous.location == location and previous.phase is ExportPhase.SUCCEEDED:
        return previous
    if batch_job is None:
        return ExportStatus(phase=ExportPhase.PENDING, location=location, message=WAITING_FOR_SHARDS)
    observed = batch_job.get("status") or {}
    failed = next(
        (c for c in observed.get("conditions") or () if c.get("type") == "Failed" and c.get("status") == "True"),
        None,
    )
    if observed.get("succeeded"):
        return ExportStatus(phase=ExportPhase.SUCCEEDED, location=location, completion_time=now)
    if failed is not None:
        why = f"{failed.get('reason') or 'Failed'}: {failed.get('message') or 'the export pod failed'}"
        return ExportStatus(phase=ExportPhase.FAILED, location=location, message=why[:MAX_CONDITION_MESSAGE])
    return ExportStatus(phase=ExportPhase.RUNNING, location=location)
