"""Cutting a model into fragments and scheduling their syncs (Streaming DiLoCo).

A fragment is a set of whole tensors synced as one unit. Fragments are balanced by size so the staggered
syncs spread bandwidth evenly, and strided across depth so every fragment holds layers from the whole
network (syncing a contiguous block of layers at once hurts quality more than syncing a strided slice).
Fragments are owned by syncer shards round-robin. Everything here is a pure function of its arguments, so
workers and syncer shards that call it independently agree on the plan.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

_NUMERIC_COMPONENT = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Fragment:
    """Fragment `index`: the names of its tensors in model order and their total element count."""

    index: int
    names: tuple[str, ...]
    numel: int


def _layer_index(name: str) -> int | None:
    for component in name.split("."):
        if _NUMERIC_COMPONENT.fullmatch(component):
            return int(component)
    return None


def plan_fragments(named_shapes: Sequence[tuple[str, Sequence[int]]], num_fragments: int) -> list[Fragment]:
    """Split tensors, given in model (depth) order, into `num_fragments` fragments of whole tensors.

    Rule:
    1. A tensor's layer is the first dot-separated component of its name that is a number
       (`blocks.7.attn.weight` is in layer 7). The distinct layer numbers are ranked in ascending order and
       layer of rank r goes, with all its tensors, to fragment r mod P: depth is strided across fragments.
    2. Tensors without a layer number (embeddings, final norm, head) are then placed largest first (ties: model
       order), each on the currently lightest fragment (ties: lowest index). A model without any layer numbers
       is fragmented by this rule alone.
    3. While a fragment is empty (fewer layers than fragments), the smallest tensor (ties: model order) of the
       heaviest fragment holding more than one tensor (ties: lowest index) moves to it.
    Tensors keep model order within a fragment. The result depends only on the input.
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be at least 1, got {num_fragments}")
    if num_fragments > len(named_shapes):
        raise ValueError(
            f"num_fragments ({num_fragments}) exceeds the number of tensors ({len(named_shapes)}): "
            "every fragment needs at least one whole tensor"
        )
    sizes: list[int] = []
    seen: set[str] = set()
    for name, shape in named_shapes:
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears more than once")
        seen.add(name)
        if any(dim < 0 for dim in shape):
            raise ValueError(f"tensor {name!r} has a negative dimension in shape {tuple(shape)}")
        sizes.append(math.prod(shape))

    layers = [_layer_index(name) for name, _ in named_shapes]
    rank = {layer: r for r, layer in enumerate(sorted({layer for layer in layers if layer is not None}))}
    members: list[list[int]] = [[] for _ in range(num_fragments)]
    loads = [0] * num_fragments
    unlayered: list[int] = []
    for position, layer in enumerate(layers):
        if layer is None:
            unlayered.append(position)
        else:
            fragment = rank[layer] % num_fragments
            members[fragment].append(position)
            loads[fragment] += sizes[position]

    for position in sorted(unlayered, key=lambda p: (-sizes[p], p)):
        lightest = min(range(num_fragments), key=lambda f: (loads[f], f))
        members[lightest].append(position)
        loads[lightest] += sizes[position]

    for empty in range(num_fragments):
        if members[empty]:
            continue
        donor = max(
            (f for f in range(num_fragments) if len(members[f]) > 1),
            key=lambda f: (loads[f], -f),
        )
        moved = min(members[donor], key=lambda p: (sizes[p], p))
        members[donor].remove(moved)
        loads[donor] -= sizes[moved]
        members[empty].append(moved)
        loads[empty] += sizes[moved]

    return [
        Fragment(index=f, names=tuple(named_shapes[p][0] for p in sorted(positions)), numel=loads[f])
        for f, positions in enumerate(members)
    ]


def _check_schedule(inner_steps: int, num_fragments: int) -> None:
    if inner_steps < 1:
        raise ValueError(f"inner_steps must be at least 1, got {inner_steps}")
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be at least 1, got {num_fragments}")


def fragment_offset(fragment: int, inner_steps: int, num_fragments: int) -> int:
    """Stagger of `fragment` in inner steps: fragment * H // P."""
    _check_schedule(inner_steps, num_fragments)
    if not 0 <= fragment < num_fragments:
        raise ValueError(f"fragment must be in [0, {num_fragments}), got {fragment}")
    return fragment * inner_steps // num_fragments


def fragments_due(step: int, inner_steps: int, num_fragments: int) -> list[int]:
    """Fragments whose sync is due right after inner step `step` (steps count from 1), ascending.

    Fragment p is due when (step + offset_p) % H == 0 with offset_p = p * H // P: fragment 0 at H, 2H, ...,
    fragment p first at H - offset_p and every H steps after. Within any H consecutive steps each fragment is
    due exactly once, and consecutive due steps are H/P apart when P divides H.
    """
    _check_schedule(inner_steps, num_fragments)
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    return [
        p for p in range(num_fragments) if (step + fragment_offset(p, inner_steps, num_fragments)) % inner_steps == 0
    ]


def resume_step(versions: Sequence[int], inner_steps: int, num_fragments: int) -> int:
    """The inner step an island joining a synchronous (K = M) job resumes at: the last due step of any
    fragment whose merge is already done, so that its next due fragment is the one the other islands are
    waiting on at the barrier (and never one they have not reached yet, which would deadlock it).

    `versions[p]` counts fragment p's merges; fragment p's k-th due step is k·H − offset_p (k ≥ 1).
    """
    if len(versions) != num_fragments:
        raise ValueError(f"expected {num_fragments} fragment versions, got {len(versions)}")
    return max(
        0,
        *(version * inner_steps - fragment_offset(p, inner_steps, num_fragments) for p, version in enumerate(versions)),
    )


def shard_of(fragment: int, num_shards: int) -> int:
    """Index of the syncer shard that owns `fragment` (round-robin)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if fragment < 0:
        raise ValueError(f"fragment must be non-negative, got {fragment}")
    return fragment % num_shards


def owned_fragments(shard_index: int, num_shards: int, num_fragments: int) -> list[int]:
    """Fragments owned by shard `shard_index` of `num_shards`, ascending."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
    if num_fragments < 0:
        raise ValueError(f"num_fragments must be non-negative, got {num_fragments}")
    return list(range(shard_index, num_fragments, num_shards))
