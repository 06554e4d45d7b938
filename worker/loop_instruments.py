"""What `diloco run` measures in a loop of one's own, and the slower hardware it emulates there, through the
loop's learner: the loop writes nothing but `learner.report(...)` and `optimizer.step()`, yet the runner
needs the progress events the built-in trainer writes (`diloco.progress`) to draw its bar, count goodput,
plot the loss the loop reports and say where each island resumed.

A learner given these instruments (`Learner.from_env` makes them from the variables of
`diloco.pod_env.RUN_INSTRUMENTS`, which a local run sets and no pod gets) writes a start event once it has
joined and warm-started, a step event per inner step (the loop's reported loss, the tokens it reported, the
step's wall time and the part of it spent in the learner's sync work), round and push events as the built-in
trainer does, and a done event when the loop ends normally. With a slowdown or jitter, each inner step then
sleeps as the built-in trainer's does (`diloco.worker.slowdown`), so `--slowdown` and `--jitter` slow a
loop of one's own the same way.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from diloco import pod_env
from diloco.core.config import Mode
from diloco.progress import (
    DoneEvent,
    LearnerTotals,
    ProgressWriter,
    PushEvent,
    RoundEvent,
    Source,
    StartEvent,
    StepEvent,
)
from diloco.worker.slowdown import jitter_seconds, overran, pause_seconds

if TYPE_CHECKING:  # the learner hands itself in; it imports this module
    from diloco.worker.learner import Learner, PushReport, RoundReport


def write_round(progress: ProgressWriter, report: RoundReport) -> None:
    """A round's end as its progress event: whether the steps up to where it began reached the global model."""
    progress.write(
        RoundEvent,
        fragment=report.fragment,
        began_at=report.began_at_step,
        outcome=report.outcome.name,
        version=report.version,
    )


def write_push(progress: ProgressWriter, report: PushReport) -> None:
    """A push as its progress event, named as its shard names it in the merges it records."""
    progress.write(
        PushEvent,
        fragment=report.fragment,
        began_at=report.began_at_step,
        incarnation=report.incarnation,
        base_version=report.base_version,
        sequence=report.sequence,
    )


class LoopInstruments:
    """A learner's progress events in `progress_file` (`{rank}` in it: the rank in the island; None: none
    written) and its emulated slowness: `slowdown` times slower, each step a random 0 to 2 x `jitter` longer,
    against the emulated device's `reference_step_seconds` when given (`diloco.worker.slowdown`)."""

    def __init__(
        self,
        progress_file: str | None,
        *,
        mode: str = Mode.DILOCO.value,
        slowdown: float = 1.0,
        jitter: float = 0.0,
        reference_step_seconds: float | None = None,
    ) -> None:
        if slowdown < 1.0 or jitter < 0.0 or (reference_step_seconds is not None and reference_step_seconds <= 0):
            raise ValueError(
                f"slowdown is a factor >= 1, jitter a share >= 0 and a reference step positive, got {slowdown}, "
                f"{jitter}, {reference_step_seconds}"
            )
        self.progress_file = progress_file
        self.mode = mode
        self.slowdown = slowdown
        self.jitter = jitter
        self.reference_step_seconds = reference_step_seconds
        self.progress = ProgressWriter(None, Source("", 0, mode, os.getpid()))  # until `started` names the rank
        self._rng = random.Random()
        self._step_began = 0.0
        self._tokens = 0
        self._blocked = 0.0
        self._done = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LoopInstruments | None:
        """From the variables a local run sets (`diloco.pod_env.RUN_INSTRUMENTS`); None without any."""
        if not pod_env.RUN_INSTRUMENTS & env.keys():
            return None
        reference = float(env.get(pod_env.REFERENCE_STEP_SECONDS) or 0) or None
        return cls(
            env.get(pod_env.PROGRESS_FILE) or None,
            mode=env.get(pod_env.MODE) or Mode.DILOCO.value,
            slowdown=float(env.get(pod_env.SLOWDOWN) or 1),
            jitter=float(env.get(pod_env.JITTER) or 0),
            reference_step_seconds=reference,
        )

    @property
    def synchronous(self) -> bool:
        """Whether the loop runs as the synchronous-DiLoCo baseline (a barrier at every sync)."""
        return self.mode == Mode.SYNC_DILOCO

    def started(self, learner: Learner) -> None:
        """The learner has joined, taken the global model and warm-started: where it resumed, and how warm."""
        rank = learner.island.rank
        path = Path(self.progress_file.format(rank=rank)) if self.progress_file else None
        self.progress = ProgressWriter(path, Source(learner.island_id, rank, self.mode, os.getpid()))
        self._rng = random.Random(f"{learner.island_id}/{rank}/{os.getpid()}")
        stats = learner.stats
        self.progress.write(
            StartEvent,
            step=learner.resume_step,
            world=learner.island.size,
            versions=tuple(stats.versions[p].version for p in sorted(stats.versions)),
            warm=learner.resumed_warm,
        )
        self._tokens, self._blocked = stats.tokens, stats.blocked_seconds
        self._step_began = time.perf_counter()

    def stepped(self, learner: Learner) -> None:
        """After the learner's own work on an inner step: the emulated slowness, then the step's event."""
        elapsed = time.perf_counter() - self._step_began
        stats = learner.stats
        synced = stats.blocked_seconds - self._blocked
        pause = pause_seconds(elapsed, self.slowdown, self.reference_step_seconds)
        if self.jitter:
            pause += jitter_seconds(elapsed, self.jitter, self.reference_step_seconds, self._rng)
        if pause > 0:
            time.sleep(pause)
        self.progress.write(
            StepEvent,
            step=learner.inner_step,
            loss=learner.loss,
            tokens=stats.tokens - self._tokens,
            seconds=time.perf_counter() - self._step_began,
            sync_seconds=synced,
            overran=overran(elapsed - synced, self.slowdown, self.reference_step_seconds),
        )
        self._tokens, self._blocked = stats.tokens, stats.blocked_seconds
        self._step_began = time.perf_counter()

    def round(self, report: RoundReport) -> None:
        write_round(self.progress, report)

    def push(self, report: PushReport) -> None:
        write_push(self.progress, report)

    def done(self, learner: Learner) -> None:
        """The loop ended normally (once): its step and the learner's counters. No held-out loss: only the
        loop knows its data (NaN)."""
        if self._done:
            return
        self._done = True
        self.progress.write(DoneEvent, step=learner.inner_step, loss=math.nan, learner=LearnerTotals.of(learner.stats))

    def close(self) -> None:
        self.progress.close()
