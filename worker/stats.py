"""What a learner has done, for logs, metrics and tests: counters written by the training thread and by
the background syncs, read as consistent snapshots."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple


class Version(NamedTuple):
    """A global fragment version as the shard names it: merges counted within one shard incarnation."""

    incarnation: int
    version: int


@dataclass
class LearnerStats:
    """Counters of one learner (one rank). Pushes and bytes are counted on the island's rank 0 only; the
    outcomes of syncs and the versions are the same on every rank."""

    inner_steps: int = 0
    tokens: int = 0
    syncs_pushed: int = 0
    syncs_merged: int = 0
    syncs_resynced: int = 0
    syncs_abandoned: int = 0
    syncs_failed: int = 0
    syncs_refused: int = 0  # of the failed: a shard refused the island's token (UNAUTHENTICATED)
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    blocked_seconds: float = 0.0
    feedback_lost_values: int = 0  # error-feedback values a restart dropped (diloco.worker.error_feedback)
    rounds_begun: int = 0
    round_inner_steps: int = 0
    round_steps: int = 0  # inner steps per round the island runs now: H, or fewer when speed-aware and slow
    phase_offset_seconds: float = 0.0  # how late the island's last measured push came to its round (rank 0)
    versions: dict[int, Version] = field(default_factory=dict)
    last_refusal_unix: float = 0.0  # when a shard last refused the island's token (0: never)


_COUNTERS = frozenset(
    f.name
    for f in fields(LearnerStats)
    if f.name not in ("versions", "round_steps", "phase_offset_seconds", "last_refusal_unix")
)


class StatsRecorder:
    """Thread-safe updates of a `LearnerStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = LearnerStats()

    def add(self, **amounts: float) -> None:
        unknown = amounts.keys() - _COUNTERS
        if unknown:
            raise AttributeError(f"LearnerStats has no counter {sorted(unknown)}")
        with self._lock:
            for name, amount in amounts.items():
                setattr(self._stats, name, getattr(self._stats, name) + amount)

    def set_round_steps(self, steps: int) -> None:
        with self._lock:
            self._stats.round_steps = steps

    def set_phase_offset(self, seconds: float) -> None:
        with self._lock:
            self._stats.phase_offset_seconds = seconds

    def refused(self, at_unix: float) -> None:
        """A shard refused a round for the island's token, at `at_unix`: counted, and the time kept."""
        with self._lock:
            self._stats.syncs_refused += 1
            self._stats.last_refusal_unix = at_unix

    def set_version(self, fragment: int, version: Version) -> None:
        with self._lock:
            self._stats.versions[fragment] = version

    def snapshot(self) -> LearnerStats:
        with self._lock:
            return replace(self._stats, versions=dict(self._stats.versions))
