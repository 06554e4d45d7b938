"""An export on disk: a safetensors file any loader reads, and the config that says what the tensors are."""

import json

import pytest
import torch
from safetensors import safe_open

from diloco.core.config import TrainingConfig
from diloco.export.assemble import FragmentRecord, GlobalModel
from diloco.export.model_files import (
    CONFIG_FILE,
    MODEL_FILE,
    load,
    matching_preset,
    save,
)
from diloco.worker.model import build_model


def tiny_global_model() -> GlobalModel:
    """The tiny preset's initial weights, cut into two fragments as a job's shards would hold them."""
    tensors = {name: p.detach().clone() for name, p in build_model("tiny", 3).named_parameters()}
    names = list(tensors)
    half = len(names) // 2
    return GlobalModel(
        tensors,
        (
            FragmentRecord(0, 0, outer_steps=7, tokens=700, names=tuple(names[:half])),
            FragmentRecord(1, 1, outer_steps=5, tokens=900, names=tuple(names[half:])),
        ),
    )


def test_the_model_file_is_plain_safetensors_with_float32_tensors_and_the_format_named(tmp_path):
    model = tiny_global_model()
    save(tmp_path, model)
    with safe_open(tmp_path / MODEL_FILE, framework="pt") as f:
        assert f.metadata() == {"format": "diloco-model/1", "preset": "tiny"}
        assert set(f.keys()) == set(model.tensors)
        assert all(f.get_tensor(name).dtype == torch.float32 for name in f.keys())


def test_an_export_loads_back_into_the_built_in_gpt_with_its_config(tmp_path):
    model = tiny_global_model()
    save(tmp_path, model, TrainingConfig(fragments=2))
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["preset"] == "tiny" and config["architecture"]["vocab_size"] == 256
    assert (config["outer_steps"], config["tokens"]) == (5, 700)
    assert [f["outer_steps"] for f in config["fragments"]] == [7, 5]
    assert config["training"]["fragments"] == 2
    assert {p["name"]: p["shape"] for p in config["parameters"]} == {
        name: list(t.shape) for name, t in model.tensors.items()
    }
    gpt = load(tmp_path).built_in()
    for name, value in gpt.state_dict().items():
        assert torch.equal(value, model.tensors[name]), name


def test_a_model_of_ones_own_exports_without_a_preset_and_is_not_sampled(tmp_path):
    tensors = {"encoder.weight": torch.ones(3, 2)}
    save(tmp_path, GlobalModel(tensors, (FragmentRecord(0, 0, 1, 10, ("encoder.weight",)),)))
    exported = load(tmp_path)
    assert exported.config["preset"] is None and exported.config["training"] is None
    assert torch.equal(exported.tensors["encoder.weight"], tensors["encoder.weight"])
    with pytest.raises(ValueError, match="your own model class"):
        exported.built_in()
    assert (tmp_path / MODEL_FILE).exists()


def test_the_preset_is_the_one_whose_shapes_match():
    assert matching_preset(tiny_global_model().tensors) == "tiny"
    assert matching_preset({"tok_emb.weight": torch.zeros(256, 128)}) is None
