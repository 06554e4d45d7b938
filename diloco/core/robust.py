"""What one contribution can do to a merge: each delta's norm is clipped against a robust reference, so a
finite but huge delta (|x| near the float32 limit, from a diverged or hostile island) moves a fragment no
further than an honest one would.

Clipping, not refusal: an island whose delta is merely larger than its peers' (more inner steps, a round
stale) keeps its direction and a bounded weight, and the push it was answered "taken" for is still merged.
The reference is the lower median of the norms of this merge's contributions and of the last `PER_ISLAND`
contributions (as clipped) of each of the last `HISTORY` other islands the fragment merged: an island has at
most that many votes, however often it pushes. One outlier can never be the median while honest islands are
most of the islands the fragment has recently merged, and a merge of one island is measured against its
peers' last deltas: an island that merges alone again and again (one pushing far more often than a round)
cannot fill the history with its own clipped norms and raise the bound each time. Until there are three
norms to take the median of, a delta is also never larger than the fragment itself (`FRAGMENT_RATIO`), which
bounds the first merges before any history exists. Norms are
taken in float64, so a float32 delta near its limit has a finite norm.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

CLIP_FACTOR = 8.0
"""A delta may be this many times the reference norm: honest islands of one job differ by less (an island
paced to fewer inner steps, a stale one), and a hostile one moves a fragment at most this much further."""
HISTORY = 8
"""Islands whose last merged norms a fragment remembers: twice a job of four islands."""
PER_ISLAND = 2
"""Merged norms remembered per island: its last two rounds, as the history held before it was per island."""
FRAGMENT_RATIO = 1.0
"""No outer gradient larger than the fragment it moves: an honest round moves it by a small fraction."""
MIN_MEDIAN = 3
"""Norms a median needs to outvote one outlier: with fewer, the fragment's own norm bounds every delta too."""


def norm(tensors: Iterable[Tensor]) -> float:
    """The L2 norm of a delta (all its tensors), in float64: finite for any finite float32 values."""
    squares = sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors)
    return math.sqrt(squares)


def remember(history: dict[str, list[float]], merged: Iterable[tuple[str, float]]) -> None:
    """Records each island's merged norm (as clipped) among its last `PER_ISLAND` in `history`, keeping the
    `HISTORY` islands merged most recently (a dict keeps its order of insertion)."""
    for island, value in merged:
        history[island] = [*history.pop(island, []), value][-PER_ISLAND:]
    while len(history) > HISTORY:
        del history[next(iter(history))]


def peers(history: dict[str, list[float]], merging: Iterable[str]) -> list[float]:
    """The remembered norms of the islands not in this merge: those in it vote with the norms they push."""
    skip = set(merging)
    return [n for island, norms in history.items() if island not in skip for n in norms]


def clip_bound(norms: Sequence[float], history: Sequence[float], fragment_norm: Callable[[], float]) -> float:
    """The largest norm any of this merge's deltas may keep: CLIP_FACTOR x the lower median of `norms` and
    `history`; with fewer than MIN_MEDIAN of them, at most FRAGMENT_RATIO x `fragment_norm()` as well (when the
    fragment is not all zeros). The fragment's norm is a pass over it, taken only then: a shard merges under
    its lock, and every pass there holds up the pushes and pulls waiting for it."""
    if not norms:
        raise ValueError("a merge needs at least one contribution")
    reference = [*norms, *history]
    bound = CLIP_FACTOR * statistics.median_low(reference)
    if len(reference) < MIN_MEDIAN and (fragment := fragment_norm()) > 0:
        bound = min(bound, FRAGMENT_RATIO * fragment)
    return bound


def clip_scale(delta_norm: float, bound: float) -> float:
    """What a delta of norm `delta_norm` is scaled by to be no longer than `bound`: 1 when it is not longer, so
    honest deltas merge as they are. A merge applies it to the delta's weight as it decodes, keeping no copy."""
    if delta_norm <= bound:
        return 1.0
    return bound / delta_norm
