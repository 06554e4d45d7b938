"""The gRPC server of one syncer shard: the wire around `ShardState`, a merge thread and checkpoints.

Data is read and checked outside the state lock, and pushes are kept as they were sent (int4: 1/7.5 of
float32) until a merge decodes them chunk by chunk; only validation, submission, merges and snapshots hold
the lock. What a pull is answered with, and what the shard served each island, is `pulls`'s: full values
encoded once per version, or the difference to what the island holds, made once for all islands that hold
it. Merges, differences and digests use `threads` cores: torch's own threads for the arithmetic (set by the
process), a pool for digests.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import torch
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2

from diloco.core.config import TrainingConfig
from diloco.core.encoding import Encoding, EncodingError
from diloco.core.merge import CHUNK, Delta, delta_norm
from diloco.core.refusal import Refusal
from diloco.progress import MergeEvent, ProgressWriter
from diloco.syncer import checkpoint
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.pulls import Pulls, ServedPull, fragment_version
from diloco.syncer.shard import MAX_PENDING_BYTES, PushKey, PushResult, Refused, ShardState, TensorSpec
from diloco.syncer.streams import (
    CONTROL_WORKERS,
    MAX_QUEUED_CALLS,
    ClientCalls,
    DataThreads,
    StreamWatch,
    calls_per_client,
    expired,
)
from diloco.transport import tls, wire
from diloco.transport.auth import AcceptedTokens, TokenInterceptor, token_fingerprint
from diloco.transport.codes import encoding_of, status_code
from diloco.transport.connections import ConnectionWatch
from diloco.transport.deadlines import patience_options, quiet_seconds
from diloco.transport.handlers import behavior_of, with_behavior
from diloco.transport.tls import Security, Tls
from diloco.transport.v1 import syncer_pb2 as pb

log = logging.getLogger("diloco.syncer")

SERVICE_NAME = "diloco.v1.Syncer"
HEADER_SLACK_BYTES = 1024 * 1024
MERGE_POLL_SECONDS = 0.5
SUMMARY_SECONDS = 30.0
U32 = 2**32 - 1  # the largest value of the uint32 fields of the StatusReply
U64 = 2**64 - 1  # the largest value of its uint64 fields

H = TypeVar("H", pb.FragmentHeader, pb.PushHeader)
R = TypeVar("R")
S = TypeVar("S")
M = TypeVar("M", pb.JoinRequest, pb.PullRequest, pb.LeaveRequest, pb.StatusRequest)


def _new_incarnation() -> int:
    return secrets.randbits(63)


def _new_lineage() -> int:
    """A state's id: never 0, which says "not known"."""
    return 1 + secrets.randbelow(2**63 - 1)


def _specs(payloads: Iterable[pb.TensorPayload]) -> list[TensorSpec]:
    return [TensorSpec(p.name, tuple(p.shape), p.dtype) for p in payloads]


def _saturated(count: int, most: int) -> int:
    """A counter as its unsigned wire field can carry it: at most `most`, so Status answers whatever the
    state holds (a checkpoint written before tokens were bounded may hold more than 2^64 tokens merged)."""
    return max(0, min(count, most))


class SyncerServer:
    """One shard: owns fragments p with p mod num_shards == shard_index."""

    def __init__(
        self,
        config: TrainingConfig,
        *,
        shard_index: int,
        num_shards: int,
        token: str | AcceptedTokens,
        security: Security,
        host: str = "127.0.0.1",
        port: int = 0,
        health_port: int | None = None,
        checkpoint_dir: Path | None = None,
        checkpoint_interval: float = 60.0,
        max_fragment_bytes: int = wire.MAX_STREAM_BYTES,
        max_reference_bytes: int = 4 * 1024**3,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        metrics: SyncerMetrics | None = None,
        max_workers: int = 32,
        max_queued_calls: int = MAX_QUEUED_CALLS,
        stream_idle_seconds: float | None = None,
        progress: ProgressWriter | None = None,
        clock: Callable[[], float] = time.time,
        threads: int = 1,
        declared_islands: int = 0,
    ) -> None:
        """`max_workers` threads serve the data calls (Seed, PushDelta, Pull), `CONTROL_WORKERS` more the
        others; `max_queued_calls` data calls may wait for a thread, and more are refused; `stream_idle_seconds`
        is how long a data stream may keep the shard waiting (`streams`).
        `security`: the shard's certificate (and the CA, for mutual TLS), or plaintext asked for by name.
        `health_port` (0: any free one) serves grpc.health.v1 alone in plaintext, for probes that cannot speak
        TLS (the kubelet's): health says only whether the shard serves, as on the main port without a token.
        `progress` records each merge and the pushes in it (the local runner's goodput accounting).
        `threads`: the cores a merge or a difference works on (the process sets torch's threads to match), which
        sizes their chunks, and the threads that hash digests. `declared_islands`: how many islands the job
        declares (0: not known), the most a round of merges is made of (`ShardState.round_members`)."""
        if threads < 1:
            raise ValueError(f"threads must be positive, got {threads}")
        self.config = config
        self.declared_islands = declared_islands
        self.chunk = CHUNK * threads  # each of torch's threads takes a cache-sized part of every chunk
        self.progress = progress
        self.metrics = metrics or SyncerMetrics()
        self.clock = clock
        self.max_fragment_bytes = max_fragment_bytes
        self.checkpoint_interval = checkpoint_interval
        self._checkpoint_path = (
            checkpoint.checkpoint_path(checkpoint_dir, shard_index, num_shards) if checkpoint_dir else None
        )
        self.state = self._resume_or_start(shard_index, num_shards, max_pending_bytes)
        self._cond = threading.Condition()
        self._dirty = False
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.pulls = Pulls(
            self.state,
            config,
            self._cond,
            chunk=self.chunk,
            threads=threads,
            max_reference_bytes=max_reference_bytes,
        )
        min_mbps = config.min_transfer_mbps
        idle = quiet_seconds(min_mbps) if stream_idle_seconds is None else stream_idle_seconds
        self.streams = StreamWatch(idle, min_mbps, on_cancel=self._count_cancelled)
        self._health = health.HealthServicer()
        self._control = futures.ThreadPoolExecutor(max_workers=CONTROL_WORKERS, thread_name_prefix="syncer-control")
        self.data_threads = DataThreads(max_workers, max_queued_calls)
        self.client_calls = ClientCalls(calls_per_client(max_workers))
        servicer = _Servicer(self)
        self.tokens = AcceptedTokens.of(token)
        interceptors: list[grpc.ServerInterceptor] = [
            TokenInterceptor(self.tokens, on_refused=self._count_unauthenticated)
        ]
        self._connections: ConnectionWatch | None = None
        if isinstance(security, Tls):
            self._connections = ConnectionWatch(
                self.metrics.tls_handshakes.inc, self.metrics.tls_connections_with_calls.inc
            )
            interceptors.insert(0, self._connections)
        self._server = grpc.server(
            self.data_threads,
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", wire.MAX_CHUNK_BYTES + HEADER_SLACK_BYTES),
                ("grpc.max_send_message_length", wire.MAX_CHUNK_BYTES + HEADER_SLACK_BYTES),
                ("grpc.so_reuseport", 0),
                *patience_options(min_mbps),
            ],
            # the data calls are bounded apart (`_Admitted`); control calls may wait as many again
            maximum_concurrent_rpcs=self.data_threads.bound + CONTROL_WORKERS + max_queued_calls,
        )
        self._server.add_generic_rpc_handlers(
            tuple(
                _Admitted(handlers, self.data_threads, servicer.refuse_busy, self._control)
                for handlers in (_handlers(servicer, self._control), _health_handlers(self._health, self._control))
            )
        )
        on_handshake = None if self._connections is None else self._connections.handshake_begun
        self.port = tls.add_port(
            self._server, f"{host}:{port}", security, on_handshake=on_handshake, on_reload=self._serving
        )
        if self.port == 0:
            raise OSError(f"could not bind {host}:{port}")
        if self._connections is not None:
            self._connections.port = self.port
        if isinstance(security, Tls):
            self._serving(security)
        self._health_server: grpc.Server | None = None
        self.health_port: int | None = None
        if health_port is not None:
            self._health_server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncer-health"),
                handlers=[_health_handlers(self._health, self._control)],
                options=[("grpc.so_reuseport", 0)],
            )
            self.health_port = self._health_server.add_insecure_port(f"{host}:{health_port}")
            if self.health_port == 0:
                raise OSError(f"could not bind {host}:{health_port} for health checks")

    def _resume_or_start(self, shard_index: int, num_shards: int, max_pending_bytes: int) -> ShardState:
        saved = checkpoint.load(self._checkpoint_path) if self._checkpoint_path else None
        if saved is None:
            return ShardState(
                self.config,
                shard_index,
                num_shards,
                _new_incarnation(),
                max_pending_bytes,
                self.chunk,
                self.declared_islands,
                lineage=_new_lineage(),
            )
        state = ShardState.from_state_dict(
            self.config,
            shard_index,
            num_shards,
            saved,
            _new_incarnation(),
            max_pending_bytes,
            self.chunk,
            self.declared_islands,
        )
        log.info(
            "resumed from checkpoint",
            extra={
                "path": str(self._checkpoint_path),
                "clean": saved["clean"],
                "incarnation": state.incarnation,
                "lineage": state.lineage,
                "versions": {p: f.version for p, f in state.fragments.items()},
            },
        )
        return state

    # Lifecycle

    def _serving(self, security: Tls) -> None:
        """The shard serves `security`'s certificate from now on: when it starts, and at each reload."""
        if security.cert is not None:
            self.metrics.serving_certificate(security.cert)
            self._warn_if_expiring(security.cert)

    def _warn_if_expiring(self, cert: bytes) -> None:
        """A WARNING now if the certificate expires within `tls.EXPIRY_WARNING` or has expired: then every
        handshake fails, and its clients only see UNAVAILABLE (the expiry itself is a metric: `metrics`)."""
        seconds = tls.seconds_to_expiry(cert, datetime.datetime.fromtimestamp(self.clock(), datetime.UTC))
        if seconds < tls.EXPIRY_WARNING.total_seconds():
            state = "has expired" if seconds <= 0 else "expires soon"
            log.warning(
                f"the shard's TLS certificate {state}: renew it (clients refuse an expired one)",
                extra={"seconds_to_expiry": round(seconds)},
            )

    def start(self) -> int:
        self._server.start()
        if self._health_server is not None:
            self._health_server.start()
        loops = (
            (self._merge_loop, "syncer-merge"),
            (self._checkpoint_loop, "syncer-checkpoint"),
            (lambda: self.streams.run(self._stopping), "syncer-streams"),
        )
        for target, name in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "syncer shard listening",
            extra={
                "port": self.port,
                "shard": self.state.shard_index,
                "shards": self.state.num_shards,
                "fragments": sorted(self.state.fragments),
            },
        )
        return self.port

    def stop(self, grace: float = 2.0) -> None:
        """Stops serving, then writes the final (clean) checkpoint: a graceful stop loses nothing."""
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        if self._health_server is not None:
            self._health_server.stop(0).wait()
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        self._control.shutdown()
        self.pulls.close()
        self.save_checkpoint(clean=True)
        if self.progress is not None:
            self.progress.close()
        log.info("syncer shard stopped", extra={"shard": self.state.shard_index})

    def wait(self) -> None:
        self._server.wait_for_termination()

    # Background work

    def _merge_loop(self) -> None:
        next_summary = self.clock() + SUMMARY_SECONDS
        while not self._stopping.is_set():
            with self._cond:
                self._merge_due()
                deadline = self.state.next_deadline()
                wait = MERGE_POLL_SECONDS if deadline is None else deadline - self.clock()
                self._cond.wait(min(max(wait, 0.0), MERGE_POLL_SECONDS))
            if self.clock() >= next_summary:
                next_summary = self.clock() + SUMMARY_SECONDS
                self._log_summary()

    def _merge_due(self) -> None:
        """Merges every fragment that is due; the caller holds the lock."""
        now = self.clock()
        self.metrics.live_islands.set(len(self.state.live_islands(now)))
        self.metrics.grace_seconds.set(self.state.grace_seconds())
        for index in self.state.poll(now):
            started = time.perf_counter()
            record = self.state.merge(index, now)
            self._dirty = True
            if record.outliers:
                self.metrics.outliers.inc(len(record.outliers))
                log.warning(
                    "deltas far beyond their peers' left out of a merge",
                    extra={"fragment": index, "islands": sorted({key.island for key in record.outliers})},
                )
            if record.dropped is not None:
                if record.pushes:
                    self.metrics.rejected.labels(record.dropped).inc(len(record.contributors))
                    log.warning(
                        "merge refused, contributions dropped",
                        extra={"fragment": index, "reason": record.dropped, "contributors": list(record.contributors)},
                    )
                continue
            self.metrics.merge_seconds.observe(time.perf_counter() - started)
            self.metrics.merges.labels(str(index)).inc()
            self.metrics.version.labels(str(index)).set(record.version)
            self.metrics.contributors.observe(len(record.contributors))
            if self.progress is not None:
                pushes = tuple((k.island, k.incarnation, k.base_version, k.sequence) for k in record.pushes)
                self.progress.write(
                    MergeEvent, fragment=index, version=record.version, pushes=pushes, landed=record.landed
                )
            log.debug(
                "merged",
                extra={
                    "fragment": index,
                    "version": record.version,
                    "contributors": list(record.contributors),
                    "tokens": record.tokens,
                    "max_staleness": record.max_staleness,
                },
            )

    def _log_summary(self) -> None:
        with self._cond:
            versions = {p: f.version for p, f in self.state.fragments.items()}
            live = self.state.live_islands(self.clock())
        log.info("shard progress", extra={"versions": versions, "live_islands": live})

    def _checkpoint_loop(self) -> None:
        """Checkpoints every interval. A write that fails (a volume this user may not write, a full disk) is
        counted and logged and tried again at the next one: the shard keeps serving, but says it would lose
        its state on a restart."""
        while not self._stopping.wait(self.checkpoint_interval):
            try:
                self.save_checkpoint(clean=False)
            except OSError as error:
                self.metrics.checkpoint_failures.inc()
                log.error("checkpoint not written", extra={"path": str(self._checkpoint_path), "error": str(error)})

    def save_checkpoint(self, clean: bool) -> None:
        """Snapshots under the lock, writes outside it; skipped when nothing changed since the last one."""
        if self._checkpoint_path is None:
            return
        with self._cond:
            if not (self._dirty or clean):
                return
            snapshot = self.state.to_state_dict(clean=clean)
            self._dirty = False
        started = time.perf_counter()
        try:
            size = checkpoint.save(self._checkpoint_path, snapshot)
        except BaseException:
            with self._cond:
                self._dirty = True  # what it held is still to be written
            raise
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - started)
        self.metrics.checkpoint_bytes.set(size)
        self.metrics.checkpoint_time.set_to_current_time()
        log.debug("checkpoint written", extra={"path": str(self._checkpoint_path), "bytes": size, "clean": clean})

    # Calls: each takes the lock for as long as it needs it; the servicer below turns them into gRPC

    def version(self, version: int) -> pb.FragmentVersion:
        """A fragment version as the wire names it: within this shard's incarnation."""
        return fragment_version(self.state.incarnation, version)

    def join(self, island: str) -> pb.JoinReply:
        """Counts the island live (again, if it had left) and tells it how the fragments are laid out."""
        with self._cond:
            self.state.join(island, self.clock())
            return pb.JoinReply(
                shard_index=self.state.shard_index,
                num_shards=self.state.num_shards,
                owned_fragments=sorted(self.state.fragments),
                unseeded_fragments=self.state.unseeded(),
                max_chunk_bytes=wire.MAX_CHUNK_BYTES,
            )

    def seeded_version(self, index: int) -> pb.FragmentVersion | None:
        """The fragment's version once it is seeded, None before; lets a late seed be answered unread."""
        with self._cond:
            frag = self.state.fragment(index)
            return self.version(frag.version) if frag.seeded else None

    def seed(
        self, index: int, specs: Sequence[TensorSpec], values: Sequence[torch.Tensor]
    ) -> tuple[bool, pb.FragmentVersion]:
        """Whether the seed was taken (the first wins) and the fragment's version after it."""
        with self._cond:
            accepted = self.state.seed(index, specs, values)
            self._dirty |= accepted
            return accepted, self.version(self.state.fragments[index].version)

    def admit_push(
        self,
        key: PushKey,
        fragment: int,
        specs: Sequence[TensorSpec],
        tokens: int,
        inner_steps: int,
        slack_seconds: float | None = None,
        declared_bytes: int | None = None,
    ) -> tuple[PushResult | None, int]:
        """Checks a push header before its data is read: a duplicate's result (None to read on) and the most
        bytes the data may take. A duplicate is answered, so it refreshes the island; a push to read on does
        when it is taken. `declared_bytes`: what the header says the data takes, which the shard will hold."""
        with self._cond:
            early = self.state.check_push(key, fragment, specs, tokens, inner_steps, slack_seconds, declared_bytes)
            if early is not None:
                self.state.touch(key.island, self.clock())
            return early, self.state.fragments[fragment].nbytes

    def submit_push(
        self,
        key: PushKey,
        fragment: int,
        specs: Sequence[TensorSpec],
        delta: Sequence[Delta],
        tokens: int,
        inner_steps: int,
        step_seconds: float,
        slack_seconds: float | None = None,
        last: bool = False,
    ) -> PushResult:
        """Takes a checked push and wakes the merge thread, which may find the fragment due now. The delta's norm
        (what its merge clips by) is a pass over its bytes: taken here, on the push's own thread, before the
        lock, so that neither the merge nor the other calls wait for it. `last`: the island's last push of the
        fragment, which its merge lands."""
        norm = delta_norm(delta, self.state.chunk)
        with self._cond:
            result = self.state.submit(
                key,
                fragment,
                specs,
                delta,
                tokens,
                inner_steps,
                self.clock(),
                step_seconds,
                slack_seconds,
                norm,
                last,
            )
            self._dirty |= not result.duplicate
            self._cond.notify_all()
            return result

    def cadence_step_seconds(self) -> float:
        """The job's cadence that a push reply tells a speed-aware island."""
        with self._cond:
            return self.state.cadence_step_seconds(self.clock())

    def pull(self, request: pb.PullRequest, encoding: Encoding, delta_encoding: Encoding | None) -> ServedPull | None:
        """The Pull reply to `request` (`Pulls.serve`), None when the island holds the newest version. A joined
        island is refreshed once the pull is answered."""
        with self._cond:
            if request.island_id:
                self.state.check_island(request.island_id)
            frag = self.state.seeded_fragment(request.fragment_id)
            self.state.touch(request.island_id, self.clock())
            if (request.have.incarnation, request.have.version) == (self.state.incarnation, frag.version):
                return None
        return self.pulls.serve(request, encoding, delta_encoding)

    def leave(self, island: str) -> None:
        """The island has finished: it no longer caps the quorum, so a merge that waited only for it is due,
        and made before the reply. Once the last island's Leave returns, every push it handed over is in the
        global model, ready to export."""
        with self._cond:
            self.state.leave(island)
            self._merge_due()
            self._cond.notify_all()

    def status(self) -> pb.StatusReply:
        with self._cond:
            st = self.state
            return pb.StatusReply(
                shard_index=st.shard_index,
                num_shards=st.num_shards,
                live_islands=st.live_islands(self.clock()),
                left_islands=sorted(st.left),
                rejected_pushes=_saturated(st.rejected_pushes, U64),
                accepted_tokens=[token_fingerprint(t) for t in self.tokens.current()],
                lineage=st.lineage,
                fragments=[
                    pb.FragmentStatus(
                        fragment_id=f.index,
                        seeded=f.seeded,
                        version=fragment_version(st.incarnation, f.version),
                        pending=_saturated(len(f.pending), U32),
                        last_contributors=_saturated(f.last_contributors, U32),
                        last_merge_unix=f.last_merge_unix,
                        max_staleness_seen=_saturated(f.max_staleness_seen, U32),
                        tokens_merged=_saturated(f.tokens_merged, U64),
                    )
                    for f in st.fragments.values()
                ],
            )

    def count_refusal(self, refusal: Refused) -> None:
        """Counts a refused call where operators look: the status reply, the metrics and the debug log."""
        with self._cond:
            self.state.rejected_pushes += 1
        self.metrics.rejected.labels(refusal.reason).inc()
        log.debug("refused", extra={"reason": refusal.reason, "detail": refusal.message})

    # Counted where operators look

    def _count_cancelled(self, reason: str, method: str) -> None:
        """A stream that kept the shard waiting too long was cancelled; count it where operators look."""
        self.metrics.rejected.labels(reason).inc()
        log.info("stream cancelled", extra={"reason": reason, "method": method})

    def _count_unauthenticated(self, method: str) -> None:
        """A wrong or missing token is refused before any handler runs; count it where operators look."""
        self.metrics.rejected.labels("unauthenticated").inc()
        log.debug("refused", extra={"reason": "unauthenticated", "detail": method})


def _first_header(parts: Iterator[wire.Part], header_type: type[H]) -> H:
    """The header that must open a stream, read before any data is buffered."""
    first = next(parts, None)
    if not isinstance(first, header_type):
        raise Refused(Refusal.INVALID, "malformed", f"the stream must start with a {header_type.__name__}")
    _check_fields(first)
    return first


def _check_fields(message: Message) -> None:
    """Every field of a request within its rule (`transport.fields`), before anything reads a value."""
    try:
        wire.check_fields(message)
    except wire.WireError as error:
        raise Refused(error.kind, "field", error.message) from None


def _declared_bytes(tensors: Iterable[pb.TensorPayload]) -> int:
    """The bytes a stream's header says its data will take (checked against the limits as it is read)."""
    return sum(t.byte_length for t in tensors)


def _requested_encoding(value: int, what: str) -> Encoding:
    """An encoding a Pull request names, refused as malformed when it is not in the contract."""
    try:
        return encoding_of(value)
    except EncodingError:
        raise Refused(Refusal.INVALID, "malformed", f"unknown {what} {value}") from None


def _wire_refusal(error: wire.WireError) -> Refused:
    reason = "oversize" if error.kind is Refusal.TOO_LARGE else "malformed"
    return Refused(error.kind, reason, error.message)


def _on_pool(behavior: Callable[[R, grpc.ServicerContext], S], pool: futures.Executor) -> Callable[..., S]:
    """`behavior` run on `pool` instead of the server's threads (gRPC reads `experimental_thread_pool`)."""

    def run(request: R, context: grpc.ServicerContext) -> S:
        return behavior(request, context)

    run.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return run


class _Admitted(grpc.GenericRpcHandler):
    """The calls of `inner` that run on the data threads, refused on arrival while the data threads hold all
    the calls they take: `refuse` answers them on the control threads, so a full queue delays no probe."""

    def __init__(
        self,
        inner: grpc.GenericRpcHandler,
        data: DataThreads,
        refuse: Callable[[object, grpc.ServicerContext], NoReturn],
        control: futures.Executor,
    ) -> None:
        self._inner = inner
        self.data_threads = data
        self._refuse = refuse
        self._control = control

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self._inner.service(handler_call_details)
        if handler is None or hasattr(behavior_of(handler), "experimental_thread_pool") or self.data_threads.has_room():
            return handler
        return with_behavior(handler, _on_pool(self._refuse, self._control))


def _health_handlers(servicer: health.HealthServicer, control: futures.Executor) -> grpc.GenericRpcHandler:
    """grpc.health.v1 with its Check on the control threads, so probes are answered while every data thread
    is held; Watch, a long-lived stream, stays on the data threads."""
    return grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health",
        {
            "Check": grpc.unary_unary_rpc_method_handler(
                _on_pool(servicer.Check, control),
                health_pb2.HealthCheckRequest.FromString,
                health_pb2.HealthCheckResponse.SerializeToString,
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                servicer.Watch,
                health_pb2.HealthCheckRequest.FromString,
                health_pb2.HealthCheckResponse.SerializeToString,
            ),
        },
    )


def _handlers(servicer: _Servicer, control: futures.Executor) -> grpc.GenericRpcHandler:
    """The diloco.v1.Syncer service with zero-copy chunk deserializers; Pull yields serialized messages. Bytes
    that are no request reach the handlers as `wire.Undecodable`, to be refused as invalid. The calls that
    carry no tensors run on the `control` threads."""
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Join": grpc.unary_unary_rpc_method_handler(
                _on_pool(servicer.Join, control), wire.parse_request(pb.JoinRequest), pb.JoinReply.SerializeToString
            ),
            "Seed": grpc.stream_unary_rpc_method_handler(
                servicer.Seed, wire.parse_fragment_chunk, pb.SeedReply.SerializeToString
            ),
            "PushDelta": grpc.stream_unary_rpc_method_handler(
                servicer.PushDelta, wire.parse_push_chunk, pb.PushReply.SerializeToString
            ),
            "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull, wire.parse_request(pb.PullRequest), None),
            "Status": grpc.unary_unary_rpc_method_handler(
                _on_pool(servicer.Status, control),
                wire.parse_request(pb.StatusRequest),
                pb.StatusReply.SerializeToString,
            ),
            "Leave": grpc.unary_unary_rpc_method_handler(
                _on_pool(servicer.Leave, control), wire.parse_request(pb.LeaveRequest), pb.LeaveReply.SerializeToString
            ),
        },
    )


class _Servicer:
    """The diloco.v1.Syncer calls in gRPC terms: reads and checks the streams, answers refusals with their
    status codes, and leaves the shard's state to the server's calls."""

    def __init__(self, server: SyncerServer) -> None:
        self.s = server

    def _refuse(self, refusal: Refused, context: grpc.ServicerContext) -> NoReturn:
        """Counts the refusal and aborts the call with its status code; the abort raises, ending the handler.
        A stream cut short because its deadline passed (also while it waited for a thread) counts as expired."""
        if refusal.reason == "malformed" and expired(context):
            refusal = Refused(refusal.kind, "expired", f"the call expired: {refusal.message}")
        self.s.count_refusal(refusal)
        context.abort(status_code(refusal.kind), refusal.message)

    def refuse_busy(self, _request: object, context: grpc.ServicerContext) -> NoReturn:
        """A data call that came while the shard holds all the data calls it takes."""
        bound = self.s.data_threads.bound
        self._refuse(
            Refused(Refusal.TOO_LARGE, "busy", f"the shard holds the {bound} data calls it takes at once; retry later"),
            context,
        )

    @contextmanager
    def _data_call(self, context: grpc.ServicerContext) -> Iterator[None]:
        """Admits a data call on its thread: one that expired while queued is counted as such (its client has
        gone: there is nothing to answer), one beyond its client's share of the data threads is refused."""
        if expired(context):
            self.s.count_refusal(Refused(Refusal.TOO_LARGE, "expired", "expired while queued"))
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the call expired while it waited for a data thread")
        with self.s.client_calls.hold(context.peer()) as taken:
            if not taken:
                most = self.s.client_calls.most
                refusal = Refused(
                    Refusal.TOO_LARGE, "client_limit", f"this client already holds the {most} data calls it may"
                )
                self._refuse(refusal, context)
            yield

    def _decoded(self, request: M | wire.Undecodable, context: grpc.ServicerContext) -> M:
        """The request, unless its bytes were no such message (a string field that is not UTF-8): the caller's
        error, refused as invalid (gRPC itself would answer INTERNAL, which clients retry)."""
        if isinstance(request, wire.Undecodable):
            self._refuse(Refused(Refusal.INVALID, "malformed", "the request is not a valid message"), context)
        try:
            _check_fields(request)
        except Refused as refusal:
            self._refuse(refusal, context)
        return request

    def Join(self, request: pb.JoinRequest | wire.Undecodable, context: grpc.ServicerContext) -> pb.JoinReply:
        join = self._decoded(request, context)
        fragments = self.s.config.fragments
        try:
            if join.num_fragments != fragments:
                raise Refused(
                    Refusal.INVALID, "layout", f"the island has {join.num_fragments} fragments, the job {fragments}"
                )
            return self.s.join(join.island_id)
        except Refused as refusal:
            self._refuse(refusal, context)

    def Seed(self, request_iterator: Iterator[wire.Part], context: grpc.ServicerContext) -> pb.SeedReply:
        with self._data_call(context):
            return self._seed(request_iterator, context)

    def _seed(self, request_iterator: Iterator[wire.Part], context: grpc.ServicerContext) -> pb.SeedReply:
        s = self.s
        try:
            with s.streams.watching(context, "Seed") as watched:
                parts = watched.parts(request_iterator)
                first = _first_header(parts, pb.FragmentHeader)
                index = first.fragment_id
                seeded = s.seeded_version(index)
                if seeded is not None:
                    return pb.SeedReply(accepted=False, version=seeded)
                watched.expect(min(_declared_bytes(first.tensors), s.max_fragment_bytes))
                _header, tensors = wire.read_fragment_stream(
                    itertools.chain([first], parts), max_total_bytes=s.max_fragment_bytes
                )
            specs = _specs(p for p, _ in tensors)
            accepted, version = s.seed(index, specs, [t for _, t in tensors])
        except wire.WireError as error:
            self._refuse(_wire_refusal(error), context)
        except Refused as refusal:
            self._refuse(refusal, context)
        s.metrics.bytes_in.inc(sum(p.byte_length for p, _ in tensors))
        if accepted:
            log.info("fragment seeded", extra={"fragment": index, "tensors": len(specs)})
        return pb.SeedReply(accepted=accepted, version=version)

    def PushDelta(self, request_iterator: Iterator[wire.Part], context: grpc.ServicerContext) -> pb.PushReply:
        with self._data_call(context):
            return self._push(request_iterator, context)

    def _push(self, request_iterator: Iterator[wire.Part], context: grpc.ServicerContext) -> pb.PushReply:
        s = self.s
        try:
            with s.streams.watching(context, "PushDelta") as watched:
                parts = watched.parts(request_iterator)
                h = _first_header(parts, pb.PushHeader)
                key = PushKey(h.island_id, h.base.incarnation, h.base.version, h.sequence)
                specs = _specs(h.tensors)
                slack = h.slack_seconds if h.HasField("slack_seconds") else None
                declared = _declared_bytes(h.tensors)
                early, limit = s.admit_push(key, h.fragment_id, specs, h.tokens, h.inner_steps, slack, declared)
                if early is None:
                    watched.expect(min(declared, limit))
                    _, tensors = wire.read_push_stream(itertools.chain([h], parts), max_total_bytes=limit)
            if early is None:
                delta = [t for _, t in tensors]
                result = s.submit_push(
                    key, h.fragment_id, specs, delta, h.tokens, h.inner_steps, h.step_seconds, slack, h.last
                )
                s.metrics.bytes_in.inc(sum(p.byte_length for p, _ in tensors))
            else:
                result = early
        except wire.WireError as error:
            self._refuse(_wire_refusal(error), context)
        except Refused as refusal:
            self._refuse(refusal, context)
        s.metrics.pushes.labels("duplicate" if result.duplicate else "accepted").inc()
        if not result.duplicate:
            s.metrics.staleness.observe(result.staleness)
        return pb.PushReply(
            duplicate=result.duplicate,
            current=s.version(result.version),
            staleness=result.staleness,
            cadence_step_seconds=s.cadence_step_seconds(),
            arrival_seconds=result.arrived,
            live_islands=_saturated(result.live_islands, U32),
        )

    def Pull(self, request: pb.PullRequest | wire.Undecodable, context: grpc.ServicerContext) -> Iterator[bytes]:
        with self._data_call(context):
            yield from self._pull(request, context)

    def _pull(self, request: pb.PullRequest | wire.Undecodable, context: grpc.ServicerContext) -> Iterator[bytes]:
        s = self.s
        request = self._decoded(request, context)
        try:
            encoding = _requested_encoding(request.encoding, "encoding") if request.encoding else Encoding.FP32
            delta_encoding = (
                _requested_encoding(request.delta_encoding, "delta encoding") if request.delta_encoding else None
            )
            served = s.pull(request, encoding, delta_encoding)
        except Refused as refusal:
            self._refuse(refusal, context)
        if served is None:
            return
        with s.streams.watching(context, "Pull") as watched:
            watched.expect(served.nbytes)
            for message in served.messages:
                with watched.waiting():
                    yield message
        s.metrics.pulls.labels("delta" if served.delta else "full").inc()
        s.metrics.bytes_out.inc(served.nbytes)

    def Leave(self, request: pb.LeaveRequest | wire.Undecodable, context: grpc.ServicerContext) -> pb.LeaveReply:
        island = self._decoded(request, context).island_id
        try:
            self.s.leave(island)
        except Refused as refusal:
            self._refuse(refusal, context)
        log.info("island left", extra={"island": island})
        return pb.LeaveReply()

    def Status(self, request: pb.StatusRequest | wire.Undecodable, context: grpc.ServicerContext) -> pb.StatusReply:
        self._decoded(request, context)
        return self.s.status()
