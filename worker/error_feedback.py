"""Error feedback for the sparse encoding: what a push leaves out is carried into the fragment's next push.

The sparse encoding sends each block's top-k values at 2 bits, a few percent of an outer gradient. What it
leaves out is not thrown away: the island keeps it in one buffer per fragment and adds it, decayed by
`DECAY`, into the next delta before that is encoded (SparseLoCo: e ← β·e + Δ; send C(e); e ← e − C(e)), so
every coordinate is sent once it has gathered enough weight. The decayed buffer acts as the outer momentum
the shard then leaves out (`diloco.core.outer_optimizer.outer_momentum`).

A buffer changes only once the shard accepted a push: a refused or failed push leaves it as it was, since
the island trains on from the same base and its next delta contains the lost one again.

Islands keep no state across a restart (a restarted island pulls the global values and starts again from
them, losing its unsent local progress too), so the buffers are declared lost then: the learner logs it
and counts the fragments in `LearnerStats.feedback_lost` (`diloco_worker_error_feedback_lost_total`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

DECAY = 0.95
"""β: the share of the buffer carried into the next round; SparseLoCo's value. Below 1 so that a coordinate
the island's later deltas keep contradicting fades instead of staying in the buffer for ever."""


class ErrorFeedback:
    """One island's per-fragment buffers of what the sparse encoding has not sent yet.

    Each fragment has at most one round in flight, so its buffer is touched by one thread at a time; the
    lock guards only the table itself.
    """

    def __init__(self, decay: float = DECAY) -> None:
        if not 0 <= decay <= 1:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        self.decay = decay
        self._buffers: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def compensated(self, fragment: int, delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What to encode this round: delta + decay · buffer (a new list; `delta` is left as it is)."""
        with self._lock:
            buffer = self._buffers.get(fragment)
        if buffer is None:
            return [d.clone() for d in delta]
        if [b.shape for b in buffer] != [d.shape for d in delta]:
            raise ValueError(f"fragment {fragment}: a delta shaped unlike its error-feedback buffer")
        return [torch.add(d, b, alpha=self.decay) for d, b in zip(delta, buffer)]

    def accepted(self, fragment: int, compensated: Sequence[torch.Tensor], sent: Sequence[torch.Tensor]) -> None:
        """The shard took the push: the buffer becomes what was meant to be sent less what the bytes carried."""
        residual = [torch.sub(c, s) for c, s in zip(compensated, sent)]
        with self._lock:
            self._buffers[fragment] = residual

    def held_back(self, fragment: int) -> list[torch.Tensor] | None:
        """The fragment's buffer (None before its first accepted push), for tests and inspection."""
        with self._lock:
            return self._buffers.get(fragment)
