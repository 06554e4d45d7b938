"""Islands kept in phase: each island nudges its schedule so that its pushes of a fragment arrive with the
other islands', and a merge holds every live island.

Islands of equal speed drift apart all the same: they start seconds apart, a restarted one resumes at the
job's step but at its own moment in the round, and step times differ by a few percent on shared machines. A
merge waits only a bounded window (`diloco.core.grace`), so islands out of phase by more than that miss
their round's merge, and the rounds break into merges of one or two islands with stale deltas.

So a shard tells an island when it took its push (the shard's clock) and when the pushes of the merge that
took it in arrived (their median, same clock): for a push in time for its round's merge, that merge's; for
one that missed it, the merge it missed. The island's *offset* is the difference: positive when it pushed
late. Like a phase-locked loop, it then corrects its schedule two ways:
- by GAIN of the offset at once, spread over its next steps (`catch_up`), which brings islands that started
  apart together within a few rounds;
- by RATE_GAIN of it in its pace (phase units a step), which learns a lasting difference in speed too small
  for speed-aware pacing (`diloco.core.pace`), so that a slightly slower island does not lag by a fixed
  offset but keeps pace.
Every island moves towards the median of its merge, so the median itself stays where it is and the spread
shrinks round after round. Islands in two groups half a round apart each see the other's merge as the one
they missed, and close in on each other.

Time is measured in phase units, the island's schedule: a fragment is due when the phase crosses its due
point, and a step advances the phase by the island's stride (`diloco.core.pace`) times its pace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

GAIN = 0.5
"""The share of a measured offset corrected in one go: all of it would overshoot on a noisy measure."""
RATE_GAIN = 0.1
"""The share of a measured offset, per round, taken into the island's pace."""
MAX_RATE = Fraction(1, 2)
"""The most an island's pace departs from its stride either way: further apart is speed-aware pacing's work."""
QUANTUM = 1000
"""Corrections are whole thousandths of a phase unit, so every rank of an island applies the same one."""
RATE_QUANTUM = 1_000_000
"""Pace changes are whole millionths, for the same reason."""


@dataclass(frozen=True)
class Correction:
    """What an island changes in its schedule after measuring an offset: `owed` phase units to advance beyond
    it (negative: to hold back), and `rate`, the change to its pace (a share of its stride a step)."""

    owed: Fraction = Fraction(0)
    rate: Fraction = Fraction(0)


def round_offset(arrival: float, merged_arrival: float, round_seconds: float) -> float:
    """Seconds a push arrived after the median arrival of the merge it is measured against, wrapped into half
    a round either way: a push that missed its round's merge by a little is late, not most of a round early."""
    if not (math.isfinite(arrival) and math.isfinite(merged_arrival)):
        raise ValueError("arrival times must be finite")
    if not (math.isfinite(round_seconds) and round_seconds > 0):
        raise ValueError(f"a round must take a positive, finite time, got {round_seconds}")
    offset = arrival - merged_arrival
    return offset - round_seconds * round(offset / round_seconds)


def correction(offset_seconds: float, step_seconds: float, stride: Fraction, round_phase: int) -> Correction:
    """How an island taking `step_seconds` per step of `stride` phase units corrects a push `offset_seconds`
    late, in rounds of `round_phase` units: GAIN of the offset at once, at most a quarter round either way,
    and RATE_GAIN of it per round in its pace. Nothing without a step time."""
    if not (math.isfinite(offset_seconds) and math.isfinite(step_seconds)) or step_seconds <= 0:
        return Correction()
    steps = offset_seconds / step_seconds
    bound = round_phase / 4
    owed = max(-bound, min(bound, GAIN * steps * float(stride)))
    rate = RATE_GAIN * steps * float(stride) / round_phase
    return Correction(Fraction(round(owed * QUANTUM), QUANTUM), Fraction(round(rate * RATE_QUANTUM), RATE_QUANTUM))


def bounded_rate(rate: Fraction) -> Fraction:
    """An island's pace kept within MAX_RATE of its stride."""
    return max(-MAX_RATE, min(MAX_RATE, rate))


def catch_up(stride: Fraction, rate: Fraction, owed: Fraction) -> tuple[Fraction, Fraction]:
    """How far one step advances the phase at pace `rate` while `owed` phase units of correction are
    outstanding, and what is owed after it: the stride times the pace, plus at most one more stride (a round
    shortens at most twice as fast as it runs) or less at most half a stride (the phase never stalls)."""
    paced = stride * (1 + rate)
    taken = max(-paced / 2, min(paced, owed))
    return paced + taken, owed - taken
