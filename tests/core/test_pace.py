from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from diloco.core.fragments import fragments_due
from diloco.core.pace import TOLERANCE, fragments_due_in, paced_inner_steps, phase_stride


def test_an_island_three_times_slower_runs_a_third_of_the_steps_per_round():
    assert paced_inner_steps(30, 2, step_seconds=0.3, cadence_step_seconds=0.1) == 10


def test_the_fastest_island_and_one_within_tolerance_run_the_full_h():
    assert paced_inner_steps(20, 2, step_seconds=0.1, cadence_step_seconds=0.1) == 20
    assert paced_inner_steps(20, 2, step_seconds=0.1 / TOLERANCE * 0.999, cadence_step_seconds=0.1) == 20


@pytest.mark.parametrize(("step_seconds", "cadence"), [(0.0, 0.1), (0.3, 0.0), (0.0, 0.0)])
def test_an_unknown_speed_keeps_h(step_seconds, cadence):
    assert paced_inner_steps(20, 2, step_seconds, cadence) == 20


def test_a_very_slow_island_still_gives_each_fragment_its_own_step():
    assert paced_inner_steps(20, 4, step_seconds=100.0, cadence_step_seconds=0.1) == 4


def test_infinite_seconds_are_refused():
    with pytest.raises(ValueError, match="finite"):
        paced_inner_steps(20, 2, float("inf"), 0.1)


@given(
    inner_steps=st.integers(1, 500),
    fragments=st.integers(1, 16),
    step_seconds=st.floats(0, 100),
    cadence=st.floats(0, 100),
)
def test_paced_steps_stay_between_p_and_h(inner_steps, fragments, step_seconds, cadence):
    paced = paced_inner_steps(inner_steps, fragments, step_seconds, cadence)
    assert min(fragments, inner_steps) <= paced <= inner_steps


@given(inner_steps=st.integers(1, 200), slow=st.floats(1.0, 8.0), fast=st.floats(0.01, 1.0))
def test_a_slower_island_never_runs_more_steps_per_round(inner_steps, slow, fast):
    assert paced_inner_steps(inner_steps, 1, fast * slow, fast) <= paced_inner_steps(inner_steps, 1, fast, fast)


def test_at_stride_one_the_phase_schedule_is_the_step_schedule():
    for step in range(1, 50):
        assert fragments_due_in(Fraction(step - 1), Fraction(step), 12, 4) == fragments_due(step, 12, 4)


@given(inner_steps=st.integers(2, 60), fragments=st.integers(1, 8), data=st.data())
def test_a_paced_island_pushes_every_fragment_once_per_paced_round(inner_steps, fragments, data):
    fragments = min(fragments, inner_steps)
    paced = data.draw(st.integers(fragments, inner_steps))
    stride = phase_stride(inner_steps, paced)
    phase, pushes = Fraction(0), []
    for _ in range(paced * 5):
        before, phase = phase, phase + stride
        pushes += fragments_due_in(before, phase, inner_steps, fragments)
    assert sorted(pushes) == sorted(list(range(fragments)) * 5)


def test_a_step_across_more_than_a_round_makes_every_fragment_due_once():
    assert fragments_due_in(Fraction(0), Fraction(100), 8, 4) == [0, 1, 2, 3]


def test_the_phase_never_goes_back():
    with pytest.raises(ValueError, match="back"):
        fragments_due_in(Fraction(5), Fraction(4), 8, 4)


def test_a_stride_needs_paced_steps_within_h():
    with pytest.raises(ValueError):
        phase_stride(10, 11)
    assert phase_stride(30, 10) == 3
