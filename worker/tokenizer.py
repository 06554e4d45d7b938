"""Tokenisers of the built-in trainer, all `tokenizers` objects so that an export carries the one it trained
with as a `tokenizer.json` any Hugging Face loader reads.

- The byte-level presets (`tiny`, `small`) read bytes: `byte_tokenizer` maps byte b to id b exactly, so the
  trainer keeps reading bytes directly (no tokenizer in the loop) and the export still has a tokenizer.
- The BPE presets (`medium` and up) read `stdlib-bpe.json`, a byte-level BPE of `diloco.worker.model.BPE_VOCAB` tokens
  trained on the embedded corpus by `python -m diloco.worker.train_tokenizer` (committed beside this file:
  nothing can be downloaded where the trainer runs).
- A job may name its own `tokenizer.json` (trainer.tokenizer), for a transformers model or a preset.

Documents are separated by the tokenizer's end-of-text token when it has one (`END_OF_TEXT_TOKENS`), as
GPT-2 and Llama pretraining data are.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm

STDLIB_BPE = Path(__file__).with_name("stdlib-bpe.json")
END_OF_TEXT_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
"""Names under which a tokenizer.json holds its end-of-text token, the first found wins (GPT-2's, Llama 2's,
Llama 3's, Gemma's)."""

BYTE_VOCAB = 256
ENCODE_BATCH = 256


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes onto printable characters, which byte-level BPE works on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(BYTE_VOCAB):
        if b not in printable:
            printable.append(b)
            chars.append(BYTE_VOCAB + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_tokenizer() -> Tokenizer:
    """The byte-level presets' tokenisation as a tokenizer: byte b is token b, UTF-8 in and out."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@cache
def _read(path: str) -> Tokenizer:
    return Tokenizer.from_file(path)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A `tokenizer.json` (or the folder holding one), read once per process."""
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer file at {path} (expected a tokenizer.json, or a folder holding one)")
    return _read(str(file.resolve()))


def tokenizer_for(vocab_size: int, path: str | Path | None) -> Tokenizer | None:
    """What a model of `vocab_size` reads: the named tokenizer, else bytes (None) for a byte-level model, else
    the committed BPE; refused when the tokenizer's ids do not fit the model's embedding."""
    if path is not None:
        tokenizer = load_tokenizer(path)
    elif vocab_size == BYTE_VOCAB:
        return None
    else:
        tokenizer = load_tokenizer(STDLIB_BPE)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.get_vocab_size()} tokens, more than the model's vocabulary "
            f"({vocab_size}): name a tokenizer (trainer.tokenizer) that fits the model"
        )
    return tokenizer


def end_of_text(tokenizer: Tokenizer) -> int | None:
    """The id of the tokenizer's end-of-text token, if it has one of `END_OF_TEXT_TOKENS`."""
    for name in END_OF_TEXT_TOKENS:
        if (token := tokenizer.token_to_id(name)) is not None:
            return token
    return None


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type holding every id: token files stay half the size for vocabularies to 64k."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def encode_documents(
    tokenizer: Tokenizer | None, documents: Iterable[str], *, desc: str = "tokenising", quiet: bool = False
) -> np.ndarray:
    """The documents' tokens, each followed by the end-of-text token when the tokenizer has one; without a
    tokenizer, their UTF-8 bytes back to back (the byte-level presets' stream). Shows a progress bar."""
    if tokenizer is None:
        return np.frombuffer(b"".join(d.encode() for d in tqdm(documents, desc, disable=quiet)), np.uint8).copy()
    dtype = token_dtype(tokenizer.get_vocab_size())
    eos = end_of_text(tokenizer)
    chunks: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        for encoding in tokenizer.encode_batch_fast(batch, add_special_tokens=False):
            ids = encoding.ids if eos is None else [*encoding.ids, eos]
            chunks.append(np.asarray(ids, dtype=dtype))
        batch.clear()

    with tqdm(desc=desc, unit="doc", disable=quiet, mininterval=1.0) as bar:
        for document in documents:
            batch.append(document)
            if len(batch) == ENCODE_BATCH:
                flush()
                bar.update(ENCODE_BATCH)
        bar.update(len(batch))
        flush()
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype)
