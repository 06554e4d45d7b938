"""The built-in trainer: a model preset or a Hugging Face architecture (`diloco.worker.language_model`) on a
token stream read in order (`diloco.worker.data`), as one rank of one island, or as one rank of the
data-parallel baseline that all-reduces every step across every worker.

It reports what it does as progress events (start, step, eval, round, checkpoint, done: `diloco.progress`)
to a progress file, so a launcher can draw progress, measure goodput and plot losses without parsing logs; a
line is flushed as soon as it is written, so a worker killed with SIGKILL loses at most the line it was
writing.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from diloco.core.config import InnerOptimizerConfig, Mode, Precision, TrainingConfig
from diloco.progress import (
    CheckpointEvent,
    DoneEvent,
    EvalEvent,
    LearnerTotals,
    ProgressWriter,
    Source,
    StartEvent,
    StepEvent,
)
from diloco.settings import DEFAULT_CORPUS_BYTES
from diloco.transport.tls import Security
from diloco.worker.adamw import AdamW
from diloco.worker.curves import TrainingCurves
from diloco.worker.data import (
    EVAL_WINDOWS,
    DataPosition,
    IslandReader,
    evaluate,
    load_position,
    load_tokens,
    position_path,
    save_position,
    split_holdout,
)
from diloco.worker.island import Island
from diloco.worker.language_model import LanguageModel, ModelSpec, build
from diloco.worker.learner import CHECKPOINT_EVERY, SYNCHRONOUS_SYNC_SECONDS, Learner, PushReport, RoundReport
from diloco.worker.loop_instruments import write_push, write_round
from diloco.worker.metrics import WorkerSnapshot
from diloco.worker.pod_ranks import local_position, place
from diloco.worker.precision import autocast, resolve_precision
from diloco.worker.shutdown import StopRequest
from diloco.worker.slowdown import jitter_seconds, overran, pause_seconds
from diloco.worker.throughput import Rate, ThroughputMeter, peak_flops
from diloco.worker.tokenizer import tokenizer_for

log = logging.getLogger("diloco.worker")


@dataclass(frozen=True)
class TrainerSettings:
    """What the built-in trainer does, apart from the DiLoCo knobs (TrainingConfig) and the syncers."""

    mode: str = Mode.DILOCO.value
    model: str = "tiny"  # a preset, a transformers configuration inline, or a config.json (ModelSpec.parse)
    init_from: str | None = None  # a Hugging Face checkpoint folder to start from
    tokenizer: str | None = None  # a tokenizer.json; unset: the preset's (bytes, or the committed BPE)
    data: str | None = None
    text_field: str = "text"  # of .jsonl and .parquet shards
    data_shard: int = 0  # this island's share of the training set: shard data_shard of data_shards
    data_shards: int = 1
    max_data_bytes: int = DEFAULT_CORPUS_BYTES
    batch_size: int = 16
    steps: int | None = None  # None: train until stopped (SIGTERM), as on Kubernetes
    eval_every: int = 50
    eval_windows: int = EVAL_WINDOWS
    seed: int = 0
    slowdown: float = 1.0
    jitter: float = 0.0  # each step lasts a random 0 to 2 x this more (diloco.worker.slowdown)
    reference_step_seconds: float | None = None  # the emulated full-speed device's step (diloco.worker.slowdown)
    threads: int | None = None
    device: str = "cpu"
    precision: str = Precision.AUTO.value
    activation_checkpointing: bool = False
    peak_tflops: float | None = None  # the accelerator's dense bf16 peak, for MFU where the table lacks it
    progress_file: Path | None = None
    checkpoint_dir: Path | None = None
    tensorboard_dir: Path | None = None  # rank 0 writes the island's TensorBoard curves under <dir>/<island>/
    checkpoint_every: int = CHECKPOINT_EVERY
    flush_seconds: float = 60.0

    def __post_init__(self) -> None:
        modes = [m.value for m in Mode]
        if self.mode not in modes:
            raise ValueError(f"mode must be one of {', '.join(modes)}, got {self.mode!r}")
        if (
            (self.steps is not None and self.steps < 1)
            or self.batch_size < 1
            or self.eval_every < 1
            or self.checkpoint_every < 1
        ):
            raise ValueError("steps, batch size, eval and checkpoint intervals must be positive")
        if not 0 <= self.data_shard < self.data_shards:
            raise ValueError(f"data shard {self.data_shard} is outside [0, {self.data_shards})")
        if self.slowdown < 1.0:
            raise ValueError(f"slowdown is a factor >= 1 (1 = full speed), got {self.slowdown}")
        if self.jitter < 0:
            raise ValueError(f"jitter is a non-negative share of a step, got {self.jitter}")
        if self.reference_step_seconds is not None and self.reference_step_seconds <= 0:
            raise ValueError(f"the reference step time must be positive, got {self.reference_step_seconds}")
        precisions = [p.value for p in Precision]
        if self.precision not in precisions:
            raise ValueError(f"precision must be one of {', '.join(precisions)}, got {self.precision!r}")


def inner_optimizer(model: torch.nn.Module, settings: InnerOptimizerConfig) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay on matrices only, as GPT recipes do."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(settings.beta1, settings.beta2),
    )


def learning_rate(step: int, settings: InnerOptimizerConfig) -> float:
    """Linear warmup to the peak, then constant: DiLoCo islands restart and join at any step."""
    if settings.warmup_steps and step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    return settings.lr


def init_distributed(backend: str) -> dist.ProcessGroup | None:
    """The torch.distributed world from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, when there is more than one
    rank; a dead peer surfaces as an error within the timeout rather than as a hang."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    dist.init_process_group(backend, timeout=timedelta(seconds=float(os.environ.get("DILOCO_DIST_TIMEOUT", "60"))))
    return dist.group.WORLD


class Trainer:
    def __init__(
        self,
        settings: TrainerSettings,
        config: TrainingConfig,
        *,
        island: str,
        syncers: list[str],
        token: str,
        security: Security,
        stop: StopRequest | None = None,
    ) -> None:
        """`stop`, once requested on any rank, ends training at the next step on every rank."""
        self.settings = settings
        self.stop = stop
        self.config = config
        self.island_id = island
        if settings.threads:
            torch.set_num_threads(settings.threads)
        local_rank, local_ranks = local_position(os.environ)
        placement = place(settings.device, local_rank, local_ranks, torch.cuda.device_count())
        self.device = torch.device(placement.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.group = init_distributed(placement.backend)
        self.ranks = Island(self.group)
        self.precision = resolve_precision(settings.precision, self.device)
        self.lm: LanguageModel = build(
            ModelSpec.parse(settings.model, settings.init_from),
            settings.seed,
            device=self.device,
            checkpoint_activations=settings.activation_checkpointing,
            init_from=settings.init_from,
        )
        self.model = self.lm.module
        self.context = self.lm.context
        tokenizer = tokenizer_for(self.lm.vocab_size, settings.tokenizer)
        tokens = load_tokens(  # text is tokenised here, with a progress bar on the island's rank 0 (its log)
            settings.data,
            settings.max_data_bytes,
            tokenizer,
            text_field=settings.text_field,
            quiet=not self.ranks.is_leader,
        )
        if int(tokens.max()) >= self.lm.vocab_size:
            raise ValueError(f"token id {int(tokens.max())} is outside the model's vocabulary ({self.lm.vocab_size})")
        self.train_tokens, self.heldout = split_holdout(tokens)
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.meter = ThroughputMeter(
            self.lm.flops_per_token, peak_flops(self.device_name, settings.peak_tflops), self.ranks.size
        )
        self.rate = Rate(0.0, 0.0, None)
        self.optimizer = inner_optimizer(self.model, config.inner)
        self.data_identity = {
            "tokens": self.train_tokens.numel(),
            "context": self.context,
            "seed": settings.seed,
            "shard": settings.data_shard,
            "shards": settings.data_shards,
        }
        self.reader = IslandReader(
            self.train_tokens,
            self.context,
            shard=settings.data_shard,
            shards=settings.data_shards,
            rank=self.ranks.rank,
            ranks=self.ranks.size,
            seed=settings.seed,
        )
        self.jitter_rng = random.Random(f"{settings.seed}/{island}/{self.ranks.rank}")
        folder = settings.checkpoint_dir
        self.position_file = position_path(folder, island, self.ranks.rank) if folder is not None else None
        self.curves = (
            TrainingCurves(settings.tensorboard_dir, lambda step: learning_rate(step, config.inner), job=False)
            if settings.tensorboard_dir is not None and self.ranks.is_leader
            else None
        )
        self.progress = ProgressWriter(
            settings.progress_file,
            Source(island=island, rank=self.ranks.rank, mode=settings.mode, pid=os.getpid()),
            sink=(lambda event: self.curves.write((event,))) if self.curves is not None else None,
        )
        self.learner: Learner | None = None
        if settings.mode != "ddp":
            self.learner = Learner(
                self.model,
                self.optimizer,
                config,
                syncers=syncers,
                token=token,
                security=security,
                island_id=island,
                process_group=self.group,
                synchronous=settings.mode == Mode.SYNC_DILOCO,
                sync_timeout=SYNCHRONOUS_SYNC_SECONDS if settings.mode == Mode.SYNC_DILOCO else 60.0,
                on_round=self._on_round,
                on_push=self._on_push,
                flush_timeout=settings.flush_seconds,
                stop=stop,
                checkpoint_dir=settings.checkpoint_dir,
                checkpoint_every=settings.checkpoint_every,
                tokens_per_step=settings.batch_size * self.context,
                last_step=settings.steps or None,
            )
        self.step = 0
        self.tokens = 0
        self.loss = math.nan
        self.eval_loss = math.nan
        self.last_step_monotonic: float | None = None  # the data-parallel baseline's; a learner keeps its own
        self.stopped = False

    def snapshot(self) -> WorkerSnapshot:
        """What this rank has done so far, for its metrics endpoint (read from another thread): the
        learner's, as any loop's, plus what only the built-in trainer measures."""
        if self.learner is not None:
            done = self.learner.snapshot()
        else:  # nothing to join: ready once a step is done
            done = WorkerSnapshot(
                island=self.island_id,
                rank=self.ranks.rank,
                mode=self.settings.mode,
                synced=True,
                step=self.step,
                tokens=self.tokens,
                loss=self.loss,
                last_step_monotonic=self.last_step_monotonic,
            )
        return replace(
            done,
            eval_loss=self.eval_loss,
            tokens_per_second=self.rate.tokens_per_second,
            island_tokens_per_second=self.rate.island_tokens_per_second,
            mfu=self.rate.mfu,
        )

    def _on_round(self, report: RoundReport) -> None:
        write_round(self.progress, report)

    def _on_push(self, report: PushReport) -> None:
        write_push(self.progress, report)

    def _checkpoint_path(self) -> Path | None:
        folder = self.settings.checkpoint_dir
        return folder / "ddp.pt" if folder else None

    def _resume(self) -> bool:
        """The data-parallel baseline restarts everyone from its last checkpoint after any failure; whether
        there was one."""
        path = self._checkpoint_path()
        if path is None or not path.exists():
            return False
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        return True

    def _save(self) -> None:
        """The data-parallel baseline's whole training state (an island's optimizer state is its learner's)."""
        path = self._checkpoint_path()
        if path is None or not self.ranks.is_leader:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step}
        torch.save(state, tmp)
        os.replace(tmp, path)
        self.progress.write(CheckpointEvent, step=self.step)

    def run(self) -> float:
        """Trains until `steps` inner steps (with none, until stopped), then flushes the last progress;
        returns the held-out loss of the final model where this process holds it (rank 0 of the data-parallel
        baseline, not after a stop: the grace period is for the flush), else the last one measured."""
        s = self.settings
        tokens_per_step = s.batch_size * self.context
        if self.learner is not None:
            self.learner.start()
            self.step, warm = self.learner.resume_step, self.learner.resumed_warm
        else:
            warm = self._resume()
            self.ranks.broadcast_tensors(list(self.model.parameters()))
        self._resume_data()
        versions = self.learner.stats.versions if self.learner is not None else {}
        self.progress.write(
            StartEvent,
            step=self.step,
            world=self.ranks.size,
            versions=tuple(versions[p].version for p in sorted(versions)),
            device=self.device_name,
            precision=self.precision.value,
            flops_per_token=self.meter.flops_per_token,
            peak_flops=self.meter.peak,
            warm=warm,
            data_epoch=self.reader.position.epoch,
            data_window=self.reader.position.window,
        )
        self.model.train()
        while s.steps is None or self.step < s.steps:
            self.stopped = self._stop_requested()
            if self.stopped:
                break
            started = time.perf_counter()
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(self.step, self.config.inner)
            read_from = self.reader.position
            inputs, targets = self.reader.next_batch(s.batch_size)
            with autocast(self.precision, self.device):
                _, loss = self.lm.forward(inputs.to(self.device), targets.to(self.device))
            loss.backward()
            self.ranks.average_gradients(self.model.parameters())
            if self.config.inner.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.inner.grad_clip)
            blocked_before = self._blocked_seconds()
            self.loss = loss.item()
            if self.learner is not None:
                self.learner.report(tokens=tokens_per_step, loss=self.loss)
            self.optimizer.step()  # with a learner, its hook counts the inner step and does the sync work
            self.optimizer.zero_grad()
            self.step += 1
            self.tokens += tokens_per_step
            self.last_step_monotonic = time.monotonic()
            elapsed = time.perf_counter() - started
            sync_seconds = self._blocked_seconds() - blocked_before
            pause = pause_seconds(elapsed, s.slowdown, s.reference_step_seconds)
            if s.jitter:
                pause += jitter_seconds(elapsed, s.jitter, s.reference_step_seconds, self.jitter_rng)
            if pause > 0:
                time.sleep(pause)
            seconds = time.perf_counter() - started
            self.rate = self.meter.record(tokens_per_step, seconds)
            if self.position_file is not None:
                save_position(self.position_file, self.reader.position, self.data_identity)
            self.progress.write(
                StepEvent,
                step=self.step,
                loss=self.loss,
                tokens=tokens_per_step,
                seconds=seconds,
                sync_seconds=sync_seconds,
                tokens_per_second=self.rate.tokens_per_second,
                mfu=self.rate.mfu,
                overran=overran(elapsed - sync_seconds, s.slowdown, s.reference_step_seconds),
                data_from=(read_from.epoch, read_from.window),
                data_to=(self.reader.position.epoch, self.reader.position.window),
            )
            if self.learner is None and self.step % s.checkpoint_every == 0:
                self._save()
            if self.step % s.eval_every == 0 and self.ranks.is_leader:
                self.eval_loss = self.evaluate()
                self.progress.write(EvalEvent, step=self.step, loss=self.eval_loss)
        if self.learner is not None and not self.stopped and self.ranks.is_leader and self.step % s.eval_every:
            self.eval_loss = self.evaluate()  # the island's own model at the end, beside the global one
            self.progress.write(EvalEvent, step=self.step, loss=self.eval_loss)
        if self.learner is not None:
            # With its island checkpoint: a stopped island is replaced (a roll, a drain). A decoupled island
            # hands its last pushes over and goes: their merges are the shards' to make, and the job's final
            # model is the shards' (what `diloco export` assembles), not this process's.
            self.learner.flush(wait_for_merges=self.learner.synchronous)
        else:
            self._save()
        if self.stopped:
            log.info("stopped", extra={"island": self.island_id, "rank": self.ranks.rank, "step": self.step})
            return self.eval_loss
        if self.learner is None and self.ranks.is_leader:  # data-parallel ranks all hold the final model
            self.eval_loss = self.evaluate()
        self.progress.write(DoneEvent, step=self.step, loss=self.eval_loss, learner=self._learner_totals())
        return self.eval_loss

    def _resume_data(self) -> None:
        """Takes up the island's data position where its last process left it: the furthest any of its
        ranks saved for this data (they read in step, so they differ by a step at most, when a rank was
        killed between its step and its save), so a replacement reads on from there."""
        mine = load_position(self.position_file, self.data_identity) if self.position_file is not None else None
        epochs = self.ranks.gather(-1 if mine is None else mine.epoch)
        windows = self.ranks.gather(-1 if mine is None else mine.window)
        saved = [DataPosition(epoch, window) for epoch, window in zip(epochs, windows) if epoch >= 0]
        if saved:
            self.reader.position = max(saved)

    def _stop_requested(self) -> bool:
        """Whether any rank of the island was asked to stop: all ranks leave the loop at the same step, so
        none is left waiting in a collective for the others (the learner's rule, where there is one)."""
        if self.learner is not None:
            return self.learner.stop_requested
        return self.stop is not None and self.ranks.any(self.stop.requested)

    def _learner_totals(self) -> LearnerTotals | None:
        """The learner's counters for the `done` event (none in data-parallel)."""
        if self.learner is None:
            return None
        return LearnerTotals.of(self.learner.stats)

    def _blocked_seconds(self) -> float:
        """Time the training thread has spent on sync work (waiting, in the synchronous baseline)."""
        return self.learner.stats.blocked_seconds if self.learner is not None else 0.0

    def evaluate(self) -> float:
        s = self.settings
        return evaluate(self.model, self.heldout, self.context, s.batch_size, s.eval_windows, self.lm.forward)

    def close(self) -> None:
        """Says Leave (the learner's close, which then waits for its checkpoint write), then frees the rest."""
        if self.learner is not None:
            self.learner.close()
        self.progress.close()
        if self.curves is not None:
            self.curves.close()
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None  # with the islands' references gone, the group's threads end now (Island.release)
        self.ranks.release()
