"""The DiLoCo outer optimizer (SGD with Nesterov momentum) as a pure in-place step on plain tensors.

Syncer shards apply it per fragment, to tensors they hold without any nn.Module, optimizer object or autograd
state, and checkpoint the momentum buffers themselves; a function over explicit parameter and momentum lists
keeps that state visible. It matches torch.optim.SGD(momentum=mu, nesterov=..., dampening=0) exactly: a
zero-initialised buffer gives mu·0 + g = g on the first step, which is torch's buf = g.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from diloco.core.config import Encoding, TrainingConfig


def outer_momentum(config: TrainingConfig) -> float:
    """The momentum coefficient a shard's outer step uses: the job's, but none for sparse outer gradients.

    With the sparse encoding each island keeps what it did not send in an error-feedback buffer and sends it
    later (`diloco.worker.error_feedback`): that decayed buffer already carries past rounds into each push, as
    momentum would. Momentum on the shard as well would apply every sent value again round after round while
    the island's buffer still holds the rest of it, and sparse, one-sided pushes make that overshoot worst;
    SparseLoCo likewise replaces outer momentum with error feedback.
    """
    return 0.0 if config.encoding is Encoding.SPARSE else config.outer.momentum


def init_momentum(params: Sequence[Tensor]) -> list[Tensor]:
    """Zero momentum buffers shaped, typed and placed like `params`."""
    return [torch.zeros_like(p) for p in params]


def outer_step(
    params: Sequence[Tensor],
    momentum: Sequence[Tensor],
    outer_grad: Sequence[Tensor],
    *,
    lr: float,
    momentum_coef: float,
    nesterov: bool = True,
    share: float = 1.0,
) -> None:
    """Apply one outer step in place: buf ← μ·buf + g; θ ← θ − lr·(g + μ·buf if nesterov else buf).

    `share` in (0, 1] is the part of a full round (every live island's delta) this step stands for. A
    partial step is the full one spread out in time: g is scaled by it, so is momentum's push, and momentum
    decays by μ**share, so that M steps of share 1/M act like one full step: buf ← μ^s·buf + s·g;
    θ ← θ − lr·(s·g + s·μ·buf). Without that, islands merged one at a time (K = 1, out of phase) take M
    full-momentum outer steps per round with delayed deltas, and the global model diverges."""
    if not len(params) == len(momentum) == len(outer_grad):
        raise ValueError(
            f"got {len(params)} params, {len(momentum)} momentum buffers and {len(outer_grad)} outer gradients"
        )
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if not 0 <= momentum_coef < 1:
        raise ValueError(f"momentum_coef must be in [0, 1), got {momentum_coef}")
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    for i, (param, buf, grad) in enumerate(zip(params, momentum, outer_grad)):
        if not param.shape == buf.shape == grad.shape:
            raise ValueError(
                f"tensor {i}: param {tuple(param.shape)}, momentum {tuple(buf.shape)} and outer gradient "
                f"{tuple(grad.shape)} differ in shape"
            )
    with torch.no_grad():
        for param, buf, grad in zip(params, momentum, outer_grad):
            scaled = grad if share == 1 else grad * share
            buf.mul_(momentum_coef**share).add_(scaled)
            if nesterov:
                step = torch.add(scaled, buf, alpha=momentum_coef * share)
            else:
                step = buf if share == 1 else buf * share
            param.add_(step, alpha=-lr)
