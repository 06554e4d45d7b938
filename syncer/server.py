"""The gRPC server of one syncer shard: the wire around `ShardState`, a merge thread and checkpoints.

Data is read and decoded outside the state lock; only validation, submission, merges and snapshots hold
it. Encoded fragment values are cached per version and encoding, so many islands pulling the same merge
cost one encoding. An island that says which values it holds gets the difference to the newest in the
job's encoding when the shard knows those values (`diloco.core.compressed_pull`), and full values otherwise.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from pathlib import Path
from typing import TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from diloco.core.compressed_pull import held_after, values_digest
from diloco.core.config import TrainingConfig
from diloco.core.encoding import Encoding, EncodingError
from diloco.syncer import checkpoint
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.references import Reference, References
from diloco.syncer.shard import PushKey, Refused, ShardState, TensorSpec
from diloco.transport import wire
from diloco.transport.auth import TokenInterceptor
from diloco.transport.codes import encoding_of
from diloco.transport.v1 import syncer_pb2 as pb

log = logging.getLogger("diloco.syncer")

SERVICE_NAME = "diloco.v1.Syncer"
HEADER_SLACK_BYTES = 1024 * 1024
MERGE_POLL_SECONDS = 0.5
SUMMARY_SECONDS = 30.0

H = TypeVar("H", pb.FragmentHeader, pb.PushHeader)


def _new_incarnation() -> int:
    return secrets.randbits(63)


def _specs(payloads: Iterable[pb.TensorPayload]) -> list[TensorSpec]:
    return [TensorSpec(p.name, tuple(p.shape), p.dtype) for p in payloads]


def _version(incarnation: int, version: int) -> pb.FragmentVersion:
    return pb.FragmentVersion(incarnation=incarnation, version=version)


class SyncerServer:
    """One shard: owns fragments p with p mod num_shards == shard_index."""

    def __init__(
        self,
        config: TrainingConfig,
        *,
        shard_index: int,
        num_shards: int,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        checkpoint_dir: Path | None = None,
        checkpoint_interval: float = 60.0,
        max_fragment_bytes: int = 16 * 1024**3,
        max_reference_bytes: int = 4 * 1024**3,
        metrics: SyncerMetrics | None = None,
        max_workers: int = 32,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.metrics = metrics or SyncerMetrics()
        self.clock = clock
        self.max_fragment_bytes = max_fragment_bytes
        self.checkpoint_interval = checkpoint_interval
        self._checkpoint_path = (
            checkpoint.checkpoint_path(checkpoint_dir, shard_index, num_shards) if checkpoint_dir else None
        )
        self.state = self._resume_or_start(shard_index, num_shards)
        self._cond = threading.Condition()
        self._dirty = False
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._replies: dict[tuple[int, int], tuple[int, list[bytes], int]] = {}
        self._full_references: dict[int, Reference] = {}
        self._references = References(max_reference_bytes)
        self._health = health.HealthServicer()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="syncer-rpc"),
            interceptors=[TokenInterceptor(token, on_refused=self._count_unauthenticated)],
            options=[
                ("grpc.max_receive_message_length", wire.MAX_CHUNK_BYTES + HEADER_SLACK_BYTES),
                ("grpc.max_send_message_length", wire.MAX_CHUNK_BYTES + HEADER_SLACK_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._server.add_generic_rpc_handlers((_handlers(_Servicer(self)),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind {host}:{port}")

    def _resume_or_start(self, shard_index: int, num_shards: int) -> ShardState:
        saved = checkpoint.load(self._checkpoint_path) if self._checkpoint_path else None
        if saved is None:
            return ShardState(self.config, shard_index, num_shards, _new_incarnation())
        state = ShardState.from_state_dict(self.config, shard_index, num_shards, saved, _new_incarnation())
        log.info(
            "resumed from checkpoint",
            extra={
                "path": str(self._checkpoint_path),
                "clean": saved["clean"],
                "incarnation": state.incarnation,
                "versions": {p: f.version for p, f in state.fragments.items()},
            },
        )
        return state

    # Lifecycle

    def start(self) -> int:
        self._server.start()
        for target, name in ((self._merge_loop, "syncer-merge"), (self._checkpoint_loop, "syncer-checkpoint")):
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
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        self.save_checkpoint(clean=True)
        log.info("syncer shard stopped", extra={"shard": self.state.shard_index})

    def wait(self) -> None:
        self._server.wait_for_termination()

    # Background work

    def _merge_loop(self) -> None:
        next_summary = self.clock() + SUMMARY_SECONDS
        while not self._stopping.is_set():
            with self._cond:
                self.merge_due()
                deadline = self.state.next_deadline()
                wait = MERGE_POLL_SECONDS if deadline is None else deadline - self.clock()
                self._cond.wait(min(max(wait, 0.0), MERGE_POLL_SECONDS))
            if self.clock() >= next_summary:
                next_summary = self.clock() + SUMMARY_SECONDS
                self._log_summary()

    def merge_due(self) -> None:
        """Merges every fragment that is due; the caller holds the lock."""
        now = self.clock()
        self.metrics.live_islands.set(len(self.state.live_islands(now)))
        for index in self.state.poll(now):
            started = time.perf_counter()
            record = self.state.merge(index, now)
            self.metrics.merge_seconds.observe(time.perf_counter() - started)
            self.metrics.merges.labels(str(index)).inc()
            self.metrics.version.labels(str(index)).set(record.version)
            self.metrics.contributors.observe(len(record.contributors))
            self._dirty = True
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
        while not self._stopping.wait(self.checkpoint_interval):
            self.save_checkpoint(clean=False)

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
        size = checkpoint.save(self._checkpoint_path, snapshot)
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - started)
        self.metrics.checkpoint_bytes.set(size)
        log.debug("checkpoint written", extra={"path": str(self._checkpoint_path), "bytes": size, "clean": clean})

    # Calls (the servicer below delegates here, holding no gRPC types beyond messages)

    def pull_reply(self, index: int, encoding: Encoding) -> tuple[int, list[bytes], int]:
        """The serialized Pull reply for the fragment's current values in `encoding` (version, messages,
        tensor bytes), built once per version; the caller holds the lock."""
        frag = self.state.seeded_fragment(index)
        cached = self._replies.get((index, encoding))
        if cached is None or cached[0] != frag.version:
            named = [(s.name, v) for s, v in zip(frag.specs, frag.values)]
            payloads, blobs = wire.tensor_payloads(named, encoding, self.config.block_size)
            for payload, spec in zip(payloads, frag.specs):
                payload.dtype = spec.dtype
            version = _version(self.state.incarnation, frag.version)
            messages = list(wire.fragment_messages(index, version, payloads, blobs))
            cached = (frag.version, messages, sum(len(b) for b in blobs))
            self._replies[(index, encoding)] = cached
        return cached

    def full_reference(self, index: int) -> Reference:
        """The fragment's current float32 values as a reference, one copy per version shared by every island
        that pulls them in full; the caller holds the lock."""
        frag = self.state.seeded_fragment(index)
        ref = self._full_references.get(index)
        if ref is None or (ref.incarnation, ref.version) != (self.state.incarnation, frag.version):
            values = tuple(v.clone() for v in frag.values)
            ref = Reference(self.state.incarnation, frag.version, values, values_digest(values))
            self._full_references[index] = ref
        return ref

    def record_full(self, island: str, index: int) -> None:
        """Notes that `island` is being sent the fragment's current values in full; the caller holds the lock."""
        self._references.record(island, index, self.full_reference(index))

    def held_reference(self, request: pb.PullRequest) -> Reference | None:
        """What the island holds, when it asks for a difference and the shard knows exactly those values: what
        it last served the island, or (version unknown) the newest values themselves; the caller holds the lock."""
        if not (request.HasField("held") and request.delta_encoding and request.island_id):
            return None
        held = request.held
        if not held.HasField("version"):
            newest = self.full_reference(request.fragment_id)
            return newest if newest.digest == held.digest else None
        return self._references.match(
            request.island_id, request.fragment_id, held.version.incarnation, held.version.version, held.digest
        )

    def delta_reply(
        self,
        request: pb.PullRequest,
        held: Reference,
        differences: list[torch.Tensor],
        version: int,
        encoding: Encoding,
    ) -> tuple[list[bytes], int]:
        """The serialized difference from `held` to the values of `version` in `encoding` (and its tensor
        bytes); records what the island will hold once it applies it. Encodes outside the lock."""
        frag = self.state.fragments[request.fragment_id]
        block_size = self.config.block_size
        named = [(spec.name, d) for spec, d in zip(frag.specs, differences)]
        payloads, blobs = wire.tensor_payloads(named, encoding, block_size)
        for payload, spec in zip(payloads, frag.specs):
            payload.dtype = spec.dtype
        values = tuple(held_after(held.values, blobs, encoding, block_size))
        ref = Reference(self.state.incarnation, version, values, values_digest(values))
        with self._cond:
            self._references.record(request.island_id, request.fragment_id, ref)
        messages = wire.fragment_messages(
            request.fragment_id, _version(ref.incarnation, version), payloads, blobs, delta_base=request.held.version
        )
        return list(messages), sum(len(b) for b in blobs)

    def _count_unauthenticated(self, method: str) -> None:
        """A wrong or missing token is refused before any handler runs; count it where operators look."""
        self.metrics.rejected.labels("unauthenticated").inc()
        log.debug("refused", extra={"reason": "unauthenticated", "detail": method})

    def refuse(self, refusal: Refused, context: grpc.ServicerContext) -> None:
        with self._cond:
            self.state.rejected_pushes += 1
        self.metrics.rejected.labels(refusal.reason).inc()
        log.debug("refused", extra={"reason": refusal.reason, "detail": refusal.message})
        context.abort(refusal.code, refusal.message)


def _first_header(parts: Iterator[wire.Part], header_type: type[H]) -> H:
    """The header that must open a stream, read before any data is buffered."""
    first = next(parts, None)
    if not isinstance(first, header_type):
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT, "malformed", f"the stream must start with a {header_type.__name__}"
        )
    return first


def _requested_encoding(value: int, what: str) -> Encoding:
    """An encoding a Pull request names, refused as malformed when it is not in the contract."""
    try:
        return encoding_of(value)
    except EncodingError:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed", f"unknown {what} {value}") from None


def _wire_refusal(error: wire.WireError) -> Refused:
    reason = "oversize" if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "malformed"
    return Refused(error.code, reason, error.message)


def _handlers(servicer: _Servicer) -> grpc.GenericRpcHandler:
    """The diloco.v1.Syncer service with zero-copy chunk deserializers; Pull yields serialized messages."""
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Join": grpc.unary_unary_rpc_method_handler(
                servicer.Join, pb.JoinRequest.FromString, pb.JoinReply.SerializeToString
            ),
            "Seed": grpc.stream_unary_rpc_method_handler(
                servicer.Seed, wire.parse_fragment_chunk, pb.SeedReply.SerializeToString
            ),
            "PushDelta": grpc.stream_unary_rpc_method_handler(
                servicer.PushDelta, wire.parse_push_chunk, pb.PushReply.SerializeToString
            ),
            "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull, pb.PullRequest.FromString, None),
            "Status": grpc.unary_unary_rpc_method_handler(
                servicer.Status, pb.StatusRequest.FromString, pb.StatusReply.SerializeToString
            ),
            "Leave": grpc.unary_unary_rpc_method_handler(
                servicer.Leave, pb.LeaveRequest.FromString, pb.LeaveReply.SerializeToString
            ),
        },
    )


class _Servicer:
    def __init__(self, server: SyncerServer) -> None:
        self.s = server

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        s = self.s
        try:
            if request.num_fragments != s.config.fragments:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "layout",
                    f"the island has {request.num_fragments} fragments, the job {s.config.fragments}",
                )
        except Refused as refusal:
            s.refuse(refusal, context)
        with s._cond:
            s.state.join(request.island_id, s.clock())
            return pb.JoinReply(
                shard_index=s.state.shard_index,
                num_shards=s.state.num_shards,
                owned_fragments=sorted(s.state.fragments),
                unseeded_fragments=s.state.unseeded(),
                max_chunk_bytes=wire.MAX_CHUNK_BYTES,
            )

    def Seed(self, request_iterator: Iterator[wire.Part], context: grpc.ServicerContext) -> pb.SeedReply:
        s = self.s
        try:
            first = _first_header(request_iterator, pb.FragmentHeader)
            index = first.fragment_id
            with s._cond:
                frag = s.state.fragment(index)
                if frag.seeded:
                    return pb.SeedReply(accepted=False, version=_version(s.state.incarnation, frag.version))
            _header, tensors = wire.read_fragment_stream(
                itertools.chain([first], request_iterator), max_total_bytes=s.max_fragment_bytes
            )
            specs = _specs(p for p, _ in tensors)
            with s._cond:
                accepted = s.state.seed(index, specs, [t for _, t in tensors])
                s._dirty |= accepted
                version = _version(s.state.incarnation, s.state.fragments[index].version)
        except wire.WireError as error:
            s.refuse(_wire_refusal(error), context)
        except Refused as refusal:
            s.refuse(refusal, context)
        s.metrics.bytes_in.inc(sum(p.byte_length for p, _ in tensors))
        if accepted:
            log.info("fragment seeded", extra={"fragment": index, "tensors": len(specs)})
        return pb.SeedReply(accepted=accepted, version=version)

    def PushDelta(self, request_iterator: Iterator[wire.Part], context: grpc.ServicerContext) -> pb.PushReply:
        s = self.s
        try:
            h = _first_header(request_iterator, pb.PushHeader)
            key = PushKey(h.island_id, h.base.incarnation, h.base.version, h.sequence)
            specs = _specs(h.tensors)
            if not h.island_id:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "a push must name its island")
            with s._cond:
                early = s.state.check_push(key, h.fragment_id, specs)
                s.state.touch(h.island_id, s.clock())
                limit = s.state.fragments[h.fragment_id].nbytes
            if early is None:
                _, tensors = wire.read_push_stream(itertools.chain([h], request_iterator), max_total_bytes=limit)
                with s._cond:
                    result = s.state.submit(
                        key, h.fragment_id, specs, [t for _, t in tensors], h.tokens, h.inner_steps, s.clock()
                    )
                    s._dirty |= not result.duplicate
                    s._cond.notify_all()
                s.metrics.bytes_in.inc(sum(p.byte_length for p, _ in tensors))
            else:
                result = early
        except wire.WireError as error:
            s.refuse(_wire_refusal(error), context)
        except Refused as refusal:
            s.refuse(refusal, context)
        s.metrics.pushes.labels("duplicate" if result.duplicate else "accepted").inc()
        if not result.duplicate:
            s.metrics.staleness.observe(result.staleness)
        return pb.PushReply(
            duplicate=result.duplicate,
            current=_version(s.state.incarnation, result.version),
            staleness=result.staleness,
        )

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        s = self.s
        held = None
        try:
            encoding = _requested_encoding(request.encoding, "encoding") if request.encoding else Encoding.FP32
            delta_encoding = (
                _requested_encoding(request.delta_encoding, "delta encoding") if request.delta_encoding else None
            )
            with s._cond:
                s.state.touch(request.island_id, s.clock())
                frag = s.state.seeded_fragment(request.fragment_id)
                if (request.have.incarnation, request.have.version) == (s.state.incarnation, frag.version):
                    return
                version = frag.version
                held = s.held_reference(request)
                if held is not None:
                    differences = [torch.sub(v, h) for v, h in zip(frag.values, held.values)]
                else:
                    _, messages, nbytes = s.pull_reply(request.fragment_id, encoding)
                    if delta_encoding is not None and request.island_id and encoding is Encoding.FP32:
                        s.record_full(request.island_id, request.fragment_id)
        except Refused as refusal:
            s.refuse(refusal, context)
        if held is not None:
            messages, nbytes = s.delta_reply(request, held, differences, version, delta_encoding)
        yield from messages
        s.metrics.pulls.labels("full" if held is None else "delta").inc()
        s.metrics.bytes_out.inc(nbytes)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        s = self.s
        if not request.island_id:
            s.refuse(Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "a leave must name its island"), context)
        with s._cond:
            s.state.leave(request.island_id)
            s._cond.notify_all()  # a merge that waited only for this island is due now
        log.info("island left", extra={"island": request.island_id})
        return pb.LeaveReply()

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        s = self.s
        with s._cond:
            st = s.state
            return pb.StatusReply(
                shard_index=st.shard_index,
                num_shards=st.num_shards,
                live_islands=st.live_islands(s.clock()),
                left_islands=sorted(st.left),
                rejected_pushes=st.rejected_pushes,
                fragments=[
                    pb.FragmentStatus(
                        fragment_id=f.index,
                        seeded=f.seeded,
                        version=_version(st.incarnation, f.version),
                        pending=len(f.pending),
                        last_contributors=f.last_contributors,
                        last_merge_unix=f.last_merge_unix,
                        max_staleness_seen=f.max_staleness_seen,
                        tokens_merged=f.tokens_merged,
                    )
                    for f in st.fragments.values()
                ],
            )
