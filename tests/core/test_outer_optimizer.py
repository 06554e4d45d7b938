import pytest
import torch

from diloco.core.config import Encoding, TrainingConfig
from diloco.core.outer_optimizer import init_momentum, outer_momentum, outer_step


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
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b.detach())
        for buf, p in zip(momentum, theirs):
            assert torch.equal(buf, sgd.state[p]["momentum_buffer"])


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


def test_hand_computed_partial_step():
    # share 0.5: buf <- 0.9**0.5 * 0 + 0.5 * 0.2 = 0.1; step = 0.1 + 0.5 * 0.9 * 0.1 = 0.145; theta = 1 - 0.7 * 0.145
    params, momentum = [torch.tensor([1.0], dtype=torch.float64)], [torch.zeros(1, dtype=torch.float64)]
    outer_step(params, momentum, [torch.tensor([0.2], dtype=torch.float64)], lr=0.7, momentum_coef=0.9, share=0.5)
    assert momentum[0].item() == pytest.approx(0.1, abs=1e-12)
    assert params[0].item() == pytest.approx(1.0 - 0.7 * 0.145, abs=1e-12)


@pytest.mark.parametrize("islands", [2, 4, 8])
def test_partial_steps_of_a_round_move_as_far_as_one_full_step(islands):
    """M merges of one island each (share 1/M) against one merge of all M, under the same steady outer
    gradient: once momentum has settled, a round moves the parameters equally far either way."""
    full, partial = [torch.zeros(1, dtype=torch.float64)], [torch.zeros(1, dtype=torch.float64)]
    full_buf, partial_buf = init_momentum(full), init_momentum(partial)
    grad = [torch.ones(1, dtype=torch.float64)]
    for _ in range(200):
        outer_step(full, full_buf, grad, lr=0.7, momentum_coef=0.9)
        for _ in range(islands):
            outer_step(partial, partial_buf, grad, lr=0.7, momentum_coef=0.9, share=1 / islands)
    before = (full[0].item(), partial[0].item())
    outer_step(full, full_buf, grad, lr=0.7, momentum_coef=0.9)
    for _ in range(islands):
        outer_step(partial, partial_buf, grad, lr=0.7, momentum_coef=0.9, share=1 / islands)
    full_round, partial_round = full[0].item() - before[0], partial[0].item() - before[1]
    assert partial_round == pytest.approx(full_round, rel=0.05)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_share_outside_0_1_is_refused(share):
    with pytest.raises(ValueError, match="share"):
        outer_step([torch.zeros(1)], [torch.zeros(1)], [torch.ones(1)], lr=0.7, momentum_coef=0.9, share=share)


def test_the_shard_leaves_momentum_to_the_islands_error_feedback_when_deltas_are_sparse():
    job = TrainingConfig()
    assert outer_momentum(job) == job.outer.momentum == 0.9
    assert outer_momentum(job.updated(encoding=Encoding.SPARSE)) == 0.0
