"""`diloco tokenize`: text shards become token files that the trainer reads as it would have read the text."""

from pathlib import Path

import numpy as np
import torch

from diloco.cli import main
from diloco.worker.data import load_tokens
from diloco.worker.tokenizer import load_tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_llama"


def test_token_files_hold_what_tokenising_the_text_on_the_fly_reads(tmp_path, capsys):
    tokenizer = EXAMPLE / "tokenizer.json"
    assert main(["tokenize", str(EXAMPLE / "data"), "--tokenizer", str(tokenizer), "--out", str(tmp_path)]) == 0
    written = sorted(tmp_path.glob("*.npy"))
    assert [p.stem for p in written] == [p.stem for p in sorted((EXAMPLE / "data").glob("*.jsonl"))]
    assert all(np.load(p).dtype == np.uint16 for p in written), "2048 tokens fit in 16 bits"
    on_the_fly = load_tokens(str(EXAMPLE / "data"), 1 << 30, load_tokenizer(tokenizer))
    assert torch.equal(load_tokens(str(tmp_path), 1 << 30), on_the_fly)
    assert f"{on_the_fly.numel()} tokens in 4 token files" in capsys.readouterr().out


def test_a_source_without_text_shards_is_refused(tmp_path, capsys):
    (tmp_path / "tokens.npy").write_bytes(b"")
    tokenizer = EXAMPLE / "tokenizer.json"
    assert main(["tokenize", str(tmp_path), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out")]) == 2
    assert "no shards" in capsys.readouterr().err
