"""Older hardware, emulated: how long a step sleeps after its compute so that an island runs `slowdown` times
slower than the fastest.

Sleeping (slowdown - 1) times the step's own compute time is right where islands do not share the machine. On
a few shared cores they do: a step's compute time then depends on how many islands compute beside it, and it
shrinks when the others wait at a barrier, so a synchronous run's slow island ran at 1.8x the others' pace, not
3x (docs/training-benchmarks.md, "Mixed hardware"). With a reference step time, the emulated device's, every
step instead lasts `slowdown` times that reference: the wall time no longer depends on the contention, as long
as the compute fits in it. A step whose compute does not fit keeps its own time and is an *overrun*: the
reference is then too short for the machine.
"""

from __future__ import annotations

import random


def pause_seconds(elapsed: float, slowdown: float, reference: float | None) -> float:
    """What a step that took `elapsed` seconds sleeps: to `slowdown` times `reference` with a reference step
    time, else (slowdown - 1) times its own."""
    if reference is None:
        return (slowdown - 1.0) * elapsed
    return max(0.0, slowdown * reference - elapsed)


def jitter_seconds(elapsed: float, jitter: float, reference: float | None, rng: random.Random) -> float:
    """A random extra pause for an island whose steps vary, as on a machine shared with other work: uniform
    between 0 and 2 x `jitter` times the step's time (the reference's, with one), so that the island is
    `jitter` slower on average and no two of its rounds take the same time."""
    if jitter < 0:
        raise ValueError(f"jitter must be non-negative, got {jitter}")
    return rng.uniform(0.0, 2.0 * jitter) * (elapsed if reference is None else reference)


def overran(elapsed: float, slowdown: float, reference: float | None) -> bool:
    """Whether a step's own time exceeded what the emulated device takes for it."""
    return reference is not None and elapsed > slowdown * reference
