"""SIGTERM as a request to stop, with the deadline the pod's termination grace period sets.

Kubernetes sends SIGTERM when a pod goes (the job finished or was suspended, a node drains, an island
re-forms) and SIGKILL `terminationGracePeriodSeconds` later. A worker that stops at once loses the steps
since each fragment's last sync and stays in the shards' live set for `islandTimeoutSeconds`; one that
finishes its step, pushes those steps and says Leave within the grace period loses nothing. The operator
passes the pod's grace period down as DILOCO_TERMINATION_GRACE_SECONDS, so that one setting bounds both.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

log = logging.getLogger("diloco.worker")

LEAVE_RESERVE_SECONDS = 5.0
"""Of the grace period, what is kept back for saying Leave and exiting after the flush."""


class StopRequest:
    """Set by SIGTERM (or SIGINT) and read by the training loop between steps."""

    def __init__(self, grace_seconds: float) -> None:
        if grace_seconds < 0:
            raise ValueError(f"the termination grace period is a duration >= 0, got {grace_seconds}")
        self.grace_seconds = grace_seconds
        self.signalled_at: float | None = None

    def install(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        """Handles `signals` from now on; only the main thread may call it."""
        for signum in signals:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()
            log.info("stop requested: finishing the step, then flushing", extra={"signal": signum})

    @property
    def requested(self) -> bool:
        return self.signalled_at is not None

    @property
    def leave_reserve(self) -> float:
        """Seconds kept for Leave and the exit: 5, or half the grace period when that is shorter."""
        return min(LEAVE_RESERVE_SECONDS, self.grace_seconds / 2)

    def flush_budget(self) -> float:
        """Seconds the last pushes may take now: what is left of the grace period since the signal (whole on
        a rank that stops because another was signalled), less the Leave reserve; never negative."""
        spent = 0.0 if self.signalled_at is None else time.monotonic() - self.signalled_at
        return max(0.0, self.grace_seconds - self.leave_reserve - spent)
