"""The built-in trainer's model: a compact GPT-style decoder and its named size presets.

A job names a preset rather than shipping model code, so every island (and the syncer, which plans
fragments from parameter names and shapes) builds exactly the same architecture. Block parameters carry
the layer index as a path component (`blocks.3.attn.qkv.weight`) because fragmenting strides fragments
across depth by that number. Initialisation draws from a private generator seeded by the job, so islands
that start apart start from identical weights without touching the global RNG, and every preset can be
built on the meta device to count parameters without allocating them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

_INIT_STD = 0.02


@dataclass(frozen=True)
class ModelPreset:
    """Architecture of a decoder-only transformer: vocabulary, context length and width/depth/heads."""

    name: str
    vocab_size: int
    context: int
    d_model: int
    n_layers: int
    n_heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for field_name in ("vocab_size", "context", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, field_name)
            if value < 1:
                raise ValueError(f"preset {self.name!r}: {field_name} must be positive, got {value}")
        if self.d_model % self.n_heads:
            raise ValueError(f"preset {self.name!r}: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"preset {self.name!r}: dropout must be in [0, 1), got {self.dropout}")


BPE_VOCAB = 16384
"""Tokens of the BPE the larger presets read (`diloco.worker.tokenizer`: trained on the embedded corpus, a
multiple of 64 for the matmuls): enough for 8 MiB of Python source, whose rarer identifiers a larger
vocabulary would only memorise."""

PRESETS: dict[str, ModelPreset] = {
    preset.name: preset
    for preset in (
        # ~0.84M parameters, byte-level: trains visibly within minutes on a laptop CPU.
        ModelPreset("tiny", vocab_size=256, context=128, d_model=128, n_layers=4, n_heads=4),
        # ~25.6M parameters, byte-level: a single modest GPU.
        ModelPreset("small", vocab_size=256, context=512, d_model=512, n_layers=8, n_heads=8),
        # ~98M parameters: GPT-2 small's shape over the committed BPE.
        ModelPreset("medium", vocab_size=BPE_VOCAB, context=1024, d_model=768, n_layers=12, n_heads=12),
        # ~320M parameters: GPT-2 medium's shape over the committed BPE.
        ModelPreset("large", vocab_size=BPE_VOCAB, context=1024, d_model=1024, n_layers=24, n_heads=16),
        # ~0.94B parameters: about the largest that trains on one 80 GB accelerator with fp32 master weights,
        # AdamW state and the learner's fp32 copies (about 21 GB), with room for bf16 activations.
        ModelPreset("xl", vocab_size=BPE_VOCAB, context=1024, d_model=2048, n_layers=18, n_heads=16),
    )
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through the fused scaled-dot-product kernel."""

    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        self.n_heads = preset.n_heads
        self.dropout = preset.dropout
        self.qkv = nn.Linear(preset.d_model, 3 * preset.d_model)
        self.proj = nn.Linear(preset.d_model, preset.d_model)
        self.resid_drop = nn.Dropout(preset.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.n_heads, width // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, time, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network with a GELU."""

    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        hidden = preset.mlp_ratio * preset.d_model
        self.fc = nn.Linear(preset.d_model, hidden)
        self.proj = nn.Linear(hidden, preset.d_model)
        self.drop = nn.Dropout(preset.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(preset.d_model)
        self.attn = CausalSelfAttention(preset)
        self.ln2 = nn.LayerNorm(preset.d_model)
        self.mlp = MLP(preset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer whose output projection reuses the token embedding (weight tying).

    The head is computed from `tok_emb.weight` directly rather than held as a second reference, so tying
    survives device moves, `to_empty` and `load_state_dict`, and the state dict holds the tensor once.
    With `checkpoint_activations`, training keeps only each block's input and recomputes the rest in the
    backward pass: about a third more compute for activations that no longer grow with depth.
    """

    def __init__(self, preset: ModelPreset, checkpoint_activations: bool = False) -> None:
        super().__init__()
        self.preset = preset
        self.checkpoint_activations = checkpoint_activations
        # Given weights, nn.Embedding skips its own normal_() init, which on the meta device runs a Python
        # reference that imports torch._dynamo (over a second of a worker's start); _initialise sets them.
        self.tok_emb = nn.Embedding(
            preset.vocab_size, preset.d_model, _weight=torch.empty(preset.vocab_size, preset.d_model)
        )
        self.pos_emb = nn.Embedding(preset.context, preset.d_model, _weight=torch.empty(preset.context, preset.d_model))
        self.drop = nn.Dropout(preset.dropout)
        self.blocks = nn.ModuleList(Block(preset) for _ in range(preset.n_layers))
        self.ln_f = nn.LayerNorm(preset.d_model)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of shape (batch, time, vocab) for int64 tokens `idx` (batch, time), and the mean
        cross-entropy against `targets` (batch, time) when given, else None."""
        time = idx.shape[1]
        if time > self.preset.context:
            raise ValueError(f"sequence length {time} exceeds the model's context {self.preset.context}")
        positions = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            if self.checkpoint_activations and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (the tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward and backward) as MFU counts them (PaLM, appendix B): 6 per
        parameter that multiplies (the tied embedding does, as the head; position embeddings do not) plus
        the attention products over the full context, whatever recomputation adds."""
        p = self.preset
        matmul_parameters = self.num_parameters() - self.pos_emb.weight.numel()
        return 6.0 * matmul_parameters + 12.0 * p.n_layers * p.d_model * p.context


def _initialise(model: GPT, seed: int) -> None:
    """GPT-2 initialisation from a private generator: N(0, 0.02) weights and embeddings, zero biases,
    unit norms, and residual output projections scaled by 1/sqrt(2 * n_layers) so the residual stream's
    variance does not grow with depth."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = _INIT_STD / math.sqrt(2 * model.preset.n_layers)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(".proj") else _INIT_STD
                module.weight.normal_(0.0, std, generator=generator)
                module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, _INIT_STD, generator=generator)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()


def resolve_preset(preset: str | ModelPreset) -> ModelPreset:
    """The preset named `preset` (or `preset` itself); unknown names list the known ones."""
    if isinstance(preset, ModelPreset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(PRESETS)}") from None


def build_model(
    preset: str | ModelPreset, seed: int, device: torch.device | str = "cpu", checkpoint_activations: bool = False
) -> GPT:
    """A freshly initialised model, identical for equal `seed` on any machine.

    Weights are initialised on the CPU and then moved to `device`, so the values do not depend on the
    accelerator. On the meta device nothing is allocated or initialised (for counting parameters). The
    model is built on the CPU rather than materialised from the meta device: `to_empty` runs a Python
    reference that imports sympy, a third of a second of every worker's start, longer than the CPU's
    default initialisation that `_initialise` then overwrites, even for the medium preset.
    """
    resolved = resolve_preset(preset)
    target = torch.device(device)
    if target.type == "meta":
        with target:
            return GPT(resolved, checkpoint_activations)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):  # the default init draws from the global RNG
        model = GPT(resolved, checkpoint_activations)
    _initialise(model, seed)
    return model.to(target)


# A preset's GPT is GPT-2's architecture exactly (pre-norm blocks, exact GELU, tied head, learned positions),
# so an export names its tensors as transformers' GPT2LMHeadModel does, and any GPT-2 loader reads it. GPT-2
# keeps its linear layers as Conv1D, (in, out): those weights are transposed on the way.
_GPT2_BLOCK = {
    "ln1": ("ln_1", False),
    "attn.qkv": ("attn.c_attn", True),
    "attn.proj": ("attn.c_proj", True),
    "ln2": ("ln_2", False),
    "mlp.fc": ("mlp.c_fc", True),
    "mlp.proj": ("mlp.c_proj", True),
}
_GPT2_TOP = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight"}


def gpt2_config(preset: ModelPreset) -> dict[str, object]:
    """The transformers GPT2Config (as a dict) of a preset's architecture."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": preset.vocab_size,
        "n_positions": preset.context,
        "n_embd": preset.d_model,
        "n_layer": preset.n_layers,
        "n_head": preset.n_heads,
        "n_inner": preset.mlp_ratio * preset.d_model,
        "activation_function": "gelu",  # F.gelu, exact (GPT-2's own is the tanh approximation)
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": preset.dropout,
        "embd_pdrop": preset.dropout,
        "attn_pdrop": preset.dropout,
        "tie_word_embeddings": True,
        "bos_token_id": None,  # GPT-2's 50256 is no token of ours: an export sets its tokenizer's
        "eos_token_id": None,
    }


def _gpt2_name(name: str) -> tuple[str, bool]:
    """GPT-2's name for one of a preset's tensors, and whether it is transposed on the way."""
    if name in _GPT2_TOP:
        return _GPT2_TOP[name], False
    if name.startswith("ln_f."):
        return f"transformer.{name}", False
    _, layer, rest = name.split(".", 2)
    module, _, kind = rest.rpartition(".")
    theirs, conv1d = _GPT2_BLOCK[module]
    return f"transformer.h.{layer}.{theirs}.{kind}", conv1d and kind == "weight"


def _preset_name(theirs: str) -> tuple[str, bool] | None:
    """The inverse of `_gpt2_name`; None for what a preset has no tensor of (GPT-2's tied head, buffers)."""
    top = {mapped: name for name, mapped in _GPT2_TOP.items()}
    if theirs in top:
        return top[theirs], False
    if theirs.startswith("transformer.ln_f."):
        return theirs.removeprefix("transformer."), False
    parts = theirs.split(".")
    if parts[:2] != ["transformer", "h"] or len(parts) < 5:
        return None
    module, kind = ".".join(parts[3:-1]), parts[-1]
    block = {mapped: (name, conv1d) for name, (mapped, conv1d) in _GPT2_BLOCK.items()}
    if module not in block:
        return None
    ours, conv1d = block[module]
    return f"blocks.{parts[2]}.{ours}.{kind}", conv1d and kind == "weight"


def to_gpt2_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A preset's tensors as GPT2LMHeadModel names them (its tied head is `wte`)."""
    renamed = {}
    for name, tensor in tensors.items():
        theirs, transposed = _gpt2_name(name)
        renamed[theirs] = tensor.t().contiguous() if transposed else tensor
    return renamed


def from_gpt2_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's tensors as a preset's GPT names them: the inverse of `to_gpt2_names`."""
    ours = {}
    for theirs, tensor in tensors.items():
        if (mapped := _preset_name(theirs)) is not None:
            name, transposed = mapped
            ours[name] = tensor.t().contiguous() if transposed else tensor
    return ours
