"""One fragment's round trip to the syncer shard that owns it, run off the training thread.

A round pushes the outer gradient Δ = base − local, then polls for the merge that takes it in. A push the
shard refuses as out of step (a base that is stale, from an older incarnation, or ahead of the shard;
FAILED_PRECONDITION on the wire) turns into a fresh pull, so the island re-bases instead of stalling. Every
other failure ends the round: the learner drops it and trains on, and the next due step pushes again. With a
pull encoding, pulls are compressed: the shard sends the difference from the island's base
(`diloco.core.compressed_pull`). With error feedback (the sparse encoding), the push carries the delta plus
what earlier pushes left out (`diloco.worker.error_feedback`).
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import grpc
import torch

from diloco.core.compressed_pull import values_digest
from diloco.core.encoding import Encoding, decode
from diloco.core.refusal import Refusal
from diloco.transport import wire
from diloco.transport.client import Held, Pulled, SyncerClient
from diloco.transport.codes import refusal_of
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.worker.error_feedback import ErrorFeedback
from diloco.worker.stats import StatsRecorder

log = logging.getLogger("diloco.worker")

POLL_INITIAL_SECONDS = 0.02
POLL_MAX_SECONDS = 1.0


class RoundOutcome(enum.IntEnum):
    """How a round ended; the values travel in the island's broadcast, 0 meaning "still running"."""

    MERGED = 1  # a version newer than the one the push was taken at arrived
    RESYNCED = 2  # the push was refused as stale, from another incarnation or ahead: fresh values pulled
    ABANDONED = 3  # no newer version within the time bound (or the learner is closing)
    FAILED = 4  # a call failed after the client's own retries

    @property
    def adopts(self) -> bool:
        """Whether the round brought global values to mix in."""
        return self in (RoundOutcome.MERGED, RoundOutcome.RESYNCED)


@dataclass(frozen=True)
class SyncRequest:
    """One round: the fragment's base, a snapshot of its local values, and what the push header carries."""

    fragment: int
    names: tuple[str, ...]
    base_version: pb.FragmentVersion
    base: Sequence[torch.Tensor]
    local: HostCopy
    tokens: int
    inner_steps: int
    sequence: int
    step_seconds: float = 0.0  # the island's measured seconds per inner step (0: not measured)
    slack_seconds: float | None = None  # how long after the push the island mixes the merge in (None: unknown)
    last: bool = False  # the island's last push of the fragment: the end of its run


@dataclass(frozen=True)
class SyncResult:
    outcome: RoundOutcome
    version: pb.FragmentVersion | None = None
    values: list[torch.Tensor] | None = None
    cadence_step_seconds: float = 0.0  # the job's cadence the shard answered the push with (0: unknown)
    # When the shard took the push, and when the round of the merge that brought it back opened, both on the
    # shard's clock (`diloco.core.phase`); 0 when unknown.
    arrival: float = 0.0
    round_opened: float = 0.0
    live_islands: int = 0  # islands the shard counted live when it took the push
    sync_seconds: float = 0.0  # the push's call and the pull that brought the merge, together


class FragmentSync:
    """A daemon thread running one round; the training thread checks `result` without waiting on it.

    `base` must stay unchanged while the round runs (the learner only re-bases a fragment once its round is
    over); `local` becomes the thread's own. A daemon thread never holds the process open at exit.
    """

    def __init__(
        self,
        client: SyncerClient,
        request: SyncRequest,
        *,
        encoding: Encoding,
        block_size: int,
        timeout: float,
        stopping: threading.Event,
        stats: StatsRecorder,
        top_k: int = 0,
        pull_encoding: Encoding | None = None,
        feedback: ErrorFeedback | None = None,
    ) -> None:
        """`pull_encoding`: the encoding of compressed pulls, None for full float32 ones. `feedback`: the
        island's error-feedback buffers, None to push each delta as it is."""
        self.client = client
        self.request = request
        self.encoding = encoding
        self.pull_encoding = pull_encoding
        self.block_size = block_size
        self.top_k = top_k
        self.feedback = feedback
        self.timeout = timeout
        self._stopping = stopping
        self._stats = stats
        self._result: SyncResult | None = None
        self._delivered = threading.Event()  # the shard holds the push, or the round is over without it
        self._thread = threading.Thread(target=self._run, name=f"diloco-sync-{request.fragment}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds; True when the round is over."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_delivered(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds until the shard has taken the push (or the round ended without it):
        from then on the push reaches the global model whatever becomes of this process."""
        return self._delivered.wait(timeout)

    @property
    def result(self) -> SyncResult | None:
        """The round's result, or None while it runs."""
        return None if self._thread.is_alive() else self._result

    def _run(self) -> None:
        try:
            self._result = self._round()
        except Exception:
            if self._stopping.is_set():
                log.debug("sync interrupted by close", extra=self._fields(), exc_info=True)
            else:
                log.exception("sync failed", extra=self._fields())
            self._result = SyncResult(RoundOutcome.FAILED)
        finally:
            self._delivered.set()

    def _fields(self, **more: object) -> dict[str, object]:
        return {"fragment": self.request.fragment, "target": self.client.target, **more}

    def _round(self) -> SyncResult:
        r = self.request
        delta = [torch.sub(base, local, out=local) for base, local in zip(r.base, r.local.values())]
        if self.feedback is not None:
            delta = self.feedback.compensated(r.fragment, delta)
        encoded = wire.tensor_payloads(list(zip(r.names, delta)), self.encoding, self.block_size, self.top_k)
        pushing = time.monotonic()
        try:
            reply = self.client.push_encoded(
                r.fragment,
                base=r.base_version,
                tokens=r.tokens,
                inner_steps=r.inner_steps,
                sequence=r.sequence,
                encoded=encoded,
                step_seconds=r.step_seconds,
                slack_seconds=r.slack_seconds,
                last=r.last,
            )
        except grpc.RpcError as error:
            if refusal_of(error.code()) is Refusal.OUT_OF_STEP:
                log.debug("push refused, pulling afresh", extra=self._fields(detail=error.details()))
                return self._fresh()
            return self._failed("push", error)
        push_seconds = time.monotonic() - pushing
        self._delivered.set()
        blobs = encoded[1]
        if self.feedback is not None:
            sent = [decode(b, d.shape, self.encoding, self.block_size, self.top_k) for b, d in zip(blobs, delta)]
            self.feedback.accepted(r.fragment, delta, sent)
        nbytes = sum(len(b) for b in blobs)
        self._stats.add(syncs_pushed=1, bytes_pushed=nbytes)
        log.debug(
            "pushed",
            extra=self._fields(
                base=r.base_version.version,
                sequence=r.sequence,
                tokens=r.tokens,
                bytes=nbytes,
                staleness=reply.staleness,
                duplicate=reply.duplicate,
            ),
        )
        # Wait for a version newer than the one the push was taken at: that merge includes this delta, so
        # the next delta, taken against it, does not count this round's progress a second time.
        have = r.base_version if reply.duplicate else reply.current
        result = self._await_merge(have)
        return replace(
            result,
            cadence_step_seconds=reply.cadence_step_seconds,
            arrival=0.0 if reply.duplicate else reply.arrival_seconds,  # a retry's arrival is the first's
            live_islands=reply.live_islands,
            sync_seconds=push_seconds + result.sync_seconds,
        )

    def _await_merge(self, have: pb.FragmentVersion) -> SyncResult:
        deadline = time.monotonic() + self.timeout
        delay = POLL_INITIAL_SECONDS
        # The island mixes a merge in at its first step from τ on that finds it in: a poll that slept longer than
        # half a step would mix it in a step late.
        longest = POLL_MAX_SECONDS
        if self.request.step_seconds:
            longest = min(longest, max(POLL_INITIAL_SECONDS, self.request.step_seconds / 2))
        held = self._held()
        while True:
            pulling = time.monotonic()
            try:
                pulled = self._pull(have, held)
            except grpc.RpcError as error:
                return self._failed("pull", error)
            if pulled is not None:
                return replace(self._adopt(RoundOutcome.MERGED, pulled), sync_seconds=time.monotonic() - pulling)
            if time.monotonic() + delay > deadline or self._stopping.wait(delay):
                log.debug("no merge in time, round abandoned", extra=self._fields(have=have.version))
                return SyncResult(RoundOutcome.ABANDONED)
            delay = min(delay * 2, longest)

    def _fresh(self) -> SyncResult:
        """The fragment's current values whatever this island holds. A shard that lost its state entirely
        (restarted without a checkpoint) knows no island and is unseeded: the island joins it again, and seeds
        it with the last global values it received, the first island to do so winning."""
        r = self.request
        try:
            self.client.rejoin()
            try:
                pulled = self._pull(None, self._held())
            except grpc.RpcError as error:
                if refusal_of(error.code()) is not Refusal.OUT_OF_STEP:
                    raise
                seeded = self.client.seed(r.fragment, list(zip(r.names, r.base)))
                log.info("re-seeded fragment", extra=self._fields(accepted=seeded.accepted))
                pulled = self._pull(None, None)
        except grpc.RpcError as error:
            return self._failed("resync", error)
        if pulled is None:
            raise RuntimeError(f"fragment {r.fragment}: a pull without a version came back empty")
        return self._adopt(RoundOutcome.RESYNCED, pulled)

    def _pull(self, have: pb.FragmentVersion | None, held: Held | None) -> Pulled | None:
        r = self.request
        return pull_values(self.client, r.fragment, have, held, self.pull_encoding, fragment_bytes(r.base))

    def _held(self) -> Held | None:
        """The island's base, named for a compressed pull."""
        if self.pull_encoding is None:
            return None
        return held_values(self.request.base_version, self.request.base)

    def _adopt(self, outcome: RoundOutcome, pulled: Pulled) -> SyncResult:
        values = fragment_values(self.request.fragment, self.request.names, pulled.tensors)
        if self.request.local.pinned:  # so that mixing them in is an asynchronous copy to the accelerator
            values = [v.pin_memory() for v in values]
        self._stats.add(bytes_pulled=pulled.wire_bytes)
        log.debug(
            "pulled",
            extra=self._fields(
                outcome=outcome.name, version=pulled.version.version, delta=pulled.delta, bytes=pulled.wire_bytes
            ),
        )
        return SyncResult(outcome, pulled.version, values, round_opened=pulled.round_opened)

    def _failed(self, call: str, error: grpc.RpcError) -> SyncResult:
        if refusal_of(error.code()) is Refusal.UNAUTHENTICATED:
            # The island's token is not one the shard accepts: the operator reads this to say so.
            self._stats.refused(time.time())
        level = logging.DEBUG if self._stopping.is_set() else logging.WARNING
        log.log(
            level,
            "sync call failed, round dropped",
            extra=self._fields(call=call, code=error.code().name, detail=error.details()),
        )
        return SyncResult(RoundOutcome.FAILED)


def held_values(version: pb.FragmentVersion | None, values: Sequence[torch.Tensor]) -> Held:
    """Float32 values named for a compressed pull; `version` None when unknown (an island's initial values)."""
    return Held(version, values, values_digest(values))


def pull_values(
    client: SyncerClient,
    fragment: int,
    have: pb.FragmentVersion | None,
    held: Held | None,
    pull_encoding: Encoding | None,
    expect_bytes: int,
) -> Pulled | None:
    """A fragment's newest values (None when `have` is the newest): compressed against `held` when
    `pull_encoding` is set, else in full float32, which take `expect_bytes` (the deadline follows them)."""
    if pull_encoding is not None:
        return client.pull_delta(fragment, have=have, held=held, encoding=pull_encoding, expect_bytes=expect_bytes)
    return client.pull_full(fragment, have=have, expect_bytes=expect_bytes)


def fragment_values(
    fragment: int, names: Sequence[str], named: Sequence[tuple[str, torch.Tensor]]
) -> list[torch.Tensor]:
    """The pulled tensors in the fragment's order, refusing a layout that is not this model's."""
    got = [name for name, _ in named]
    if got != list(names):
        raise ValueError(
            f"fragment {fragment}: the shard holds tensors {got}, this model's fragment is {list(names)}; "
            "every island must train the same model with the same number of fragments"
        )
    return [tensor for _, tensor in named]


class HostCopy:
    """Float32 host copies of tensors as they are at one step: what a round pushes from, or what an island
    checkpoint writes.

    On an accelerator the training thread only queues the copy: a device-side clone in stream order (so later
    steps cannot change what is copied), then a copy into pinned host memory on a side stream, which overlaps
    the next steps' compute. `values()` waits for it, in the round's own thread. What is already on the host
    (a CPU model's parameters, AdamW's `step` counts beside a GPU model's moments) is copied at once.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._ready: torch.cuda.Event | None = None
        self._values = [
            p.detach().to("cpu", torch.float32, copy=True) if p.device.type != "cuda" else p for p in params
        ]
        on_device = [i for i, p in enumerate(params) if p.device.type == "cuda"]
        self.pinned = bool(on_device)
        if not on_device:
            return
        device = params[on_device[0]].device
        frozen = [params[i].detach().to(torch.float32, copy=True) for i in on_device]
        side = _copy_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for i, clone in zip(on_device, frozen):
                self._values[i] = torch.empty(clone.shape, dtype=torch.float32, pin_memory=True)
                self._values[i].copy_(clone, non_blocking=True)
                clone.record_stream(side)  # the allocator keeps the clone until the side stream is past the copy
            self._ready = torch.cuda.Event()
            self._ready.record(side)

    def values(self) -> list[torch.Tensor]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._values


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def local_snapshot(params: Sequence[torch.Tensor]) -> HostCopy:
    """The copy of `params` that the training thread hands to a round (see `HostCopy`)."""
    return HostCopy(params)


def fragment_bytes(values: Sequence[torch.Tensor]) -> int:
    """Bytes of float32 values as a pull carries them."""
    return sum(4 * v.numel() for v in values)
