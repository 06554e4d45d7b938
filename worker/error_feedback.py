"""Error feedback for the sparse encoding: what a push leaves out is carried into the fragment's next push.

The sparse encoding sends each block's top-k values at 2 bits, a few percent of an outer gradient. What it
leaves out is not thrown away: the island keeps it in one buffer per fragment and adds it, decayed by
`DECAY`, into the next delta before that is encoded (SparseLoCo: e ← β·e + Δ; send C(e); e ← e − C(e)), so
every coordinate is sent once it has gathered enough weight. The decayed buffer acts as the outer momentum
the shard then leaves out (`diloco.core.outer_optimizer.outer_momentum`).

A buffer changes only once the shard accepted a push: a refused or failed push leaves it as it was, since
the island trains on from the same base and its next delta contains the lost one again.

The buffers survive a restart of the worker: the island checkpoint saves them beside the inner optimizer's
state, at its cadence (`diloco.worker.island_checkpoint`), and a replacement restores them before it starts
(`Learner.restore_error_feedback`). Those are the buffers as of the checkpoint's step, as the optimizer
state is: a replacement re-trains the steps after its last merged push anyway. A fragment the job has merged
into whose buffer cannot be restored (a cold start, a missing or mismatched checkpoint) is declared lost: the
learner logs it and counts its values in `LearnerStats.feedback_lost_values`
(`diloco_worker_error_feedback_lost_values_total`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

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

    def named(self) -> dict[str, torch.Tensor]:
        """Every buffer's tensors, named `<fragment>.<position>`: what an island checkpoint saves. The live
        tensors, not copies: an accepted push replaces a fragment's buffer and never writes into one."""
        with self._lock:
            return {f"{p}.{i}": t for p, buffer in self._buffers.items() for i, t in enumerate(buffer)}

    def restore(self, saved: Mapping[str, torch.Tensor], shapes: Mapping[int, Sequence[torch.Size]]) -> list[int]:
        """Takes from `saved` (named as `named` names them) the buffer of every fragment in `shapes` whose
        tensors are all there, exactly, in its parameters' shapes; returns those fragments in order. Any other
        fragment (nothing saved, a partial buffer, another model's) keeps no buffer."""
        restored = {}
        for fragment, expected in shapes.items():
            mine = {name: t for name, t in saved.items() if name.partition(".")[0] == str(fragment)}
            names = [f"{fragment}.{i}" for i in range(len(expected))]
            if mine.keys() == set(names) and all(mine[n].shape == shape for n, shape in zip(names, expected)):
                restored[fragment] = [mine[n].to(torch.float32) for n in names]
        with self._lock:
            self._buffers.update(restored)
        return sorted(restored)
