"""The model a job names, as the trainer drives it: a preset, or a transformers architecture from its
configuration, the same on every island for a seed, fragmented across depth, in bf16 and with activation
checkpointing as the presets are, and started from a checkpoint folder on request."""

import json
from pathlib import Path

import pytest
import torch

from diloco.core.fragments import plan_fragments
from diloco.worker.language_model import ModelSpec, build, read_config
from diloco.worker.precision import autocast, resolve_precision

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_llama"
LLAMA = json.loads((EXAMPLE / "config.json").read_text())
TOKENS = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(0))


def named(model):
    return {name: p.detach() for name, p in model.module.named_parameters()}


def test_a_model_is_named_by_preset_config_file_folder_or_inline_json(tmp_path):
    assert ModelSpec.parse("small") == ModelSpec(preset="small")
    assert ModelSpec.parse(None) == ModelSpec(preset="tiny")
    by_file = ModelSpec.parse(str(EXAMPLE / "config.json"))
    assert by_file.config == LLAMA and by_file.name == "llama" and by_file.context == 128
    assert ModelSpec.parse(str(EXAMPLE)).config == LLAMA, "a folder holding a config.json"
    assert ModelSpec.parse(json.dumps(LLAMA)) == by_file
    assert ModelSpec.parse(None, init_from=EXAMPLE) == by_file, "a checkpoint folder's own configuration"
    with pytest.raises(ValueError, match="neither a preset"):
        ModelSpec.parse("huge")
    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    with pytest.raises(ValueError, match="model_type"):
        read_config(tmp_path)


def test_every_island_builds_the_same_weights_for_the_seed_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, again = build(ModelSpec(config=LLAMA), 7), build(ModelSpec(config=LLAMA), 7)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(first_value, named(again)[name]) for name, first_value in named(first).items())
    other = named(build(ModelSpec(config=LLAMA), 8))
    assert not torch.equal(
        other["model.layers.0.self_attn.q_proj.weight"], named(first)["model.layers.0.self_attn.q_proj.weight"]
    )


def test_a_transformers_model_is_fragmented_across_depth_by_its_own_names():
    model = build(ModelSpec(config=LLAMA), 0)
    plan = plan_fragments([(name, tuple(p.shape)) for name, p in model.module.named_parameters()], 2)
    layers = [sorted({n.split(".")[2] for n in f.names if n.startswith("model.layers.")}) for f in plan]
    assert layers == [["0", "2"], ["1", "3"]], "layers strided across the fragments, as for the presets"


def test_the_forward_pass_gives_logits_and_the_next_token_loss():
    model = build(ModelSpec(config=LLAMA), 0)
    logits, loss = model.forward(TOKENS[:, :-1], TOKENS[:, 1:])
    assert logits.shape == (2, 32, 2048) and model.vocab_size == 2048 and model.context == 128
    assert loss.item() == pytest.approx(torch.log(torch.tensor(2048.0)).item(), abs=0.3), "untrained: uniform"
    assert model.forward(TOKENS, None)[1] is None
    assert model.num_parameters() == pytest.approx(1.3e6, rel=0.1)
    assert model.flops_per_token > 6 * (model.num_parameters() - 2048 * 128), "the head multiplies; the input does not"


def test_bf16_autocast_and_activation_checkpointing_train_it_as_they_train_the_presets():
    plain = build(ModelSpec(config=LLAMA), 0)
    checkpointed = build(ModelSpec(config=LLAMA), 0, checkpoint_activations=True)
    assert checkpointed.module.is_activation_checkpointing
    grads = []
    for model in (plain, checkpointed):
        model.module.train()
        model.forward(TOKENS[:, :-1], TOKENS[:, 1:])[1].backward()
        grads.append({n: p.grad for n, p in model.module.named_parameters()})
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0]), "the same gradients"
    device = torch.device("cpu")
    with autocast(resolve_precision("bf16", device), device):
        _, loss = plain.forward(TOKENS[:, :-1], TOKENS[:, 1:])
    assert loss.dtype == torch.float32 and torch.isfinite(loss), "the loss is taken in float32 over bf16 logits"
    assert all(p.dtype == torch.float32 for p in plain.module.parameters()), "master weights stay float32"


def test_continued_pretraining_starts_from_the_checkpoints_weights(tmp_path):
    trained = build(ModelSpec(config=LLAMA), 3)
    trained.module.save_pretrained(tmp_path)
    resumed = build(ModelSpec.parse(None, init_from=tmp_path), 0, init_from=tmp_path)
    assert all(torch.equal(value, named(resumed)[name]) for name, value in named(trained).items())
    with pytest.raises(ValueError, match="does not fit"):
        build(ModelSpec(config=LLAMA | {"hidden_size": 64}), 0, init_from=tmp_path)


def test_a_preset_continues_from_its_own_export(tmp_path):
    """A preset's export is GPT-2 under transformers' names; initFrom reads it back into the preset."""
    from diloco.export.assemble import FragmentRecord, GlobalModel
    from diloco.export.model_files import save

    trained = named(build(ModelSpec(preset="tiny"), 3))
    save(tmp_path, GlobalModel(trained, (FragmentRecord(0, 0, 1, 10, tuple(trained)),)))
    resumed = build(ModelSpec(preset="tiny"), 0, init_from=tmp_path)
    assert all(torch.equal(named(resumed)[name], value) for name, value in trained.items())


@pytest.mark.gpu
def test_a_transformers_model_trains_on_cuda_in_bf16_with_activation_checkpointing():
    device = torch.device("cuda")
    model = build(ModelSpec(config=LLAMA), 0, device=device, checkpoint_activations=True)
    optimizer = torch.optim.AdamW(model.module.parameters(), lr=3e-3)
    tokens = TOKENS.to(device).repeat(8, 1)
    losses = []
    for _ in range(30):
        with autocast(resolve_precision("auto", device), device):
            _, loss = model.forward(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.module.parameters())
    assert losses[-1] < losses[0] - 1.0, losses
