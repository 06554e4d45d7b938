import math

import pytest
import torch

from diloco.api.job import PRESET_TENSORS
from diloco.core.fragments import plan_fragments
from diloco.worker.data import IslandReader, load_tokens
from diloco.worker.model import (
    GPT,
    PRESETS,
    ModelPreset,
    build_model,
    from_gpt2_names,
    gpt2_config,
    resolve_preset,
    to_gpt2_names,
)

# Stated parameter-count targets of the presets (distinct elements, tied head counted once).
TARGETS = {"tiny": 0.84e6, "small": 25e6, "medium": 98e6, "large": 320e6, "xl": 0.94e9}


@pytest.fixture(scope="module")
def tiny() -> GPT:
    return build_model("tiny", seed=0)


def test_logits_and_loss_shapes(tiny):
    idx = torch.randint(0, 256, (3, 17))
    logits, loss = tiny(idx)
    assert logits.shape == (3, 17, 256) and loss is None
    logits, loss = tiny(idx, idx)
    assert loss.shape == () and torch.isfinite(loss)


def test_sequence_longer_than_context_is_refused(tiny):
    with pytest.raises(ValueError, match="context"):
        tiny(torch.zeros(1, tiny.preset.context + 1, dtype=torch.long))


def test_initial_loss_is_uniform_over_bytes(tiny):
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (8, 128), generator=generator)
    targets = torch.randint(0, 256, (8, 128), generator=generator)
    _, loss = tiny(idx, targets)
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)


def test_init_is_deterministic_per_seed_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = build_model("tiny", 7), build_model("tiny", 7), build_model("tiny", 8)
    assert torch.equal(state, torch.random.get_rng_state())
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name


def test_init_follows_gpt2_scheme(tiny):
    params = dict(tiny.named_parameters())
    assert torch.equal(params["blocks.0.ln1.weight"], torch.ones(128))
    assert torch.equal(params["blocks.0.attn.qkv.bias"], torch.zeros(384))
    assert params["tok_emb.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert params["blocks.2.mlp.proj.weight"].std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)


def test_output_head_is_tied_to_token_embedding():
    model = build_model("tiny", 0)
    assert not any("head" in name for name, _ in model.named_parameters())
    assert not any("head" in name for name in model.state_dict())
    idx = torch.zeros(1, 4, dtype=torch.long)
    before, _ = model(idx)
    with torch.no_grad():
        model.tok_emb.weight[200] += 1.0  # token 200 is not in the input: only the head sees it
    after, _ = model(idx)
    changed = (after - before).abs().amax(dim=(0, 1)) > 0
    assert changed[200] and changed.sum() == 1


def test_parameter_names_carry_layer_indices(tiny):
    names = [name for name, _ in tiny.named_parameters()]
    for layer in range(4):
        assert f"blocks.{layer}.attn.qkv.weight" in names
        assert f"blocks.{layer}.mlp.proj.weight" in names
    shapes = [(name, tuple(p.shape)) for name, p in tiny.named_parameters()]
    plan = plan_fragments(shapes, 2)
    assert {n.split(".")[1] for n in plan[0].names if n.startswith("blocks.")} == {"0", "2"}
    assert {n.split(".")[1] for n in plan[1].names if n.startswith("blocks.")} == {"1", "3"}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_counts_on_meta_device(name):
    model = build_model(name, 0, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.num_parameters() == pytest.approx(TARGETS[name], rel=0.15)
    assert model.num_parameters() == sum(p.numel() for p in model.state_dict().values())


def test_presets_and_errors():
    assert resolve_preset("tiny") is PRESETS["tiny"]
    custom = ModelPreset("custom", vocab_size=50, context=8, d_model=16, n_layers=1, n_heads=2)
    assert build_model(custom, 0).preset is custom
    with pytest.raises(ValueError, match="known presets: tiny, small, medium, large, xl"):
        build_model("huge", 0)
    with pytest.raises(ValueError, match="divisible"):
        ModelPreset("bad", vocab_size=8, context=8, d_model=10, n_layers=1, n_heads=3)


def test_causality(tiny):
    idx = torch.randint(0, 256, (2, 32))
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    before, _ = tiny(idx)
    after, _ = tiny(changed)
    assert torch.equal(before[:, :20], after[:, :20])
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_bf16_autocast_runs_and_backpropagates(tiny):
    idx = torch.randint(0, 256, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = tiny(idx, idx)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in tiny.parameters())
    tiny.zero_grad(set_to_none=True)


def test_dropout_is_active_only_in_training():
    preset = ModelPreset("drop", vocab_size=32, context=16, d_model=32, n_layers=2, n_heads=2, dropout=0.5)
    model = build_model(preset, 0)
    idx = torch.randint(0, 32, (2, 16))
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])


def test_tiny_preset_learns_the_embedded_corpus(one_thread):
    model = build_model("tiny", 0)
    sampler = IslandReader(load_tokens(None, 1 << 20), 128, shard=0, shards=1, rank=0, ranks=1, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(30):
        inputs, targets = sampler.next_batch(16)
        _, loss = model(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 5.0
    assert sum(losses[-5:]) / 5 < 4.0


def test_the_api_states_each_presets_tensor_count_as_the_learner_counts_them():
    """The CRD bounds spec.training.fragments by these counts; the Learner cuts fragments of trainable tensors."""
    counted = {
        name: sum(p.requires_grad for p in build_model(name, seed=0, device="meta").parameters()) for name in PRESETS
    }
    assert {size.value: count for size, count in PRESET_TENSORS.items()} == counted


def test_flops_per_token_counts_every_multiplying_parameter_and_the_attention():
    model = build_model("medium", seed=0, device="meta")
    p = model.preset
    expected = 6 * (model.num_parameters() - p.context * p.d_model) + 12 * p.n_layers * p.d_model * p.context
    assert model.flops_per_token() == expected
    assert 6.9e8 < model.flops_per_token() < 7.0e8, "GPT-2 small's shape over 16k tokens: 6 x 98M plus 113M"


def test_activation_checkpointing_changes_memory_not_results():
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointed in (False, True):
        model = build_model("tiny", seed=0, checkpoint_activations=checkpointed)
        _, loss = model(tokens, tokens)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (plain_loss, plain), (ckpt_loss, ckpt) = grads
    assert ckpt_loss == pytest.approx(plain_loss, abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, ckpt))


def test_a_preset_is_gpt2_under_transformers_names_and_reads_back_unchanged(tiny):
    """The export's mapping: transformers' GPT2LMHeadModel, configured by gpt2_config and given the renamed
    tensors, computes our logits exactly; and the renaming inverts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = gpt2_config(tiny.preset)
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    ours = dict(tiny.state_dict())
    gpt2.load_state_dict(to_gpt2_names(ours), strict=False)
    assert torch.equal(gpt2.lm_head.weight, ours["tok_emb.weight"]), "the head is tied to the embedding"
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(gpt2.eval()(input_ids=idx).logits, tiny.eval()(idx)[0], atol=1e-5)
    back = from_gpt2_names(dict(gpt2.state_dict()))
    assert back.keys() == ours.keys() and all(torch.equal(back[n], ours[n]) for n in ours)
