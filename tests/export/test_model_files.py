"""An export on disk in Hugging Face's layout: transformers loads it with no code of ours, and it reads back
into the model the job trained, with the job's record beside it."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from diloco.core.config import TrainingConfig
from diloco.export.assemble import FragmentRecord, GlobalModel
from diloco.export.model_files import DILOCO_FILE, load, matching_preset, save
from diloco.worker.language_model import ModelSpec, build
from diloco.worker.model import build_model

EXAMPLE_TOKENIZER = str(Path(__file__).resolve().parents[2] / "examples" / "hf_llama" / "tokenizer.json")
LLAMA = {
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def global_model(tensors: dict[str, torch.Tensor]) -> GlobalModel:
    """`tensors` cut into two fragments as a job's shards would hold them."""
    names = list(tensors)
    half = len(names) // 2
    return GlobalModel(
        tensors,
        (
            FragmentRecord(0, 0, outer_steps=7, tokens=700, names=tuple(names[:half])),
            FragmentRecord(1, 1, outer_steps=5, tokens=900, names=tuple(names[half:])),
        ),
    )


def tiny_global_model() -> GlobalModel:
    """The tiny preset's initial weights."""
    return global_model({name: p.detach().clone() for name, p in build_model("tiny", 3).named_parameters()})


def llama_global_model(**changes) -> GlobalModel:
    model = build(ModelSpec(config=LLAMA | changes), 4).module
    return global_model({name: p.detach().clone() for name, p in model.named_parameters()})


def test_a_preset_exports_as_gpt2_in_hugging_face_layout(tmp_path):
    model = tiny_global_model()
    record = save(tmp_path, model, training=TrainingConfig(fragments=2))
    names = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", DILOCO_FILE} <= names
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert (config["n_embd"], config["n_layer"], config["vocab_size"]) == (128, 4, 256)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert "transformer.h.3.attn.c_attn.weight" in f.keys()
        assert all(f.get_tensor(name).dtype == torch.float32 for name in f.keys())
    assert record == json.loads((tmp_path / DILOCO_FILE).read_text())
    assert record["preset"] == "tiny" and (record["outer_steps"], record["tokens"]) == (5, 700)
    assert [f["outer_steps"] for f in record["fragments"]] == [7, 5]
    assert record["training"]["fragments"] == 2
    assert {p["name"]: p["shape"] for p in record["parameters"]} == {
        name: list(t.shape) for name, t in model.tensors.items()
    }


def test_an_export_reads_back_into_the_model_the_job_trained(tmp_path):
    model = tiny_global_model()
    save(tmp_path, model)
    exported = load(tmp_path)
    assert exported.spec == ModelSpec(preset="tiny")
    assert exported.tensors.keys() == model.tensors.keys()
    assert all(torch.equal(exported.tensors[name], value) for name, value in model.tensors.items())


def test_transformers_loads_a_preset_export_and_computes_our_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save(tmp_path, tiny_global_model())
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = load(tmp_path).language_model()
    text = "def f(x):\n    return x\n"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(text.encode()), "the byte-level presets' tokenizer is bytes"
    with torch.no_grad():
        assert torch.allclose(theirs(input_ids=ids).logits, ours.forward(ids, None)[0], atol=1e-5)


def test_a_transformers_model_exports_as_itself_with_the_committed_bpe(tmp_path):
    from transformers import AutoModelForCausalLM

    model = llama_global_model(vocab_size=16384)
    record = save(tmp_path, model, json.dumps(LLAMA | {"vocab_size": 16384}))
    assert record["preset"] is None and record["model_type"] == "llama"
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(theirs.state_dict()[name], value) for name, value in model.tensors.items())
    tokenizer = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer["eos_token"] == "<|endoftext|>", "a model without its own tokenizer gets the committed BPE"
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 0


def test_a_large_model_is_written_in_shards_with_an_index(tmp_path):
    from transformers import AutoModelForCausalLM

    model = llama_global_model()
    save(tmp_path, model, json.dumps(LLAMA), tokenizer=EXAMPLE_TOKENIZER, max_shard_size=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / shard).is_file() for shard in shards)
    assert not (tmp_path / "model.safetensors").exists()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(theirs.state_dict()[name], value) for name, value in model.tensors.items())


def test_tensors_of_no_preset_and_no_model_named_export_as_a_model_of_ones_own(tmp_path):
    model = llama_global_model()
    record = save(tmp_path / "own", model)
    assert record["preset"] is None and record["model"] is None and record["model_type"] is None
    assert not (tmp_path / "own" / "config.json").exists(), "no configuration describes it"
    exported = load(tmp_path / "own")
    assert exported.spec is None
    assert exported.tensors.keys() == model.tensors.keys()
    assert all(torch.equal(exported.tensors[name], value) for name, value in model.tensors.items())
    with pytest.raises(ValueError, match="of one's own"):
        exported.language_model()


def test_tensors_that_do_not_fit_the_model_named_are_refused(tmp_path):
    with pytest.raises(ValueError, match="do not fit"):
        save(tmp_path, llama_global_model(), json.dumps(LLAMA | {"hidden_size": 64}))


def test_the_preset_is_the_one_whose_shapes_match():
    assert matching_preset(tiny_global_model().tensors) == "tiny"
    assert matching_preset({"tok_emb.weight": torch.zeros(256, 128)}) is None


def test_writing_and_reading_an_export_draw_no_progress_bars_of_transformers(tmp_path, capfd):
    save(tmp_path, tiny_global_model())
    load(tmp_path).language_model()
    captured = capfd.readouterr()
    assert "Writing model shards" not in captured.err + captured.out
    assert "Loading weights" not in captured.err + captured.out
