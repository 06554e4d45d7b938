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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# A step of more than 2^32 tokens is beyond any batch trained; a push claiming more per inner step is false.
MAX_TOKENS_PER_INNER_STEP = 2**32
# Islands differing more than 16x in tokens per push are no longer weighted apart: the larger counts as 16x.
MAX_TOKEN_RATIO = 16

# Below this many float32 epsilons (relative to the direction weight) the mean direction is rounding noise.
_DIRECTION_EPS = 4 * torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class Contribution:
    """One island's outer gradient for a fragment: one tensor per fragment tensor, in fragment order."""

    island: str
    delta: Sequence[Tensor]
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


def _check_deltas(deltas: Sequence[Sequence[Tensor]], weights: Sequence[float]) -> None:
    if not deltas:
        raise ValueError("cannot merge an empty set of deltas")
    if len(weights) != len(deltas):
        raise ValueError(f"got {len(weights)} weights for {len(deltas)} deltas")
    first = deltas[0]
    for i, delta in enumerate(deltas):
        if len(delta) != len(first):
            raise ValueError(f"delta {i} has {len(delta)} tensors, delta 0 has {len(first)}")
        for j, (tensor, reference) in enumerate(zip(delta, first)):
            if tensor.shape != reference.shape:
                raise ValueError(
                    f"tensor {j} of delta {i} has shape {tuple(tensor.shape)}, delta 0 has {tuple(reference.shape)}"
                )
            if not tensor.is_floating_point():
                raise ValueError(f"tensor {j} of delta {i} has non-floating dtype {tensor.dtype}")


def weighted_mean(deltas: Sequence[Sequence[Tensor]], weights: Sequence[float]) -> list[Tensor]:
    """Per tensor position, Σ_i weights[i] · deltas[i][j] (weights are used as given)."""
    _check_deltas(deltas, weights)
    merged = []
    for j in range(len(deltas[0])):
        out = torch.mul(deltas[0][j], weights[0])
        for delta, weight in zip(deltas[1:], weights[1:]):
            out.add_(delta[j], alpha=weight)
        merged.append(out)
    return merged


def radial_directional_mean(deltas: Sequence[Sequence[Tensor]], weights: Sequence[float]) -> list[Tensor]:
    """Per tensor position, (Σ w_i ‖d_i‖) · unit(Σ w_i d_i / ‖d_i‖).

    A zero delta adds norm 0 and no direction. When the mean direction vanishes (opposite directions cancel,
    up to float32 rounding) the result is zero.
    """
    _check_deltas(deltas, weights)
    merged = []
    for j in range(len(deltas[0])):
        reference = deltas[0][j]
        direction = torch.zeros_like(reference)
        mean_norm = 0.0
        direction_weight = 0.0
        for delta, weight in zip(deltas, weights):
            norm = torch.linalg.vector_norm(delta[j]).item()
            if norm == 0.0:
                continue
            mean_norm += weight * norm
            direction_weight += abs(weight)
            direction.add_(delta[j], alpha=weight / norm)
        direction_norm = torch.linalg.vector_norm(direction).item()
        if direction_norm <= _DIRECTION_EPS * direction_weight:
            merged.append(direction.zero_())
        else:
            merged.append(direction.mul_(mean_norm / direction_norm))
    return merged


def merge_deltas(
    contributions: Sequence[Contribution],
    *,
    staleness_decay: float = 1.0,
    radial_directional: bool = False,
) -> list[Tensor]:
    """The merged outer gradient of a fragment: contribution weights, then the plain or radial-directional mean."""
    weights = contribution_weights(contributions, staleness_decay)
    deltas = [c.delta for c in contributions]
    if radial_directional:
        return radial_directional_mean(deltas, weights)
    return weighted_mean(deltas, weights)


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether no element is NaN or Inf: a merge whose result is not finite is refused, not applied."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def is_too_stale(staleness: int, max_staleness: int) -> bool:
    """Whether a contribution `staleness` merges behind the current version exceeds the bound and is refused."""
    if staleness < 0:
        raise ValueError(f"staleness must be non-negative, got {staleness}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be non-negative, got {max_staleness}")
    return staleness > max_staleness
