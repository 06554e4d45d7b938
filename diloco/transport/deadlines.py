"""How long moving bytes between an island and a shard may take, from the job's slowest transfer rate
(`TrainingConfig.min_transfer_mbps`): one rule for the island's call deadlines and the shard's watch on
slow streams, so that a link the job declares slow is slow for both."""

from __future__ import annotations

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
