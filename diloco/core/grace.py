"""The merge window: how long a shard holds a merge open, once its quorum is in, for the islands that are merely
late, and never so long that an island which has pushed must wait for the merge.

A merge goes ahead as soon as every live island has pushed. Otherwise it closes:
- within the *slack* of the islands already in the merge, as Decoupled DiLoCo sizes its grace window from the
  job's own slack, γ·(slack − t_quorum − t_sync): how long after its push an island can wait for the merge at
  no cost, less the time its sync takes, as each push says. A merge that closes within γ of every pending
  island's slack reaches each of them before it needs it, so waiting for the late ones costs the early ones
  nothing, and the merge waits that long for every live island (at most an island timeout: one silent that
  long is no longer live anyway, whatever slack a push claims).
  The paper's islands block τ inner steps after a push; ours never block (an island mixes a merge in at the
  first step from τ on that finds it in), so their slack is the round until they push the fragment again.
- after the *adaptive* window, where no pending push said its slack (an island's first push, before it knows
  its step time; a client that does not say it): the shard records how late contributions arrive after the
  quorum was reached (`lateness`) and waits a margin beyond what it has seen, never longer than
  ADAPTIVE_MAX_SECONDS.
`graceSeconds`, where a job sets it, caps both (0: every merge goes ahead once its quorum is in).
Bounded by τ steps, windows on two shared cores closed before islands 1 to 2 s apart came in (about 2 of 4
islands a merge); bounded by `graceSeconds` (2 s) or the adaptive window within a round's slack, before the
one island in a few that came twice the usual spread late (2.7 to 3.8); by the slack alone, 3.96 to 4.00 of 4
(docs/training-benchmarks.md). Islands stay in phase (`diloco.core.phase`), so in steady state every live
island pushes within the window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

HISTORY = 32
"""Latenesses a shard remembers: the last few rounds of every island of a small job."""
MIN_OBSERVATIONS = 4
"""Until it has seen this many, a shard waits the whole configured window."""
QUANTILE = 0.9
"""The lateness a window is sized to cover: an outlier (a restart) does not stretch every merge after it."""
MARGIN = 1.5
"""A window is this many times the lateness it covers, for the spread it has not seen yet."""
FLOOR_SECONDS = 0.25
"""The shortest adaptive window: islands arriving together still differ by a push's transfer and a poll."""
SLACK_FRACTION = 0.8
"""γ: the share of an island's slack a merge may take, the rest a margin for the merge itself and the pull."""
ADAPTIVE_MAX_SECONDS = 2.0
"""The longest adaptive window where `graceSeconds` is unset: such a merge may wait for an island that joined and
will not push for a while (a 30 s cap held a test's pull that long), while islands arriving together come within
a second or two of each other."""


def adaptive_max(grace_seconds: float | None) -> float:
    """The longest a merge whose pushes say no slack waits after its quorum: `graceSeconds`, or
    ADAPTIVE_MAX_SECONDS where it is unset."""
    return ADAPTIVE_MAX_SECONDS if grace_seconds is None else grace_seconds


def slack_max(grace_seconds: float | None, island_timeout_seconds: float) -> float:
    """The longest a merge whose pushes say their slack waits after its quorum: an island timeout (one silent
    that long is no longer live, whatever slack a push claims), or `graceSeconds` where set and shorter."""
    return island_timeout_seconds if grace_seconds is None else min(grace_seconds, island_timeout_seconds)


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


def merge_closes(
    quorum_since: float, window: float, pushed: Iterable[tuple[float, float | None]], max_wait: float
) -> float:
    """When a merge whose quorum came in at `quorum_since` closes: before any pending island, `pushed` as
    (arrival, slack seconds) with slack None when unknown, would wait for it (arrival + SLACK_FRACTION x
    slack), at most `max_wait` after the quorum; after the adaptive `window` where no pending island said its
    slack; at once when the quorum itself came after a deadline."""
    if window < 0 or max_wait < 0:
        raise ValueError(f"windows must be non-negative, got {window} and {max_wait}")
    deadlines = [arrival + SLACK_FRACTION * slack for arrival, slack in pushed if slack is not None]
    return max(quorum_since, min([quorum_since + (max_wait if deadlines else window), *deadlines]))
