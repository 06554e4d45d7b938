"""TensorBoard event files from progress events, written as they come, so that an ML engineer watches the training
curves where they look for them (`tensorboard --logdir ...`) rather than in a summary's PNG at the end: by
`diloco run` for every island and the job (under `<out>/<mode>/tensorboard/`), and by an island's rank 0 on
Kubernetes when the job gives it a folder (`DILOCO_TENSORBOARD_DIR`, on a volume its podTemplate mounts).

One TensorBoard run per island (its rank 0's training loss, held-out loss, learning rate and tokens per second,
against the island's inner step) and, with `job`, one for the job as a whole, `global` (the islands' mean
training loss, the latest held-out losses' mean, and the islands' tokens per second summed, against the inner
steps of every island together: `diloco run`'s progress bar count)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.progress import EvalEvent, ProgressEvent, StepEvent

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

GLOBAL = "global"


class TrainingCurves:
    """Turns progress events into TensorBoard scalars, one writer per island and one for the job."""

    def __init__(self, folder: Path, learning_rate: Callable[[int], float] | None = None, job: bool = True) -> None:
        self.folder = folder
        self.learning_rate = learning_rate  # of the built-in trainer at a step; None: a loop of one's own
        self.job = job  # also the `global` run: where every island's events come here
        self._writers: dict[str, SummaryWriter] = {}
        self._steps: dict[str, int] = {}
        self._losses: dict[str, float] = {}
        self._eval_losses: dict[str, float] = {}
        self._rates: dict[str, float] = {}

    def _writer(self, run: str) -> SummaryWriter:
        if run not in self._writers:
            from torch.utils.tensorboard import SummaryWriter

            # Flushed every 10 s rather than 120: the curves are for watching as the run goes.
            self._writers[run] = SummaryWriter(log_dir=str(self.folder / run), flush_secs=10)
        return self._writers[run]

    def write(self, events: Iterable[ProgressEvent]) -> None:
        """Adds what `events` say: each island's rank 0 speaks for its island (every rank takes its steps)."""
        for event in events:
            if event.source.rank != 0 or not isinstance(event, StepEvent | EvalEvent):
                continue
            island, writer = event.source.island, self._writer(event.source.island)
            if isinstance(event, StepEvent):
                self._steps[island] = event.step
                if math.isfinite(event.loss):
                    self._losses[island] = event.loss
                    writer.add_scalar("loss", event.loss, event.step)
                writer.add_scalar("tokens_per_second", event.tokens_per_second, event.step)
                self._rates[island] = event.tokens_per_second
                if self.learning_rate is not None:
                    writer.add_scalar("learning_rate", self.learning_rate(event.step - 1), event.step)
            else:
                self._eval_losses[island] = event.loss
                writer.add_scalar("held_out_loss", event.loss, event.step)
            if self.job:
                self._write_global(isinstance(event, EvalEvent))

    def _write_global(self, evaluated: bool) -> None:
        writer, step = self._writer(GLOBAL), sum(self._steps.values())
        if self._losses:
            writer.add_scalar("loss", sum(self._losses.values()) / len(self._losses), step)
        writer.add_scalar("tokens_per_second", sum(self._rates.values()), step)
        if evaluated:
            writer.add_scalar("held_out_loss", sum(self._eval_losses.values()) / len(self._eval_losses), step)

    def write_final(self, global_eval_loss: float | None) -> None:
        """The global model's held-out loss at the end (the shards' merged model, evaluated once)."""
        if global_eval_loss is not None and math.isfinite(global_eval_loss):
            self._writer(GLOBAL).add_scalar("global_model_held_out_loss", global_eval_loss, sum(self._steps.values()))

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
