"""Speed-aware islands: how many inner steps an island runs per round, from its speed.

With one H for all, an island k times slower than the fastest pushes each fragment k times less often, so
its fragments reach the shards late and stale and, in the synchronous baseline, hold everyone back. As in
Async Local-SGD's dynamic local updates, each island instead runs H_i = H x (the fastest island's seconds
per step / its own) inner steps per round: every island pushes a fragment at about the wall-clock cadence
of the fastest island's H steps. The merge weights contributions by the tokens they stand for, so an
island's fewer steps weigh less and the merge stays fair.

The island measures its own seconds per step and sends them with each push; the shard answers with the
fastest live island's (the job's cadence). The island then runs its rounds on a phase that advances by
H / H_i per inner step, so the fragments stay staggered by H/P phase units whatever H_i becomes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction

from diloco.core.fragments import fragments_due

MIN_STEP_SECONDS = 1e-6
"""No inner step of a model takes less than a microsecond: a shorter one is a clock's or a peer's error."""
MAX_STEP_SECONDS = 3600.0
"""Nor more than an hour: an island that slow is stalled, not slow."""
TOLERANCE = 0.7
"""Islands at least 70% as fast as the fastest run the full H: on shared machines measured speeds jitter by
tens of percent without a difference in hardware (a generation apart is 1.5x and more), and a shorter round
costs communication."""


def paced_inner_steps(inner_steps: int, fragments: int, step_seconds: float, cadence_step_seconds: float) -> int:
    """H_i: inner steps per round for an island taking `step_seconds` per step when the fastest live island
    takes `cadence_step_seconds`. H when either is unknown (0) or the island is within TOLERANCE of the
    fastest; never below P (each fragment's sync stays at least one step apart) nor above H."""
    if inner_steps < 1 or fragments < 1:
        raise ValueError(f"inner_steps and fragments must be at least 1, got {inner_steps} and {fragments}")
    if not (math.isfinite(step_seconds) and math.isfinite(cadence_step_seconds)):
        raise ValueError("seconds per step must be finite")
    if step_seconds <= 0 or cadence_step_seconds <= 0:
        return inner_steps
    ratio = cadence_step_seconds / step_seconds
    if ratio >= TOLERANCE:
        return inner_steps
    return max(min(fragments, inner_steps), min(inner_steps, round(inner_steps * ratio)))


def phase_stride(inner_steps: int, paced: int) -> Fraction:
    """Phase units an inner step advances when an island runs `paced` steps per round of `inner_steps`."""
    if not 1 <= paced <= inner_steps:
        raise ValueError(f"paced steps must be in [1, {inner_steps}], got {paced}")
    return Fraction(inner_steps, paced)


def fragments_due_in(before: Fraction, after: Fraction, inner_steps: int, fragments: int) -> list[int]:
    """Fragments due at a phase point in (before, after], ascending: the schedule of `fragments_due` read on
    the phase, where one inner step may cross several due points (each fragment counted once)."""
    if after < before:
        raise ValueError(f"phase went back from {before} to {after}")
    first, last = math.floor(before) + 1, math.floor(after)
    points: Iterable[int] = range(max(1, first), last + 1)
    if last - first + 1 > inner_steps:  # every fragment falls due within any H consecutive points
        points = range(max(1, last - inner_steps + 1), last + 1)
    return sorted({p for point in points for p in fragments_due(point, inner_steps, fragments)})


def next_due(phase: Fraction, inner_steps: int, fragments: int) -> tuple[int, int]:
    """The first due point after `phase` and the lowest fragment due there: where the island's schedule goes
    next (some fragment is due within any H consecutive points)."""
    start = max(1, math.floor(phase) + 1)
    for point in range(start, start + inner_steps):
        due = fragments_due(point, inner_steps, fragments)
        if due:
            return point, due[0]
    raise AssertionError("every fragment is due within any H consecutive points")
