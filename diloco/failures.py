"""Failure traces: which process is killed when, and for how long it stays down.

A trace is data, made before a run, so that a run and its baselines (and the simulator) replay exactly the
same failures. Targets name a worker by island and rank (`worker:island-1/0`) or a syncer shard
(`syncer:0`); the data-parallel baseline maps worker targets onto its own ranks.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True, order=True)
class FailureEvent:
    at: float  # seconds after training starts
    target: str  # "worker:<island>/<rank>" or "syncer:<shard>"
    downtime: float  # seconds before the replacement process starts (rescheduling, image pull, ...)

    def __post_init__(self) -> None:
        kind, _, name = self.target.partition(":")
        if kind not in ("worker", "syncer") or not name:
            raise ValueError(f"a failure target is worker:<island>/<rank> or syncer:<shard>, got {self.target!r}")
        if self.at < 0 or self.downtime < 0:
            raise ValueError(f"failure times must be non-negative: {self}")


def worker_target(island: str, rank: int) -> str:
    return f"worker:{island}/{rank}"


def syncer_target(shard: int) -> str:
    return f"syncer:{shard}"


def random_trace(
    *,
    seed: int,
    duration: float,
    mean_interval: float,
    workers: Sequence[str],
    downtime: float,
    syncer_kills: Sequence[tuple[float, int]] = (),
    syncer_downtime: float = 2.0,
) -> list[FailureEvent]:
    """Worker kills as a Poisson process (exponential gaps of `mean_interval` seconds, uniform target) up to
    `duration`, plus syncer kills at given (time, shard); deterministic for a seed."""
    rng = random.Random(seed)
    events = [FailureEvent(at, syncer_target(shard), syncer_downtime) for at, shard in syncer_kills]
    at = rng.expovariate(1.0 / mean_interval) if mean_interval > 0 and workers else duration
    while at < duration:
        events.append(FailureEvent(round(at, 3), rng.choice(list(workers)), downtime))
        at += rng.expovariate(1.0 / mean_interval)
    return sorted(events)


def save_trace(path: Path, events: Sequence[FailureEvent]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(e) for e in events], indent=1))


def load_trace(path: Path) -> list[FailureEvent]:
    return sorted(FailureEvent(**item) for item in json.loads(Path(path).read_text()))
