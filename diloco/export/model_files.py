"""An exported model in Hugging Face's layout, which `AutoModelForCausalLM.from_pretrained(folder)` and
`AutoTokenizer.from_pretrained(folder)` load with no code of ours (and vLLM serves):

- `config.json` and `model.safetensors` (float32; above `MAX_SHARD_SIZE`, shards with
  `model.safetensors.index.json`), written by transformers' own `save_pretrained`;
- `generation_config.json`, with the tokenizer's end-of-text token;
- `tokenizer.json` and `tokenizer_config.json`: the tokenizer the job trained with (the byte-level presets'
  bytes as a tokenizer, the committed BPE, or the job's own);
- `diloco.json`: what the job recorded: the model as the job named it (a preset, or a transformers
  configuration), outer steps and tokens (the slowest fragment's, as the job's status reports them), each
  parameter's fragment, each fragment's shard, outer steps and tokens, and `training` (spec.training).

A preset's GPT is GPT-2's architecture, so a preset exports as a `GPT2LMHeadModel` (`diloco.worker.model`
maps the names). A transformers model exports as itself. A model of one's own (a custom loop's, no preset's
and not named) exports as its tensors under its own names in `model.safetensors`, with `diloco.json`, for
the loop's code to load.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from diloco.core.config import TrainingConfig
from diloco.export.assemble import GlobalModel
from diloco.worker.data import evaluate, load_tokens, split_holdout
from diloco.worker.language_model import LanguageModel, ModelSpec, build, build_hf
from diloco.worker.model import PRESETS, build_model, gpt2_config, resolve_preset, to_gpt2_names
from diloco.worker.tokenizer import byte_tokenizer, end_of_text, tokenizer_for

DILOCO_FILE = "diloco.json"
FORMAT = "diloco-export/2"
MAX_SHARD_SIZE = "2GB"
OWN_MODEL_FILE = "model.safetensors"
"""Above this a model is written as safetensors shards with an index, as the Hugging Face Hub keeps them."""


@contextmanager
def without_progress_bars() -> Iterator[None]:
    """transformers' own bars (writing shards, loading weights) off: an export is one step of a run that shows
    its own progress, and a quiet run stays quiet."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def matching_preset(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The built-in preset whose GPT has exactly these tensor names and shapes, if any."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    for name in PRESETS:
        model = build_model(name, 0, device="meta")
        if {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes:
            return name
    return None


def model_spec(model: str | None, tensors: Mapping[str, torch.Tensor]) -> ModelSpec | None:
    """The model the tensors are of: as named (`--model`, as the trainer takes it), else the preset whose
    tensors they are; None for a model of one's own (a custom loop's), which no configuration describes. A
    transformers model must be named: its tensors do not say which it is."""
    if model:
        return ModelSpec.parse(model)
    preset = matching_preset(tensors)
    return ModelSpec(preset=preset) if preset is not None else None


def _transformers_model(spec: ModelSpec, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A transformers model holding `tensors` (built unallocated, then given them, tied weights tied)."""
    if spec.preset is not None:
        config, named = gpt2_config(resolve_preset(spec.preset)), to_gpt2_names(dict(tensors))
    else:
        config, named = dict(spec.config or {}), dict(tensors)
    model = build_hf(config, 0, device="meta")
    try:
        unexpected = model.load_state_dict(named, strict=False, assign=True).unexpected_keys
    except RuntimeError as error:  # a shape that differs
        raise ValueError(f"the tensors do not fit the {spec.name} model: {error}") from None
    model.tie_weights()
    unset = [name for name, p in model.named_parameters() if p.is_meta]
    if unset or unexpected:
        raise ValueError(f"the tensors do not fit the {spec.name} model: missing {unset[:5]}, unknown {unexpected[:5]}")
    return model


def save(
    folder: Path,
    model: GlobalModel,
    model_name: str | None = None,
    training: TrainingConfig | None = None,
    *,
    tokenizer: str | None = None,
    max_shard_size: str | int = MAX_SHARD_SIZE,
) -> dict[str, Any]:
    """Writes the model, its tokenizer and the job's record into `folder` (created); returns the record.
    `model_name` and `tokenizer` are the trainer's `--model` and `--tokenizer` (unset: a preset found by the
    tensors' shapes, and its own tokenisation)."""
    spec = model_spec(model_name, model.tensors)
    folder.mkdir(parents=True, exist_ok=True)
    if spec is None:
        return _save_own_model(folder, model, training)
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    hf = _transformers_model(spec, model.tensors)
    words = tokenizer_for(hf.config.vocab_size, tokenizer) or byte_tokenizer()
    eos = end_of_text(words)
    hf.config.bos_token_id = hf.config.eos_token_id = eos
    hf.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    with without_progress_bars():
        hf.save_pretrained(folder, max_shard_size=max_shard_size)
    eos_name = words.id_to_token(eos) if eos is not None else None
    PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token=eos_name, bos_token=eos_name, pad_token=eos_name
    ).save_pretrained(folder)
    return _write_record(folder, model, spec, hf.config.model_type, training)


def _save_own_model(folder: Path, model: GlobalModel, training: TrainingConfig | None) -> dict[str, Any]:
    """A model of one's own: its tensors under the names its loop gave them, in `model.safetensors`, for the
    loop's own code to load; no configuration or tokenizer, which only the loop knows."""
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in model.tensors.items()}, folder / OWN_MODEL_FILE)
    return _write_record(folder, model, None, None, training)


def _write_record(
    folder: Path, model: GlobalModel, spec: ModelSpec | None, model_type: str | None, training: TrainingConfig | None
) -> dict[str, Any]:
    fragment_of = {name: f.index for f in model.fragments for name in f.names}
    record: dict[str, Any] = {
        "format": FORMAT,
        "preset": spec.preset if spec is not None else None,
        "model": None if spec is None else spec.preset or dict(spec.config or {}),
        "model_type": model_type,
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
    (folder / DILOCO_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record


@dataclass(frozen=True)
class ExportedModel:
    """An export read back: its folder and the job's record."""

    folder: Path
    config: dict[str, Any]

    @property
    def spec(self) -> ModelSpec | None:
        """The model's description; None for a model of one's own."""
        model = self.config["model"]
        if model is None:
            return None
        return ModelSpec(preset=model) if isinstance(model, str) else ModelSpec(config=model)

    @cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The trained parameters, named as the job's fragments name them."""
        if self.spec is None:
            from safetensors.torch import load_file

            return load_file(self.folder / OWN_MODEL_FILE)
        return {name: p.detach() for name, p in self.language_model().module.named_parameters()}

    def language_model(self, device: torch.device | str = "cpu") -> LanguageModel:
        """The model as the trainer trains and evaluates it (a preset's GPT, or the transformers model),
        holding the exported weights."""
        if self.spec is None:
            raise ValueError(f"{self.folder} holds a model of one's own: load its tensors into the loop's model")
        with without_progress_bars():
            model = build(self.spec, 0, init_from=self.folder)
        model.module.to(device).eval()
        return model


def load(folder: Path) -> ExportedModel:
    """An export written by `save`."""
    path = folder / DILOCO_FILE
    if not path.is_file():
        raise ValueError(f"{folder} is not a diloco export (no {DILOCO_FILE})")
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} export (format {config.get('format')!r})")
    return ExportedModel(folder, config)


def evaluate_export(
    folder: Path, data: str | None, max_bytes: int, batch_size: int, *, tokenizer: str | None = None
) -> float:
    """The exported model's held-out loss, as a worker of its job measures it (the same windows, the same
    tokenisation): the loss `diloco run` reports for the final global model."""
    model = load(folder).language_model()
    heldout = split_holdout(load_tokens(data, max_bytes, tokenizer_for(model.vocab_size, tokenizer)))[1]
    return evaluate(model.module, heldout, model.context, batch_size, forward=model.forward)
