"""Whether a live child is still what the operator would apply: the rule every pass uses to decide what to
apply (and a rolling update to tell an applied template from a pending one)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from diloco.operator import naming as n


def applied_hash(obj: Mapping[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata", {}).get("annotations") or {}).get(n.ANNOTATION_HASH)


def _same_value(live: Any, want: Any) -> bool:
    if live == want:
        return True
    if isinstance(live, str) and isinstance(want, str):
        try:
            return parse_quantity(live) == parse_quantity(want)
        except (ValueError, ArithmeticError):
            return False
    return False


def contains(live: Any, want: Any) -> bool:
    """Whether the live object still holds every value the operator set: fields the API server or others
    added are ignored; a changed or removed one, or a quantity not equal in value, is drift."""
    if isinstance(want, Mapping):
        return isinstance(live, Mapping) and all(k in live and contains(live[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(live, list) and len(live) == len(want) and all(map(contains, live, want))
    return _same_value(live, want)


def in_sync(live: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """The live child is what this pass would apply: the same digest (so nothing was dropped from the
    rendering since it was applied) and no drift (so nobody changed what the operator set)."""
    return applied_hash(live) == applied_hash(desired) and contains(live, desired)
