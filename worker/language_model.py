"""The model a job trains, whichever way it was named: a built-in preset, or a Hugging Face `transformers`
architecture given by its configuration (a `config.json`, or the configuration inline), optionally started
from a checkpoint folder (continued pretraining).

Both are built the same way on every island: on the CPU, from the job's seed, before moving to the device,
so islands that start apart start from identical weights and nothing is downloaded. A transformers model's
parameters keep their own names (`model.layers.3.self_attn.q_proj.weight`), whose first number is the layer:
fragmenting strides them across depth as it does the presets' `blocks.3....`, and the syncer, which plans
fragments from names and shapes alone, never needs transformers.

The trainer sees one `LanguageModel` either way: the module holding the parameters (what the learner
fragments and the export names), its context and vocabulary, its FLOPs per token, and a forward pass that
returns logits and the mean next-token cross-entropy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from diloco.worker.data import Forward
from diloco.worker.model import GPT, PRESETS, build_model, from_gpt2_names, resolve_preset

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ModelSpec:
    """What `trainer.model` (`--model`) names: a preset, or a transformers configuration as a dict."""

    preset: str | None = None
    config: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, text: str | None, init_from: str | Path | None = None) -> ModelSpec:
        """A preset name, a configuration as inline JSON (`{"model_type": "llama", ...}`), or the path of a
        `config.json` (or of the folder holding one); unset: the `init_from` checkpoint's configuration,
        else the tiny preset."""
        if not text:
            return cls(config=read_config(Path(init_from))) if init_from else cls(preset="tiny")
        if text in PRESETS:
            return cls(preset=text)
        if text.lstrip().startswith("{"):
            config = json.loads(text)
        elif Path(text).exists():
            config = read_config(Path(text))
        else:
            raise ValueError(
                f"model {text!r} is neither a preset ({', '.join(PRESETS)}), an inline configuration nor a "
                "config.json that exists"
            )
        return cls(config=_checked(config, text))

    @property
    def name(self) -> str:
        """How summaries name it: the preset, or the configuration's model type."""
        return self.preset or str(self.config["model_type"] if self.config else "?")

    @property
    def context(self) -> int:
        """The longest sequence the model reads: the preset's context, or the configuration's positions."""
        if self.preset is not None:
            return resolve_preset(self.preset).context
        return hf_context(self.config or {})


def read_config(path: Path) -> dict[str, Any]:
    """The configuration in a `config.json`, or in the one a checkpoint folder holds."""
    file = path / CONFIG_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no model configuration at {path} (expected a config.json or a folder with one)")
    return _checked(json.loads(file.read_text()), str(file))


def _checked(config: Any, where: str) -> dict[str, Any]:
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError(f"{where}: a transformers configuration is a JSON object with a model_type")
    return config


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def hf_context(config: Mapping[str, Any]) -> int:
    """The configuration's context length, under the name its architecture uses."""
    for key in CONTEXT_KEYS:
        if isinstance(config.get(key), int):
            return int(config[key])
    keys = ", ".join(CONTEXT_KEYS)
    raise ValueError(f"the {config.get('model_type')} configuration names no context length ({keys})")


@dataclass(frozen=True)
class LanguageModel:
    """A causal language model as the trainer drives it."""

    module: nn.Module  # the parameters, named as fragments and exports name them
    context: int
    vocab_size: int
    flops_per_token: float  # training FLOPs per token as MFU counts them
    forward: Forward  # (tokens, targets or None) -> (logits, mean cross-entropy or None)

    def num_parameters(self) -> int:
        """Distinct parameter elements (tied weights once)."""
        return sum(p.numel() for p in self.module.parameters())


def build(
    spec: ModelSpec,
    seed: int,
    device: torch.device | str = "cpu",
    *,
    checkpoint_activations: bool = False,
    init_from: str | Path | None = None,
) -> LanguageModel:
    """The model `spec` names, identical for equal `seed` anywhere; with `init_from`, holding the weights of
    that Hugging Face checkpoint folder instead (which must fit the architecture exactly). On the meta device
    nothing is allocated or initialised (for counting parameters)."""
    if torch.device(device).type == "meta":
        if spec.preset is not None:
            return preset_model(build_model(spec.preset, seed, device="meta"))
        return hf_model(build_hf(spec.config or {}, seed, device="meta"))
    if spec.preset is not None:
        gpt = build_model(spec.preset, seed, device="cpu", checkpoint_activations=checkpoint_activations)
        if init_from is not None:
            gpt.load_state_dict(from_gpt2_names(pretrained_tensors(init_from)), strict=True)
        return preset_model(gpt.to(device))
    model = build_hf(spec.config or {}, seed, checkpoint_activations=checkpoint_activations)
    if init_from is not None:
        try:
            model.load_state_dict(pretrained_tensors(init_from), strict=True)
        except RuntimeError as error:
            raise ValueError(f"initFrom {init_from} does not fit the model: {error}") from None
    return hf_model(model.to(device))


def preset_model(gpt: GPT) -> LanguageModel:
    """A built-in GPT as the trainer drives it."""
    return LanguageModel(gpt, gpt.preset.context, gpt.preset.vocab_size, gpt.flops_per_token(), gpt)


def build_hf(
    config: Mapping[str, Any], seed: int, *, checkpoint_activations: bool = False, device: str = "cpu"
) -> nn.Module:
    """A transformers causal LM from its configuration, initialised by its own `_init_weights` from `seed`
    (the global RNG forked, so the caller's draws are untouched), in float32 on the CPU (or, unallocated, on
    the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(config)
    hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    hf_config.use_cache = False
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="sdpa")
    if checkpoint_activations:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def hf_model(model: nn.Module) -> LanguageModel:
    """A transformers causal LM as the trainer drives it: its logits, and our loss on them, in float32."""
    config = model.config

    def forward(tokens: torch.Tensor, targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = model(input_ids=tokens, use_cache=False).logits
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    context = hf_context(config.to_dict())
    return LanguageModel(model, context, config.vocab_size, hf_flops_per_token(model, context), forward)


def hf_flops_per_token(model: nn.Module, context: int) -> float:
    """PaLM's count, as for the presets: 6 per parameter that multiplies (the input embedding only when it is
    also the head) plus the attention products over the context."""
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embedding
    matmul = sum(p.numel() for p in model.parameters()) - (0 if tied else embedding.numel())
    config = model.config
    return 6.0 * matmul + 12.0 * config.num_hidden_layers * config.hidden_size * context


def pretrained_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """The float32 tensors of a Hugging Face checkpoint folder (one safetensors file, or shards with an
    index), as its model names them."""
    from transformers import AutoModelForCausalLM

    path = Path(folder)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"initFrom {folder}: not a Hugging Face checkpoint folder (no {CONFIG_FILE})")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return dict(model.state_dict())
