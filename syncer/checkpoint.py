"""Atomic checkpoint files for a shard: a crash mid-write leaves the previous checkpoint intact."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def checkpoint_path(directory: Path, shard_index: int, num_shards: int) -> Path:
    return Path(directory) / f"shard-{shard_index}-of-{num_shards}.pt"


def save(path: Path, state: dict[str, Any]) -> int:
    """Writes to a temporary file beside `path`, fsyncs it, renames it over `path` and fsyncs the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return size


def load(path: Path) -> dict[str, Any] | None:
    """The saved state, or None when there is no checkpoint yet. Only tensors and plain data are loaded."""
    if not path.exists():
        return None
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state
