"""An exported model on disk: `model.safetensors` (the tensors, float32) and `config.json` (what they are).

The tensors are written and read with the `safetensors` package, so any loader (Hugging Face's, another
framework's) reads the file as it is; its metadata names the format and the preset. The config names the
built-in preset the tensors fit (null for a model of one's own), each parameter's shape and fragment, each
fragment's outer steps and tokens, and the job's training settings when known.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from diloco.core.config import TrainingConfig
from diloco.export.assemble import GlobalModel
from diloco.worker.model import GPT, PRESETS, build_model

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FORMAT = "diloco-model/1"


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
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in model.tensors.items()}
    save_file(tensors, folder / MODEL_FILE, metadata={"format": FORMAT, "preset": preset or ""})
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
    return ExportedModel(load_file(folder / MODEL_FILE), config)
