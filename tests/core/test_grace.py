import pytest
from hypothesis import given
from hypothesis import strategies as st

from diloco.core.grace import FLOOR_SECONDS, MARGIN, MIN_OBSERVATIONS, grace_window, lateness_quantile, may_push_by


def test_until_it_has_seen_enough_a_shard_waits_the_whole_configured_window():
    assert grace_window([0.1] * (MIN_OBSERVATIONS - 1), 10.0) == 10.0


def test_the_window_covers_the_lateness_seen_with_a_margin():
    assert grace_window([1.0, 2.0, 3.0, 4.0], 30.0) == pytest.approx(MARGIN * 4.0)


def test_islands_arriving_together_still_get_the_floor():
    assert grace_window([0.0] * 8, 30.0) == FLOOR_SECONDS


def test_the_configured_grace_bounds_the_window():
    assert grace_window([100.0] * 8, 2.0) == 2.0


def test_one_outlier_in_twenty_does_not_stretch_the_window():
    assert grace_window([1.0] * 19 + [60.0], 120.0) == pytest.approx(MARGIN * 1.0)


def test_negative_or_infinite_lateness_is_refused():
    with pytest.raises(ValueError):
        grace_window([1.0, -1.0, 1.0, 1.0], 2.0)
    with pytest.raises(ValueError):
        grace_window([float("nan")] * 4, 2.0)


def test_the_quantile_of_nothing_is_zero():
    assert lateness_quantile([]) == 0.0


@given(lateness=st.lists(st.floats(0, 1e4), max_size=64), max_grace=st.floats(0, 1e3))
def test_the_window_never_exceeds_the_configured_grace(lateness, max_grace):
    assert 0 <= grace_window(lateness, max_grace) <= max_grace


@given(lateness=st.lists(st.floats(0, 100), min_size=MIN_OBSERVATIONS, max_size=32), extra=st.floats(0, 100))
def test_later_arrivals_never_shorten_the_window(lateness, extra):
    later = [x + extra for x in lateness]
    assert grace_window(later, 1e6) >= grace_window(lateness, 1e6)


def test_an_island_of_unknown_cadence_may_push_at_any_time():
    assert may_push_by(None, None, 0.0) and may_push_by(5.0, None, 0.0)


def test_an_island_is_due_one_interval_after_its_last_push():
    assert may_push_by(10.0, 5.0, 15.0) and not may_push_by(10.0, 5.0, 14.9)


def test_an_overdue_island_may_still_push():
    assert may_push_by(10.0, 5.0, 30.0)
