"""`diloco tokenize`: text shards into token files, once, so islands read tokens instead of tokenising at
every start.

    diloco tokenize data/ --tokenizer tokenizer.json --out tokens/

Each text shard (`.txt`, `.jsonl`, `.parquet`: `diloco.worker.documents`) becomes a `.npy` of the same
relative path under `--out`: its documents' tokens, each followed by the tokenizer's end-of-text token, in the
narrowest unsigned type that holds the vocabulary (uint16 up to 65,536 tokens). The trainer reads the
folder of them in path order, as it would have read the text (`trainer.data`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from diloco.worker.documents import TEXT_FIELD, TEXT_SUFFIXES, read_documents, shard_files
from diloco.worker.tokenizer import STDLIB_BPE, encode_documents, load_tokenizer


def tokenize(sources: list[Path], tokenizer_file: Path, out: Path, text_field: str = TEXT_FIELD) -> list[Path]:
    """Writes one token file per text shard of `sources` under `out`; returns them in reading order."""
    tokenizer = load_tokenizer(tokenizer_file)
    written = []
    for source in sources:
        root = source if source.is_dir() else source.parent
        for shard in shard_files(source, TEXT_SUFFIXES):
            target = (out / shard.relative_to(root)).with_suffix(".npy")
            target.parent.mkdir(parents=True, exist_ok=True)
            tokens = encode_documents(tokenizer, read_documents(shard, text_field), desc=shard.name)
            np.save(target, tokens)
            written.append(target)
    return written


def command(args: argparse.Namespace) -> int:
    try:
        written = tokenize(args.sources, args.tokenizer, args.out, args.text_field)
    except (OSError, ValueError) as error:
        print(f"diloco tokenize: {error}", file=sys.stderr)
        return 2
    total = sum(np.load(path, mmap_mode="r").size for path in written)
    print(f"{total} tokens in {len(written)} token files under {args.out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tokenize", help="turn text shards (txt, jsonl, parquet) into token files", description=__doc__
    )
    p.add_argument("sources", type=Path, nargs="+", help="text shards, or folders holding them")
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=STDLIB_BPE,
        help="a tokenizer.json (or the folder holding one); default: the BPE of the medium and larger presets",
    )
    p.add_argument("--out", type=Path, required=True, help="the folder to write .npy token files into")
    p.add_argument("--text-field", default=TEXT_FIELD, help="the text of .jsonl and .parquet rows")
    p.set_defaults(func=command)
