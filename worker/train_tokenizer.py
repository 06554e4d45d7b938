"""Trains the BPE the larger presets read and writes it beside the worker (`stdlib-bpe.json`), offline:

    python -m diloco.worker.train_tokenizer            # about a minute on one core

A byte-level BPE (GPT-2's scheme: any text encodes, nothing is unknown) of `BPE_VOCAB` tokens, trained with
`tokenizers` on the embedded corpus (the standard library's sources, one document per file, as the trainer
reads them), with `<|endoftext|>` as token 0, the documents' separator. The file is committed: nothing can be
downloaded where the trainer runs, and every island must read the same ids. The corpus is the interpreter's
own, so another Python version trains a slightly different file: keep the committed one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from diloco.worker.data import stdlib_documents
from diloco.worker.model import BPE_VOCAB
from diloco.worker.tokenizer import END_OF_TEXT_TOKENS, STDLIB_BPE


def train_bpe(documents: Iterable[str], vocab_size: int, *, quiet: bool = False) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens (fewer if the text has fewer pairs), end-of-text first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT_TOKENS[0]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=not quiet,
    )
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco.worker.train_tokenizer", description=__doc__)
    parser.add_argument("--out", type=Path, default=STDLIB_BPE)
    parser.add_argument("--vocab-size", type=int, default=BPE_VOCAB)
    args = parser.parse_args(argv)
    tokenizer = train_bpe(stdlib_documents(), args.vocab_size)
    tokenizer.save(str(args.out), pretty=False)
    print(f"{tokenizer.get_vocab_size()} tokens -> {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
