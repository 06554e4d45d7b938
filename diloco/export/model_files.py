"""An exported model on disk: `model.safetensors` (the tensors, float32) and `config.json` (what they are).

The safetensors file is the format's plain layout (an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the bytes), written and read here without the
`safetensors` package, so any loader (`safetensors.torch.load_file`, Hugging Face) reads the file as it is.
The config names the built-in preset the tensors fit (null for a model of one's own), each parameter's
shape and fragment, each fragment's outer steps and tokens, and the job's training settings when known.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from diloco.core.config import TrainingConfig
from diloco.export.assemble import GlobalModel
from diloco.worker.model import GPT, PRESETS, build_model

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FORMAT = "diloco-model/1"
_F32 = "F32"
_HEADER_ALIGN = 8


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Float32 tensors in the safetensors layout, in the order given."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    blobs: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        blob = tensor.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": _F32, "shape": list(tensor.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _HEADER_ALIGN)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (float32 only, the only dtype an export writes) and the metadata of a safetensors file."""
    data = path.read_bytes()
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + length])
    metadata = header.pop("__metadata__", {})
    body = memoryview(data)[8 + length :]
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if entry["dtype"] != _F32:
            raise ValueError(f"{path}: tensor {name} is {entry['dtype']}; an export holds {_F32} only")
        begin, end = entry["data_offsets"]
        values = torch.frombuffer(bytearray(body[begin:end]), dtype=torch.float32)
        tensors[name] = values.reshape(entry["shape"])
    return tensors, metadata


def matching_preset(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The built-in preset whose GPT has exactly these tensor names and shapes, if any."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    for name in PRESETS:
        model = build_model(name, 0, device="meta")
        if {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes:
            return name
    return None


def save(folder: Path, model: GlobalModel, training: TrainingConfig | None = None) -> dict[str, Any]:
    """Writes the model and its config into `folder` (created); returns the config."""
    preset = matching_preset(model.tensors)
    fragment_of = {name: f.index for f in model.fragments for name in f.names}
    config: dict[str, Any] = {
        "format": FORMAT,
        "preset": preset,
        "architecture": {k: v for k, v in asdict(PRESETS[preset]).items() if k != "name"} if preset else None,
        "outer_steps": model.outer_steps,
        "tokens": model.tokens,
        "parameters": [
            {"name": name, "shape": list(t.shape), "fragment": fragment_of[name]} for name, t in model.tensors.items()
        ],
        "fragments": [
            {"index": f.index, "shard": f.shard, "outer_steps": f.outer_steps, "tokens": f.tokens}
            for f in model.fragments
        ],
        "training": json.loads(training.to_json()) if training is not None else None,  # as in spec.training
    }
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / MODEL_FILE, model.tensors, {"format": FORMAT, "preset": preset or ""})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return config


@dataclass(frozen=True)
class ExportedModel:
    """An export read back: its tensors and its config."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]

    def built_in(self) -> GPT:
        """The built-in GPT with these weights; refused for a model of one's own (no preset matched)."""
        preset = self.config.get("preset")
        if not preset:
            raise ValueError(
                f"this export is not a built-in preset's model: load {MODEL_FILE} into your own model class"
            )
        model = build_model(preset, 0)
        model.load_state_dict(self.tensors, strict=True)
        return model.eval()


def load(folder: Path) -> ExportedModel:
    """An export written by `save`."""
    config = json.loads((folder / CONFIG_FILE).read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{folder / CONFIG_FILE} is not a {FORMAT} export (format {config.get('format')!r})")
    tensors, _ = read_safetensors(folder / MODEL_FILE)
    return ExportedModel(tensors, config)
