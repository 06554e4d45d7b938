"""A process's start: its imports run with the cyclic garbage collector paused, and what they made is then
kept out of the collector's sight.

Importing torch creates about a million objects and frees almost none. Collecting as they are made walks
them again every few hundred allocations; pausing the collector alone only defers that walk to the first
collections after the imports (0.2 CPU-seconds each, twice in a worker's start). Freezing them (`gc.freeze`)
spares every later collection the walk: together 0.3 of a worker start's 1.9 CPU-seconds, which on a
machine shared with training islands is part of the time an island is down after a restart.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    """Collects nothing inside; on the way out, freezes what is there and collects as before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
