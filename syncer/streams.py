"""How long a data stream may hold one of the shard's threads, and the watch that cancels those that overstay.

gRPC's synchronous server gives each call a thread for its whole life, and a peer that opens a stream and
then sends nothing would hold it until its own deadline. A stream the shard waits on (a push or seed whose
next chunk has not come, a pull whose reader takes no more) is cancelled once it has waited
`idle_seconds`, and every stream once it has taken longer than its bytes at the job's slowest transfer rate
(`minTransferMbps`, which the islands' deadlines follow too: `transport.deadlines`). Join, Status, Leave and
the health check run on threads of their own (`CONTROL_WORKERS`), so they answer even while every data
thread is held, and the data calls beyond the data threads and the queue bound are refused on arrival
without counting against the control calls (`DataThreads`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc

from diloco.transport.deadlines import transfer_seconds

log = logging.getLogger("diloco.syncer")

T = TypeVar("T")

CONTROL_WORKERS = 4
"""Threads for Join, Status, Leave and the health check, apart from the data calls' threads: these calls
only take the state lock, so a few answer a job's probes and islands."""
MAX_QUEUED_CALLS = 1024
"""Calls that may wait for a data thread: a push and a pull from each of 512 islands (the most a DiLoCoJob
admits). The shard refuses data calls beyond these and the threads with RESOURCE_EXHAUSTED, before reading
them."""


class DataThreads(futures.ThreadPoolExecutor):
    """The data calls' threads, counting the calls given to them, running or waiting, so the server can refuse
    a data call on arrival once `max_workers + max_queued` are in. gRPC's own bound counts every call, the
    health check's too: a flood of data calls under it alone would make a busy shard look dead."""

    def __init__(self, max_workers: int, max_queued: int) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix="syncer-rpc")
        self.bound = max_workers + max_queued
        self._lock = threading.Lock()
        self._calls = 0

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> futures.Future[T]:
        future = super().submit(fn, *args, **kwargs)
        with self._lock:
            self._calls += 1
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: futures.Future[Any]) -> None:
        with self._lock:
            self._calls -= 1

    def calls(self) -> int:
        """The data calls running or waiting for a thread."""
        with self._lock:
            return self._calls

    def has_room(self) -> bool:
        return self.calls() < self.bound


def calls_per_client(max_workers: int) -> int:
    """The data calls one client (one connection) may hold at once: a quarter of the data threads, so that
    one peer opening streams and sending nothing leaves three quarters to everyone else; at least two, a
    push and a pull."""
    return max(2, max_workers // 4)


class ClientCalls:
    """The data calls each client holds, by its connection (gRPC's peer address): `hold` refuses one beyond
    `most` before it takes a thread's time, so no client can hold every data thread."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    @contextmanager
    def hold(self, peer: str) -> Iterator[bool]:
        """Yields whether the call may go on (False: the client already holds `most`); counted while it does."""
        with self._lock:
            taken = self._held.get(peer, 0) < self.most
            if taken:
                self._held[peer] = self._held.get(peer, 0) + 1
        try:
            yield taken
        finally:
            if taken:
                with self._lock:
                    self._held[peer] -= 1
                    if not self._held[peer]:
                        del self._held[peer]


def expired(context: grpc.ServicerContext) -> bool:
    """Whether a call's deadline passed (or its client gave up) before a data thread took it up."""
    remaining = context.time_remaining()
    return not context.is_active() or (remaining is not None and remaining <= 0)


def stream_deadline(started: float, nbytes: int, idle_seconds: float, min_mbps: float) -> float:
    """When a stream that moves `nbytes` must be done: its bytes at the slowest rate, plus one idle wait of
    slack."""
    return started + idle_seconds + transfer_seconds(nbytes, min_mbps)


def overdue(now: float, waiting_since: float | None, deadline: float, idle_seconds: float) -> str | None:
    """Why a stream must be cancelled now (a metrics label), None while it may go on."""
    if now >= deadline:
        return "slow_stream"
    if waiting_since is not None and now - waiting_since >= idle_seconds:
        return "idle_stream"
    return None


class Watched:
    """One stream under watch: when the shard began waiting on its peer (None while the shard works on it)
    and its deadline once its size is known."""

    def __init__(self, watch: StreamWatch, context: grpc.ServicerContext, method: str, started: float) -> None:
        self._watch = watch
        self.context = context
        self.method = method
        self.started = started
        self.waiting_since: float | None = None
        self.deadline = math.inf

    def expect(self, nbytes: int) -> None:
        """The stream is to move `nbytes`: it must be done by `stream_deadline`."""
        with self._watch.lock:
            self.deadline = stream_deadline(self.started, nbytes, self._watch.idle_seconds, self._watch.min_mbps)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The shard waits on the peer for as long as this lasts: the idle bound runs."""
        with self._watch.lock:
            self.waiting_since = self._watch.clock()
        try:
            yield
        finally:
            with self._watch.lock:
                self.waiting_since = None

    def parts(self, incoming: Iterator[T]) -> Iterator[T]:
        """The messages of a client stream, each waited for under the idle bound."""
        while True:
            with self.waiting():
                part = next(incoming, None)
            if part is None:
                return
            yield part


class StreamWatch:
    """The shard's data streams in flight; `run` cancels each one that is overdue (its peer sees CANCELLED),
    which ends its handler and frees its thread."""

    def __init__(
        self,
        idle_seconds: float,
        min_mbps: float,
        on_cancel: Callable[[str, str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_cancel(reason, method)` is told of each stream cancelled, to count it where operators look."""
        self.idle_seconds = idle_seconds
        self.min_mbps = min_mbps
        self.clock = clock
        self.lock = threading.Lock()
        self._on_cancel = on_cancel
        self._streams: set[Watched] = set()

    @contextmanager
    def watching(self, context: grpc.ServicerContext, method: str) -> Iterator[Watched]:
        """Watches the stream for as long as this lasts."""
        watched = Watched(self, context, method, self.clock())
        with self.lock:
            self._streams.add(watched)
        try:
            yield watched
        finally:
            with self.lock:
                self._streams.discard(watched)

    def cancel_overdue(self) -> None:
        now = self.clock()
        with self.lock:
            due = [
                (w, why) for w in self._streams if (why := overdue(now, w.waiting_since, w.deadline, self.idle_seconds))
            ]
            for watched, _ in due:
                self._streams.discard(watched)
        for watched, why in due:
            watched.context.cancel()
            self._on_cancel(why, watched.method)

    def run(self, stopping: threading.Event) -> None:
        """Checks the streams a few times per idle bound until `stopping` is set."""
        period = min(1.0, self.idle_seconds / 4)
        while not stopping.wait(period):
            self.cancel_overdue()
