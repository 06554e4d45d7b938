"""Islands kept in phase: how far a push was out of phase, when to push next, and how each step steers there."""

import random
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from diloco.core.pace import next_due
from diloco.core.phase import GAIN, QUANTUM, push_target, round_offset, steered_advance


def test_a_push_after_its_rounds_opening_is_late_by_the_difference():
    assert round_offset(10.3, 10.0, 5.0) == pytest.approx(0.3)
    assert round_offset(9.8, 10.0, 5.0) == pytest.approx(-0.2)


def test_a_push_that_missed_its_merge_is_late_not_a_round_early():
    # Rounds of 5 s: the push came 0.5 s after its round opened and went into the next round, opened 4.5 s on.
    assert round_offset(10.5, 15.0, 5.0) == pytest.approx(0.5)


@given(arrival=st.floats(-1e6, 1e6), reference=st.floats(-1e6, 1e6), round_seconds=st.floats(0.01, 1e3))
def test_an_offset_is_within_half_a_round(arrival, reference, round_seconds):
    assert abs(round_offset(arrival, reference, round_seconds)) <= round_seconds / 2 * (1 + 1e-9) + 1e-6


def test_a_round_of_no_time_is_refused():
    with pytest.raises(ValueError, match="round"):
        round_offset(1.0, 0.0, 0.0)


def test_the_next_push_is_aimed_a_round_on_and_gain_of_the_offset_earlier():
    assert push_target(100.0, 0.0, 5.0) == 105.0
    assert push_target(100.0, 0.4, 5.0) == pytest.approx(105.0 - GAIN * 0.4), "late: sooner"
    assert push_target(100.0, -0.4, 5.0) == pytest.approx(105.0 + GAIN * 0.4), "early: later"


def test_a_step_advances_as_much_as_reaches_the_due_point_at_the_target():
    # 4 phase units to go, 2 s left at 0.5 s a step: 4 steps, one unit each.
    assert steered_advance(Fraction(1), Fraction(4), 2.0, 0.5) == 1
    # 5 steps' time for 4 units: slower than the stride; 2.5 steps' time: faster.
    assert steered_advance(Fraction(1), Fraction(4), 2.5, 0.5) == Fraction(4, 5)
    assert steered_advance(Fraction(1), Fraction(4), 1.25, 0.5) == Fraction(8, 5)


def test_a_step_stays_between_half_and_twice_the_stride():
    assert steered_advance(Fraction(1), Fraction(4), 100.0, 0.5) == Fraction(1, 2), "never stalls"
    assert steered_advance(Fraction(1), Fraction(4), 0.1, 0.5) == 2, "catches up at most twice as fast"
    assert steered_advance(Fraction(1), Fraction(4), -3.0, 0.5) == 2, "a target already past"
    assert steered_advance(Fraction(2), Fraction(4), 100.0, 0.5) == 1, "a paced island's stride"


def test_without_a_step_time_a_step_advances_its_stride():
    assert steered_advance(Fraction(3, 2), Fraction(4), 2.0, 0.0) == Fraction(3, 2)


@given(
    stride=st.fractions(Fraction(1, 4), 8),
    to_due=st.fractions(Fraction(1, 100), 40),
    seconds_left=st.floats(-100, 100),
    step_seconds=st.floats(0.001, 10),
)
def test_a_steered_advance_is_in_quanta_and_within_its_bounds(stride, to_due, seconds_left, step_seconds):
    advance = steered_advance(stride, to_due, seconds_left, step_seconds)
    assert (advance * QUANTUM).denominator == 1
    assert stride / 2 - Fraction(1, QUANTUM) <= advance <= 2 * stride + Fraction(1, QUANTUM)


def test_the_schedule_goes_next_to_the_first_due_point_after_the_phase():
    # H = 20, P = 2: fragment 1 due at 10, 30, ...; fragment 0 at 20, 40, ...
    assert next_due(Fraction(0), 20, 2) == (10, 1)
    assert next_due(Fraction(10), 20, 2) == (20, 0)
    assert next_due(Fraction(39, 2), 20, 2) == (20, 0)


def test_islands_steering_towards_their_targets_come_into_phase():
    """Four islands of equal speed whose steps vary by 10 %, their first pushes of a fragment up to 3 s apart,
    in rounds of 20 steps of 0.25 s: each aims its next push by its offset to the round's opening (the
    earliest push) and steers every step. Within a few rounds they push within two steps of each other."""
    rng = random.Random(0)
    step, h = 0.25, 20
    round_seconds = h * step
    pushed = [0.0, 1.1, 2.2, 3.0]
    for _ in range(12):
        opened = min(pushed)
        following = []
        for at in pushed:
            target = push_target(at, round_offset(at, opened, round_seconds), round_seconds)
            now, phase = at, Fraction(0)
            while phase < h:
                now += step * rng.uniform(0.9, 1.1)
                phase += steered_advance(Fraction(1), h - phase, target - now, step)
            following.append(now)
        pushed = following
    # Islands that came together a round apart push with the same rounds' merges all the same.
    apart = [round_offset(at, min(pushed), round_seconds) for at in pushed]
    assert max(apart) - min(apart) < 2 * step, pushed
