"""Failure traces: what is interrupted when, and how long until its replacement is ready.

A trace is data, made before a run, so that a run, its baselines and the failure simulator replay exactly the
same failures. It is one JSON list of events, `{"at": seconds, "target": "...", "downtime": seconds}`, one
event per line. A target names:

- `worker:<island>/<rank>`: one worker process of `diloco run` (its island fails with it; the data-parallel
  baseline, one world, fails whole);
- `syncer:<shard>`: a syncer shard process of `diloco run`;
- `learner:<index>`: a learner of the simulator (an island: the unit that fails together);
- `chip:<index>`: one chip of the simulator's fleet (it takes out the learner, or elastic replica, holding it).

`diloco run` replays worker and syncer targets; `diloco simulate` replays chip and learner targets, and
worker targets too, read as the learner of that island (`diloco.sim.engine` maps them), so a trace written
for a run can be replayed by the simulator.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("worker", "syncer", "learner", "chip")
_FORMS = "worker:<island>/<rank>, syncer:<shard>, learner:<index> or chip:<index>"
_NAME = {
    "worker": re.compile(r"[^/\s]+/\d+"),
    "syncer": re.compile(r"\d+"),
    "learner": re.compile(r"\d+"),
    "chip": re.compile(r"\d+"),
}


@dataclass(frozen=True, order=True)
class FailureEvent:
    at: float  # seconds after training starts
    target: str  # one of the forms in the module docstring
    downtime: float  # seconds before the replacement starts (rescheduling, image pull, ...)

    def __post_init__(self) -> None:
        kind, _, name = self.target.partition(":")
        if kind not in _NAME or not _NAME[kind].fullmatch(name):
            raise ValueError(f"a failure target is {_FORMS}, got {self.target!r}")
        if not (self.at >= 0 and self.downtime >= 0):  # also refuses NaN
            raise ValueError(f"failure times must be non-negative: {self}")

    @property
    def kind(self) -> str:
        """`worker`, `syncer`, `learner` or `chip`."""
        return self.target.partition(":")[0]

    @property
    def index(self) -> int:
        """The shard, learner or chip number (for a worker: its rank)."""
        return int(self.target.rpartition("/")[2] if self.kind == "worker" else self.target.partition(":")[2])

    @property
    def island(self) -> str:
        """The island of a worker target."""
        return worker_island(self.target)


def worker_target(island: str, rank: int) -> str:
    return f"worker:{island}/{rank}"


def worker_island(target: str) -> str:
    """`worker:<island>/<rank>` -> `<island>`."""
    kind, _, rest = target.partition(":")
    if kind != "worker":
        raise ValueError(f"{target!r} is not a worker target")
    return rest.rpartition("/")[0]


def syncer_target(shard: int) -> str:
    return f"syncer:{shard}"


def learner_target(index: int) -> str:
    return f"learner:{index}"


def chip_target(index: int) -> str:
    return f"chip:{index}"


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
    """Kills as a Poisson process (exponential gaps of `mean_interval` seconds, uniform target among
    `workers`, which may be any targets) up to `duration`, plus syncer kills at given (time, shard);
    deterministic for a seed."""
    rng = random.Random(seed)
    events = [FailureEvent(at, syncer_target(shard), syncer_downtime) for at, shard in syncer_kills]
    at = rng.expovariate(1.0 / mean_interval) if mean_interval > 0 and workers else duration
    while at < duration:
        events.append(FailureEvent(round(at, 3), rng.choice(list(workers)), downtime))
        at += rng.expovariate(1.0 / mean_interval)
    return sorted(events)


def save_trace(path: str | Path, events: Iterable[FailureEvent]) -> None:
    """Writes the events as a JSON list, one event per line (times round-trip exactly)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(json.dumps(asdict(e)) for e in events)
    path.write_text(f"[\n{lines}\n]\n" if lines else "[]\n")


def load_trace(path: str | Path) -> list[FailureEvent]:
    """Reads a trace written by `save_trace` (or by hand), sorted by time; a bad event is refused with its
    position in the file."""
    try:
        items = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a JSON failure trace ({error})") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: a trace is a JSON list of events")
    events = []
    for number, item in enumerate(items):
        try:
            if not isinstance(item, dict) or set(item) != {"at", "target", "downtime"}:
                raise ValueError('an event is {"at": seconds, "target": "...", "downtime": seconds}')
            events.append(FailureEvent(float(item["at"]), str(item["target"]), float(item["downtime"])))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: event {number}: {error}") from None
    return sorted(events)
