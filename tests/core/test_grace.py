import pytest
from hypothesis import given
from hypothesis import strategies as st

from diloco.core.grace import (
    ADAPTIVE_MAX_SECONDS,
    FLOOR_SECONDS,
    MARGIN,
    MIN_OBSERVATIONS,
    SLACK_FRACTION,
    adaptive_max,
    grace_window,
    lateness_quantile,
    merge_closes,
    slack_max,
)


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


def test_without_slack_a_merge_closes_when_its_window_ends():
    assert merge_closes(10.0, 2.0, [(10.0, None), (10.5, None)], max_wait=30.0) == 12.0


def test_with_slack_a_merge_waits_past_the_window_up_to_the_slack_of_the_islands_in_it():
    # Waiting costs the islands in it nothing within their slack, so a late island is waited for that long:
    # the window sized from the lateness seen bounds only pushes that say no slack.
    assert merge_closes(10.0, 2.0, [(10.0, 8.0), (10.4, 9.0)], max_wait=30.0) == pytest.approx(
        10.0 + SLACK_FRACTION * 8.0
    )
    assert merge_closes(10.0, 2.0, [(10.0, 8.0)], max_wait=3.0) == 13.0, "an island timeout caps it"


def test_a_merge_closes_before_any_pending_island_would_wait_for_it():
    # The first island pushed at 10 and mixes in 0.5 s later; the second pushed at 10.1 with 2 s to spare.
    assert merge_closes(10.0, 2.0, [(10.0, 0.5), (10.1, 2.0)], max_wait=30.0) == pytest.approx(
        10.0 + SLACK_FRACTION * 0.5
    )


def test_a_quorum_that_came_after_the_slack_closes_its_merge_at_once():
    # K = 2: the quorum came at 11, after the first island's slack ran out at 10.4.
    assert merge_closes(11.0, 2.0, [(10.0, 0.5), (11.0, 3.0)], max_wait=30.0) == 11.0


@given(
    quorum_since=st.floats(0, 1e4),
    window=st.floats(0, 100),
    max_wait=st.floats(0, 100),
    pushed=st.lists(st.tuples(st.floats(0, 1e4), st.none() | st.floats(0, 100)), max_size=16),
)
def test_a_merge_never_closes_before_its_quorum_nor_after_its_bounds(quorum_since, window, max_wait, pushed):
    closes = merge_closes(quorum_since, window, pushed, max_wait)
    bounds = [arrival + SLACK_FRACTION * slack for arrival, slack in pushed if slack is not None]
    assert quorum_since <= closes <= quorum_since + (max_wait if bounds else window)
    assert all(closes <= max(quorum_since, bound) for bound in bounds)


def test_an_island_without_slack_closes_the_merge_at_its_push():
    assert merge_closes(10.0, 2.0, [(10.0, 0.0)], max_wait=30.0) == 10.0


def test_a_negative_window_is_refused():
    with pytest.raises(ValueError, match="windows"):
        merge_closes(0.0, -1.0, [], max_wait=1.0)
    with pytest.raises(ValueError, match="windows"):
        merge_closes(0.0, 1.0, [], max_wait=-1.0)


def test_unset_grace_leaves_the_slack_to_bound_a_merge_within_an_island_timeout():
    assert slack_max(None, 60.0) == 60.0
    assert adaptive_max(None) == ADAPTIVE_MAX_SECONDS, "pushes that say no slack wait a short window"


def test_a_grace_the_job_sets_caps_every_wait():
    assert (slack_max(5.0, 60.0), adaptive_max(5.0)) == (5.0, 5.0)
    assert slack_max(0.0, 60.0) == adaptive_max(0.0) == 0.0, "0: a merge goes ahead once its quorum is in"
    assert slack_max(90.0, 60.0) == 60.0, "never past an island timeout"
