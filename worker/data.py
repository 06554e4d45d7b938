"""Training data for the built-in trainer: where tokens come from, how each island reads its share of them in
order, and how every learner measures held-out loss on the same windows.

The default corpus is the Python standard library's own source: it exists on every machine that runs the
worker, needs no download, and is identical wherever the interpreter is, so a newcomer's first `diloco run`
trains on real text offline. The byte-level presets read it as bytes, the others through a BPE
(`diloco.worker.tokenizer`). A job's own data is a file or a folder of shards: token files (`.bin`, `.npy`,
as `diloco tokenize` writes them) or text (`.txt`, `.jsonl`, `.parquet`: `diloco.worker.documents`),
tokenised as it is read.

The training set behaves as a data set, not a bag: it is cut into windows of `context + 1` tokens, one
`context` apart; each epoch orders every window (a permutation drawn from the job's seed and the epoch, from
an offset drawn with it, so epochs differ); island i of n reads every n-th window of that order, from its
`DataPosition` on, so no window is read twice in an epoch, nor by two islands. The position is saved with
the island's checkpoint after every step (`save_position`) and taken up by a replacement, which neither
repeats nor skips what the killed one read. The held-out split is the stream's tail, the same for all.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from diloco.settings import DEFAULT_CORPUS_BYTES
from diloco.worker.documents import TEXT_FIELD, is_text, read_documents, shard_files
from diloco.worker.tokenizer import encode_documents

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


def _stdlib_files(max_bytes: int) -> list[bytes]:
    """The stdlib sources' bytes, file by file in sorted order, the last cut so they total `max_bytes`."""
    _check_cap(max_bytes)
    chunks: list[bytes] = []
    remaining = max_bytes
    for path in stdlib_sources():
        if remaining == 0:
            break
        chunk = path.read_bytes()[:remaining]
        chunks.append(chunk)
        remaining -= len(chunk)
    if not chunks:
        raise ValueError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}")
    return chunks


def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> torch.Tensor:
    """Byte-level tokens (uint8, vocab 256) of the stdlib sources concatenated in sorted order, cut at
    exactly `max_bytes` (or fewer if the stdlib is smaller)."""
    return _byte_tokens(b"".join(_stdlib_files(max_bytes)))


def stdlib_documents(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[str]:
    """The same bytes as `stdlib_corpus`, one document per file, as text for a tokenizer."""
    return [chunk.decode("utf-8", errors="replace") for chunk in _stdlib_files(max_bytes)]


def load_tokens(
    source: str | None,
    max_bytes: int = DEFAULT_CORPUS_BYTES,
    tokenizer: Tokenizer | None = None,
    *,
    text_field: str = TEXT_FIELD,
    quiet: bool = True,
) -> torch.Tensor:
    """A 1-D integer tensor of tokens, reading at most `max_bytes` bytes of the source (of text, or of token
    files), its shards in path order.

    - None or "stdlib": the embedded corpus, as bytes without a tokenizer, else one document per file.
    - a file or a folder of shards: `.bin` (raw little-endian uint16 tokens, the nanoGPT convention) and
      `.npy` (a 1-D integer array) are tokens already; `.jsonl` and `.parquet` hold documents in their
      `text_field`; any other file is text. Text is tokenised by `tokenizer` (each document followed by its
      end-of-text token), or without one read as bytes (vocab 256).
    Returned in the narrowest torch dtype that holds the ids.
    """
    _check_cap(max_bytes)
    if source is None or source == STDLIB_SOURCE:
        if tokenizer is None:
            return stdlib_corpus(max_bytes)
        return _as_tensor(encode_documents(tokenizer, stdlib_documents(max_bytes), quiet=quiet))
    parts: list[np.ndarray] = []
    remaining = max_bytes
    for path in shard_files(Path(source)):
        if remaining <= 0:
            break
        if not is_text(path):
            tokens = _read_bin(path, remaining) if path.suffix.lower() == ".bin" else _read_npy(path, remaining)
            remaining -= tokens.nbytes
        elif tokenizer is None and path.suffix.lower() not in (".jsonl", ".json", ".parquet"):
            with path.open("rb") as handle:
                tokens = np.frombuffer(handle.read(remaining), np.uint8)
            remaining -= tokens.nbytes
        else:
            documents = _Capped(read_documents(path, text_field), remaining)
            tokens = encode_documents(tokenizer, documents, desc=f"tokenising {path.name}", quiet=quiet)
            remaining -= documents.used
        parts.append(tokens)
    joined = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    if joined.size == 0:
        raise ValueError(f"data source {source!r} holds no tokens")
    return _as_tensor(joined)


class _Capped:
    """Documents until `budget` bytes of UTF-8 are used, the last one cut there; `used` counts them."""

    def __init__(self, documents: Iterator[str], budget: int) -> None:
        self.documents, self.budget, self.used = documents, budget, 0

    def __iter__(self) -> Iterator[str]:
        for document in self.documents:
            data = document.encode()[: self.budget - self.used]
            self.used += len(data)
            yield data.decode("utf-8", errors="ignore")
            if self.used >= self.budget:
                return


def _as_tensor(tokens: np.ndarray) -> torch.Tensor:
    """Ids in the narrowest torch dtype that holds them (torch has no uint16 arithmetic, nor uint32)."""
    if tokens.size and np.issubdtype(tokens.dtype, np.signedinteger) and tokens.min() < 0:
        raise ValueError(f"token ids must be non-negative, found {tokens.min()}")
    if tokens.dtype == np.uint16:
        tokens = tokens.astype(np.int32)
    elif tokens.dtype in (np.uint32, np.uint64):
        tokens = tokens.astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(tokens))


def _byte_tokens(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))


def _check_cap(max_bytes: int) -> None:
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")


def _read_bin(path: Path, max_bytes: int) -> np.ndarray:
    size = path.stat().st_size
    if size % 2:
        raise ValueError(f"{path}: a .bin token file holds uint16 tokens, but its size {size} is odd")
    return np.fromfile(path, dtype="<u2", count=min(size, max_bytes) // 2)


def _read_npy(path: Path, max_bytes: int) -> np.ndarray:
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D integer array, got shape {array.shape} dtype {array.dtype}")
    head = np.array(array[: max_bytes // array.dtype.itemsize])
    if head.size and head.min() < 0:
        raise ValueError(f"{path}: token ids must be non-negative, found {head.min()}")
    return head


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


@dataclass(frozen=True, order=True)
class DataPosition:
    """How far an island has read: `window` windows of its share of epoch `epoch`'s order."""

    epoch: int = 0
    window: int = 0


@dataclass(frozen=True)
class EpochOrder:
    """One epoch of the training set: window w starts at token `offset` + w * context; `order` is every
    window once, in the order the islands read them (island i of n takes order[i::n])."""

    offset: int
    order: np.ndarray


def epoch_order(tokens: int, context: int, seed: int, epoch: int) -> EpochOrder:
    """The windows of `epoch` and their order: a pure function of its arguments, so every island of a job
    (and a test) computes the same."""
    rng = np.random.default_rng([seed, epoch])
    offset = int(rng.integers(context))
    count = (tokens - 1 - offset) // context
    if count < 1:
        raise ValueError(f"{tokens} training tokens hold no window of context {context} + 1")
    return EpochOrder(offset, rng.permutation(count))


def island_windows(order: EpochOrder, shard: int, shards: int) -> np.ndarray:
    """The windows island `shard` of `shards` reads in an epoch, in order: disjoint from every other island's."""
    return order.order[shard::shards]


class IslandReader:
    """One rank's reader of its island's share of the training set, in order, from a position.

    Every step the island reads `batch_size` windows per rank from its position on (rank r the r-th
    `batch_size` of them) and its position moves past them all, into the next epoch when its share of this
    one runs out: the ranks of an island read disjoint windows and keep one position between them.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        context: int,
        *,
        shard: int,
        shards: int,
        rank: int,
        ranks: int,
        seed: int,
        position: DataPosition = DataPosition(),
    ) -> None:
        _check_length(tokens, context)
        if not 0 <= shard < shards or not 0 <= rank < ranks:
            raise ValueError(f"data shard {shard} of {shards}, rank {rank} of {ranks}: out of range")
        self.tokens, self.context = tokens, context
        self.shard, self.shards, self.rank, self.ranks, self.seed = shard, shards, rank, ranks, seed
        self.position = position
        self._epoch: tuple[int, int, np.ndarray] | None = None  # epoch, offset, this island's windows

    def _share(self, epoch: int) -> tuple[int, np.ndarray]:
        if self._epoch is None or self._epoch[0] != epoch:
            order = epoch_order(self.tokens.numel(), self.context, self.seed, epoch)
            windows = island_windows(order, self.shard, self.shards)
            if windows.size == 0:
                raise ValueError(f"{order.order.size} windows are too few to give {self.shards} islands one each")
            self._epoch = (epoch, order.offset, windows)
        return self._epoch[1], self._epoch[2]

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 of shape (batch_size, context); targets are inputs shifted by one."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        starts: list[int] = []
        epoch, window = self.position.epoch, self.position.window
        wanted = batch_size * self.ranks
        while len(starts) < wanted:
            offset, windows = self._share(epoch)
            if window >= windows.size:
                epoch, window = epoch + 1, 0
                continue
            taken = windows[window : window + wanted - len(starts)]
            starts.extend(int(offset + w * self.context) for w in taken)
            window += taken.size
        self.position = DataPosition(epoch, window)
        mine = torch.tensor(starts[self.rank * batch_size : (self.rank + 1) * batch_size])
        return _windows(self.tokens, mine, self.context)


def position_path(folder: Path, island: str, rank: int) -> Path:
    """Where `rank` of `island` keeps its data position, beside its optimizer checkpoint."""
    return folder / f"{island}-rank{rank}.data.json"


def save_position(path: Path, position: DataPosition, identity: dict[str, int]) -> None:
    """Writes the position atomically (a kill leaves the previous one whole); `identity` says what it is a
    position in (tokens, context, seed, shard, shards), so that a position in other data is not taken up."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({**asdict(position), "of": identity}))
    os.replace(tmp, path)


def load_position(path: Path, identity: dict[str, int]) -> DataPosition | None:
    """The position saved at `path` for the same data, else None (none saved, unreadable, or other data).
    Saved for the same data cut among another number of islands (islands added or removed), it is the start
    of the next epoch: the shares of this one changed hands, and only a new epoch reads none twice."""
    try:
        saved = json.loads(path.read_text())
        position = DataPosition(int(saved["epoch"]), int(saved["window"]))
        of = dict(saved["of"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if of == identity:
        return position
    recut = ("shard", "shards")
    same_data = {k: v for k, v in of.items() if k not in recut} == {k: v for k, v in identity.items() if k not in recut}
    return DataPosition(position.epoch + 1, 0) if same_data else None


EVAL_WINDOWS = 128
"""Held-out windows every evaluation averages over, whatever the batch size it runs in, so that runs with
different batch sizes (a data-parallel baseline at the islands' global batch, say) are measured alike."""

Forward = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]
"""A model's forward pass: (tokens, targets or None) -> (logits, mean next-token cross-entropy or None)."""


def evaluate(
    model: nn.Module,
    heldout: torch.Tensor,
    context: int,
    batch_size: int,
    windows: int = EVAL_WINDOWS,
    forward: Forward | None = None,
) -> float:
    """Mean cross-entropy of `model` over `windows` held-out windows spaced evenly across `heldout`, in
    batches of `batch_size`: the same windows for every caller. `forward` (tokens, targets) -> (logits, loss)
    runs the model (by default it is called so). The model runs in eval mode under `torch.no_grad()` on its
    own device, and its train/eval mode is restored afterwards."""
    _check_length(heldout, context)
    if batch_size < 1 or windows < 1:
        raise ValueError(f"batch_size and windows must be positive, got {batch_size} and {windows}")
    run = forward or model
    device = next(model.parameters()).device
    starts = torch.linspace(0, heldout.numel() - context - 1, windows).long()
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros((), dtype=torch.float64, device=device)
        with torch.no_grad():
            for chunk in starts.split(batch_size):
                inputs, targets = _windows(heldout, chunk, context)
                _, loss = run(inputs.to(device), targets.to(device))
                total += loss.double() * len(chunk)
    finally:
        model.train(was_training)
    return total.item() / windows
