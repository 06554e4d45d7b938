"""An export on disk: the safetensors layout as the format specifies it, and the config that says what the
tensors are."""

import json
import struct

import pytest
import torch

from diloco.core.config import TrainingConfig
from diloco.export.assemble import FragmentRecord, GlobalModel
from diloco.export.model_files import (
    CONFIG_FILE,
    MODEL_FILE,
    load,
    matching_preset,
    read_safetensors,
    save,
    write_safetensors,
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


def test_safetensors_layout_header_then_little_endian_float32(tmp_path):
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"a": torch.tensor([[1.0, 2.0]]), "b": torch.tensor([3.0])}, {"k": "v"})
    data = path.read_bytes()
    (length,) = struct.unpack_from("<Q", data)
    assert length % 8 == 0
    header = json.loads(data[8 : 8 + length])
    assert header == {
        "__metadata__": {"k": "v"},
        "a": {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
    }
    assert data[8 + length :] == struct.pack("<3f", 1.0, 2.0, 3.0)
    tensors, metadata = read_safetensors(path)
    assert metadata == {"k": "v"} and torch.equal(tensors["a"], torch.tensor([[1.0, 2.0]]))


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
