"""How a syncer shard merges the outer gradients that islands sent for one fragment.

Islands push at their own pace, so contributions differ in how many tokens they stand for and in how
many merges behind the current fragment version they were computed (staleness). The merged outer gradient
is a weighted mean with weights proportional to tokens, optionally decayed with staleness, either plain or
radial-directional (mean norm along the mean direction, so islands that disagree in direction do not
shrink the step the way plain averaging does). Pure functions: inputs are never modified.

Tokens are the island's own claim, so what one claim can weigh is bounded twice. A claim no inner steps
could have produced is impossible and refused (`tokens_are_possible`). Within a merge, a contribution counts
at most `MAX_TOKEN_RATIO` times the tokens of the lightest one that claims any: islands up to that far apart
in throughput are weighted exactly by their tokens, and no claim moves a merge of n contributions further
than a share of R / (R + n - 1) (R = MAX_TOKEN_RATIO), between equal averaging (R = 1) and plain token
weighting (R unbounded).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diloco.core.encoding import Encoded, accumulate, alignment
from diloco.core.outer_optimizer import largest_magnitude

# A step of more than 2^32 tokens is beyond any batch trained; a push claiming more per inner step is false.
MAX_TOKENS_PER_INNER_STEP = 2**32
# Islands differing more than 16x in tokens per push are no longer weighted apart: the larger counts as 16x.
MAX_TOKEN_RATIO = 16

# Below this many float32 epsilons (relative to the direction weight) the mean direction is rounding noise.
_DIRECTION_EPS = 4 * torch.finfo(torch.float32).eps


Delta = Tensor | Encoded
"""One tensor of an island's outer gradient: float values, or the bytes as they came over the wire, checked but
not decoded (`diloco.core.encoding.Encoded`), which the merge decodes chunk by chunk."""

CHUNK = 1 << 18
"""Elements per tensor a merge works on at a time, by default: a chunk's accumulator and the values and momentum
it updates stay in a core's cache between the steps of the pass."""


@dataclass(frozen=True)
class Contribution:
    """One island's outer gradient for a fragment: one tensor per fragment tensor, in fragment order."""

    island: str
    delta: Sequence[Delta]
    tokens: int
    staleness: int


def tokens_are_possible(tokens: int, inner_steps: int) -> bool:
    """Whether `inner_steps` inner steps could have trained on `tokens` tokens (none without a step)."""
    return 0 <= tokens <= inner_steps * MAX_TOKENS_PER_INNER_STEP


def contribution_weights(contributions: Sequence[Contribution], staleness_decay: float) -> list[float]:
    """Merge weights ∝ min(tokens, MAX_TOKEN_RATIO × the fewest non-zero tokens) × staleness_decay**staleness,
    summing to 1 (equal when every raw weight is 0)."""
    if not contributions:
        raise ValueError("cannot weight an empty set of contributions")
    if not 0 < staleness_decay <= 1:
        raise ValueError(f"staleness_decay must be in (0, 1], got {staleness_decay}")
    for c in contributions:
        if c.tokens < 0:
            raise ValueError(f"contribution from island {c.island!r} has negative tokens ({c.tokens})")
        if c.staleness < 0:
            raise ValueError(f"contribution from island {c.island!r} has negative staleness ({c.staleness})")
    ceiling = MAX_TOKEN_RATIO * min((c.tokens for c in contributions if c.tokens > 0), default=0)
    raw = [min(c.tokens, ceiling) * staleness_decay**c.staleness for c in contributions]
    total = sum(raw)
    if total == 0:
        return [1.0 / len(contributions)] * len(contributions)
    return [w / total for w in raw]


def _shape(delta: Delta) -> tuple[int, ...]:
    return delta.shape if isinstance(delta, Encoded) else tuple(delta.shape)


def _check_deltas(deltas: Sequence[Sequence[Delta]], weights: Sequence[float]) -> None:
    if not deltas:
        raise ValueError("cannot merge an empty set of deltas")
    if len(weights) != len(deltas):
        raise ValueError(f"got {len(weights)} weights for {len(deltas)} deltas")
    first = deltas[0]
    for i, delta in enumerate(deltas):
        if len(delta) != len(first):
            raise ValueError(f"delta {i} has {len(delta)} tensors, delta 0 has {len(first)}")
        for j, (tensor, reference) in enumerate(zip(delta, first)):
            if _shape(tensor) != _shape(reference):
                raise ValueError(f"tensor {j} of delta {i} has shape {_shape(tensor)}, delta 0 has {_shape(reference)}")
            if isinstance(tensor, Tensor) and not tensor.is_floating_point():
                raise ValueError(f"tensor {j} of delta {i} has non-floating dtype {tensor.dtype}")


def _magnitude(delta: Delta) -> float:
    """A bound on |x| over the delta's values: inf when a float tensor holds NaN or Inf."""
    return delta.magnitude if isinstance(delta, Encoded) else largest_magnitude([delta])


def _add_weighted(out: Tensor, delta: Delta, start: int, weight: float, first: bool) -> None:
    """`out` = (`first`) or += weight × elements [start, start + len(out)) of the delta, flattened."""
    if isinstance(delta, Encoded):
        accumulate(out, delta, start, weight, first)
        return
    values = delta.detach().reshape(-1)[start : start + out.numel()]
    if first:
        torch.mul(values, weight, out=out)
    else:
        out.add_(values, alpha=weight)


def _steps(numel: int, chunk: int, align: int) -> range:
    """Where the chunks of a tensor of `numel` elements start: about `chunk` elements each, on multiples of
    `align`."""
    return range(0, numel, max(1, chunk // align) * align)


def _norm(delta: Delta, chunk: int) -> float:
    """The delta's L2 norm, decoded a chunk at a time, summed in float64."""
    if isinstance(delta, Tensor):
        return float(torch.linalg.vector_norm(delta.detach(), dtype=torch.float64))
    steps = _steps(delta.numel, chunk, alignment(delta.encoding, delta.block_size))
    scratch = torch.empty(min(steps.step, delta.numel))
    squares = 0.0
    for start in steps:
        part = scratch[: min(steps.step, delta.numel - start)]
        accumulate(part, delta, start, first=True)
        squares += float(torch.linalg.vector_norm(part, dtype=torch.float64)) ** 2
    return math.sqrt(squares)


def delta_norm(delta: Sequence[Delta], chunk: int = CHUNK) -> float:
    """The L2 norm of a whole delta (all its tensors), in float64, decoding encoded tensors a chunk at a time:
    what a merge measures outliers by (`diloco.core.robust`), without a float32 copy of the delta."""
    return math.sqrt(sum(_norm(t, chunk) ** 2 for t in delta))


class MergedGradient:
    """The merged outer gradient of a fragment, never held whole: `fill` writes a chunk of one of its tensors,
    decoding each island's delta for just that chunk, so that the outer step takes it while it is in cache and
    a merge needs no float32 copy of any delta (`diloco.core.outer_optimizer.outer_step_chunked`).

    Plain: Σ_i weights[i] · deltas[i][j] (weights as given). Radial-directional: (Σ w_i ‖d_i‖) · unit(Σ w_i d_i
    / ‖d_i‖) per tensor position j, where a zero delta adds norm 0 and no direction and a mean direction that
    vanishes (opposite directions cancel, up to float32 rounding) gives zero; its direction needs every delta
    before any chunk is known, so it is accumulated whole, one tensor at a time (4 bytes per element of the
    largest tensor). `bound` bounds every element's magnitude, float32 rounding included, so a shard can prove
    that an outer step stays finite before taking it in place."""

    def __init__(
        self,
        deltas: Sequence[Sequence[Delta]],
        weights: Sequence[float],
        *,
        radial: bool = False,
        chunk: int = CHUNK,
    ) -> None:
        _check_deltas(deltas, weights)
        if chunk < 1:
            raise ValueError(f"chunk must be positive, got {chunk}")
        self.deltas = [list(d) for d in deltas]
        self.weights = list(weights)
        self.radial = radial
        self.chunk = chunk
        self.shapes = [_shape(t) for t in deltas[0]]
        tensors = range(len(self.shapes))
        if radial:  # every element lies within its tensor's mean norm
            self._norms = [[_norm(d[j], chunk) for j in tensors] for d in self.deltas]
            sizes = [[n[j] for n in self._norms] for j in tensors]
        else:
            sizes = [[_magnitude(d[j]) for d in self.deltas] for j in tensors]
        rounding = 1 + (len(deltas) + 4) * 2.0**-23
        self.bound = max((sum(abs(w) * m for w, m in zip(self.weights, s)) for s in sizes), default=0.0) * rounding
        self._direction: tuple[int, Tensor, float] | None = None

    def alignment(self, index: int) -> int:
        """Chunks of tensor `index` start on multiples of this: whole blocks of every delta's encoding."""
        step = 1
        for delta in self.deltas:
            tensor = delta[index]
            if isinstance(tensor, Encoded):
                step = math.lcm(step, alignment(tensor.encoding, tensor.block_size))
        return step

    def numel(self, index: int) -> int:
        return math.prod(self.shapes[index])

    def fill(self, index: int, start: int, out: Tensor) -> None:
        """`out` (flat) = elements [start, start + len(out)) of tensor `index` of the merged gradient; `start` a
        multiple of `alignment(index)`."""
        if not self.radial:
            for i, (delta, weight) in enumerate(zip(self.deltas, self.weights)):
                _add_weighted(out, delta[index], start, weight, i == 0)
            return
        _, direction, scale = self._radial_direction(index)
        torch.mul(direction[start : start + out.numel()], scale, out=out)

    def _radial_direction(self, index: int) -> tuple[int, Tensor, float]:
        """Tensor `index`'s mean direction, whole, and the factor that gives it the mean norm (0: vanished)."""
        if self._direction is not None and self._direction[0] == index:
            return self._direction
        self._direction = None  # the previous tensor's direction is freed before this one's is made
        kept = [(d[index], w, n[index]) for d, w, n in zip(self.deltas, self.weights, self._norms) if n[index] != 0.0]
        direction = torch.zeros(self.numel(index))
        steps = _steps(direction.numel(), self.chunk, self.alignment(index))
        for start in steps:  # chunk after chunk, each delta onto it while it is in cache
            part = direction[start : start + steps.step]
            for delta, weight, norm in kept:
                _add_weighted(part, delta, start, weight / norm, False)
        mean_norm = sum(weight * norm for _, weight, norm in kept)
        direction_weight = sum(abs(weight) for _, weight, _ in kept)
        direction_norm = float(torch.linalg.vector_norm(direction, dtype=torch.float64))
        vanished = direction_norm <= _DIRECTION_EPS * direction_weight
        self._direction = (index, direction, 0.0 if vanished else mean_norm / direction_norm)
        return self._direction


def merge_deltas(
    contributions: Sequence[Contribution],
    *,
    staleness_decay: float = 1.0,
    radial_directional: bool = False,
    chunk: int = CHUNK,
) -> MergedGradient:
    """The merged outer gradient of a fragment: contribution weights, then the plain or radial-directional mean of
    the deltas."""
    weights = contribution_weights(contributions, staleness_decay)
    return MergedGradient([c.delta for c in contributions], weights, radial=radial_directional, chunk=chunk)


def is_too_stale(staleness: int, max_staleness: int) -> bool:
    """Whether a contribution `staleness` merges behind the current version exceeds the bound and is refused."""
    if staleness < 0:
        raise ValueError(f"staleness must be non-negative, got {staleness}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be non-negative, got {max_staleness}")
    return staleness > max_staleness
