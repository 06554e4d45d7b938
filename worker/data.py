"""Training data for the built-in trainer: where tokens come from, how each rank samples them, and how
every learner measures held-out loss on the same windows.

The default corpus is the Python standard library's own source, read as bytes: it exists on every machine
that runs the worker, needs no download or tokenizer, and is identical wherever the interpreter is, so a
newcomer's first `diloco run` trains on real text offline. Nothing is cached on disk. Each rank of each
island draws its own reproducible stream of random windows, so islands see different data (the premise of
DiLoCo) and a restarted run sees the same data again; evaluation uses fixed, evenly spaced held-out
windows so the losses of islands and baselines are directly comparable.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import nn

from diloco.settings import DEFAULT_CORPUS_BYTES

STDLIB_SOURCE = "stdlib"

_SKIPPED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_sources() -> list[Path]:
    """The standard library's `*.py` files, sorted by path relative to the stdlib root (POSIX form),
    without installed packages or test suites."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in _SKIPPED_STDLIB_DIRS]
        for name in files:
            if name.endswith(".py"):
                path = Path(directory, name)
                found.append((path.relative_to(root).as_posix(), path))
    return [path for _, path in sorted(found)]


def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> torch.Tensor:
    """Byte-level tokens (uint8, vocab 256) of the stdlib sources concatenated in sorted order, cut at
    exactly `max_bytes` (or fewer if the stdlib is smaller)."""
    _check_cap(max_bytes)
    chunks: list[bytes] = []
    remaining = max_bytes
    for path in stdlib_sources():
        if remaining == 0:
            break
        chunk = path.read_bytes()[:remaining]
        chunks.append(chunk)
        remaining -= len(chunk)
    data = b"".join(chunks)
    if not data:
        raise ValueError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}")
    return _byte_tokens(data)


def load_tokens(source: str | None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> torch.Tensor:
    """A 1-D integer tensor of tokens, reading at most `max_bytes` bytes of the source.

    - None or "stdlib": the embedded default corpus (byte-level, vocab 256).
    - `*.bin`: raw little-endian uint16 tokens (the nanoGPT convention), returned as int32.
    - `*.npy`: a 1-D array of any integer dtype, returned in the narrowest torch dtype that holds it.
    - any other file: its bytes as byte-level tokens (uint8, vocab 256).
    """
    _check_cap(max_bytes)
    if source is None or source == STDLIB_SOURCE:
        return stdlib_corpus(max_bytes)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"data source {source!r} is not a file (expected {STDLIB_SOURCE!r}, a .bin/.npy token file or a text file)"
        )
    suffix = path.suffix.lower()
    if suffix == ".bin":
        tokens = _read_bin(path, max_bytes)
    elif suffix == ".npy":
        tokens = _read_npy(path, max_bytes)
    else:
        with path.open("rb") as handle:
            tokens = _byte_tokens(handle.read(max_bytes))
    if tokens.numel() == 0:
        raise ValueError(f"data source {source!r} holds no tokens")
    return tokens


def _byte_tokens(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))


def _check_cap(max_bytes: int) -> None:
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")


def _read_bin(path: Path, max_bytes: int) -> torch.Tensor:
    size = path.stat().st_size
    if size % 2:
        raise ValueError(f"{path}: a .bin token file holds uint16 tokens, but its size {size} is odd")
    tokens = np.fromfile(path, dtype="<u2", count=min(size, max_bytes) // 2)
    return torch.from_numpy(tokens.astype(np.int32))


def _read_npy(path: Path, max_bytes: int) -> torch.Tensor:
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D integer array, got shape {array.shape} dtype {array.dtype}")
    head = np.array(array[: max_bytes // array.dtype.itemsize])
    if head.size and head.min() < 0:
        raise ValueError(f"{path}: token ids must be non-negative, found {head.min()}")
    if head.dtype == np.uint16:
        head = head.astype(np.int32)
    elif head.dtype in (np.uint32, np.uint64):
        head = head.astype(np.int64)
    return torch.from_numpy(head)


def split_holdout(tokens: torch.Tensor, holdout_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, heldout): the last `holdout_fraction` of the tokens (at least one) are held out."""
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    total = tokens.numel()
    held = max(1, int(total * holdout_fraction))
    if held >= total:
        raise ValueError(f"{total} tokens are too few to hold out {holdout_fraction:.0%} and still train")
    return tokens[: total - held], tokens[total - held :]


def _check_length(tokens: torch.Tensor, context: int) -> None:
    if context < 1:
        raise ValueError(f"context must be positive, got {context}")
    if tokens.dim() != 1 or tokens.numel() < context + 1:
        raise ValueError(
            f"need a 1-D tensor of at least context + 1 = {context + 1} tokens, got shape {tuple(tokens.shape)}"
        )


def _windows(tokens: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    window = tokens[starts[:, None] + torch.arange(context + 1)].long()
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class BatchSampler:
    """Random windows of `context + 1` tokens for one rank of one island.

    The stream is a pure function of (seed, island, rank, num_ranks): every rank of every island draws a
    different sequence of windows, and the same arguments reproduce the same sequence.
    """

    def __init__(
        self, tokens: torch.Tensor, context: int, island: int | str, rank: int, num_ranks: int, seed: int
    ) -> None:
        _check_length(tokens, context)
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} is outside [0, {num_ranks})")
        self.tokens = tokens
        self.context = context
        key = f"{seed}\x00{island}\x00{rank}\x00{num_ranks}".encode()
        stream_seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)
        self._generator = torch.Generator(device="cpu").manual_seed(stream_seed)

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 of shape (batch_size, context); targets are inputs shifted by one."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        highest_start = self.tokens.numel() - self.context - 1
        starts = torch.randint(0, highest_start + 1, (batch_size,), generator=self._generator)
        return _windows(self.tokens, starts, self.context)


EVAL_WINDOWS = 128
"""Held-out windows every evaluation averages over, whatever the batch size it runs in, so that runs with
different batch sizes (a data-parallel baseline at the islands' global batch, say) are measured alike."""


def evaluate(
    model: nn.Module, heldout: torch.Tensor, context: int, batch_size: int, windows: int = EVAL_WINDOWS
) -> float:
    """Mean cross-entropy of `model` over `windows` held-out windows spaced evenly across `heldout`, in
    batches of `batch_size`: the same windows for every caller. The model runs in eval mode under
    `torch.no_grad()` on its own device, and its train/eval mode is restored afterwards."""
    _check_length(heldout, context)
    if batch_size < 1 or windows < 1:
        raise ValueError(f"batch_size and windows must be positive, got {batch_size} and {windows}")
    device = next(model.parameters()).device
    starts = torch.linspace(0, heldout.numel() - context - 1, windows).long()
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros((), dtype=torch.float64, device=device)
        with torch.no_grad():
            for chunk in starts.split(batch_size):
                inputs, targets = _windows(heldout, chunk, context)
                _, loss = model(inputs.to(device), targets.to(device))
                total += loss.double() * len(chunk)
    finally:
        model.train(was_training)
    return total.item() / windows
