"""Specification of the bound on one contribution's delta: clipped against the lower median of its merge and
the fragment's recent history, never beyond the fragment's own norm, finite for any finite float32 delta."""

import pytest
import torch

from diloco.core.robust import (
    CLIP_FACTOR,
    FRAGMENT_RATIO,
    HISTORY,
    PER_ISLAND,
    clip_bound,
    clip_scale,
    norm,
    peers,
    remember,
)

F32_MAX = torch.finfo(torch.float32).max


def test_the_norm_of_a_delta_near_the_float32_limit_is_finite():
    delta = [torch.full((64, 32), F32_MAX), torch.full((32,), -F32_MAX)]
    assert norm(delta) == pytest.approx(F32_MAX * (64 * 32 + 32) ** 0.5)


def test_one_huge_delta_among_honest_ones_is_bounded_by_theirs():
    assert clip_bound([1.0, 1.2, 1e38], [], lambda: 0.0) == CLIP_FACTOR * 1.2


def test_a_merge_of_one_is_measured_against_the_fragments_history():
    assert clip_bound([1e38], [1.0, 1.1, 0.9], lambda: 0.0) == CLIP_FACTOR * 1.0


def test_until_a_median_can_outvote_an_outlier_no_delta_is_larger_than_the_fragment_it_moves():
    assert clip_bound([1e38], [], lambda: 10.0) == FRAGMENT_RATIO * 10.0
    assert clip_bound([1e38, 1e38], [], lambda: 10.0) == FRAGMENT_RATIO * 10.0
    assert clip_bound([1.0], [], lambda: 0.0) == CLIP_FACTOR, "an all-zero fragment bounds nothing"
    assert clip_bound([20.0, 20.0, 20.0], [], lambda: 10.0) == CLIP_FACTOR * 20.0, "three norms: their median decides"


def test_the_fragment_is_measured_only_while_a_median_cannot_outvote_an_outlier():
    def unmeasured() -> float:
        raise AssertionError("a pass over the fragment, under the shard's lock, that the bound did not need")

    assert clip_bound([1.0, 1.2, 0.8], [], unmeasured) == CLIP_FACTOR * 1.0
    assert clip_bound([1e38], [1.0, 1.1, 0.9], unmeasured) == CLIP_FACTOR * 1.0


def test_honest_deltas_within_the_bound_are_merged_as_they_are():
    delta = [torch.ones(3)]
    assert clip_scale(norm(delta), 10.0) == 1.0


def test_a_delta_beyond_the_bound_keeps_its_direction_at_the_bound():
    delta = [torch.full((4,), F32_MAX)]
    scale = clip_scale(norm(delta), 2.0)
    assert torch.allclose(delta[0].double() * scale, torch.ones(4, dtype=torch.float64))


def test_a_merge_needs_a_contribution():
    with pytest.raises(ValueError):
        clip_bound([], [1.0], lambda: 1.0)


def test_an_island_that_merges_alone_again_and_again_keeps_its_votes():
    """A hostile island merging alone every second, between the honest islands' rounds, once filled the history
    with its own clipped norms and raised the bound eightfold each time; now it replaces only its own entries."""
    history: dict[str, list[float]] = {}
    remember(history, [("a", 1.0), ("b", 1.1), ("c", 0.9)])
    for _ in range(20):
        bound = clip_bound([1e38], peers(history, ["hostile"]), lambda: 0.0)
        assert bound == CLIP_FACTOR * 1.0
        remember(history, [("hostile", min(1e38, bound))])
    assert history["hostile"] == [CLIP_FACTOR] * PER_ISLAND
    assert list(history) == ["a", "b", "c", "hostile"]
    assert sorted(peers(history, ["a"])) == [0.9, 1.1, CLIP_FACTOR, CLIP_FACTOR], "a's own norms are not its peers'"


def test_the_history_keeps_the_islands_merged_most_recently():
    history: dict[str, list[float]] = {}
    remember(history, [(f"island-{i}", float(i)) for i in range(HISTORY + 2)])
    remember(history, [("island-3", 30.0)])
    assert len(history) == HISTORY
    assert list(history)[-1] == "island-3" and history["island-3"] == [3.0, 30.0]
    assert "island-0" not in history and "island-1" not in history
