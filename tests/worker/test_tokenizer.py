"""What each model reads: bytes for the byte-level presets, the committed BPE for the others, or the job's own
tokenizer.json, refused when its ids do not fit the model."""

import json

import pytest

from diloco.worker.model import BPE_VOCAB, PRESETS
from diloco.worker.tokenizer import (
    STDLIB_BPE,
    byte_tokenizer,
    encode_documents,
    end_of_text,
    load_tokenizer,
    tokenizer_for,
)
from diloco.worker.train_tokenizer import train_bpe


def test_the_byte_tokenizer_is_bytes_both_ways():
    text = "déf f(x):\n\treturn x  # ✓\n"
    tokenizer = byte_tokenizer()
    assert tokenizer.encode(text).ids == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text
    assert tokenizer.get_vocab_size() == 256 and end_of_text(tokenizer) is None


def test_the_committed_bpe_is_the_larger_presets_vocabulary_with_end_of_text_first():
    tokenizer = load_tokenizer(STDLIB_BPE)
    assert tokenizer.get_vocab_size() == BPE_VOCAB
    assert {PRESETS[name].vocab_size for name in ("medium", "large", "xl")} == {BPE_VOCAB}
    assert end_of_text(tokenizer) == 0
    assert len(tokenizer.encode("    def __init__(self):").ids) <= 7 < len("    def __init__(self):") / 3, (
        "it knows Python"
    )
    assert STDLIB_BPE.stat().st_size < 600_000


def test_a_model_reads_its_presets_tokenisation_unless_it_names_one_that_fits(tmp_path):
    assert tokenizer_for(256, None) is None, "the byte-level presets read bytes directly"
    assert tokenizer_for(BPE_VOCAB, None).get_vocab_size() == BPE_VOCAB
    small = train_bpe(["a b c ab abc " * 20, "bc ca"], 300, quiet=True)
    small.save(str(tmp_path / "tokenizer.json"))
    assert tokenizer_for(300, tmp_path).get_vocab_size() == small.get_vocab_size(), "a folder holding one"
    with pytest.raises(ValueError, match="more than the model's vocabulary"):
        tokenizer_for(256, STDLIB_BPE)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing.json")


def test_training_a_bpe_gives_the_size_asked_with_end_of_text_and_repeats():
    documents = [f"def f{i}(x):\n    return x * {i}\n" for i in range(200)]
    first, again = train_bpe(documents, 320, quiet=True), train_bpe(documents, 320, quiet=True)
    assert first.get_vocab_size() == 320 and end_of_text(first) == 0
    assert json.loads(first.to_str()) == json.loads(again.to_str()), "the same text trains the same tokenizer"


def test_documents_are_encoded_each_followed_by_end_of_text():
    tokenizer = load_tokenizer(STDLIB_BPE)
    tokens = encode_documents(tokenizer, ["import os", "x = 1"], quiet=True)
    assert tokens.dtype.name == "uint16"
    assert tokens.tolist() == [*tokenizer.encode("import os").ids, 0, *tokenizer.encode("x = 1").ids, 0]
    assert encode_documents(None, ["ab", "c"], quiet=True).tolist() == list(b"abc")
