"""How long moving bytes between an island and a shard may take, from the job's slowest transfer rate
(`TrainingConfig.min_transfer_mbps`): one rule for the island's call deadlines, the shard's watch on slow
streams and both sides' patience with a quiet peer, so that a link the job declares slow is slow for all."""

from __future__ import annotations

from diloco.transport.wire import MAX_CHUNK_BYTES

BASE_SECONDS = 60.0
"""What a call may take besides moving its bytes: the round trips, a shard's queue, a merge's lock."""


def transfer_seconds(nbytes: int, min_mbps: float) -> float:
    """Seconds `nbytes` take at `min_mbps` Mbit/s."""
    if min_mbps <= 0:
        raise ValueError(f"a transfer rate must be positive, not {min_mbps} Mbit/s")
    return nbytes * 8 / (min_mbps * 1e6)


def call_timeout(nbytes: int, min_mbps: float, base: float = BASE_SECONDS) -> float:
    """The deadline of one attempt of a call that moves `nbytes`: `base` plus its bytes at `min_mbps`."""
    return base + transfer_seconds(nbytes, min_mbps)


def quiet_seconds(min_mbps: float) -> float:
    """How long a side waits on a peer that sends nothing before it gives the stream or the connection up:
    a whole chunk (4 MiB) at the slowest rate, since a chunk is handed over only once whole and a ping's
    answer queues behind what the link still carries (67 s at the default 0.5 Mbit/s), and never less
    than the base."""
    return max(BASE_SECONDS, transfer_seconds(MAX_CHUNK_BYTES, min_mbps))


def patience_options(min_mbps: float) -> tuple[tuple[str, int], ...]:
    """gRPC channel and server options under which a connection outlasts a saturated slow link: gRPC drops
    one whose ping (keepalive, or its bandwidth probe) goes unanswered for 20 s or a minute, while the
    answer waits behind the bytes queued on the link."""
    quiet_ms = round(quiet_seconds(min_mbps) * 1000)
    return (("grpc.keepalive_timeout_ms", quiet_ms), ("grpc.http2.ping_timeout_ms", quiet_ms))
