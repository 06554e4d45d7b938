"""Compressed pull replies made once per fragment version and base, however many islands ask at once.

Islands that pull every version hold the same values, so they need the same reply: the difference from
those values to the newest, encoded (`diloco.core.compressed_pull.difference`). Made per island, that pass
over a large fragment repeats for every island, and all at once when they pull together after a merge. Here
the first pull of a (version, base) makes it while the others wait for it, and all of them send its bytes.
Only the newest version's replies are kept, at most `bases` of them per fragment (least recently used out).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedReplies(Generic[T]):
    """Values made once per (fragment, version, key): the first caller makes one, later and concurrent ones
    get it. A version newer than a fragment's entries drops them; a failure is raised to every waiting
    caller and kept by none."""

    def __init__(self, bases: int = 4) -> None:
        if bases < 1:
            raise ValueError(f"bases must be positive, got {bases}")
        self.bases = bases
        self._lock = threading.Lock()
        self._versions: dict[int, Hashable] = {}
        self._entries: dict[int, OrderedDict[Hashable, Future[T]]] = {}

    def get(self, fragment: int, version: Hashable, key: Hashable, make: Callable[[], T]) -> T:
        """The value for `key` at the fragment's `version`, made by `make` unless another caller made it or is
        making it."""
        with self._lock:
            if self._versions.get(fragment) != version:
                self._versions[fragment] = version
                self._entries[fragment] = OrderedDict()
            entries = self._entries[fragment]
            future = entries.get(key)
            mine = future is None
            if future is None:
                future = entries[key] = Future()
                while len(entries) > self.bases:
                    entries.popitem(last=False)
            else:
                entries.move_to_end(key)
        if mine:
            try:
                future.set_result(make())
            except BaseException as error:
                with self._lock:
                    held = self._entries.get(fragment)
                    if held is not None and held.get(key) is future:
                        del held[key]
                future.set_exception(error)
                raise
        return future.result()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(entries) for entries in self._entries.values())
