"""Merging a user's pod-template override into the template the operator generates.

RFC 7386 JSON merge patch (objects merge key by key, `null` deletes, anything else replaces), with the one
exception that makes it useful for pods: a list whose items are all objects with a `name` (containers, env,
volumes, volumeMounts, ports) merges item by item by name, as Kubernetes' strategic merge does, so an
override can change the trainer's image or add one env var without restating the container.
"""

from __future__ import annotations

import copy
from typing import Any


def _named_items(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) and "name" in item for item in value)


def _merge_named(base: list[dict[str, Any]], patch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged = [copy.deepcopy(item) for item in base]
    index = {item["name"]: i for i, item in enumerate(merged)}
    for item in patch:
        if item["name"] in index:
            merged[index[item["name"]]] = merge(merged[index[item["name"]]], item)
        else:
            index[item["name"]] = len(merged)
            merged.append(merge({}, item))
    return merged


def merge(base: Any, patch: Any) -> Any:
    """`base` with `patch` applied; neither argument is modified."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value)
            else:
                out[key] = merge({}, value) if isinstance(value, dict) else copy.deepcopy(value)
        return out
    if _named_items(base) and patch and _named_items(patch):
        return _merge_named(base, patch)
    if isinstance(patch, dict):
        return merge({}, patch)
    return copy.deepcopy(patch)
