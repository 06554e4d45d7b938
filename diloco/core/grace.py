"""The adaptive grace window: how long a shard holds a merge open, once its quorum is in, for the islands
that are merely late.

A fixed window either cuts off islands that drift further apart than it (they miss the merge and their
fragment arrives a round stale) or, sized for the worst case, delays every merge. So the shard records how
late contributions arrive after the quorum was reached (`lateness`) and waits a margin beyond what it has
seen, never longer than the configured `graceSeconds`. Islands that left or whose lease expired are not
waited for at all: a merge goes ahead as soon as every live island has pushed, whatever the window.

Nor is a live island whose own cadence puts its next push after the window closes. Islands drift out of
phase (a restarted island resumes at the job's step, not at the others' moment in the round), the
latenesses spread over the whole round, and the window grows to the configured bound; a merge then waited
that long for islands that were not due until well after it, and every island whose round it was heard
its merge that much later (the last rounds of a run, which end it, most of all). An island's cadence is
the time between its last two pushes of the fragment; one without two pushes yet, or overdue, may still
come and is waited for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

HISTORY = 32
"""Latenesses a shard remembers: the last few rounds of every island of a small job."""
MIN_OBSERVATIONS = 4
"""Until it has seen this many, a shard waits the whole configured window."""
QUANTILE = 0.9
"""The lateness a window is sized to cover: an outlier (a restart) does not stretch every merge after it."""
MARGIN = 1.5
"""A window is this many times the lateness it covers, for the spread it has not seen yet."""
FLOOR_SECONDS = 0.25
"""The shortest window: islands arriving together still differ by a push's transfer and a poll."""


def lateness_quantile(lateness: Sequence[float], quantile: float = QUANTILE) -> float:
    """The `quantile` of the recorded latenesses (nearest rank; 0 when there are none)."""
    if not 0 <= quantile <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    if not lateness:
        return 0.0
    ordered = sorted(lateness)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(quantile * len(ordered)) - 1))]


def grace_window(lateness: Sequence[float], max_grace: float) -> float:
    """Seconds a merge waits after its quorum is in: MARGIN x the QUANTILE of the recorded latenesses, at
    least FLOOR_SECONDS and at most `max_grace`; the whole `max_grace` until MIN_OBSERVATIONS are in."""
    if max_grace < 0:
        raise ValueError(f"max_grace must be non-negative, got {max_grace}")
    if any(not math.isfinite(x) or x < 0 for x in lateness):
        raise ValueError("lateness must be finite and non-negative")
    if len(lateness) < MIN_OBSERVATIONS:
        return max_grace
    return min(max_grace, max(FLOOR_SECONDS, MARGIN * lateness_quantile(lateness)))


def may_push_by(last_push: float | None, interval: float | None, deadline: float) -> bool:
    """Whether a live island that has not pushed to a merge yet may still do so by `deadline`, from its
    last push of the fragment and the `interval` between its last two: when either is unknown, it may."""
    if last_push is None or interval is None:
        return True
    return last_push + interval <= deadline
