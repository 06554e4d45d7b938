"""What an island may call itself: the one rule for island ids, which the shards check before anything else
and the worker before it calls them.

An id is a key of the shard's live set, its pending contributions and its checkpoints, and a label in logs
and metrics, so it is short and plain: the form of a Kubernetes label value (letters, digits, and '-', '_'
or '.' between them), which every island name a DiLoCoJob admits (a DNS-1035 label) already has.
"""

import re

ISLAND_ID_MAX_CHARS = 63
"""As a Kubernetes label value: ids fit where labels go, and a shard's Status lists them all."""

MAX_KNOWN_ISLANDS = 4096
"""Island ids a shard keeps at once, joined or lately gone: 8 times the most a DiLoCoJob admits, so a Status
reply that lists them all stays small."""

FORGET_AFTER_TIMEOUTS = 4
"""An island unheard of for this many island timeouts, left or gone silent, is forgotten: it no longer counts
against MAX_KNOWN_ISLANDS, in memory or in checkpoints, and must join again to count as live."""


def forget_before(now: float, island_timeout_seconds: float) -> float:
    """The time before which an island last heard of is forgotten."""
    return now - FORGET_AFTER_TIMEOUTS * island_timeout_seconds


_ISLAND_ID = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def check_island_id(island: str) -> None:
    """Raises ValueError, naming the rule, when `island` is not an island id."""
    if len(island) > ISLAND_ID_MAX_CHARS or not _ISLAND_ID.fullmatch(island):
        shown = island if len(island) <= ISLAND_ID_MAX_CHARS else f"{island[:ISLAND_ID_MAX_CHARS]}..."
        raise ValueError(
            f"{shown!r} is not an island id: at most {ISLAND_ID_MAX_CHARS} characters, ASCII letters and digits "
            "with '-', '_' or '.' only between them"
        )
