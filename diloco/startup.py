"""A process's start: its imports run with the cyclic garbage collector paused.

Importing torch creates about a million objects and frees almost none, yet every few hundred allocations set
off a collection that walks them again: about 7% of a worker's imports, which on a busy machine is part of
the time an island is down after a restart. (Freezing those objects afterwards, `gc.freeze`, would spare
later collections them too, but changes teardown at exit: local ranks of a two-rank island then sometimes
aborted there, "terminate called without an active exception".)
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    """Collects nothing inside; collects as before on the way out."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
