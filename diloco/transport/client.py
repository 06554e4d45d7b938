"""The island's side of the wire: calls to one syncer shard with the job's token, a deadline on every call,
and retries with jittered exponential backoff, so a restarting shard or a flaky link never stops training.

Every call is safe to repeat: pushes are idempotent by (island, fragment, base, sequence), seeds are
first-wins, pulls and status read only. A retried stream is rebuilt from bytes encoded once. `pull_delta`
asks for the difference to the values the island holds (see `diloco.core.compressed_pull`).
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch
from grpc_health.v1 import health_pb2

from diloco.core.compressed_pull import apply_delta
from diloco.core.config import DEFAULT_MIN_TRANSFER_MBPS
from diloco.core.encoding import Encoding
from diloco.core.refusal import Refusal
from diloco.transport import handshake, tls, wire
from diloco.transport.auth import bearer_metadata
from diloco.transport.codes import wire_encoding
from diloco.transport.deadlines import call_timeout, patience_options
from diloco.transport.reload import Watched
from diloco.transport.tls import Role, Security, Tls
from diloco.transport.v1 import syncer_pb2 as pb

log = logging.getLogger("diloco.transport.client")

T = TypeVar("T")

RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
    }
)
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", wire.MAX_CHUNK_BYTES + 1024 * 1024),
    ("grpc.max_send_message_length", wire.MAX_CHUNK_BYTES + 1024 * 1024),
    ("grpc.enable_retries", 0),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


PROBE_SECONDS = 5.0
"""The longest a TLS handshake probe of a shard that failed a call UNAVAILABLE may take (`handshake`)."""


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter, so islands retrying a restarted shard do not stampede it."""

    initial: float = 0.1
    maximum: float = 5.0
    multiplier: float = 2.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.maximum, self.initial * self.multiplier**attempt))


@dataclass(frozen=True)
class Held:
    """Float32 values an island holds of a fragment and their digest (`values_digest`); `version` is None
    when the island does not know it (its initial values, which may be what the first island seeded)."""

    version: pb.FragmentVersion | None
    values: Sequence[torch.Tensor]
    digest: int


@dataclass(frozen=True)
class Pulled:
    """A fragment's newest values, however they travelled: `delta` when as a difference to held values."""

    version: pb.FragmentVersion
    tensors: list[tuple[str, torch.Tensor]]
    wire_bytes: int
    delta: bool
    round_opened: float = 0.0  # the shard's clock when the round `version` belongs to opened (0: unknown)


def _method(name: str) -> str:
    return f"/{pb.DESCRIPTOR.services_by_name['Syncer'].full_name}/{name}"


_HEALTH_CHECK = f"/{health_pb2.DESCRIPTOR.services_by_name['Health'].full_name}/Check"


class SyncerClient:
    def __init__(
        self,
        target: str,
        token: str,
        *,
        security: Security,
        island_id: str = "",
        timeout: float = 120.0,
        min_transfer_mbps: float = DEFAULT_MIN_TRANSFER_MBPS,
        retry_for: float | None = 300.0,
        backoff: Backoff = Backoff(),
        seed: int | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """`timeout` bounds each attempt, plus, for a call that moves tensors, its bytes at `min_transfer_mbps`
        (the job's slowest link, `deadlines`); `retry_for` bounds all attempts of one call (None: forever); once
        `stop` is set, a call waiting to retry gives up at once with its last error, so the owner can close
        without waiting out a backoff against a dead shard. `security`: TLS, or plaintext asked for by name; TLS
        read from files is read again before a call's attempt once they changed (a CA or client certificate
        rotated in a Secret volume), and new connections use it from then on."""
        self.target = target
        self.island_id = island_id
        self.timeout = timeout
        self.min_transfer_mbps = min_transfer_mbps
        self.retry_for = retry_for
        self.backoff = backoff
        self._stop = stop if stop is not None else threading.Event()
        self._security = security
        self._refusal_logged = False
        self._metadata = bearer_metadata(token)
        self._rng = random.Random(seed)
        self._joined: pb.JoinRequest | None = None
        self._options = (*CHANNEL_OPTIONS, *patience_options(min_transfer_mbps))
        self._watched: Watched | None = None
        if isinstance(security, Tls) and security.files is not None:
            self._watched = Watched(security.check(Role.CLIENT), security.files, Role.CLIENT)
        self._reloading = threading.Lock()
        self._retired: grpc.Channel | None = None
        self._bind(tls.channel(target, security, self._options))

    def _bind(self, channel: grpc.Channel) -> None:
        """Makes every call on `channel`."""
        self._channel = channel
        # Every call is made from its method and (de)serializers, as the generated stubs would, but typed. The
        # tensor-carrying calls skip message objects: serialized chunks out, zero-copy views in.
        self._join = channel.unary_unary(_method("Join"), pb.JoinRequest.SerializeToString, pb.JoinReply.FromString)
        self._seed: grpc.StreamUnaryMultiCallable[bytes, pb.SeedReply] = channel.stream_unary(
            _method("Seed"), None, pb.SeedReply.FromString
        )
        self._push: grpc.StreamUnaryMultiCallable[bytes, pb.PushReply] = channel.stream_unary(
            _method("PushDelta"), None, pb.PushReply.FromString
        )
        self._pull = channel.unary_stream(_method("Pull"), pb.PullRequest.SerializeToString, wire.parse_fragment_chunk)
        self._leave = channel.unary_unary(_method("Leave"), pb.LeaveRequest.SerializeToString, pb.LeaveReply.FromString)
        self._status = channel.unary_unary(
            _method("Status"), pb.StatusRequest.SerializeToString, pb.StatusReply.FromString
        )
        self._health_check = channel.unary_unary(
            _HEALTH_CHECK, health_pb2.HealthCheckRequest.SerializeToString, health_pb2.HealthCheckResponse.FromString
        )

    def close(self) -> None:
        self._channel.close()
        if self._retired is not None:
            self._retired.close()

    def _reload(self) -> None:
        """A channel with the TLS files as they are now, once they changed into valid ones. Calls under way
        finish on the channel they began on, kept open until the next reload or `close`."""
        if self._watched is None:
            return
        with self._reloading:
            fresh = self._watched.changed()
            if fresh is None:
                return
            log.info("TLS files reloaded: new connections use them", extra={"target": self.target})
            retired, self._retired = self._retired, self._channel
            self._security = fresh
            self._bind(tls.channel(self.target, fresh, self._options))
        if retired is not None:
            retired.close()

    def __enter__(self) -> SyncerClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _timeout(self, nbytes: int) -> float:
        """The deadline of one attempt of a call that moves `nbytes` of tensors."""
        return call_timeout(nbytes, self.min_transfer_mbps, self.timeout)

    def _retrying(self, what: str, attempt_call: Callable[[], T]) -> T:
        started = time.monotonic()
        attempt = 0
        while True:
            self._reload()
            try:
                return attempt_call()
            except grpc.RpcError as error:
                code = error.code()
                if code is grpc.StatusCode.UNAVAILABLE:
                    self._check_handshake(error)
                out_of_time = self.retry_for is not None and time.monotonic() - started > self.retry_for
                if code not in RETRYABLE or out_of_time or self._stop.is_set():
                    raise
                delay = self.backoff.delay(attempt, self._rng)
                log.debug(
                    "retrying",
                    extra={"call": what, "target": self.target, "code": code.name, "attempt": attempt, "delay": delay},
                )
                if self._stop.wait(delay):
                    raise
                attempt += 1

    def _check_handshake(self, error: grpc.RpcError) -> None:
        """Raises HandshakeRefused when the shard refuses TLS with this client for a reason no retry changes
        (gRPC says only UNAVAILABLE, as for a shard that is down): one probe (`handshake`) per such failure,
        logged at WARNING once per client."""
        if not isinstance(self._security, Tls):
            return
        finding = handshake.probe(self.target, self._security, timeout=min(self.timeout, PROBE_SECONDS))
        if finding is None:
            return
        refused = handshake.HandshakeRefused(self.target, finding.reason, finding.detail)
        if not self._refusal_logged:
            self._refusal_logged = True
            log.warning(str(refused), extra={"target": self.target, "reason": finding.reason.name})
        raise refused from error

    def wait_ready(self, timeout: float) -> bool:
        """True once the shard's health service answers SERVING, within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._reload()
            try:
                reply = self._health_check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        return False

    def join(self, num_fragments: int) -> pb.JoinReply:
        request = pb.JoinRequest(island_id=self.island_id, num_fragments=num_fragments)
        self._joined = request
        reply = self._retrying("Join", lambda: self._join(request, timeout=self.timeout, metadata=self._metadata))
        wire.check_fields(reply)
        return reply

    def rejoin(self) -> None:
        """Joins again as last time, if this client joined: a shard that restarted without its state counts
        only the islands that joined it as live. Joining is idempotent."""
        request = self._joined
        if request is not None:
            self._retrying("Join", lambda: self._join(request, timeout=self.timeout, metadata=self._metadata))

    def seed(self, fragment_id: int, named: Sequence[tuple[str, torch.Tensor]]) -> pb.SeedReply:
        payloads, blobs = wire.tensor_payloads(named, Encoding.FP32, 0)
        unset = pb.FragmentVersion()
        timeout = self._timeout(sum(len(b) for b in blobs))
        return self._retrying(
            "Seed",
            lambda: self._seed(
                wire.fragment_messages(fragment_id, unset, payloads, blobs), timeout=timeout, metadata=self._metadata
            ),
        )

    def push(
        self,
        fragment_id: int,
        *,
        base: pb.FragmentVersion,
        tokens: int,
        inner_steps: int,
        sequence: int,
        delta: Sequence[tuple[str, torch.Tensor]],
        encoding: Encoding,
        block_size: int,
        top_k: int = 0,
        step_seconds: float = 0.0,
    ) -> pb.PushReply:
        """Streams one outer gradient; encoded once, re-sent whole on a retry, counted once by the shard.
        `step_seconds` is the island's measured seconds per inner step, for speed-aware islands."""
        return self.push_encoded(
            fragment_id,
            base=base,
            tokens=tokens,
            inner_steps=inner_steps,
            sequence=sequence,
            encoded=wire.tensor_payloads(delta, encoding, block_size, top_k),
            step_seconds=step_seconds,
        )

    def push_encoded(
        self,
        fragment_id: int,
        *,
        base: pb.FragmentVersion,
        tokens: int,
        inner_steps: int,
        sequence: int,
        encoded: tuple[Sequence[pb.TensorPayload], Sequence[bytes]],
        step_seconds: float = 0.0,
        slack_seconds: float | None = None,
        last: bool = False,
    ) -> pb.PushReply:
        """`push` of an outer gradient the caller encoded (`wire.tensor_payloads`), for a caller that needs
        the bytes it sends (error feedback decodes them). `slack_seconds`: how long after this push the island
        mixes the merge in (a merge waits for late islands no longer than that). `last`: the island's last push
        of the fragment (the end of its run), which its merge lands rather than steps past."""
        payloads, blobs = encoded
        header = pb.PushHeader(
            island_id=self.island_id,
            fragment_id=fragment_id,
            base=base,
            tokens=tokens,
            inner_steps=inner_steps,
            sequence=sequence,
            step_seconds=step_seconds,
            slack_seconds=slack_seconds,
            last=last,
        )
        timeout = self._timeout(sum(len(b) for b in blobs))
        reply = self._retrying(
            "PushDelta",
            lambda: self._push(wire.push_messages(header, payloads, blobs), timeout=timeout, metadata=self._metadata),
        )
        wire.check_fields(reply)  # a cadence of Inf or 1e-300 from a broken shard is refused here, not paced by
        return reply

    def pull(
        self,
        fragment_id: int,
        have: pb.FragmentVersion | None = None,
        encoding: Encoding = Encoding.FP32,
        *,
        expect_bytes: int = 0,
    ) -> tuple[pb.FragmentVersion, list[tuple[str, torch.Tensor]]] | None:
        """The fragment's newest values, or None when `have` is already the newest. `expect_bytes`, the most
        the reply may carry (the fragment's float32 bytes), sizes the deadline."""
        pulled = self.pull_full(fragment_id, have, encoding, expect_bytes=expect_bytes)
        return None if pulled is None else (pulled.version, pulled.tensors)

    def pull_full(
        self,
        fragment_id: int,
        have: pb.FragmentVersion | None = None,
        encoding: Encoding = Encoding.FP32,
        *,
        expect_bytes: int = 0,
    ) -> Pulled | None:
        """`pull`, with all the reply says of the values."""
        request = pb.PullRequest(
            fragment_id=fragment_id,
            have=have or pb.FragmentVersion(),
            encoding=wire_encoding(encoding),
            island_id=self.island_id,
        )
        return self._retrying("Pull", lambda: self._pull_attempt(request, None, expect_bytes))

    def pull_delta(
        self,
        fragment_id: int,
        *,
        have: pb.FragmentVersion | None,
        held: Held | None,
        encoding: Encoding,
        expect_bytes: int = 0,
    ) -> Pulled | None:
        """Like `pull`, but the shard may answer with the difference, in `encoding`, from the `held` values
        (what a pull of this client returned, or values of unknown version that may be the newest) to the
        newest; either way the newest values come back. With `held` None they come in full. `expect_bytes` as
        for `pull`."""
        if not self.island_id:
            raise ValueError("a compressed pull needs the client's island id")
        request = pb.PullRequest(
            fragment_id=fragment_id,
            have=have or pb.FragmentVersion(),
            encoding=wire_encoding(Encoding.FP32),
            island_id=self.island_id,
            delta_encoding=wire_encoding(encoding),
        )
        if held is not None:
            request.held.SetInParent()
            request.held.digest = held.digest
            if held.version is not None:
                request.held.version.CopyFrom(held.version)
        return self._retrying("Pull", lambda: self._pull_attempt(request, held, expect_bytes))

    def _pull_attempt(self, request: pb.PullRequest, held: Held | None, expect_bytes: int) -> Pulled | None:
        timeout = self._timeout(expect_bytes)
        chunks: Iterator[wire.Part] = self._pull(request, timeout=timeout, metadata=self._metadata)
        first = next(chunks, None)
        if first is None:
            return None
        header, tensors = wire.read_fragment_stream(itertools.chain([first], chunks))
        wire_bytes = sum(p.byte_length for p, _ in tensors)
        named = [(p.name, t) for p, t in tensors]
        delta = header.HasField("delta_base")
        if delta:
            if held is None or header.delta_base != (held.version or pb.FragmentVersion()):
                raise wire.WireError(
                    Refusal.INVALID, f"fragment {request.fragment_id}: a difference to values this island does not hold"
                )
            values = apply_delta(held.values, [t for _, t in named])
            # The wire takes finite values only, but a finite difference can still take them beyond float32: an
            # island that mixed them in would train on NaN from then on, so it keeps its own instead.
            if not all(bool(torch.isfinite(v).all()) for v in values):
                raise wire.WireError(
                    Refusal.INVALID, f"fragment {request.fragment_id}: the difference takes the values beyond float32"
                )
            named = [(name, v) for (name, _), v in zip(named, values)]
        return Pulled(header.version, named, wire_bytes, delta=delta, round_opened=header.round_opened_seconds)

    def leave(self, timeout: float) -> None:
        """Tells the shard this island has finished. Tried once: a shard that misses it times the island out
        of its live set (islandTimeoutSeconds) as it would a dead one."""
        request = pb.LeaveRequest(island_id=self.island_id)
        self._leave(request, timeout=min(timeout, self.timeout), metadata=self._metadata)

    def status(self) -> pb.StatusReply:
        reply = self._retrying(
            "Status", lambda: self._status(pb.StatusRequest(), timeout=self.timeout, metadata=self._metadata)
        )
        wire.check_fields(reply)
        return reply
