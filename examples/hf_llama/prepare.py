"""Makes this example's data and tokenizer from the project's own documentation (prose we may ship):

    python examples/hf_llama/prepare.py        # writes data/shard-*.jsonl and tokenizer.json (seconds)

The Markdown of the README and docs/, cut into one document per section, dealt round-robin into four JSON
Lines shards ({"text": ...} per line, as most pretraining sets on the Hugging Face Hub are kept), and a
byte-level BPE of 2048 tokens trained on them with `tokenizers` (`diloco.worker.train_tokenizer`, the same
recipe as the larger presets' BPE). Both are committed: run this again only to remake them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from diloco.worker.train_tokenizer import train_bpe

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SOURCES = ("README.md", "docs/*.md", "deploy/README.md", "charts/diloco/README.md", "examples/custom_loop/README.md")
SHARDS = 4
VOCAB = 2048


def documents() -> list[str]:
    """Every section of the sources, in path order."""
    found: list[str] = []
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            found += [s.strip() for s in re.split(r"\n(?=#{1,3} )", path.read_text()) if s.strip()]
    return found


def main() -> None:
    docs = documents()
    folder = HERE / "data"
    folder.mkdir(exist_ok=True)
    for shard in range(SHARDS):
        lines = [json.dumps({"text": text}) for text in docs[shard::SHARDS]]
        (folder / f"shard-{shard:04d}.jsonl").write_text("\n".join(lines) + "\n")
    tokenizer = train_bpe(docs, VOCAB, quiet=True)
    tokenizer.save(str(HERE / "tokenizer.json"), pretty=False)
    print(f"{len(docs)} documents in {SHARDS} shards, a tokenizer of {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
