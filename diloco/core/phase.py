"""Islands kept in phase: each island steers its schedule so that its pushes of a fragment arrive with the
other islands', and a merge holds every live island.

Islands of equal speed drift apart all the same: they start seconds apart, a restarted one resumes at the
job's step but at its own moment in the round, and on a busy host each step takes what the host gives it. A
merge waits only a bounded window (`diloco.core.grace`), so islands out of phase by more than that miss
their round's merge, and the rounds break into merges of one or two islands with stale deltas.

So every round of a fragment has a reference time on its shard: when the merge that opened the round got its
pushes (the median arrival of those on time), on the shard's clock. A push's reply says when the shard took
it, and the merged values say when their round opened; their difference is the push's *offset* (positive:
late), wrapped into half a round either way. The island then aims its next push of the fragment at one
round after that reference, less what it corrects now: it *targets* its push at pushed + round - GAIN x
offset, on its own clock. Every step it steers its phase towards the next target (`steered_advance`): at
the pace that reaches the next due point at the target, between half and twice its stride. Steering every
step absorbs the noise of each step as it comes, where a correction once a round would leave the noise of a
whole round in the next push.

A round's reference is the merge that opened it, not the merge a push went into: islands spread evenly
through a round each merge alone, and against their own merges they would all be on time and stay spread.
Against the round's opening merge they are late by their place in the round, and close in on the island
that opens it.

Time is measured in phase units, the island's schedule: a fragment is due when the phase crosses its due
point, and a step advances the phase by the island's stride (`diloco.core.pace`), or as steered.
"""

from __future__ import annotations

import math
from fractions import Fraction

GAIN = 0.5
"""The share of a measured offset corrected in one round: all of it would overshoot on a noisy measure, and
two islands late by half a round against each other's merges would swap places instead of meeting."""
QUANTUM = 1000
"""A steered advance is whole thousandths of a phase unit, so every rank of an island applies the same one."""


def round_offset(arrival: float, reference: float, round_seconds: float) -> float:
    """Seconds a push arrived after its round's reference time, wrapped into half a round either way: a push
    that missed its round's merge by a little is late, not most of a round early."""
    if not (math.isfinite(arrival) and math.isfinite(reference)):
        raise ValueError("arrival times must be finite")
    if not (math.isfinite(round_seconds) and round_seconds > 0):
        raise ValueError(f"a round must take a positive, finite time, got {round_seconds}")
    offset = arrival - reference
    return offset - round_seconds * round(offset / round_seconds)


def push_target(pushed_at: float, offset: float, round_seconds: float) -> float:
    """When, on the island's clock, to begin the next push of a fragment whose last push began at `pushed_at`
    and arrived `offset` seconds late: a round later, GAIN of the offset earlier."""
    return pushed_at + round_seconds - GAIN * offset


def steered_advance(stride: Fraction, to_due: Fraction, seconds_left: float, step_seconds: float) -> Fraction:
    """Phase units this step advances so that the island, `to_due` units short of its next due point, reaches
    it `seconds_left` from now at `step_seconds` a step: as many units a step as that takes, at least half and
    at most twice its `stride` (a target already past is caught up on at twice the stride), in QUANTUMs.
    Its stride when the step time is unknown."""
    if to_due <= 0:
        raise ValueError(f"the next due point must lie ahead, got {to_due} phase units")
    if not (math.isfinite(step_seconds) and step_seconds > 0 and math.isfinite(seconds_left)):
        return stride
    steps_left = seconds_left / step_seconds
    wanted = float(to_due) / steps_left if steps_left > 0 else math.inf
    bounded = max(float(stride) / 2, min(2 * float(stride), wanted))
    return max(Fraction(1, QUANTUM), Fraction(round(bounded * QUANTUM), QUANTUM))
