"""Progress events: what a worker reports as it trains, one JSON object per line of its progress file, so
that the local runner can draw its bar, goodput accounting can count useful time, and the run predictor
and the benchmarks can measure the machine, all without parsing logs.

A line is `{"event": <kind>, "t": <unix time>, "island", "rank", "mode", "pid", <the kind's fields>}`;
each kind is a record below. The worker writes with `ProgressWriter`, which flushes every line as it
is written, so a worker killed with SIGKILL loses at most the line it was writing; everyone else reads with
`read_events` or, while the run goes on, `ProgressFollower`.

A line counts once it ends in a newline. A complete line that is not an event is skipped with the reason
kept (`ProgressFollower.skipped`), not refused: a relaunched worker appends to the file its killed
predecessor left, so a line cut short by the kill runs into the next process's first one, and a kind this
reader does not know comes from a newer worker and must not stop the accounting of a run. Fields that
older workers did not write yet (a step's `sync_seconds` and rates, a round's `version`, a start's `versions`
and device) read as their defaults, so old run folders still read.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ClassVar, Concatenate, ParamSpec

_P = ParamSpec("_P")


@dataclass(frozen=True)
class Source:
    """Which worker wrote an event: its slot (island and rank in the island), the run mode, its process. A
    syncer shard writes as island `shard-<index>`, rank 0, mode `syncer`."""

    island: str
    rank: int
    mode: str
    pid: int

    @property
    def slot(self) -> tuple[str, int]:
        """The worker position, which outlives the processes a kill and a relaunch put in it."""
        return self.island, self.rank


@dataclass(frozen=True)
class ProgressEvent:
    """What every event carries: when it was written (unix seconds) and by whom. `kind` is the
    discriminator, the line's `"event"`."""

    kind: ClassVar[str]
    t: float
    source: Source

    def payload(self) -> dict[str, Any]:
        """The kind's own fields, as the line holds them after the header."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _HEADER}

    @classmethod
    def from_payload(cls, t: float, source: Source, payload: dict[str, Any]) -> ProgressEvent:
        """The record of this kind from a line's own fields (lists as tuples: records are frozen)."""
        values = {name: tuple(v) if isinstance(v, list) else v for name, v in payload.items()}
        return cls(t, source, **values)


_HEADER = tuple(f.name for f in fields(ProgressEvent))


@dataclass(frozen=True)
class StartEvent(ProgressEvent):
    """A process began training at `step` in a world of `world` ranks, holding these fragment versions, on
    this device and precision; `flops_per_token` and `peak_flops` (None: unknown) turn its tokens per second
    into model FLOPs utilisation; `warm`: it restored its optimizer state from a checkpoint."""

    kind: ClassVar[str] = "start"
    step: int
    world: int
    versions: tuple[int, ...] = ()  # global version of each fragment, fragment 0 first (none in ddp)
    device: str = ""
    precision: str = ""
    flops_per_token: float = 0.0
    peak_flops: float | None = None
    warm: bool = False
    data_epoch: int = 0  # where the island takes up its share of the training set (diloco.worker.data)
    data_window: int = 0


@dataclass(frozen=True)
class StepEvent(ProgressEvent):
    """One inner step: its training loss, the tokens it consumed, its wall time and the part of that spent
    blocked on a sync; the rank's tokens per second and MFU over its last steps (None: peak unknown); whether
    its compute outlasted the emulated device's step (`diloco.worker.slowdown`)."""

    kind: ClassVar[str] = "step"
    step: int
    loss: float
    tokens: int
    seconds: float
    sync_seconds: float = 0.0
    tokens_per_second: float = 0.0
    mfu: float | None = None
    overran: bool = False
    data_from: tuple[int, int] = (0, 0)  # the island's data position (epoch, window) before and after the step
    data_to: tuple[int, int] = (0, 0)

    @property
    def compute_seconds(self) -> float:
        """The step's wall time less the time blocked on a sync: what goodput counts and the simulator models."""
        return max(0.0, self.seconds - self.sync_seconds)


@dataclass(frozen=True)
class EvalEvent(ProgressEvent):
    """The held-out loss of the island's model after `step`."""

    kind: ClassVar[str] = "eval"
    step: int
    loss: float


@dataclass(frozen=True)
class RoundEvent(ProgressEvent):
    """How a fragment's sync round ended: the steps up to `began_at` reached the global model iff it merged."""

    kind: ClassVar[str] = "round"
    fragment: int
    began_at: int
    outcome: str  # MERGED, RESYNCED, ABANDONED or FAILED
    version: int | None = None  # the global version adopted, when the outcome adopts one

    @property
    def merged(self) -> bool:
        return self.outcome == "MERGED"


@dataclass(frozen=True)
class PushEvent(ProgressEvent):
    """Rank 0 of an island began pushing a fragment's progress over the steps up to `began_at`; the push is
    named as its shard names it (the island, its base's `incarnation` and `base_version`, its `sequence`),
    so that the shard's `MergeEvent` says whether those steps reached the global model, also when this
    process was killed before it heard so."""

    kind: ClassVar[str] = "push"
    fragment: int
    began_at: int
    incarnation: int
    base_version: int
    sequence: int


PushKey = tuple[str, int, int, int]
"""A push as a shard names it: (island, base incarnation, base version, sequence)."""


@dataclass(frozen=True)
class MergeEvent(ProgressEvent):
    """A syncer shard merged these pushes into `fragment`, making its global `version` (the local runner
    has each shard write these beside the workers' events, under its own source)."""

    kind: ClassVar[str] = "merge"
    fragment: int
    version: int
    pushes: tuple[PushKey, ...] = ()
    landed: int = 0  # of the pushes, the islands' last, landed on their mean (`diloco.core.outer_optimizer.land`)

    @classmethod
    def from_payload(cls, t: float, source: Source, payload: dict[str, Any]) -> MergeEvent:
        own = {name: v for name, v in payload.items() if name != "pushes"}
        pushes = tuple((str(i), int(n), int(v), int(q)) for i, n, v, q in payload.get("pushes", ()))
        return cls(t, source, **own, pushes=pushes)


@dataclass(frozen=True)
class CheckpointEvent(ProgressEvent):
    """The data-parallel baseline saved its model at `step`."""

    kind: ClassVar[str] = "checkpoint"
    step: int


@dataclass(frozen=True)
class LearnerTotals:
    """A DiLoCo learner's counters when its process finished (the worker's `LearnerStats`, less versions)."""

    inner_steps: int
    tokens: int
    syncs_pushed: int
    syncs_merged: int
    syncs_resynced: int
    syncs_abandoned: int
    syncs_failed: int
    bytes_pushed: int
    bytes_pulled: int
    blocked_seconds: float
    rounds_begun: int = 0  # fragment rounds begun (rank 0 of an island)
    round_inner_steps: int = 0  # their inner steps per round together: below H per round on a slow speed-aware island

    @classmethod
    def of(cls, stats: object) -> LearnerTotals:
        """The totals of a learner's counters (`diloco.worker.stats.LearnerStats`, read by name)."""
        return cls(**{f.name: getattr(stats, f.name) for f in fields(cls)})


_TOTALS = tuple(f.name for f in fields(LearnerTotals))


@dataclass(frozen=True)
class DoneEvent(ProgressEvent):
    """A process finished its steps: the held-out loss of its final model, and its learner's counters
    (none in data-parallel), which the line holds flat beside `step` and `loss`."""

    kind: ClassVar[str] = "done"
    step: int
    loss: float
    learner: LearnerTotals | None = None

    def payload(self) -> dict[str, Any]:
        own = {name: v for name, v in super().payload().items() if name != "learner"}
        return own | (asdict(self.learner) if self.learner is not None else {})

    @classmethod
    def from_payload(cls, t: float, source: Source, payload: dict[str, Any]) -> DoneEvent:
        own = {name: v for name, v in payload.items() if name not in _TOTALS}
        totals = {name: v for name, v in payload.items() if name in _TOTALS}
        return cls(t, source, **own, learner=LearnerTotals(**totals) if totals else None)


EVENT_KINDS: dict[str, type[ProgressEvent]] = {
    cls.kind: cls
    for cls in (StartEvent, StepEvent, EvalEvent, RoundEvent, PushEvent, MergeEvent, CheckpointEvent, DoneEvent)
}
_SOURCE = tuple(f.name for f in fields(Source))


class ProgressLineError(ValueError):
    """A line that is not a progress event this reader knows, and why."""


def to_line(event: ProgressEvent) -> str:
    """The event as its progress file holds it, newline included."""
    return json.dumps({"event": event.kind, "t": event.t, **asdict(event.source), **event.payload()}) + "\n"


def parse_line(line: str) -> ProgressEvent:
    """The record a line holds; ProgressLineError says why when it holds none."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ProgressLineError(f"not JSON ({e})") from None
    if not isinstance(record, dict):
        raise ProgressLineError(f"not a JSON object: {line.strip()[:80]}")
    kind = record.pop("event", None)
    if kind not in EVENT_KINDS:
        raise ProgressLineError(f"unknown event kind {kind!r} (known: {', '.join(EVENT_KINDS)})")
    missing = [name for name in ("t", *_SOURCE) if name not in record]
    if missing:
        raise ProgressLineError(f"{kind} event without {', '.join(missing)}")
    t = record.pop("t")
    source = Source(**{name: record.pop(name) for name in _SOURCE})
    try:
        return EVENT_KINDS[kind].from_payload(t, source, record)
    except (TypeError, ValueError) as e:  # a field missing, unexpected or malformed for the kind
        raise ProgressLineError(f"{kind} event: {e}") from None


class ProgressWriter:
    """Appends a worker's events to its progress file, one flushed line each (nothing when there is no file).

    The writer stamps each event with the time and the worker it comes from: `write(StepEvent, step=...)`
    takes an event class and the kind's own fields. `sink`, when given, is handed each event too (the
    island's TensorBoard curves), with or without a file."""

    def __init__(
        self,
        path: Path | None,
        source: Source,
        clock: Callable[[], float] = time.time,
        sink: Callable[[ProgressEvent], None] | None = None,
    ) -> None:
        self.source = source
        self._clock = clock
        self._sink = sink
        self._file: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)  # line-buffered: each line reaches the file whole

    def write(
        self, kind: Callable[Concatenate[float, Source, _P], ProgressEvent], /, *args: _P.args, **own: _P.kwargs
    ) -> None:
        if self._file is None and self._sink is None:
            return
        event = kind(self._clock(), self.source, *args, **own)
        if self._file is not None:
            self._file.write(to_line(event))
        if self._sink is not None:
            self._sink(event)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> ProgressWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True)
class SkippedLine:
    """A complete line that held no event, where it was and why."""

    path: Path
    line: int  # 1-based
    reason: str


class ProgressFollower:
    """Reads the progress files of a folder as they grow: each `poll` returns the events completed since the
    last one, file by file in name order, and leaves a line still without its newline for a later poll."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.skipped: list[SkippedLine] = []
        self._offsets: dict[Path, int] = {}
        self._lines: dict[Path, int] = {}

    def poll(self) -> list[ProgressEvent]:
        events: list[ProgressEvent] = []
        for path in sorted(self.folder.glob("*.jsonl")):
            events += self._read_on(path)
        return events

    def _read_on(self, path: Path) -> list[ProgressEvent]:
        """The events of the lines completed in `path` since the last poll."""
        with open(path, "rb") as f:
            f.seek(self._offsets.get(path, 0))
            complete, newline, _partial = f.read().rpartition(b"\n")
        if not newline:
            return []
        self._offsets[path] = self._offsets.get(path, 0) + len(complete) + len(newline)
        events = []
        for raw in complete.split(b"\n"):
            self._lines[path] = number = self._lines.get(path, 0) + 1
            try:
                events.append(parse_line(raw.decode()))
            except (ProgressLineError, UnicodeDecodeError) as e:
                self.skipped.append(SkippedLine(path, number, str(e)))
        return events


def read_events(folder: Path) -> list[ProgressEvent]:
    """Every event of every progress file under `folder` (see the module for the lines it skips)."""
    return ProgressFollower(folder).poll()
