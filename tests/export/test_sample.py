"""Text from an exported built-in model: bytes in, bytes out for the byte-level presets."""

import pytest
from test_model_files import tiny_global_model

from diloco.export.model_files import load, save
from diloco.export.sample import continue_text, generate
from diloco.worker.model import build_model


def test_greedy_generation_is_deterministic_and_as_long_as_asked():
    model = build_model("tiny", 0).eval()
    first = generate(model, list(b"def "), 12, temperature=0)
    assert len(first) == 12 and all(0 <= t < 256 for t in first)
    assert generate(model, list(b"def "), 12, temperature=0) == first


def test_a_sample_continues_the_prompt_as_text():
    model = build_model("tiny", 0).eval()
    text = continue_text(model, "import ", 30, seed=1)
    assert text.startswith("import ") and isinstance(text, str)
    assert continue_text(model, "import ", 30, seed=1) == text


def test_generation_refuses_nonsense_settings():
    with pytest.raises(ValueError, match="top-k"):
        generate(build_model("tiny", 0), [1], 3, top_k=0)


def test_diloco_sample_prints_text_from_an_export(tmp_path, capsys):
    from diloco.cli import main

    save(tmp_path, tiny_global_model())
    assert main(["sample", str(tmp_path), "--prompt", "def ", "--tokens", "40"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def ") and len(printed) > len("def ")
    assert load(tmp_path).config["preset"] == "tiny"


def test_diloco_export_from_checkpoint_files_needs_them(tmp_path, capsys):
    from diloco.cli import main

    assert main(["export", str(tmp_path / "out"), "--checkpoints", str(tmp_path)]) == 2
    assert "no shard checkpoint" in capsys.readouterr().err
