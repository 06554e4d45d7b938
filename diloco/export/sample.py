"""Text from a built-in model: the byte-level presets (tiny, small) read and write bytes, so a prompt is
UTF-8 text and a sample decodes to text; the BPE presets have no tokenizer here and give token ids."""

from __future__ import annotations

import torch

from diloco.worker.model import GPT

BYTE_VOCAB = 256


def encode(prompt: str, model: GPT) -> list[int]:
    """The prompt's tokens: its UTF-8 bytes for a byte-level model, else space-separated token ids."""
    if model.preset.vocab_size == BYTE_VOCAB:
        return list(prompt.encode())
    return [int(word) for word in prompt.split()]


def decode(tokens: list[int], model: GPT) -> str:
    """Bytes as text (invalid UTF-8 replaced) for a byte-level model, else the token ids."""
    if model.preset.vocab_size == BYTE_VOCAB:
        return bytes(tokens).decode("utf-8", errors="replace")
    return " ".join(map(str, tokens))


@torch.no_grad()
def generate(
    model: GPT, prompt: list[int], new_tokens: int, *, temperature: float = 0.8, top_k: int = 40, seed: int = 0
) -> list[int]:
    """`new_tokens` tokens sampled after `prompt` (temperature 0: greedy), seeing at most the context."""
    if new_tokens < 0 or temperature < 0 or top_k < 1:
        raise ValueError("new tokens and temperature must be >= 0, top-k >= 1")
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt) or [ord("\n") if model.preset.vocab_size == BYTE_VOCAB else 0]
    start = len(tokens)
    for _ in range(new_tokens):
        window = torch.tensor([tokens[-model.preset.context :]])
        logits, _ = model(window)
        last = logits[0, -1].float()
        if temperature == 0:
            tokens.append(int(last.argmax()))
            continue
        values, indices = torch.topk(last / temperature, min(top_k, last.numel()))
        choice = torch.multinomial(torch.softmax(values, dim=-1), 1, generator=generator)
        tokens.append(int(indices[choice]))
    return tokens[start:]


def continue_text(
    model: GPT, prompt: str, new_tokens: int, *, temperature: float = 0.8, top_k: int = 40, seed: int = 0
) -> str:
    """The prompt and what the model writes after it, as text (token ids for the BPE presets)."""
    tokens = generate(model, encode(prompt, model), new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return prompt + decode(tokens, model)
