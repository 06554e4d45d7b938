import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.config import Encoding, TrainingConfig
from diloco.core.outer_optimizer import (
    init_momentum,
    land,
    land_bound,
    land_chunked,
    outer_momentum,
    outer_step,
    outer_step_chunked,
    step_bounds,
)


def test_hand_computed_three_nesterov_steps():
    params = [torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)]
    momentum = init_momentum(params)
    grads = [[0.1, -0.2, 0.0], [0.2, 0.1, -0.4], [-0.1, 0.0, 0.3]]
    # lr 0.7, mu 0.9; buf <- 0.9 buf + g; step = g + 0.9 buf; theta <- theta - 0.7 step
    # theta[0]: buf 0.1,   step 0.19,    theta 1 - 0.133 = 0.867
    #           buf 0.29,  step 0.461,   theta 0.867 - 0.3227 = 0.5443
    #           buf 0.161, step 0.0449,  theta 0.5443 - 0.03143 = 0.51287
    # theta[1]: buf -0.2,  step -0.38,   theta -2 + 0.266 = -1.734
    #           buf -0.08, step 0.028,   theta -1.734 - 0.0196 = -1.7536
    #           buf -0.072, step -0.0648, theta -1.7536 + 0.04536 = -1.70824
    # theta[2]: buf 0,     step 0,       theta 0.5
    #           buf -0.4,  step -0.76,   theta 0.5 + 0.532 = 1.032
    #           buf -0.06, step 0.246,   theta 1.032 - 0.1722 = 0.8598
    expected_params = [[0.867, -1.734, 0.5], [0.5443, -1.7536, 1.032], [0.51287, -1.70824, 0.8598]]
    expected_momentum = [[0.1, -0.2, 0.0], [0.29, -0.08, -0.4], [0.161, -0.072, -0.06]]
    for g, want_param, want_buf in zip(grads, expected_params, expected_momentum):
        outer_step(params, momentum, [torch.tensor(g, dtype=torch.float64)], lr=0.7, momentum_coef=0.9)
        assert params[0].tolist() == pytest.approx(want_param, abs=1e-12)
        assert momentum[0].tolist() == pytest.approx(want_buf, abs=1e-12)


def test_hand_computed_heavy_ball_step():
    params = [torch.tensor([1.0], dtype=torch.float64)]
    momentum = [torch.tensor([0.5], dtype=torch.float64)]
    outer_step(params, momentum, [torch.tensor([0.1], dtype=torch.float64)], lr=0.7, momentum_coef=0.9, nesterov=False)
    # buf = 0.45 + 0.1 = 0.55; theta = 1 - 0.7 * 0.55 = 0.615
    assert momentum[0].item() == pytest.approx(0.55, abs=1e-12)
    assert params[0].item() == pytest.approx(0.615, abs=1e-12)


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_sgd_over_ten_steps(nesterov):
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), ()]
    ours = [torch.randn(s, generator=gen) for s in shapes]
    theirs = [torch.nn.Parameter(p.clone()) for p in ours]
    sgd = torch.optim.SGD(theirs, lr=0.7, momentum=0.9, nesterov=nesterov)
    momentum = init_momentum(ours)
    for _ in range(10):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        outer_step(ours, momentum, grads, lr=0.7, momentum_coef=0.9, nesterov=nesterov)
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        sgd.step()
        for a, b in zip(ours, theirs):  # the same step, its terms added in another order
            torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-6)
        for buf, p in zip(momentum, theirs):
            torch.testing.assert_close(buf, sgd.state[p]["momentum_buffer"], rtol=1e-6, atol=1e-6)


def test_grad_is_not_modified_and_params_requiring_grad_are_fine():
    param = torch.nn.Parameter(torch.ones(3))
    grad = torch.full((3,), 0.5)
    outer_step([param], init_momentum([param]), [grad], lr=0.1, momentum_coef=0.9)
    assert torch.equal(grad, torch.full((3,), 0.5))
    # step = 0.5 + 0.9 * 0.5 = 0.95; theta = 1 - 0.095
    assert torch.allclose(param.detach(), torch.full((3,), 0.905))


def test_init_momentum_is_zeros_like():
    params = [torch.ones(2, 3, dtype=torch.float64), torch.ones(4)]
    buffers = init_momentum(params)
    assert [b.shape for b in buffers] == [p.shape for p in params]
    assert [b.dtype for b in buffers] == [torch.float64, torch.float32]
    assert all(not b.any() for b in buffers)


def test_errors_leave_state_untouched():
    params = [torch.ones(2), torch.ones(3)]
    momentum = init_momentum(params)
    with pytest.raises(ValueError, match="shape"):
        outer_step(params, momentum, [torch.ones(2), torch.ones(4)], lr=0.7, momentum_coef=0.9)
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)
    with pytest.raises(ValueError, match="params"):
        outer_step(params, momentum, [torch.ones(2)], lr=0.7, momentum_coef=0.9)
    with pytest.raises(ValueError, match="lr"):
        outer_step(params, momentum, [torch.ones(2), torch.ones(3)], lr=0.0, momentum_coef=0.9)
    with pytest.raises(ValueError, match="momentum_coef"):
        outer_step(params, momentum, [torch.ones(2), torch.ones(3)], lr=0.7, momentum_coef=1.0)


def test_hand_computed_partial_steps_of_one_round():
    # buf 0.5 from earlier rounds, lr 0.7, mu 0.9. The round opens: buf <- 0.45, theta stays 1. Share 0.5 of
    # g = 0.2: buf <- 0.45 + 0.1 = 0.55; theta <- 1 - 0.7 * 0.1 = 0.93. The other half, g = 0.4: buf <- 0.55 +
    # 0.2 = 0.75; theta <- 0.93 - 0.7 * 0.2 = 0.79; the round completes with its look-ahead, theta <- 0.79 -
    # 0.7 * 0.9 * 0.75 = 0.3175: one full step's 1 - 0.7 * (0.3 + 0.9 * 0.75).
    params, momentum = [torch.tensor([1.0], dtype=torch.float64)], [torch.tensor([0.5], dtype=torch.float64)]
    progress = outer_step(params, momentum, [torch.tensor([0.2], dtype=torch.float64)], **OUTER, share=0.5)
    assert (progress, momentum[0].item(), params[0].item()) == pytest.approx((0.5, 0.55, 0.93), abs=1e-12)
    progress = outer_step(
        params, momentum, [torch.tensor([0.4], dtype=torch.float64)], **OUTER, share=0.5, round_progress=progress
    )
    assert (progress, momentum[0].item(), params[0].item()) == pytest.approx((0.0, 0.75, 0.3175), abs=1e-12)


def test_a_round_that_never_completes_takes_its_shares_and_no_look_ahead():
    """The end of a run: a quarter of a round pushed after the last full one moves the fragment by its share of
    the gradient alone, not by a look-ahead for the rounds that would have followed."""
    params, momentum = [torch.tensor([1.0], dtype=torch.float64)], [torch.tensor([0.5], dtype=torch.float64)]
    outer_step(params, momentum, [torch.tensor([0.4], dtype=torch.float64)], **OUTER, share=0.25)
    assert params[0].item() == pytest.approx(1 - 0.7 * 0.25 * 0.4, abs=1e-12)


def test_landing_moves_by_the_share_of_the_gradient_and_leaves_momentum():
    params, momentum = [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, 0.5])]
    land(params, [torch.tensor([0.4, -0.8])], share=0.5)
    assert torch.equal(params[0], torch.tensor([0.8, 2.4]))
    assert torch.equal(momentum[0], torch.tensor([0.5, 0.5]))


def test_landing_every_islands_last_push_at_once_gives_the_mean_of_their_models():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(5, generator=gen)
    models = [base + torch.randn(5, generator=gen) for _ in range(4)]
    params = [base.clone()]
    land(params, [torch.stack([base - m for m in models]).mean(0)])
    torch.testing.assert_close(params[0], torch.stack(models).mean(0))


@pytest.mark.parametrize("share", [0.0, 1.5])
def test_landing_refuses_a_share_outside_a_round(share):
    with pytest.raises(ValueError, match="share"):
        land([torch.zeros(1)], [torch.zeros(1)], share=share)


OUTER = {"lr": 0.7, "momentum_coef": 0.9}


def synchronous_rounds(rounds: list[list[torch.Tensor]], nesterov: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: one full outer step per round, of the mean of that round's deltas."""
    params, momentum = [torch.zeros(6, dtype=torch.float64)], [torch.zeros(6, dtype=torch.float64)]
    for deltas in rounds:
        outer_step(params, momentum, [torch.stack(deltas).mean(0)], **OUTER, nesterov=nesterov)
    return params[0], momentum[0]


@pytest.mark.parametrize("nesterov", [True, False])
@given(
    groupings=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=4), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_however_a_round_is_grouped_into_merges_it_moves_the_fragment_as_one_merge_of_it(groupings, seed, nesterov):
    """M islands per round, merged in groups of any sizes (a merge of k of them is a share k/M): the fragment
    and its momentum end every round exactly where one synchronous merge of the round's deltas puts them."""
    gen = torch.Generator().manual_seed(seed)
    rounds, merges = [], []
    for sizes in groupings:
        deltas = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(sum(sizes))]
        rounds.append(deltas)
        at = 0
        for k in sizes:
            merges.append((torch.stack(deltas[at : at + k]).mean(0), k / len(deltas)))
            at += k
    params, momentum = [torch.zeros(6, dtype=torch.float64)], [torch.zeros(6, dtype=torch.float64)]
    progress = 0.0
    for grad, share in merges:
        progress = outer_step(
            params, momentum, [grad], **OUTER, nesterov=nesterov, share=share, round_progress=progress
        )
    want_params, want_momentum = synchronous_rounds(rounds, nesterov)
    assert progress == 0.0
    torch.testing.assert_close(params[0], want_params, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(momentum[0], want_momentum, rtol=1e-9, atol=1e-9)


def test_a_share_past_the_end_of_a_round_opens_the_next_with_the_rest():
    # Three merges of half a round each: the second completes round one and is the first half of nothing
    # more; the third opens round two. As two rounds of one island's delta g each, split in halves.
    g = [torch.tensor([1.0], dtype=torch.float64)]
    split, whole = [torch.zeros(1, dtype=torch.float64)], [torch.zeros(1, dtype=torch.float64)]
    split_buf, whole_buf = init_momentum(split), init_momentum(whole)
    progress = outer_step(split, split_buf, g, **OUTER, share=0.75)
    progress = outer_step(split, split_buf, g, **OUTER, share=0.75, round_progress=progress)
    assert progress == pytest.approx(0.5)
    progress = outer_step(split, split_buf, g, **OUTER, share=0.5, round_progress=progress)
    assert progress == 0.0
    for _ in range(2):
        outer_step(whole, whole_buf, g, **OUTER)
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(split_buf, whole_buf)


@pytest.mark.parametrize("progress", [-0.1, 1.0])
def test_round_progress_outside_0_1_is_refused(progress):
    with pytest.raises(ValueError, match="round_progress"):
        outer_step([torch.zeros(1)], [torch.zeros(1)], [torch.ones(1)], **OUTER, round_progress=progress)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_share_outside_0_1_is_refused(share):
    with pytest.raises(ValueError, match="share"):
        outer_step([torch.zeros(1)], [torch.zeros(1)], [torch.ones(1)], lr=0.7, momentum_coef=0.9, share=share)


def test_the_shard_leaves_momentum_to_the_islands_error_feedback_when_deltas_are_sparse():
    job = TrainingConfig()
    assert outer_momentum(job) == job.outer.momentum == 0.9
    assert outer_momentum(job.updated(encoding=Encoding.SPARSE)) == 0.0


# The step chunk by chunk, as a shard takes it in place.


class Whole:
    """A gradient held whole, handed out chunk by chunk (a merged gradient does so without holding it)."""

    def __init__(self, tensors: list[torch.Tensor], align: int = 1) -> None:
        self.tensors, self.align = tensors, align

    def alignment(self, index: int) -> int:
        return self.align

    def fill(self, index: int, start: int, out: torch.Tensor) -> None:
        out.copy_(self.tensors[index].reshape(-1)[start : start + out.numel()])


CHUNKED = {
    "sizes": st.lists(st.integers(0, 50), min_size=1, max_size=3),
    "chunk": st.integers(1, 20),
    "align": st.integers(1, 4),
    "share": st.floats(0.05, 1.0),
    "seed": st.integers(0, 2**16),
}
"""Tensors of any sizes, taken chunk by chunk on any alignment, and any share of a round."""


@settings(deadline=None)
@given(**CHUNKED, progress=st.floats(0.0, 0.95), nesterov=st.booleans())
def test_chunk_by_chunk_is_the_whole_step_bit_for_bit(sizes, chunk, align, share, progress, nesterov, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in sizes]
    momentum = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    whole_params, whole_momentum = [p.clone() for p in params], [m.clone() for m in momentum]
    want = outer_step(
        whole_params, whole_momentum, grads, **OUTER, nesterov=nesterov, share=share, round_progress=progress
    )
    step = outer_step_chunked(
        params,
        momentum,
        Whole(grads, align),
        **OUTER,
        nesterov=nesterov,
        share=share,
        round_progress=progress,
        chunk=chunk,
    )
    assert step.progress == want
    assert all(torch.equal(a, b) for a, b in zip(params, whole_params))
    assert all(torch.equal(a, b) for a, b in zip(momentum, whole_momentum))
    magnitude = max((float(p.abs().max()) for p in whole_params if p.numel()), default=0.0)
    assert step.value_magnitude == magnitude
    assert step.momentum_magnitude == max((float(m.abs().max()) for m in whole_momentum if m.numel()), default=0.0)


@settings(deadline=None)
@given(**CHUNKED)
def test_landing_chunk_by_chunk_is_landing_whole_bit_for_bit_and_within_its_bound(sizes, chunk, align, share, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    whole = [p.clone() for p in params]
    before = max((float(p.abs().max()) for p in params if p.numel()), default=0.0)
    bound = land_bound(before, max((float(g.abs().max()) for g in grads if g.numel()), default=0.0), share=share)
    land(whole, grads, share=share)
    magnitude = land_chunked(params, Whole(grads, align), share=share, chunk=chunk)
    assert all(torch.equal(a, b) for a, b in zip(params, whole))
    assert magnitude == max((float(p.abs().max()) for p in whole if p.numel()), default=0.0) <= bound


def test_a_step_that_overflows_reports_an_infinite_magnitude():
    params, momentum = [torch.full((4,), 3e38)], [torch.zeros(4)]
    step = outer_step_chunked(params, momentum, Whole([torch.full((4,), -3e38)]), **OUTER, chunk=2)
    assert math.isinf(step.value_magnitude) and step.momentum_magnitude == pytest.approx(3e38)


def test_values_that_are_not_contiguous_are_refused():
    params = [torch.zeros(4, 2).t()]
    with pytest.raises(ValueError, match="contiguous"):
        outer_step_chunked(params, [torch.zeros(2, 4)], Whole([torch.zeros(2, 4)]), **OUTER, chunk=2)


def test_hand_computed_step_bounds():
    # |buf| <= 2 + 1 = 3; |theta| <= 10 + 0.7 * (2 * 0.9 * 3 + 1) = 10 + 0.7 * 6.4 = 14.48, each with a
    # margin of 2^-20 for float32 rounding.
    values, momentum = step_bounds(10.0, 2.0, 1.0, **OUTER)
    assert momentum == pytest.approx(3.0, rel=1e-5) and momentum >= 3.0
    assert values == pytest.approx(14.48, rel=1e-5) and values >= 14.48


@settings(deadline=None)
@given(
    share=st.floats(0.05, 1.0),
    progress=st.floats(0.0, 0.95),
    nesterov=st.booleans(),
    mu=st.floats(0.0, 0.99),
    scale=st.sampled_from([1e-3, 1.0, 1e30]),
    seed=st.integers(0, 2**16),
)
def test_no_step_leaves_the_bounds(share, progress, nesterov, mu, scale, seed):
    """Whatever the share and the round it lands in, the values and momentum after a step lie within the
    bounds computed from their magnitudes before it and the gradient's."""
    gen = torch.Generator().manual_seed(seed)
    params, momentum, grad = (torch.randn(64, generator=gen) * scale for _ in range(3))
    bounds = [float(x.abs().max()) for x in (params, momentum, grad)]
    outer_step(
        [params], [momentum], [grad], lr=0.7, momentum_coef=mu, nesterov=nesterov, share=share, round_progress=progress
    )
    value_bound, momentum_bound = step_bounds(*bounds, lr=0.7, momentum_coef=mu, nesterov=nesterov)
    assert float(params.abs().max()) <= value_bound
    assert float(momentum.abs().max()) <= momentum_bound
