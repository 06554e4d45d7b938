"""A wide-area link between an island and the syncers, as numbers: its bandwidth and round-trip time, the
token-bucket (`tc` tbf) parameters that enforce the bandwidth, the schedule on which the delay proxy releases
what it holds, and the link that puts a small model in the position of a large one on a real WAN. No I/O:
`diloco.local.netns` builds the link and `diloco.local.delay_proxy` adds the delay.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from diloco.core.config import TrainingConfig
from diloco.core.encoding import encoded_nbytes

MTU_BYTES = 1514
"""The largest frame a veth sends without segmentation offload: 1500 bytes of IP and 14 of Ethernet header.
tbf must hold at least one such frame in its bucket, or it never sends it."""

TIMER_SECONDS = 0.004
"""The coarsest kernel timer tick (HZ=250): tbf refills its bucket on ticks, so the bucket must hold what the
rate sends in one, or the link runs below its rate."""

TCP_SHARE = 0.3
"""The least share of a shaped link's rate TCP is counted on to keep (`tests/local/test_netns.py` measures
it): through a token bucket of a few kbit/s its drops and backoffs cost it much of the rate."""

QUEUE_SECONDS = 0.05
"""How much of the rate a link queues before it drops, as on a router's buffer: senders on this machine are
held back by TCP's small-queue limit long before it fills."""


@dataclass(frozen=True)
class Link:
    """The link between each island and the syncers: `mbps` in each direction (None: not limited) and the
    round trip `rtt_ms` added to every exchange with a syncer."""

    mbps: float | None = None
    rtt_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.mbps is not None and not (math.isfinite(self.mbps) and self.mbps > 0):
            raise ValueError(f"--link-mbps must be a positive number of Mbit/s, got {self.mbps}")
        if not (math.isfinite(self.rtt_ms) and self.rtt_ms >= 0):
            raise ValueError(f"--rtt-ms must be zero or more milliseconds, got {self.rtt_ms}")

    @property
    def shaped(self) -> bool:
        """Whether the islands sit behind a link at all (else they reach the syncers on loopback)."""
        return self.mbps is not None or self.rtt_ms > 0

    @property
    def one_way_seconds(self) -> float:
        """What the delay proxy holds each chunk for, in each direction: half the round trip."""
        return self.rtt_ms / 2000.0

    def min_transfer_mbps(self, config: TrainingConfig) -> float:
        """The slowest rate a sync must cross at (`TrainingConfig.min_transfer_mbps`) for islands behind this
        link: the job's, or what TCP keeps of the link's rate shared by every fragment's push at once,
        whichever is lower."""
        if self.mbps is None:
            return config.min_transfer_mbps
        return min(config.min_transfer_mbps, self.mbps * TCP_SHARE / config.fragments)

    def describe(self) -> str:
        rate = "unlimited" if self.mbps is None else f"{self.mbps:.4g} Mbit/s"
        return f"{rate}, RTT {self.rtt_ms:.4g} ms"


@dataclass(frozen=True)
class Tbf:
    """One direction's token bucket: `rate_bits` per second, `burst_bytes` in the bucket, `limit_bytes` queued."""

    rate_bits: int
    burst_bytes: int
    limit_bytes: int

    def tc_args(self) -> list[str]:
        """The qdisc as `tc qdisc add dev D root` takes it."""
        return ["tbf", "rate", f"{self.rate_bits}bit", "burst", str(self.burst_bytes), "limit", str(self.limit_bytes)]


def tbf(mbps: float) -> Tbf:
    """The token bucket that holds a direction to `mbps`: a bucket of one frame or one timer tick's worth of the
    rate, whichever is larger, and a queue of QUEUE_SECONDS of the rate on top of it."""
    rate_bits = max(1, round(mbps * 1e6))
    rate_bytes = rate_bits / 8
    burst = max(MTU_BYTES, math.ceil(rate_bytes * TIMER_SECONDS))
    return Tbf(rate_bits, burst, burst + max(MTU_BYTES, math.ceil(rate_bytes * QUEUE_SECONDS)))


class DelayLine:
    """One direction of the delay proxy: chunks leave in the order they came, each `delay` seconds after it
    arrived. Bandwidth is untouched (a chunk never waits on the ones before it longer than they wait), so the
    link's rate stays the tbf's and its round trip gains exactly 2 x delay."""

    def __init__(self, delay: float) -> None:
        if delay < 0:
            raise ValueError(f"a delay is zero or more seconds, got {delay}")
        self.delay = delay
        self._held: deque[tuple[float, bytes]] = deque()

    def put(self, chunk: bytes, now: float) -> None:
        self._held.append((now + self.delay, chunk))

    def due(self, now: float) -> list[bytes]:
        """The chunks whose time has come, oldest first, taken out of the line."""
        out = []
        while self._held and self._held[0][0] <= now:
            out.append(self._held.popleft()[1])
        return out

    def wait(self, now: float) -> float | None:
        """Seconds until the next chunk is due (0 when one is), or None when nothing is held."""
        return max(0.0, self._held[0][0] - now) if self._held else None


def sync_bytes_per_step(parameters: int, config: TrainingConfig) -> float:
    """Bytes an island's link carries per inner step under `config`: every parameter pushed and pulled once
    per H steps (fragment by fragment), in the job's encoding."""
    return 2 * encoded_nbytes(parameters, config.encoding, config.block_size) / config.inner_steps


@dataclass(frozen=True)
class Equivalent:
    """A link for a small model that stands where `reference` stands for a large one (see `equivalent_link`)."""

    link: Link
    bytes_ratio: float  # our bytes per step / the reference's
    time_ratio: float  # the reference's step time / ours


def equivalent_link(
    reference: Link,
    reference_bytes_per_step: float,
    reference_step_seconds: float,
    bytes_per_step: float,
    step_seconds: float,
) -> Equivalent:
    """The link on which our model's sync traffic takes the same share of a step as the reference model's on
    `reference`: the rate scaled by our bytes per step over theirs and by their step time over ours, and
    the round trip by our step time over theirs, so transfer time and latency, counted in steps, match."""
    if reference.mbps is None:
        raise ValueError("the reference link needs a bandwidth")
    if min(reference_bytes_per_step, reference_step_seconds, bytes_per_step, step_seconds) <= 0:
        raise ValueError("bytes per step and step times must be positive")
    bytes_ratio = bytes_per_step / reference_bytes_per_step
    time_ratio = reference_step_seconds / step_seconds
    return Equivalent(
        Link(mbps=reference.mbps * bytes_ratio * time_ratio, rtt_ms=reference.rtt_ms / time_ratio),
        bytes_ratio,
        time_ratio,
    )
