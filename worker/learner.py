"""`Learner`: turns any PyTorch training loop into a Decoupled DiLoCo island in a few lines.

    learner = Learner.from_env(model, optimizer, tokens_per_step=n)  # n: the tokens of one step's batches
    with learner:  # joins the shards and takes the global model; at the end pushes the last steps, leaves
        # The schedule takes up the island's step: 0 in a new job, the job's step for a restarted island.
        scheduler = LambdaLR(optimizer, lambda step: schedule(learner.resume_step + step))
        while learner.inner_step < steps:
            if learner.stop_requested:  # SIGTERM: the pod is going
                break
            batch = next(data)
            loss = loss_fn(model(batch))
            loss.backward()
            learner.report(tokens=n, loss=loss)
            optimizer.step()  # the learner's hook counts the inner step and does its sync work
            optimizer.zero_grad()
            scheduler.step()

The loop stays the user's own: the learner hooks `optimizer.step()` (a post-step hook, as torchft's DiLoCo
does), so gradient accumulation (one `optimizer.step()` per several backward passes), a GradScaler (whose
skipped steps never call `optimizer.step()`, so they count as no inner step) and an LR scheduler the user
steps all work unchanged. The learner serves the worker's metrics and readiness (`diloco.worker.metrics`)
when given a metrics port, as `from_env` is on Kubernetes.

Per fragment p the learner keeps the global values it last received (`base`, float32 on the host) and
their version. When p falls due (every H inner steps, staggered by H/P), the training thread snapshots the
fragment and a background round pushes Δ_p = base_p − θ_p to the owning shard and polls for the merge.
τ inner steps later, or at the first step after that when the reply is in, the fragment is mixed,
θ_p ← α·θ_p + (1−α)·θ_p(global), and the global values become the new base. Training never waits on the
network: a round that fails or takes too long is dropped, and the fragment is pushed again when next due.

A speed-aware island (`speedAware`, decoupled only) slower than the job's fastest runs fewer inner steps per
round (`diloco.core.pace`): its schedule runs on a phase that advances H / H_i per inner step, so H and τ
above are counted in phase units.

An island restarted (a container restart, a pod replaced) resumes where the job is, not at step 0 with cold
inner-optimizer state: given a checkpoint folder (DILOCO_CHECKPOINT_DIR, which the operator sets), each rank
writes its optimizer's state there every `checkpoint_every` inner steps and at the end of a run, off the
training thread (`diloco.worker.island_checkpoint`), and `start` restores the newest state any rank of the
island holds and continues the step count at the later of that checkpoint's step and the job's, as the
shards count it in the island's `tokens_per_step` (`diloco.worker.warm_start`). `resume_step` says where:
a loop that counts its own steps or steps an LR scheduler starts from there, as above.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from diloco import pod_env
from diloco.core.config import Encoding, Mode, TrainingConfig
from diloco.core.fragments import Fragment, plan_fragments, resume_step, shard_of
from diloco.core.island_id import check_island_id
from diloco.core.pace import fragments_due_in, next_due, paced_inner_steps, phase_stride
from diloco.core.phase import QUANTUM, push_target, round_offset, steered_advance
from diloco.settings import env_default, load_security, load_token, load_training_config
from diloco.transport.client import Backoff, SyncerClient
from diloco.transport.deadlines import BASE_SECONDS
from diloco.transport.tls import Role, Security
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.worker.error_feedback import ErrorFeedback
from diloco.worker.island import Island
from diloco.worker.island_checkpoint import IslandCheckpointer, checkpoint_path, load_error_feedback
from diloco.worker.loop_instruments import LoopInstruments
from diloco.worker.metrics import WorkerSnapshot, serve_metrics
from diloco.worker.pod_ranks import local_position, metrics_port
from diloco.worker.shutdown import StopRequest
from diloco.worker.stats import LearnerStats, StatsRecorder, Version
from diloco.worker.sync import (
    FragmentSync,
    RoundOutcome,
    SyncRequest,
    SyncResult,
    fragment_bytes,
    fragment_values,
    held_values,
    local_snapshot,
    pull_values,
)
from diloco.worker.warm_start import restore_island, resume_at

log = logging.getLogger("diloco.worker")

CHECKPOINT_EVERY = 50
"""Inner steps between two island checkpoints unless told otherwise (DILOCO_CHECKPOINT_EVERY)."""

SYNCHRONOUS_SYNC_SECONDS = 600.0
"""How long an island of the synchronous baseline waits at its barrier for a merge before it gives the round up."""

CHECKPOINT_CLOSE_SECONDS = 5.0
"""How long `close` waits for an island checkpoint still being written, after the island has left."""

STEP_SECONDS_SMOOTHING = 0.1
"""Weight of the newest inner step in the island's measured seconds per step (an exponential average)."""

_OUTCOME_COUNTERS = {
    RoundOutcome.MERGED: "syncs_merged",
    RoundOutcome.RESYNCED: "syncs_resynced",
    RoundOutcome.ABANDONED: "syncs_abandoned",
    RoundOutcome.FAILED: "syncs_failed",
}


@dataclass(frozen=True)
class RoundReport:
    """How one fragment's round ended; the steps up to `began_at_step` reached the global model iff the
    outcome is MERGED."""

    fragment: int
    began_at_step: int
    outcome: RoundOutcome
    version: int | None = None  # the global version adopted, when the outcome adopts one


@dataclass(frozen=True)
class PushReport:
    """A push rank 0 began: the fragment's progress over the steps up to `began_at_step`, named as the shard
    names it, so the shard's record of its merges says whether those steps reached the global model even
    when this process does not live to hear the round end."""

    fragment: int
    began_at_step: int
    incarnation: int
    base_version: int
    sequence: int


@dataclass
class _IslandFragment:
    """One fragment as this rank tracks it; `base`, `base_version` and `sequence` are used on rank 0 only."""

    plan: Fragment
    params: list[torch.nn.Parameter]
    shard: int
    base: list[torch.Tensor] = field(default_factory=list)
    base_version: pb.FragmentVersion = field(default_factory=pb.FragmentVersion)
    tokens: int = 0
    steps: int = 0
    sequence: int = 0
    mixable_at: Fraction | None = None  # while a round runs: the first phase that may act on its result (push + τ)
    began_at: int = 0  # the step the last round began at
    pushed_at: float = 0.0  # rank 0: when (monotonic) the last round began its push
    target: float | None = None  # rank 0: when (monotonic) to begin the next push, to keep in phase


class Learner:
    """A model and its inner optimizer, trained as one island of a Decoupled DiLoCo job.

    With `process_group`, the island spans that group's ranks (ordinary data parallelism): rank 0 alone
    talks to the syncers and broadcasts what it receives, so every rank mixes the same values at the same
    step. Gradients are averaged by the caller's usual means (DDP) or by `all_reduce_gradients()`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: TrainingConfig,
        *,
        syncers: Sequence[str],
        token: str,
        security: Security,
        island_id: str,
        process_group: dist.ProcessGroup | None = None,
        sync_timeout: float = 60.0,
        close_timeout: float = 10.0,
        rpc_timeout: float = BASE_SECONDS,
        retry_for: float = 120.0,
        backoff: Backoff = Backoff(),
        synchronous: bool = False,
        on_round: Callable[[RoundReport], None] | None = None,
        on_push: Callable[[PushReport], None] | None = None,
        compressed_pulls: bool | None = None,
        flush_timeout: float = 60.0,
        stop: StopRequest | None = None,
        metrics_port: int = 0,
        metrics_host: str = "0.0.0.0",
        checkpoint_dir: Path | None = None,
        checkpoint_every: int = CHECKPOINT_EVERY,
        tokens_per_step: int | None = None,
        instruments: LoopInstruments | None = None,
        last_step: int | None = None,
    ) -> None:
        """`syncers[i]` is the address of shard i, reached with `security` (TLS, or plaintext by name). A
        round with no merge within `sync_timeout` seconds is abandoned; each call gets `rpc_timeout` seconds
        per attempt, plus its bytes at the job's `min_transfer_mbps`, and is retried for `retry_for`.

        `synchronous` makes every sync a barrier (the island waits for the merge and mixes at once): the
        synchronous-DiLoCo baseline. `on_round` hears how every round ended, on every rank; `on_push`
        hears every push as rank 0 begins it.
        `compressed_pulls` (default: DILOCO_COMPRESSED_PULLS, on unless "0") has the shards send merged
        fragments as differences to the island's base in the job's encoding instead of float32 values.

        `flush` waits up to `flush_timeout` seconds for the last merges; once `stop` is requested (SIGTERM),
        `stop_requested` says so and `flush` and `close` keep within its grace period instead. With a
        `metrics_port`, `start` serves the worker's metrics and readiness there until `close`.

        With `checkpoint_dir`, each rank writes its optimizer's state there every `checkpoint_every` inner
        steps and at `flush`, and `start` takes up the newest any rank of the island holds. `tokens_per_step`,
        the tokens each rank trains on in one inner step (what the loop reports a step), lets `start` find
        the job's step from the shards' token counts; without it, an island resumes at its checkpoint's
        step (or 0).

        `instruments` write the progress events a local run reads and emulate its slower hardware
        (`diloco.worker.loop_instruments`).

        `last_step`, the inner step the loop ends at when it knows it, marks the pushes that step begins as
        the island's last, as `flush` marks its own: the shards land them on the mean of the islands' models
        rather than stepping past it (`diloco.core.outer_optimizer.land`)."""
        if not syncers:
            raise ValueError("a learner needs at least one syncer shard")
        if not island_id:
            raise ValueError("a learner needs an island id: the shards count contributions per island")
        if checkpoint_every < 1 or (tokens_per_step is not None and tokens_per_step < 1):
            raise ValueError("checkpoint_every and tokens_per_step must be positive")
        check_island_id(island_id)
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.syncers = list(syncers)
        self.island_id = island_id
        self.island = Island(process_group)
        self.sync_timeout = sync_timeout
        self.close_timeout = close_timeout
        self.synchronous = synchronous
        self.on_round = on_round
        self.on_push = on_push
        self.flush_timeout = flush_timeout
        self.stop = stop
        self.checkpoint_every = checkpoint_every
        self.tokens_per_step = tokens_per_step
        self.last_step = last_step
        self._instruments = instruments
        self._token = token
        if compressed_pulls is None:
            compressed_pulls = env_default("COMPRESSED_PULLS", "1") != "0"
        self._pull_encoding = config.encoding if compressed_pulls else None
        self._feedback = ErrorFeedback() if config.encoding is Encoding.SPARSE else None
        self._checkpointer = (
            IslandCheckpointer(checkpoint_path(checkpoint_dir, island_id, self.island.rank), optimizer, self._feedback)
            if checkpoint_dir is not None
            else None
        )
        self._security = security
        self._client_options = {
            "timeout": rpc_timeout,
            "min_transfer_mbps": config.min_transfer_mbps,
            "retry_for": retry_for,
            "backoff": backoff,
        }
        # Names must be the same on every island, whether or not it wraps its model in DDP ("module." prefix).
        named_model = model.module if isinstance(model, DistributedDataParallel) else model
        params = {name: p for name, p in named_model.named_parameters() if p.requires_grad}
        plan = plan_fragments([(name, tuple(p.shape)) for name, p in params.items()], config.fragments)
        self._fragments = [
            _IslandFragment(f, [params[name] for name in f.names], shard_of(f.index, len(self.syncers))) for f in plan
        ]
        self._clients: list[SyncerClient] = []
        self._rounds: dict[int, FragmentSync] = {}
        self._stopping = threading.Event()
        self._stats = StatsRecorder()
        self._step = 0
        self._pending_tokens = 0
        self._loss = math.nan
        self._last_step_monotonic: float | None = None
        self._last_sync_unix = 0.0
        self._stop_agreed = False
        self._metrics_address = (metrics_host, metrics_port)
        self._metrics_server: WSGIServer | None = None
        self._step_hook: RemovableHandle | None = None
        self._phase = Fraction(0)
        self._sync_seconds = 0.0  # the last round's push and pull, which the island's slack leaves room for
        self._round_steps = config.inner_steps
        self._stats.set_round_steps(self._round_steps)
        self._step_seconds = 0.0
        self._last_step_at: float | None = None
        self._resume_step = 0
        self._resumed_warm = False
        self._started = False
        self._closed = False
        self._left = False

    @classmethod
    def from_env(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        process_group: dist.ProcessGroup | None = None,
        **options: Any,
    ) -> Learner:
        """A learner configured by what the operator injects into an island's pods: DILOCO_SYNCERS
        (comma-separated, index = shard), DILOCO_TOKEN or DILOCO_TOKEN_FILE, DILOCO_ISLAND, DILOCO_CONFIG or
        DILOCO_CONFIG_FILE, DILOCO_TLS_CA_FILE (with DILOCO_TLS_MUTUAL, DILOCO_TLS_CERT_FILE and
        DILOCO_TLS_KEY_FILE for mutual TLS) or DILOCO_INSECURE_PLAINTEXT=1; DILOCO_METRICS_PORT (plus the
        LOCAL_RANK a launcher sets, as the built-in worker does) and DILOCO_METRICS_HOST for the metrics and
        readiness endpoint; DILOCO_TERMINATION_GRACE_SECONDS, the pod's grace period, within which the last
        steps are pushed after SIGTERM (whose handler it installs when called on the main thread; Ctrl-C
        keeps its usual meaning); DILOCO_CHECKPOINT_DIR and DILOCO_CHECKPOINT_EVERY, where and how often
        the island checkpoints its optimizer state (the names: `diloco.pod_env`). A local run's
        DILOCO_PROGRESS_FILE, DILOCO_MODE, DILOCO_SLOWDOWN, DILOCO_JITTER and DILOCO_REFERENCE_STEP_SECONDS
        give it the instruments of `diloco.worker.loop_instruments` (DILOCO_MODE=sync-diloco: the synchronous
        baseline). Without `process_group`, an initialised default process group is taken to be the island
        (one torch.distributed world per island, formed from the WORLD_SIZE, RANK, MASTER_ADDR and
        MASTER_PORT the operator sets). `options` are the constructor's keyword arguments (`tokens_per_step`,
        which only the loop knows, among them), which win over the environment."""
        env = os.environ
        syncers = [target.strip() for target in env.get(pod_env.SYNCERS, "").split(",") if target.strip()]
        if not syncers:
            raise ValueError(f"{pod_env.SYNCERS} is not set: expected comma-separated syncer addresses")
        island = env.get(pod_env.ISLAND)
        if not island:
            raise ValueError(f"{pod_env.ISLAND} is not set: expected this island's id")
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        stop = StopRequest(float(env.get(pod_env.TERMINATION_GRACE_SECONDS, pod_env.DEFAULT_GRACE_SECONDS)))
        if threading.current_thread() is threading.main_thread():
            stop.install((signal.SIGTERM,))
        instruments = LoopInstruments.from_env(env)
        synchronous = instruments is not None and instruments.synchronous
        settings: dict[str, Any] = {
            "syncers": syncers,
            "token": load_token(None),
            "security": load_security(Role.CLIENT),
            "island_id": island,
            "process_group": process_group,
            "stop": stop,
            "metrics_port": metrics_port(int(env.get(pod_env.METRICS_PORT, "0")), local_position(env)[0]),
            "metrics_host": env.get(pod_env.METRICS_HOST, "0.0.0.0"),
            "checkpoint_dir": Path(folder) if (folder := env.get(pod_env.CHECKPOINT_DIR)) else None,
            "checkpoint_every": int(env.get(pod_env.CHECKPOINT_EVERY, CHECKPOINT_EVERY)),
            "instruments": instruments,
            "synchronous": synchronous,
            "sync_timeout": SYNCHRONOUS_SYNC_SECONDS if synchronous else 60.0,
        }
        return cls(model, optimizer, load_training_config(None), **(settings | options))

    @property
    def stats(self) -> LearnerStats:
        """A consistent snapshot of this rank's counters."""
        return self._stats.snapshot()

    def __enter__(self) -> Learner:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        """A loop that ends normally pushes its last steps first; one that raised only leaves."""
        if error is None:
            self.flush()
        self.close()

    def start(self) -> None:
        """Joins every shard, seeds the fragments no island has seeded yet (the first island wins), then
        takes the global values, so every island, and every rank of this one, starts from the same point;
        from then on every `optimizer.step()` is an inner step. With a metrics port, serves the metrics
        and /readyz from the start, not ready until this has succeeded and a step has followed.

        Then warm-starts the island (`_warm_start`): its optimizer state from its checkpoints, and the step
        it resumes at, `resume_step`."""
        if self._started:
            raise RuntimeError("start() was already called")
        if self._checkpointer is not None and (saved := load_error_feedback(self._checkpointer.path)):
            self.restore_error_feedback(saved)
        host, port = self._metrics_address
        if port:
            self._metrics_server = serve_metrics(self.snapshot, port, host)[1]
        started = time.perf_counter()
        error: Exception | None = None
        if self.island.is_leader:
            try:
                self._connect()
            except Exception as failure:
                error = failure
        succeeded = self.island.broadcast(torch.tensor([error is None], dtype=torch.int64))
        if not succeeded.item():
            self._stop_metrics()
            raise error or RuntimeError(f"island {self.island_id}: rank 0 could not reach the syncers")
        versions = self.island.broadcast(
            torch.tensor([[f.base_version.incarnation, f.base_version.version] for f in self._fragments])
        ).cpu()
        for f in self._fragments:
            self.island.broadcast_tensors(f.params)
            self._stats.set_version(f.plan.index, Version(*versions[f.plan.index].tolist()))
        if self.synchronous:
            self._step = resume_step(versions[:, 1].tolist(), self.config.inner_steps, self.config.fragments)
            self._phase = Fraction(self._step)
        self._warm_start()
        self._step_hook = self.optimizer.register_step_post_hook(self._after_optimizer_step)
        self._started = True
        if self._instruments is not None:
            self._instruments.started(self)
        log.info(
            "learner started",
            extra={
                "island": self.island_id,
                "rank": self.island.rank,
                "ranks": self.island.size,
                "syncers": self.syncers,
                "fragments": [f.plan.numel for f in self._fragments],
                "versions": versions[:, 1].tolist(),
                "seconds": time.perf_counter() - started,
            },
        )

    def _warm_start(self) -> None:
        """On every rank: restores the optimizer state from the newest checkpoint any rank of the island
        holds, and continues a decoupled island's step count at the later of that checkpoint's step and the
        job's (a synchronous island keeps the barrier's step, which `start` took from the versions)."""
        path = self._checkpointer.path if self._checkpointer is not None else None
        restored = restore_island(self.island, self.optimizer, path)
        if not self.synchronous:
            tokens = self.tokens_per_step * self.island.size if self.tokens_per_step else None
            self._step = resume_at(self.island, restored, self.shard_status, tokens)
            self._phase = Fraction(self._step)
        self._resume_step = self._step
        self._resumed_warm = restored is not None
        log.info(
            "island resumes",
            extra={
                "island": self.island_id,
                "rank": self.island.rank,
                "step": self._step,
                "warm": self._resumed_warm,
                "checkpoint": restored,
            },
        )

    def _connect(self) -> None:
        self._clients = [
            SyncerClient(
                target,
                self._token,
                security=self._security,
                island_id=self.island_id,
                stop=self._stopping,
                **self._client_options,
            )
            for target in self.syncers
        ]
        for index, client in enumerate(self._clients):
            reply = client.join(self.config.fragments)
            if (reply.shard_index, reply.num_shards) != (index, len(self._clients)):
                raise ValueError(
                    f"syncer {client.target} is shard {reply.shard_index} of {reply.num_shards}, but it is "
                    f"listed at index {index} of {len(self._clients)}: list the shards in index order"
                )
            for p in reply.unseeded_fragments:
                f = self._fragments[p]
                seeded = client.seed(p, list(zip(f.plan.names, local_snapshot(f.params).values())))
                log.info("seeded fragment", extra={"fragment": p, "accepted": seeded.accepted})
        if self.synchronous:
            self._await_islands()
        sequence = time.time_ns()
        trained = []
        for f in self._fragments:
            # Islands start from the same initial values as the one that seeded: then the shard need not
            # send them again, only the (compressed) difference to its newest.
            mine = held_values(None, local_snapshot(f.params).values()) if self._pull_encoding is not None else None
            pulled = pull_values(
                self._clients[f.shard], f.plan.index, None, mine, self._pull_encoding, fragment_bytes(f.params)
            )
            if pulled is None:
                raise RuntimeError(f"fragment {f.plan.index}: a pull without a version came back empty")
            version = pulled.version
            values = fragment_values(f.plan.index, f.plan.names, pulled.tensors)
            with torch.no_grad():
                for param, value in zip(f.params, values):
                    param.copy_(value)
            f.base, f.base_version, f.sequence = values, version, sequence
            self._stats.add(bytes_pulled=pulled.wire_bytes)
            if version.version > 0:
                trained.append(f.plan.index)
        self._declare_feedback_lost(trained)

    def _declare_feedback_lost(self, trained: list[int]) -> None:
        """An island that starts on fragments already merged into may be a restart: what its previous run's
        error-feedback buffers held back is lost unless `restore_error_feedback` brought it back (see
        `diloco.worker.error_feedback`). Said, and the values dropped counted, on rank 0, like pushes."""
        if self._feedback is None or not self.island.is_leader:
            return
        restored = [p for p in trained if self._feedback.held_back(p) is not None]
        lost = [p for p in trained if p not in restored]
        if restored:
            log.info(
                "error feedback restored from the island checkpoint",
                extra={"fragments": restored, "values": self._numel(restored)},
            )
        if lost:
            values = self._numel(lost)
            log.warning(
                "error feedback lost: what a previous run of this island held back will not be sent",
                extra={"fragments": lost, "values": values},
            )
            self._stats.add(feedback_lost_values=values)

    def _numel(self, fragments: Sequence[int]) -> int:
        return sum(self._fragments[p].plan.numel for p in fragments)

    @property
    def error_feedback(self) -> ErrorFeedback | None:
        """The island's error-feedback buffers (the sparse encoding's; None otherwise), for its checkpoint."""
        return self._feedback

    def restore_error_feedback(self, saved: Mapping[str, torch.Tensor]) -> None:
        """Before `start()`: the buffers a previous run of this island saved, so what it held back is still
        sent. With `checkpoint_dir`, `start()` does this itself from the island checkpoint
        (`diloco.worker.island_checkpoint.load_error_feedback`). A fragment's buffer that does not fit the
        model is left out; `start()` then declares it lost."""
        if self._started:
            raise RuntimeError("restore_error_feedback() goes before start()")
        if self._feedback is not None:
            self._feedback.restore(saved, {f.plan.index: [p.shape for p in f.params] for f in self._fragments})

    def _await_islands(self) -> None:
        """The synchronous baseline's first barrier: every shard hears from `quorum` islands (K = M) before
        anyone trains, since a shard caps the quorum by the islands it has heard from and would otherwise
        merge the first pushes without the islands still starting up. Gives up after `sync_timeout`."""
        deadline = time.monotonic() + self.sync_timeout
        for client in self._clients:
            while time.monotonic() < deadline:
                status = client.status()
                if len(status.live_islands) + len(status.left_islands) >= self.config.quorum:
                    break  # islands that already finished will not come: a restarted island trains on alone
                time.sleep(0.1)

    @property
    def speed_aware(self) -> bool:
        """Whether this island sizes its rounds by its speed: `speedAware`, and never at a barrier."""
        return self.config.speed_aware and not self.synchronous

    @property
    def round_steps(self) -> int:
        """Inner steps per round this island runs now: H, or fewer when it is speed-aware and slower."""
        return self._round_steps

    @property
    def inner_step(self) -> int:
        """The island's inner step count: `resume_step` at `start`, then one more per optimizer step."""
        return self._step

    @property
    def resume_step(self) -> int:
        """The inner step `start` resumed the island at: 0 in a new job; for an island restarted or joining
        late, the job's step (the later of its checkpoint's and the shards' count). A loop's own step
        counter and LR schedule start there: `LambdaLR(optimizer, lambda step: schedule(learner.resume_step
        + step))`, made after `start`."""
        return self._resume_step

    @property
    def resumed_warm(self) -> bool:
        """Whether `start` restored the inner optimizer's state from an island checkpoint."""
        return self._resumed_warm

    @property
    def loss(self) -> float:
        """The latest training loss the loop reported (NaN before any)."""
        return self._loss

    def shard_status(self) -> list[pb.StatusReply]:
        """Every shard's status, in shard order (rank 0 alone holds the channels: [] on the other ranks)."""
        return [client.status() for client in self._clients]

    def report(self, *, tokens: int = 0, loss: float | torch.Tensor | None = None) -> None:
        """What the loop trained on since the last call: `tokens` this rank consumed (a micro-batch's, or a
        whole step's), credited to the next inner step (a push carries the island's sum), and the latest
        training `loss`, served as the `diloco_worker_loss` metric that the job's status shows. A tensor
        loss is read here (`item()`), so report it once per step rather than per micro-batch on an
        accelerator."""
        if tokens < 0:
            raise ValueError(f"tokens must be non-negative, got {tokens}")
        self._pending_tokens += tokens
        if loss is not None:
            self._loss = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer's post-step hook: one inner step, then its sync work, which never waits on the
        network (except in the synchronous baseline). Registered by `start`, removed by `close`."""
        started = time.perf_counter()
        tokens, self._pending_tokens = self._pending_tokens, 0
        self._measure_step(started)
        self._step += 1
        before, self._phase = self._phase, self._phase + self._advance()
        for f in self._fragments:
            f.tokens += tokens
            f.steps += 1
        self._finish_rounds()
        due = fragments_due_in(before, self._phase, self.config.inner_steps, self.config.fragments)
        for index in due:
            if self._fragments[index].mixable_at is None:
                self._begin_round(
                    self._fragments[index], last=self.last_step is not None and self._step >= self.last_step
                )
        if self.synchronous and due:
            self._await_rounds(self.sync_timeout)
        self._last_step_monotonic = time.monotonic()
        self._stats.add(inner_steps=1, tokens=tokens, blocked_seconds=time.perf_counter() - started)
        if self._step % self.checkpoint_every == 0:
            self._save_checkpoint()
        if self._instruments is not None:
            self._instruments.stepped(self)

    def _save_checkpoint(self) -> None:
        """Starts writing this rank's optimizer state as it is now (skipped while the last write runs)."""
        if self._checkpointer is not None:
            self._checkpointer.save(self._step)

    @property
    def stop_requested(self) -> bool:
        """Whether any rank of the island was asked to stop (SIGTERM): every rank must ask at the same step
        (a collective in a multi-rank island), and all then leave the loop together, none left waiting in a
        collective for the others. False without a `stop`."""
        if self.stop is not None and not self._stop_agreed:
            self._stop_agreed = self.island.any(self.stop.requested)
        return self._stop_agreed

    def snapshot(self) -> WorkerSnapshot:
        """What this rank has done so far, as its metrics and readiness endpoint serves it (read from
        another thread). Synced from a successful `start` until `close`, when the island leaves the shards."""
        stats = self.stats
        return WorkerSnapshot(
            island=self.island_id,
            rank=self.island.rank,
            mode=(Mode.SYNC_DILOCO if self.synchronous else Mode.DILOCO).value,
            synced=self._started and not self._closed,
            step=self._step,
            tokens=stats.tokens,
            loss=self._loss,
            last_sync_unix=self._last_sync_unix,
            step_seconds=self._step_seconds,
            last_step_monotonic=self._last_step_monotonic,
            learner=stats,
        )

    def _measure_step(self, now: float) -> None:
        """Folds the time since the previous inner step into the island's seconds per step."""
        if self._last_step_at is not None:
            seconds = now - self._last_step_at
            smoothed = STEP_SECONDS_SMOOTHING * seconds + (1 - STEP_SECONDS_SMOOTHING) * self._step_seconds
            self._step_seconds = smoothed if self._step_seconds else seconds
        self._last_step_at = now

    def flush(self, timeout: float | None = None, *, wait_for_merges: bool = True) -> None:
        """Pushes every fragment's progress since its last sync (where a round is still out, against the merge
        it brings back) and waits up to `timeout` seconds (default `flush_timeout`, or after a stop request
        what its grace period leaves) for the merges: the end of a run, so that its last steps reach the
        global model too; the island pushes no more after it, so these pushes are marked its last (the shards
        land them rather than step past them: `diloco.core.outer_optimizer.land`). Once the
        shards hold those pushes a decoupled island tells them it has left, so that no merge of the islands
        still training waits for it while it waits for its own (a synchronous one stays in the barrier until
        it closes: its last merge takes in every island). Also checkpoints the optimizer state, for the
        island that replaces this one (a roll, a drain).

        `wait_for_merges=False` returns once the pushes are handed over (a decoupled island has then left):
        for a process that ends here and needs no merged model of its own, the job's final model being the
        shards' (`diloco export`). The shards merge those pushes all the same."""
        self._save_checkpoint()
        if timeout is None:
            timeout = self.stop.flush_budget() if self.stop is not None and self.stop_requested else self.flush_timeout
        deadline = time.monotonic() + timeout
        out = [f for f in self._fragments if f.mixable_at is not None]
        for f in self._fragments:
            if f.mixable_at is None:
                self._begin_round(f, last=True)
        out = [f for f in out if f.began_at < self._step]  # one that began at this step carries every step
        if out:  # a round still out holds its fragment's base: the steps since go against what it brings back
            self._await_rounds(max(0.0, deadline - time.monotonic()), out)
            for f in out:
                if f.mixable_at is None:
                    self._begin_round(f, last=True)
        if self.island.is_leader and not self.synchronous:
            for round_ in list(self._rounds.values()):
                round_.wait_delivered(max(0.0, deadline - time.monotonic()))
            self._leave(deadline)
        if wait_for_merges:
            self._await_rounds(max(0.0, deadline - time.monotonic()))
        if self._instruments is not None and not self._stop_agreed:  # stopped: no end of its own (a roll, a drain)
            self._instruments.done(self)

    def _await_rounds(self, timeout: float, fragments: Sequence[_IslandFragment] | None = None) -> None:
        """Waits for the running rounds (of these `fragments`, default all) and mixes their results now
        rather than τ steps later."""
        running = [f for f in (self._fragments if fragments is None else fragments) if f.mixable_at is not None]
        for f in running:
            f.mixable_at = self._phase
        if self.island.is_leader:
            deadline = time.monotonic() + timeout
            for f in running:
                self._rounds[f.plan.index].join(max(0.0, deadline - time.monotonic()))
        self._finish_rounds()

    def all_reduce_gradients(self) -> None:
        """Averages the gradients over the island's ranks, for loops that do not use DDP. Call it between
        backward() and step() on every rank."""
        self.island.average_gradients(self.model.parameters())

    def wait_for_syncs(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for the running rounds' replies, which the next step() mixes in;
        True when none is left running. Training never needs this: it is for the end of a run and for tests."""
        deadline = time.monotonic() + timeout
        return all(r.join(max(0.0, deadline - time.monotonic())) for r in list(self._rounds.values()))

    def close(self, timeout: float | None = None) -> None:
        """Gives running pushes up to `timeout` seconds (default `close_timeout`, or after a stop request
        what its grace period keeps for leaving) to land, stops polling, tells the shards the island has left
        (so no merge waits for it), closes the channels and the metrics endpoint, then waits up to
        `CHECKPOINT_CLOSE_SECONDS` for a checkpoint being written; later optimizer steps are the model's
        alone. Issues no collective, so the ranks of an island may close in any order."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self._step_hook is not None:
            self._step_hook.remove()
        if timeout is None:
            timeout = self.stop.leave_reserve if self.stop is not None and self._stop_agreed else self.close_timeout
        deadline = time.monotonic() + timeout
        self.wait_for_syncs(timeout)
        self._leave(deadline)
        for client in self._clients:
            client.close()
        self._stop_metrics()
        if self._checkpointer is not None:
            self._checkpointer.close(CHECKPOINT_CLOSE_SECONDS)
        if self._instruments is not None:
            self._instruments.close()
        self.island.release()
        log.info("learner closed", extra={"island": self.island_id, "rank": self.island.rank, **asdict(self.stats)})

    def _leave(self, deadline: float) -> None:
        """Tells every shard, once, that the island has left: it no longer caps a quorum or holds a merge."""
        if self._left:
            return
        self._left = True
        for client in self._clients:
            try:
                client.leave(max(0.1, deadline - time.monotonic()))
            except grpc.RpcError as error:
                log.debug("leave not delivered", extra={"target": client.target, "code": str(error.code())})

    def _stop_metrics(self) -> None:
        """Frees the metrics port, so that a learner made again in this process can serve on it."""
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None

    def _begin_round(self, f: _IslandFragment, *, last: bool = False) -> None:
        f.mixable_at = self._phase + self.config.overlap_steps
        f.began_at = self._step
        tokens = self.island.sum(f.tokens)
        if not self.island.is_leader:
            return
        f.sequence += 1
        f.pushed_at, f.target = time.monotonic(), None  # a target serves one push: the next comes with its merge
        self._stats.add(rounds_begun=1, round_inner_steps=self._round_steps)
        request = SyncRequest(
            fragment=f.plan.index,
            names=f.plan.names,
            base_version=f.base_version,
            base=f.base,
            local=local_snapshot(f.params),
            tokens=tokens,
            inner_steps=f.steps,
            sequence=f.sequence,
            step_seconds=self._step_seconds,
            slack_seconds=self._slack_seconds(),
            last=last,
        )
        round_ = FragmentSync(
            self._clients[f.shard],
            request,
            encoding=self.config.encoding,
            block_size=self.config.block_size,
            top_k=self.config.top_k,
            timeout=self.sync_timeout,
            stopping=self._stopping,
            stats=self._stats,
            pull_encoding=self._pull_encoding,
            feedback=self._feedback,
        )
        self._rounds[f.plan.index] = round_
        version = f.base_version
        push = PushReport(f.plan.index, f.began_at, version.incarnation, version.version, f.sequence)
        if self.on_push is not None:
            self.on_push(push)
        if self._instruments is not None:
            self._instruments.push(push)
        round_.start()

    def _slack_seconds(self) -> float | None:
        """How long after a push this island can wait for its merge at no cost but a longer overlap: a round of
        its steps, less what its last sync took. It never blocks on a merge: it mixes one in at the first step
        from τ on that finds it in, and only a merge still out when the fragment is due again costs it
        anything (that push is skipped for a round). None when unknown, and at a barrier, where the island
        waits for the merge anyway."""
        if self.synchronous or not self._step_seconds:
            return None
        return max(0.0, self._round_steps * self._step_seconds - self._sync_seconds)

    def _advance(self) -> Fraction:
        """Phase units this inner step advances: the island's stride, or, once a merge has told it when its next
        push of the fragment due next should begin, as steered towards then (`diloco.core.phase`); rank 0's
        decision on every rank. At a barrier, always the stride."""
        stride = phase_stride(self.config.inner_steps, self._round_steps)
        if self.synchronous:
            return stride
        advance = stride
        if self.island.is_leader:
            point, fragment = next_due(self._phase, self.config.inner_steps, self.config.fragments)
            target = self._fragments[fragment].target
            if target is not None:
                seconds_left = target - time.monotonic()
                advance = steered_advance(stride, point - self._phase, seconds_left, self._step_seconds)
        if self.island.distributed:
            quanta = self.island.broadcast(torch.tensor([int(advance * QUANTUM)], dtype=torch.int64))
            advance = Fraction(int(quanta.item()), QUANTUM)
        return advance

    def _keep_in_phase(self, f: _IslandFragment, result: SyncResult) -> None:
        """Rank 0: when to begin the fragment's next push, from how late this one came to its round
        (`diloco.core.phase`), in rounds of the job's cadence (the fastest island's H steps); nothing at a
        barrier, alone (no other island to keep in phase with), or while the arrivals or the step time are
        unknown."""
        if self.synchronous or result.live_islands < 2:
            return
        if not (result.arrival and result.round_opened and self._step_seconds):
            return
        cadence = result.cadence_step_seconds or self._step_seconds
        round_seconds = self.config.inner_steps * cadence
        offset = round_offset(result.arrival, result.round_opened, round_seconds)
        f.target = push_target(f.pushed_at, offset, round_seconds)
        self._stats.set_phase_offset(offset)
        log.debug("phase offset", extra={"island": self.island_id, "fragment": f.plan.index, "offset": offset})

    def _decisions(self, running: dict[int, Fraction]) -> torch.Tensor:
        """Rank 0's verdict per fragment: (outcome, incarnation, version, inner steps per round), outcome 0
        while a round must go on (reply not in, or fewer than τ steps since its push began), steps per round
        0 to keep them as they are."""
        decisions = torch.zeros(len(self._fragments), 4, dtype=torch.int64)
        if not self.island.is_leader:
            return decisions
        for index, mixable_at in running.items():
            round_ = self._rounds[index]
            result = round_.result
            if result is None or self._phase < mixable_at:
                continue
            decisions[index, 0] = result.outcome
            if result.version is not None:
                decisions[index, 1] = result.version.incarnation
                decisions[index, 2] = result.version.version
            if self.speed_aware:  # against the speed the push reported, which the shard's cadence counted
                decisions[index, 3] = paced_inner_steps(
                    self.config.inner_steps,
                    self.config.fragments,
                    round_.request.step_seconds,
                    result.cadence_step_seconds,
                )
            self._keep_in_phase(self._fragments[index], result)
            if result.sync_seconds:
                self._sync_seconds = result.sync_seconds
        return decisions

    def _finish_rounds(self) -> None:
        running = {f.plan.index: f.mixable_at for f in self._fragments if f.mixable_at is not None}
        if not running:
            return
        decisions = self.island.broadcast(self._decisions(running)).cpu()
        for index in running:
            f = self._fragments[index]
            code, incarnation, version, round_steps = decisions[index].tolist()
            if code == 0:
                continue
            if round_steps and round_steps != self._round_steps:
                log.info("inner steps per round", extra={"island": self.island_id, "steps": round_steps})
                self._round_steps = round_steps
                self._stats.set_round_steps(round_steps)
            outcome = RoundOutcome(code)
            f.mixable_at = None
            ended = RoundReport(index, f.began_at, outcome, version if outcome.adopts else None)
            if self.on_round is not None:
                self.on_round(ended)
            if self._instruments is not None:
                self._instruments.round(ended)
            if outcome.adopts:
                self._mix(f, Version(incarnation, version))
                self._last_sync_unix = time.time()
            elif self.island.is_leader:
                self._rounds.pop(index)
            self._stats.add(**{_OUTCOME_COUNTERS[outcome]: 1})

    def _mix(self, f: _IslandFragment, version: Version) -> None:
        """θ ← α·θ + (1−α)·global on rank 0, then its result on every rank; the global values become the base."""
        if self.island.is_leader:
            result = self._rounds.pop(f.plan.index).result
            if result is None or result.values is None or result.version is None:
                raise RuntimeError(f"fragment {f.plan.index}: an adopting round without values")
            with torch.no_grad():
                for param, value in zip(f.params, result.values):
                    mixed = torch.lerp(value.to(param.device, non_blocking=True), param.float(), self.config.mix_alpha)
                    param.copy_(mixed)
            f.base, f.base_version = result.values, result.version
        self.island.broadcast_tensors(f.params)
        f.tokens = f.steps = 0
        self._stats.set_version(f.plan.index, version)
        log.debug("mixed", extra={"fragment": f.plan.index, "version": version.version, "step": self._step})
