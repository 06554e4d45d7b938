"""Specification of the bound beyond which a delta is left out of its merge: OUTLIER_FACTOR times the lower median
of its merge's norms and the fragment's recent history, never beyond the fragment's own norm until there is a
median, finite for any finite float32 delta."""

import pytest
import torch

from diloco.core.robust import (
    FRAGMENT_RATIO,
    HISTORY,
    OUTLIER_FACTOR,
    PER_ISLAND,
    norm,
    outlier_bound,
    peers,
    remember,
)

F32_MAX = torch.finfo(torch.float32).max


def test_the_norm_of_a_delta_near_the_float32_limit_is_finite():
    delta = [torch.full((64, 32), F32_MAX), torch.full((32,), -F32_MAX)]
    assert norm(delta) == pytest.approx(F32_MAX * (64 * 32 + 32) ** 0.5)


def test_one_huge_delta_among_honest_ones_is_bounded_by_theirs():
    assert outlier_bound([1.0, 1.2, 1e38], [], lambda: 0.0) == OUTLIER_FACTOR * 1.2


def test_a_merge_of_one_is_measured_against_the_fragments_history():
    assert outlier_bound([1e38], [1.0, 1.1, 0.9], lambda: 0.0) == OUTLIER_FACTOR * 1.0


def test_until_a_median_can_outvote_an_outlier_the_fragment_votes_in_the_place_of_the_norms_missing():
    fragment = FRAGMENT_RATIO * 10.0
    assert outlier_bound([1e38], [], lambda: 10.0) == OUTLIER_FACTOR * fragment, "a lone huge delta is left out"
    assert outlier_bound([1.0, 1e38], [], lambda: 10.0) == OUTLIER_FACTOR * fragment
    assert outlier_bound([1.0], [], lambda: 0.0) == OUTLIER_FACTOR, "an all-zero fragment has no vote"
    assert outlier_bound([20.0, 20.0, 20.0], [], lambda: 10.0) == OUTLIER_FACTOR * 20.0, "three norms: their median"


def test_a_fragment_that_started_at_zero_leaves_out_no_honest_delta_once_it_is_small():
    """After its first merge a fragment that started at zero is smaller than the deltas that move it: as a cap,
    its norm left every later delta out until three norms were remembered, which never came."""
    assert outlier_bound([1.0], [1.2], lambda: 0.1) == OUTLIER_FACTOR * 1.0


def test_the_fragment_is_measured_only_while_a_median_cannot_outvote_an_outlier():
    def unmeasured() -> float:
        raise AssertionError("a pass over the fragment, under the shard's lock, that the bound did not need")

    assert outlier_bound([1.0, 1.2, 0.8], [], unmeasured) == OUTLIER_FACTOR * 1.0
    assert outlier_bound([1e38], [1.0, 1.1, 0.9], unmeasured) == OUTLIER_FACTOR * 1.0


def test_a_merge_needs_a_contribution():
    with pytest.raises(ValueError):
        outlier_bound([], [1.0], lambda: 1.0)


def test_an_island_that_merges_alone_again_and_again_keeps_its_votes():
    """An island merging alone every second, between the other islands' rounds, is measured against their norms
    each time, and holds PER_ISLAND entries of the history however often it merges: its own norms never vote on
    its own deltas, and a run of them cannot move the bound its peers set."""
    history: dict[str, list[float]] = {}
    remember(history, [("a", 1.0), ("b", 1.1), ("c", 0.9)])
    for _ in range(20):
        assert outlier_bound([7.0], peers(history, ["eager"]), lambda: 0.0) == OUTLIER_FACTOR * 1.0
        remember(history, [("eager", 7.0)])
    assert history["eager"] == [7.0] * PER_ISLAND
    assert list(history) == ["a", "b", "c", "eager"]
    assert sorted(peers(history, ["a"])) == [0.9, 1.1, 7.0, 7.0], "a's own norms are not its peers'"


def test_the_history_keeps_the_islands_merged_most_recently():
    history: dict[str, list[float]] = {}
    remember(history, [(f"island-{i}", float(i)) for i in range(HISTORY + 2)])
    remember(history, [("island-3", 30.0)])
    assert len(history) == HISTORY
    assert list(history)[-1] == "island-3" and history["island-3"] == [3.0, 30.0]
    assert "island-0" not in history and "island-1" not in history
