import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.encoding import Encoding, decode, encode, validated
from diloco.core.merge import (
    MAX_TOKEN_RATIO,
    MAX_TOKENS_PER_INNER_STEP,
    Contribution,
    MergedGradient,
    contribution_weights,
    delta_norm,
    is_too_stale,
    merge_deltas,
    tokens_are_possible,
)


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def whole(gradient: MergedGradient) -> list[torch.Tensor]:
    """Every tensor of a merged gradient, filled chunk after chunk as a merge fills them."""
    tensors = []
    for index, shape in enumerate(gradient.shapes):
        out = torch.empty(math.prod(shape))
        size = max(1, gradient.chunk // gradient.alignment(index)) * gradient.alignment(index)
        for start in range(0, out.numel(), size):
            gradient.fill(index, start, out[start : start + size])
        tensors.append(out.view(shape))
    return tensors


def weighted_mean(deltas, weights, chunk=3):
    return whole(MergedGradient(deltas, weights, chunk=chunk))


def radial_directional_mean(deltas, weights, chunk=3):
    return whole(MergedGradient(deltas, weights, radial=True, chunk=chunk))


def c(island, delta, tokens=1, staleness=0):
    return Contribution(island=island, delta=delta, tokens=tokens, staleness=staleness)


def test_token_weighting_one_to_three():
    contributions = [c("a", [t(4.0, 0.0), t(8.0)], tokens=100), c("b", [t(0.0, 4.0), t(-8.0)], tokens=300)]
    assert contribution_weights(contributions, 1.0) == [0.25, 0.75]
    merged = whole(merge_deltas(contributions))
    # 0.25 * [4, 0] + 0.75 * [0, 4] = [1, 3]; 0.25 * 8 + 0.75 * -8 = -4
    assert torch.equal(merged[0], t(1.0, 3.0))
    assert torch.equal(merged[1], t(-4.0))


def test_staleness_decay():
    contributions = [c("fresh", [t(1.0)], tokens=10, staleness=0), c("old", [t(0.0)], tokens=10, staleness=2)]
    # raw weights 10 and 10 * 0.5**2 = 2.5 -> 0.8 and 0.2
    assert contribution_weights(contributions, 0.5) == pytest.approx([0.8, 0.2])
    assert whole(merge_deltas(contributions, staleness_decay=0.5))[0].item() == pytest.approx(0.8)
    assert contribution_weights(contributions, 1.0) == [0.5, 0.5]


def test_zero_tokens():
    assert contribution_weights([c("a", [], tokens=0), c("b", [], tokens=0)], 1.0) == [0.5, 0.5]
    assert contribution_weights([c("a", [], tokens=0), c("b", [], tokens=5)], 1.0) == [0.0, 1.0]


def test_one_claim_counts_at_most_max_token_ratio_times_the_lightest():
    ratio = MAX_TOKEN_RATIO
    huge = [c("honest", [], tokens=1000), c("claims", [], tokens=2**64 - 1)]
    assert contribution_weights(huge, 1.0) == pytest.approx([1 / (1 + ratio), ratio / (1 + ratio)])
    within = [c("small", [], tokens=100), c("large", [], tokens=100 * ratio)]
    assert contribution_weights(within, 1.0) == pytest.approx([1 / (1 + ratio), ratio / (1 + ratio)])


def test_token_ceiling_bounds_a_claims_share_of_n_contributions_and_applies_before_decay():
    n, ratio = 4, MAX_TOKEN_RATIO
    contributions = [c(str(i), [], tokens=10) for i in range(n - 1)] + [c("claims", [], tokens=10**30)]
    assert contribution_weights(contributions, 1.0)[-1] == pytest.approx(ratio / (ratio + n - 1))
    stale = [c("fresh", [], tokens=10, staleness=0), c("claims", [], tokens=10**30, staleness=1)]
    assert contribution_weights(stale, 0.5) == pytest.approx([10 / (10 + 5 * ratio), 5 * ratio / (10 + 5 * ratio)])


def test_contributions_without_tokens_set_no_ceiling():
    ratio = MAX_TOKEN_RATIO
    weights = contribution_weights([c("none", [], tokens=0), c("a", [], tokens=10), c("b", [], tokens=10**30)], 1.0)
    assert weights == pytest.approx([0.0, 1 / (1 + ratio), ratio / (1 + ratio)])


def test_tokens_are_possible_only_within_the_inner_steps_taken():
    assert tokens_are_possible(0, 0)
    assert tokens_are_possible(10 * MAX_TOKENS_PER_INNER_STEP, 10)
    assert not tokens_are_possible(10 * MAX_TOKENS_PER_INNER_STEP + 1, 10)
    assert not tokens_are_possible(1, 0), "tokens without an inner step"
    assert not tokens_are_possible(2**64 - 1, 100)
    assert not tokens_are_possible(-1, 10)


def test_weight_errors():
    with pytest.raises(ValueError, match="empty"):
        contribution_weights([], 1.0)
    with pytest.raises(ValueError, match="staleness_decay"):
        contribution_weights([c("a", [])], 0.0)
    with pytest.raises(ValueError, match="negative tokens"):
        contribution_weights([c("a", [], tokens=-1)], 1.0)
    with pytest.raises(ValueError, match="negative staleness"):
        contribution_weights([c("a", [], staleness=-1)], 1.0)


def test_radial_opposite_unit_deltas_cancel():
    merged = radial_directional_mean([[t(1.0, 0.0)], [t(-1.0, 0.0)]], [0.5, 0.5])
    assert torch.equal(merged[0], t(0.0, 0.0))


def test_radial_orthogonal_equal_norms_keep_the_norm():
    merged = radial_directional_mean([[t(1.0, 0.0)], [t(0.0, 1.0)]], [0.5, 0.5])[0]
    # mean norm 1 along the diagonal: [1/sqrt(2), 1/sqrt(2)]; a plain mean would give [0.5, 0.5]
    assert torch.allclose(merged, t(1 / math.sqrt(2), 1 / math.sqrt(2)))
    assert torch.linalg.vector_norm(merged).item() == pytest.approx(1.0)
    plain = weighted_mean([[t(1.0, 0.0)], [t(0.0, 1.0)]], [0.5, 0.5])[0]
    assert torch.equal(plain, t(0.5, 0.5))


def test_radial_zero_delta_adds_norm_zero_and_no_direction():
    merged = radial_directional_mean([[t(0.0, 0.0)], [t(2.0, 0.0)]], [0.5, 0.5])
    # mean norm 0.5 * 0 + 0.5 * 2 = 1, direction [1, 0]
    assert torch.allclose(merged[0], t(1.0, 0.0))
    assert torch.equal(radial_directional_mean([[t(0.0, 0.0)], [t(0.0, 0.0)]], [0.5, 0.5])[0], t(0.0, 0.0))


def test_radial_equals_plain_mean_for_parallel_deltas():
    deltas = [[t(1.0, 2.0), t(3.0)], [t(3.0, 6.0), t(1.0)]]
    weights = [0.25, 0.75]
    for radial, plain in zip(radial_directional_mean(deltas, weights), weighted_mean(deltas, weights)):
        assert torch.allclose(radial, plain)


def test_radial_is_per_tensor_and_selected_by_merge_deltas():
    contributions = [c("a", [t(1.0, 0.0), t(2.0)]), c("b", [t(0.0, 1.0), t(-2.0)])]
    merged = whole(merge_deltas(contributions, radial_directional=True))
    assert torch.allclose(merged[0], t(1 / math.sqrt(2), 1 / math.sqrt(2)))
    assert torch.equal(merged[1], t(0.0))


@pytest.mark.parametrize("radial", [False, True])
def test_inputs_not_mutated_and_result_not_aliased(radial):
    gen = torch.Generator().manual_seed(0)
    deltas = [[torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)] for _ in range(3)]
    copies = [[x.clone() for x in d] for d in deltas]
    contributions = [c(str(i), d, tokens=i + 1, staleness=i) for i, d in enumerate(deltas)]
    merged = whole(merge_deltas(contributions, staleness_decay=0.9, radial_directional=radial))
    for d, copy in zip(deltas, copies):
        assert all(torch.equal(x, y) for x, y in zip(d, copy))
    single = whole(merge_deltas(contributions[:1], radial_directional=radial))
    single[0].add_(1.0)
    assert torch.equal(deltas[0][0], copies[0][0])
    assert all(m.dtype == torch.float32 for m in merged)


def test_weighted_mean_matches_reference_on_random_tensors():
    gen = torch.Generator().manual_seed(1)
    deltas = [[torch.randn(64, 32, generator=gen)] for _ in range(4)]
    weights = [0.1, 0.2, 0.3, 0.4]
    expected = sum(w * d[0] for w, d in zip(weights, deltas))
    assert torch.allclose(weighted_mean(deltas, weights)[0], expected, atol=1e-6)


def test_shape_and_count_mismatch_errors():
    with pytest.raises(ValueError, match="tensors"):
        merge_deltas([c("a", [t(1.0), t(2.0)]), c("b", [t(1.0)])])
    with pytest.raises(ValueError, match="shape"):
        merge_deltas([c("a", [t(1.0, 2.0)]), c("b", [t(1.0)])])
    with pytest.raises(ValueError, match="shape"):
        merge_deltas([c("a", [t(1.0, 2.0)]), c("b", [t(1.0, 2.0).reshape(2, 1)])], radial_directional=True)
    with pytest.raises(ValueError, match="weights"):
        MergedGradient([[t(1.0)]], [0.5, 0.5])
    with pytest.raises(ValueError, match="empty"):
        MergedGradient([], [])
    with pytest.raises(ValueError, match="dtype"):
        MergedGradient([[torch.tensor([1])]], [1.0])


# Merged from the bytes as they came over the wire, chunk by chunk, against the straightforward computation:
# every delta decoded whole, then weighted and summed (plain) or normalised (radial), in float64.

ENCODINGS = [Encoding.FP32, Encoding.BF16, Encoding.INT8, Encoding.INT4, Encoding.SPARSE]


def reference_mean(tensors: list[torch.Tensor], weights: list[float], radial: bool) -> torch.Tensor:
    if not radial:
        return sum(w * x.double() for w, x in zip(weights, tensors))
    kept = [(w, x.double(), float(x.double().norm())) for w, x in zip(weights, tensors)]
    kept = [(w, x, n) for w, x, n in kept if n > 0]
    direction = sum((w / n * x for w, x, n in kept), torch.zeros_like(tensors[0], dtype=torch.float64))
    norm = float(direction.norm())
    if norm <= 4 * torch.finfo(torch.float32).eps * sum(w for w, _, _ in kept):
        return torch.zeros_like(direction)
    return direction * sum(w * n for w, _, n in kept) / norm


@settings(max_examples=60, deadline=None)
@given(
    encoding=st.sampled_from(ENCODINGS),
    islands=st.integers(1, 5),
    sizes=st.lists(st.integers(0, 70), min_size=1, max_size=3),
    chunk=st.integers(1, 40),
    radial=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_merged_from_encoded_bytes_chunk_by_chunk_is_the_mean_of_the_decoded_deltas(
    encoding, islands, sizes, chunk, radial, seed
):
    gen = torch.Generator().manual_seed(seed)
    block, top_k = 4, 2
    sent = [[encode(torch.randn(n, generator=gen), encoding, block, top_k) for n in sizes] for _ in range(islands)]
    deltas = [[validated(b, [n], encoding, block, top_k) for b, n in zip(d, sizes)] for d in sent]
    decoded = [[decode(b, [n], encoding, block, top_k) for b, n in zip(d, sizes)] for d in sent]
    weights = torch.rand(islands, generator=gen).add_(0.1)
    weights = (weights / weights.sum()).tolist()
    gradient = MergedGradient(deltas, weights, radial=radial, chunk=chunk)
    for j, got in enumerate(whole(gradient)):
        want = reference_mean([d[j] for d in decoded], weights, radial)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        assert float(got.abs().max()) <= gradient.bound if got.numel() else gradient.bound >= 0


@pytest.mark.parametrize("radial", [False, True])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_held_deltas_merge_as_decoded_and_their_norms_come_from_their_bytes(encoding, radial):
    """A shard holds deltas as they came over the wire and decodes them a chunk at a time while it merges."""
    gen = torch.Generator().manual_seed(7)
    block, top_k, sizes = 4, 2, [37, 8]
    sent = [[encode(torch.randn(n, generator=gen), encoding, block, top_k) for n in sizes] for _ in range(3)]
    held = [[validated(b, [n], encoding, block, top_k) for b, n in zip(d, sizes)] for d in sent]
    decoded = [[decode(b, [n], encoding, block, top_k) for b, n in zip(d, sizes)] for d in sent]
    for delta, values in zip(held, decoded):
        whole_norm = math.sqrt(sum(float(v.double().norm()) ** 2 for v in values))
        assert delta_norm(delta, chunk=5) == pytest.approx(whole_norm)
    contributions = [Contribution(str(i), d, 10, 0) for i, d in enumerate(held)]
    gradient = merge_deltas(contributions, radial_directional=radial, chunk=5)
    for j, got in enumerate(whole(gradient)):
        want = reference_mean([d[j] for d in decoded], [1 / 3] * 3, radial)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        assert float(got.abs().max()) <= gradient.bound


def test_the_bound_holds_every_element_within_it():
    deltas = [[t(1.0, -3.0)], [t(2.0, 0.5)]]
    assert MergedGradient(deltas, [0.5, 0.5]).bound == pytest.approx(0.5 * 3.0 + 0.5 * 2.0, rel=1e-6)
    radial = MergedGradient(deltas, [0.5, 0.5], radial=True)
    assert radial.bound == pytest.approx(0.5 * math.sqrt(10) + 0.5 * math.sqrt(4.25), rel=1e-6)
    assert math.isinf(MergedGradient([[t(1.0, math.inf)]], [1.0]).bound), "no bound for values no push sends"


def test_is_too_stale():
    assert not is_too_stale(0, 0)
    assert is_too_stale(1, 0)
    assert not is_too_stale(4, 4)
    assert is_too_stale(5, 4)
    with pytest.raises(ValueError):
        is_too_stale(-1, 4)
    with pytest.raises(ValueError):
        is_too_stale(0, -1)
