"""The job's global model as its syncer shards hold it: every fragment's float32 values, by tensor name.

Two sources give the same tensors: the live shards, over the same Status and Pull calls the islands use,
and the checkpoint files the shards write (`shard-<i>-of-<n>.pt` on each shard's volume), which outlive
them. Either way every shard of the job must be there, and every fragment seeded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.syncer import checkpoint
from diloco.transport.client import SyncerClient
from diloco.transport.tls import Security

CHECKPOINT_GLOB = "shard-*-of-*.pt"


@dataclass(frozen=True)
class FragmentRecord:
    """Where a fragment's values came from and how far it had trained."""

    index: int
    shard: int
    outer_steps: int
    tokens: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class GlobalModel:
    """Every tensor of the model by name (float32, CPU), and its fragments in index order."""

    tensors: dict[str, torch.Tensor]
    fragments: tuple[FragmentRecord, ...]

    @property
    def outer_steps(self) -> int:
        """Outer steps every fragment has reached: the job's progress as the operator reports it."""
        return min(f.outer_steps for f in self.fragments)

    @property
    def tokens(self) -> int:
        """Tokens every fragment's merges account for."""
        return min(f.tokens for f in self.fragments)


def _assembled(fragments: Iterable[tuple[FragmentRecord, list[tuple[str, torch.Tensor]]]]) -> GlobalModel:
    """The fragments joined into one model, refusing gaps and tensors held twice."""
    records: list[FragmentRecord] = []
    tensors: dict[str, torch.Tensor] = {}
    for record, named in sorted(fragments, key=lambda item: item[0].index):
        for name, value in named:
            if name in tensors:
                raise ValueError(f"tensor {name} is held by two fragments: the sources are not one job")
            tensors[name] = value.detach().to("cpu", torch.float32)
        records.append(record)
    indices = [r.index for r in records]
    if not records or indices != list(range(len(records))):
        raise ValueError(f"the fragments found are {indices}: every shard of the job is needed")
    return GlobalModel(tensors, tuple(records))


def _check_shards(found: Sequence[tuple[int, int]], where: str) -> None:
    """Each (shard index, shards) pair must name shard i of the same n, for i = 0..n-1, once."""
    counts = {n for _, n in found}
    if len(counts) != 1 or sorted(i for i, _ in found) != list(range(counts.pop())):
        raise ValueError(f"{where}: found shards {sorted(found)} (index, of); every shard of one job is needed")


def from_shards(targets: Sequence[str], token: str, *, security: Security, timeout: float = 60.0) -> GlobalModel:
    """The model the live shards hold now; `targets[i]` is shard i's address, reached as `security` says.
    A fragment merged while it is being read is taken as it was when pulled."""
    found: list[tuple[FragmentRecord, list[tuple[str, torch.Tensor]]]] = []
    shards: list[tuple[int, int]] = []
    for target in targets:
        with SyncerClient(target, token, security=security, timeout=timeout, retry_for=timeout) as client:
            status = client.status()
            shards.append((status.shard_index, status.num_shards))
            for fragment in status.fragments:
                if not fragment.seeded:
                    raise ValueError(f"fragment {fragment.fragment_id} on {target} is not seeded: nothing trained")
                pulled = client.pull(fragment.fragment_id)
                if pulled is None:
                    raise RuntimeError(f"fragment {fragment.fragment_id} on {target}: a full pull came back empty")
                version, named = pulled
                record = FragmentRecord(
                    fragment.fragment_id,
                    status.shard_index,
                    version.version,
                    fragment.tokens_merged,
                    tuple(name for name, _ in named),
                )
                found.append((record, named))
    _check_shards(shards, "the shards given")
    return _assembled(found)


def checkpoint_files(paths: Iterable[Path]) -> list[Path]:
    """The shard checkpoints among `paths`: files as given, folders searched for `shard-<i>-of-<n>.pt`."""
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(path.glob(CHECKPOINT_GLOB)) if path.is_dir() else [path])
    if not files:
        raise ValueError(f"no shard checkpoint ({CHECKPOINT_GLOB}) in {', '.join(map(str, paths))}")
    return files


def from_checkpoints(paths: Iterable[Path]) -> GlobalModel:
    """The model as the shards' last checkpoints hold it (files, or folders holding them)."""
    found: list[tuple[FragmentRecord, list[tuple[str, torch.Tensor]]]] = []
    shards: list[tuple[int, int]] = []
    for path in checkpoint_files(paths):
        state = checkpoint.load(path)
        if state is None:
            raise ValueError(f"{path} does not exist")
        shards.append((state["shard_index"], state["num_shards"]))
        for index, saved in state["fragments"].items():
            names = [name for name, _, _ in saved["specs"]]
            if not names:
                raise ValueError(f"fragment {index} in {path} is not seeded: nothing trained")
            record = FragmentRecord(index, state["shard_index"], saved["version"], saved["tokens_merged"], tuple(names))
            found.append((record, list(zip(names, saved["values"]))))
    _check_shards(shards, "the checkpoints given")
    return _assembled(found)
