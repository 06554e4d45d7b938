"""Islands kept in phase: how far a push was out of phase, and how an island corrects its schedule for it."""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from diloco.core.phase import (
    GAIN,
    MAX_RATE,
    QUANTUM,
    RATE_GAIN,
    Correction,
    bounded_rate,
    catch_up,
    correction,
    round_offset,
)


def test_a_push_after_its_merges_median_is_late_by_the_difference():
    assert round_offset(10.3, 10.0, 5.0) == pytest.approx(0.3)
    assert round_offset(9.8, 10.0, 5.0) == pytest.approx(-0.2)


def test_a_push_that_missed_its_merge_is_late_not_a_round_early():
    # Rounds of 5 s: the push came 0.5 s after the median of the merge it missed, so it went into the next
    # merge, whose median is 4.5 s later.
    assert round_offset(10.5, 15.0, 5.0) == pytest.approx(0.5)


@given(arrival=st.floats(-1e6, 1e6), merged=st.floats(-1e6, 1e6), round_seconds=st.floats(0.01, 1e3))
def test_an_offset_is_within_half_a_round(arrival, merged, round_seconds):
    assert abs(round_offset(arrival, merged, round_seconds)) <= round_seconds / 2 * (1 + 1e-9) + 1e-6


def test_a_round_of_no_time_is_refused():
    with pytest.raises(ValueError, match="round"):
        round_offset(1.0, 0.0, 0.0)


def test_a_late_island_advances_its_phase_by_gain_of_its_offset_in_steps():
    # 0.4 s late at 0.2 s a step is 2 steps; GAIN of them at once, one phase unit per step.
    assert correction(0.4, 0.2, Fraction(1), 20).owed == Fraction(round(GAIN * 2 * QUANTUM), QUANTUM)
    assert correction(-0.4, 0.2, Fraction(1), 20).owed == -Fraction(round(GAIN * 2 * QUANTUM), QUANTUM)


def test_a_late_island_quickens_its_pace_by_rate_gain_of_its_offset_per_round():
    # 2 steps late in rounds of 20: RATE_GAIN of a tenth of a round.
    assert float(correction(0.4, 0.2, Fraction(1), 20).rate) == pytest.approx(RATE_GAIN * 2 / 20)


def test_a_slow_speed_aware_island_counts_its_steps_in_phase_units():
    # Its stride is 2 phase units a step: the same offset is twice the phase units.
    assert correction(0.4, 0.2, Fraction(2), 20).owed == 2 * correction(0.4, 0.2, Fraction(1), 20).owed


def test_a_correction_is_at_most_a_quarter_round_and_a_pace_at_most_max_rate():
    assert correction(100.0, 0.1, Fraction(1), 20).owed == 5
    assert correction(-100.0, 0.1, Fraction(1), 20).owed == -5
    assert bounded_rate(Fraction(3)) == MAX_RATE and bounded_rate(Fraction(-3)) == -MAX_RATE


def test_without_a_step_time_there_is_nothing_to_correct():
    assert correction(1.0, 0.0, Fraction(1), 20) == Correction()


def test_a_step_catches_up_at_most_one_stride_and_holds_back_at_most_half():
    one = Fraction(1)
    assert catch_up(one, Fraction(0), Fraction(3)) == (Fraction(2), Fraction(2))
    assert catch_up(one, Fraction(0), Fraction(-3)) == (Fraction(1, 2), Fraction(-5, 2))
    assert catch_up(one, Fraction(0), Fraction(1, 4)) == (Fraction(5, 4), Fraction(0))
    assert catch_up(one, Fraction(0), Fraction(0)) == (one, Fraction(0))
    assert catch_up(one, Fraction(1, 10), Fraction(0)) == (Fraction(11, 10), Fraction(0)), "at its pace"


@given(
    owed=st.fractions(-100, 100),
    stride=st.fractions(Fraction(1, 10), 10),
    rate=st.fractions(-MAX_RATE, MAX_RATE),
)
def test_catching_up_pays_what_is_owed_and_never_stalls(owed, stride, rate):
    advance, left = catch_up(stride, rate, owed)
    paced = stride * (1 + rate)
    assert advance + left == paced + owed
    assert paced / 2 <= advance <= 2 * paced


def test_islands_correcting_towards_their_merges_median_come_into_phase():
    """Four islands of equal speed, started up to 3 s apart, each correcting by its offset after every merge
    of a fragment (rounds of 20 steps of 0.25 s, two fragments): within a few rounds they push together."""
    step, h = 0.25, 20
    arrivals = [0.0, 1.1, 2.2, 3.0]
    for _ in range(6):
        merged = sorted(arrivals)[1:3]
        median = sum(merged) / 2
        fixes = [correction(round_offset(a, median, h * step), step, Fraction(1), h) for a in arrivals]
        arrivals = [a + h * step - float(c.owed) * step for a, c in zip(arrivals, fixes)]
    assert max(arrivals) - min(arrivals) < 0.1


def test_an_island_slightly_slower_than_the_others_learns_their_pace():
    """One island 10 % slower, within speed-aware pacing's tolerance: its pace makes up the difference, and
    its offset, measured against the merges of the others, shrinks towards nothing rather than staying at
    the lag a correction of the offset alone would leave."""
    step, slow, h = 0.25, 0.275, 20
    arrival, rate, others = 0.0, Fraction(0), 0.0
    offsets = []
    for _ in range(80):
        others += h * step
        paced_steps = h / (1 + float(rate))
        fix = correction(round_offset(arrival, others, h * step), slow, Fraction(1), h)
        offsets.append(round_offset(arrival, others, h * step))
        rate = bounded_rate(rate + fix.rate)
        arrival += paced_steps * slow - float(fix.owed) * slow
    assert abs(offsets[-1]) < 0.05 < abs(offsets[5])
    assert float(rate) == pytest.approx(0.1, abs=0.01)
