"""What one contribution can do to a merge: a delta whose norm lies far beyond a robust reference is left out
of it, so a finite but huge delta (|x| near the float32 limit, from a diverged or hostile island) does not move
the fragment at all, whatever tokens it claims and however often it pushes.

Leaving out, not clipping. A delta clipped to the bound still moved the fragment by that much, in a direction
nobody trained, with the weight its tokens claimed; one pushed every round and merged alone did so every round,
and that was enough to wreck the model (README, hardening). An honest island loses little when its delta is
left out: its local model keeps what it trained, and its next delta, against the newer base, carries that
progress again. Honest deltas lie well inside the bound: they differ by the inner steps and the rounds they
stand for, a few times at most, not by OUTLIER_FACTOR.

The reference is the lower median of the norms of this merge's contributions and of the last `PER_ISLAND`
merged contributions of each of the last `HISTORY` other islands the fragment merged: an island has at most
that many votes, however often it pushes. One outlier can never be the median while honest islands are most
of the islands the fragment has recently merged, and a merge of one is measured against its peers' last
deltas: an island that merges alone again and again (one pushing far more often than a round) cannot fill the
history with its own norms and raise the bound each time. Until there are three norms to take the median of,
the fragment's own norm (`FRAGMENT_RATIO`) votes in their place, which bounds the first merges before any
history exists: a lone huge delta is measured against the fragment it would move. A vote, not a cap: a fragment
that starts at zero is small after its first merges, and a cap at its norm would leave out every honest delta
from then on. Norms are taken in float64, so a float32 delta near its limit has a finite norm.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

OUTLIER_FACTOR = 8.0
"""A delta may be this many times the reference norm, and a larger one is left out: honest islands of one job
differ by less (an island paced to fewer inner steps, a stale one)."""
HISTORY = 8
"""Islands whose last merged norms a fragment remembers: twice a job of four islands."""
PER_ISLAND = 2
"""Merged norms remembered per island: its last two rounds, as the history held before it was per island."""
FRAGMENT_RATIO = 1.0
"""The fragment's vote, times its norm: an honest round moves a fragment by a small fraction of it."""
MIN_MEDIAN = 3
"""Norms a median needs to outvote one outlier: the fragment's own norm votes in the place of those missing."""


def norm(tensors: Iterable[Tensor]) -> float:
    """The L2 norm of a delta (all its tensors), in float64: finite for any finite float32 values."""
    squares = sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors)
    return math.sqrt(squares)


def remember(history: dict[str, list[float]], merged: Iterable[tuple[str, float]]) -> None:
    """Records each island's merged norm among its last `PER_ISLAND` in `history`, keeping the
    `HISTORY` islands merged most recently (a dict keeps its order of insertion)."""
    for island, value in merged:
        history[island] = [*history.pop(island, []), value][-PER_ISLAND:]
    while len(history) > HISTORY:
        del history[next(iter(history))]


def peers(history: dict[str, list[float]], merging: Iterable[str]) -> list[float]:
    """The remembered norms of the islands not in this merge: those in it vote with the norms they push."""
    skip = set(merging)
    return [n for island, norms in history.items() if island not in skip for n in norms]


def outlier_bound(norms: Sequence[float], history: Sequence[float], fragment_norm: Callable[[], float]) -> float:
    """The largest norm a delta of this merge may have to be merged: OUTLIER_FACTOR x the lower median of `norms` and
    `history`, where, with fewer than MIN_MEDIAN of them, FRAGMENT_RATIO x `fragment_norm()` votes in the place
    of each one missing (when the fragment is not all zeros). The fragment's norm is a pass over it, taken only
    then: a shard merges under its lock, and every pass there holds up the pushes and pulls waiting for it."""
    if not norms:
        raise ValueError("a merge needs at least one contribution")
    reference = [*norms, *history]
    if len(reference) < MIN_MEDIAN and (fragment := fragment_norm()) > 0:
        reference += [FRAGMENT_RATIO * fragment] * (MIN_MEDIAN - len(reference))
    return OUTLIER_FACTOR * statistics.median_low(reference)
