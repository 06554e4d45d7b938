"""Text from an exported model, read as anyone would read it: `AutoModelForCausalLM` and `AutoTokenizer`
from the export folder, and transformers' own `generate` (top-k sampling, or greedy at temperature 0)."""

from __future__ import annotations

from pathlib import Path

import torch

from diloco.export.model_files import without_progress_bars


@torch.no_grad()
def continue_text(
    folder: Path, prompt: str, new_tokens: int, *, temperature: float = 0.8, top_k: int = 40, seed: int = 0
) -> str:
    """The prompt and what the model writes after it (`new_tokens` tokens, stopping early at the end of a
    text), seeing at most its context; the same for equal `seed`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if new_tokens < 0 or temperature < 0 or top_k < 1:
        raise ValueError("new tokens and temperature must be >= 0, top-k >= 1")
    with without_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt").input_ids if prompt else None
    if ids is None or ids.numel() == 0:  # start from the end-of-text token, or a newline without one
        start = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer("\n").input_ids[0]
        ids = torch.tensor([[start]])
    context = getattr(model.config, "max_position_embeddings", None)  # GPT-2's n_positions answers to it too
    if context is not None:
        new_tokens = min(new_tokens, max(0, context - ids.shape[1]))
    torch.manual_seed(seed)
    sampling = {"temperature": temperature, "top_k": top_k} if temperature > 0 else {}
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=temperature > 0, **sampling)
    return prompt + tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
