"""The DiLoCo outer optimizer (SGD with Nesterov momentum) as a pure in-place step on plain tensors.

Syncer shards apply it per fragment, to tensors they hold without any nn.Module, optimizer object or autograd
state, and checkpoint the momentum buffers themselves; a function over explicit parameter and momentum lists
keeps that state visible. A full step matches torch.optim.SGD(momentum=mu, nesterov=..., dampening=0)
exactly: a zero-initialised buffer gives mu·0 + g = g on the first step, which is torch's buf = g.

A decoupled shard rarely takes a full step: it merges whichever islands have pushed, so one round of M islands
may arrive as M merges of one island each. Each merge is a *share* of a round, and momentum advances once per
round of shares, not once per merge (as Delayed Nesterov does in Async Local-SGD, Liu et al. 2024). One
Nesterov step, θ ← θ − lr·(g + μ·buf') with buf' = μ·buf + g, splits into a part linear in this round's
gradient (g) and the look-ahead along the new momentum (μ·buf'). Each merge adds its share s of the gradient,
lr·s·g to the step and s·g to the buffer (decayed by μ when the round opens); the look-ahead is taken when the
round completes, once the buffer holds all of it. However the round's deltas happen to be grouped in time, the
fragment and its momentum end the round exactly where one merge of all of them would have put them; and a
round that never completes (the end of a run, where islands push the steps since their last round) steps its
shares of the gradient and nothing of a look-ahead for rounds that will not come. Taking the momentum when a
round opened, as shards did before, moved the model a whole round's look-ahead past the islands on a share of
a round's progress: at the end of a run that overshoot was what the exported model kept. Scaling each merge's
step by its share instead (and decaying momentum by μ^share), as shards did earlier still, only matched a full
step once momentum had settled: stale one-island merges each carried momentum forward, and the global model
fell behind its islands. The islands' last pushes are not stepped at all but landed (`land`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from diloco.core.config import Encoding, TrainingConfig

ROUND_EPSILON = 1e-9
"""Shares of a round add up in floating point (three thirds are 0.999…): this close to 1, a round is complete."""


def outer_momentum(config: TrainingConfig) -> float:
    """The momentum coefficient a shard's outer step uses: the job's, but none for sparse outer gradients.

    With the sparse encoding each island keeps what it did not send in an error-feedback buffer and sends it
    later (`diloco.worker.error_feedback`): that decayed buffer already carries past rounds into each push, as
    momentum would. Momentum on the shard as well would apply every sent value again round after round while
    the island's buffer still holds the rest of it, and sparse, one-sided pushes make that overshoot worst;
    SparseLoCo likewise replaces outer momentum with error feedback.
    """
    return 0.0 if config.encoding is Encoding.SPARSE else config.outer.momentum


def round_momentum(momentum: float, freshness: float) -> float:
    """The momentum coefficient of a round: the job's, times the share of the last round whose deltas were
    fresh (computed against the version they were merged into).

    Asynchrony begets momentum (Mitliagkas et al., 2016): a delta computed against an older version carries
    the fragment's motion since then a second time, as momentum would. Islands out of phase, merged one at a
    time, push deltas up to a round stale, and Nesterov momentum of 0.9 on top of them overshoots. Scaling
    momentum by the last round's freshness keeps all of it for islands in phase, where it is worth most, and
    none for islands that never are (`bench/merge_rules.py`, docs/training-benchmarks.md)."""
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not 0 <= freshness <= 1:
        raise ValueError(f"freshness must be in [0, 1], got {freshness}")
    return momentum * freshness


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
    round_progress: float = 0.0,
) -> float:
    """Apply `share` of a round's outer step in place, `round_progress` of the round being already applied;
    returns the round's progress after it (0 once the round is complete).

    Opening a round (progress 0): buf ← μ·buf (heavy ball, which has no look-ahead: also θ ← θ − lr·buf).
    Then for the share s: buf ← buf + s·g, θ ← θ − lr·s·g. Completing a round (Nesterov): θ ← θ − lr·μ·buf. A
    share that runs past the end of the round completes it and opens the next with the rest. With share 1
    from progress 0 this is one full step of torch's SGD."""
    if not len(params) == len(momentum) == len(outer_grad):
        raise ValueError(
            f"got {len(params)} params, {len(momentum)} momentum buffers and {len(outer_grad)} outer gradients"
        )
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if not 0 <= momentum_coef < 1:
        raise ValueError(f"momentum_coef must be in [0, 1), got {momentum_coef}")
    _check_share(share)
    if not 0 <= round_progress < 1:
        raise ValueError(f"round_progress must be in [0, 1), got {round_progress}")
    for i, (param, buf, grad) in enumerate(zip(params, momentum, outer_grad)):
        if not param.shape == buf.shape == grad.shape:
            raise ValueError(
                f"tensor {i}: param {tuple(param.shape)}, momentum {tuple(buf.shape)} and outer gradient "
                f"{tuple(grad.shape)} differ in shape"
            )
    remaining, progress = share, round_progress
    with torch.no_grad():
        while remaining > ROUND_EPSILON:
            if progress == 0:
                for param, buf in zip(params, momentum):
                    buf.mul_(momentum_coef)
                    if not nesterov:
                        param.add_(buf, alpha=-lr)
            taken = min(remaining, 1 - progress)
            for param, buf, grad in zip(params, momentum, outer_grad):
                buf.add_(grad, alpha=taken)
                param.add_(grad, alpha=-lr * taken)
            remaining -= taken
            progress += taken
            if progress >= 1 - ROUND_EPSILON:
                progress = 0.0
                if nesterov:
                    for param, buf in zip(params, momentum):
                        param.add_(buf, alpha=-lr * momentum_coef)
    return progress


class ChunkedGradient(Protocol):
    """An outer gradient produced chunk by chunk (`diloco.core.merge.MergedGradient`)."""

    def alignment(self, index: int) -> int:
        """Chunks of tensor `index` start on multiples of this."""
        ...

    def fill(self, index: int, start: int, out: Tensor) -> None:
        """`out` = elements [start, start + len(out)) of tensor `index`, flattened."""
        ...


@dataclass(frozen=True)
class ChunkedStep:
    """What `outer_step_chunked` did: the round's progress after it, and the largest magnitude of the values and
    of the momentum it left (inf when any is not finite)."""

    progress: float
    value_magnitude: float
    momentum_magnitude: float


def largest_magnitude(tensors: Sequence[Tensor]) -> float:
    """max |x| over the tensors in one pass each (0 when empty; inf when any value is NaN or Inf)."""
    largest = 0.0
    for tensor in tensors:
        if tensor.numel():
            lo, hi = (float(x) for x in torch.aminmax(tensor.detach()))
            largest = max(largest, hi, -lo) if math.isfinite(hi) and math.isfinite(lo) else math.inf
    return largest


def outer_step_chunked(
    params: Sequence[Tensor],
    momentum: Sequence[Tensor],
    gradient: ChunkedGradient,
    *,
    lr: float,
    momentum_coef: float,
    nesterov: bool = True,
    share: float = 1.0,
    round_progress: float = 0.0,
    chunk: int,
) -> ChunkedStep:
    """`outer_step` with a gradient filled about `chunk` elements at a time: each chunk of the gradient is made
    and taken while it and the chunk of values and momentum it moves are in cache, in one pass over each. The
    step is elementwise, so the result is `outer_step`'s with the whole gradient, bit for bit. Measures the
    magnitudes it leaves on the way (the next merge's proof that its step stays finite)."""
    step = functools.partial(
        outer_step, lr=lr, momentum_coef=momentum_coef, nesterov=nesterov, share=share, round_progress=round_progress
    )
    progress = step([], [], [])  # the arguments checked, and the progress known, with no tensor at all
    if len(params) != len(momentum):
        raise ValueError(f"got {len(params)} params and {len(momentum)} momentum buffers")
    value_magnitude = momentum_magnitude = 0.0
    for values, (moment,), grad in _chunks(params, [momentum], gradient, chunk):
        step([values], [moment], [grad])
        value_magnitude = max(value_magnitude, largest_magnitude([values]))
        momentum_magnitude = max(momentum_magnitude, largest_magnitude([moment]))
    return ChunkedStep(progress, value_magnitude, momentum_magnitude)


def land(params: Sequence[Tensor], outer_grad: Sequence[Tensor], *, share: float = 1.0) -> None:
    """θ ← θ − share·g in place, momentum untouched: the merge of islands' last pushes, at the end of their run.

    An outer step moves the fragment past the mean of the islands' models (lr·(1+μ) of the gradient, and μ²
    of the momentum on top), a bet that the rounds after it pay for: islands train on from there and correct
    it. After an island's last push there is no such round, and the step past the mean is what the exported
    model keeps: at the end of a run it ended up to 0.3 worse in held-out loss than the islands that trained
    it. Landing takes the last pushes as they are: with every island's last push in one merge (share 1, fresh
    deltas) the fragment becomes the token-weighted mean of their models. Momentum is left as it was, for
    islands still training (a replaced island catching up), and so is the round in progress."""
    _check_share(share)
    if len(params) != len(outer_grad):
        raise ValueError(f"got {len(params)} params and {len(outer_grad)} outer gradients")
    with torch.no_grad():
        for i, (param, grad) in enumerate(zip(params, outer_grad)):
            if param.shape != grad.shape:
                raise ValueError(f"tensor {i}: param {tuple(param.shape)}, outer gradient {tuple(grad.shape)}")
            param.add_(grad, alpha=-share)


def land_chunked(params: Sequence[Tensor], gradient: ChunkedGradient, *, share: float, chunk: int) -> float:
    """`land` with a gradient filled about `chunk` elements at a time, as `outer_step_chunked` takes a step;
    returns the largest magnitude of the values it leaves (inf when any is not finite)."""
    _check_share(share)
    value_magnitude = 0.0
    for values, _, grad in _chunks(params, [], gradient, chunk):
        land([values], [grad], share=share)
        value_magnitude = max(value_magnitude, largest_magnitude([values]))
    return value_magnitude


def _check_share(share: float) -> None:
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")


def _chunks(
    params: Sequence[Tensor], alongside: Sequence[Sequence[Tensor]], gradient: ChunkedGradient, chunk: int
) -> Iterator[tuple[Tensor, list[Tensor], Tensor]]:
    """The values, the same elements of each tensor list `alongside` them (momentum) and the gradient filled for
    them, about `chunk` elements at a time, on the gradient's alignment: views, so that a step on them is one
    in place."""
    for index, param in enumerate(params):
        tensors = [param, *(others[index] for others in alongside)]
        if any(t.shape != param.shape or not t.is_contiguous() for t in tensors):
            raise ValueError(f"tensor {index}: param and momentum must be contiguous and alike in shape")
        flat = [t.view(-1) for t in tensors]
        align = gradient.alignment(index)
        size = max(1, chunk // align) * align
        scratch = torch.empty(min(size, param.numel()), dtype=param.dtype)
        for start in range(0, param.numel(), size):
            views = [f[start : start + size] for f in flat]
            grad = scratch[: views[0].numel()]
            gradient.fill(index, start, grad)
            yield views[0], views[1:], grad


def land_bound(value_bound: float, gradient_bound: float, *, share: float) -> float:
    """A bound on the magnitude of the values after `land`, given bounds before it and on the gradient (with
    `step_bounds`' margin for float32 rounding)."""
    return (value_bound + share * gradient_bound) * (1 + 2.0**-20)


def step_bounds(
    value_bound: float,
    momentum_bound: float,
    gradient_bound: float,
    *,
    lr: float,
    momentum_coef: float,
    nesterov: bool = True,
) -> tuple[float, float]:
    """Bounds on the magnitude of the values and momentum during and after any share of a step, given bounds
    before it and on the gradient: what lets a shard take a step in place, proven finite before it starts.

    A share opens or completes at most two rounds (it runs past the end of one into the next). The momentum
    never exceeds momentum_bound + gradient_bound (each opening scales it by μ < 1, and the shares add up to at
    most one gradient); each look-ahead (Nesterov's at a completion, heavy ball's at an opening) moves the
    values by lr · look-ahead · that at most and the shares by lr · gradient_bound. float32 rounding of the few
    operations on each element adds relative errors of a few 2^-24, covered by a margin of 2^-20."""
    look_ahead = momentum_coef if nesterov else 1.0
    margin = 1 + 2.0**-20
    momentum_after = (momentum_bound + gradient_bound) * margin
    value_after = (value_bound + lr * (2 * look_ahead * momentum_after + gradient_bound)) * margin
    return value_after, momentum_after
