"""An island's optimizer state on disk: written whole or not at all, read back into a fresh optimizer."""

from __future__ import annotations

import torch
from torch import nn

from diloco.worker.adamw import AdamW
from diloco.worker.island_checkpoint import IslandCheckpointer, checkpoint_path, load, optimizer_tensors


def trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    optimizer = AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def fresh_like(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    twin = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    twin.load_state_dict(model.state_dict())
    return twin, AdamW(twin.parameters(), lr=1e-2)


def test_a_fresh_optimizer_takes_the_saved_state_and_steps_as_the_original_does(tmp_path):
    model, optimizer = trained(3)
    checkpointer = IslandCheckpointer(checkpoint_path(tmp_path, "island-0", 0), optimizer)
    assert checkpointer.save(3)
    checkpointer.close(30)
    assert checkpointer.saved_step == 3
    twin, restored = fresh_like(model)
    assert load(checkpointer.path, restored) == 3
    saved, loaded = optimizer_tensors(optimizer), optimizer_tensors(restored)
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert all(v.device.type == "cpu" for k, v in loaded.items() if k.endswith(".step")), "AdamW's step on the CPU"
    batch = torch.randn(3, 4)
    for net, opt in ((model, optimizer), (twin, restored)):
        net(batch).square().sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_no_checkpoint_or_another_models_leaves_the_optimizer_cold(tmp_path):
    model, optimizer = trained(2)
    path = checkpoint_path(tmp_path, "island-0", 0)
    _, cold = fresh_like(model)
    assert load(path, cold) is None, "nothing saved yet"
    assert not IslandCheckpointer(path, AdamW(nn.Linear(4, 3).parameters())).save(1), "nothing to save yet"
    checkpointer = IslandCheckpointer(path, optimizer)
    checkpointer.save(2)
    checkpointer.close(30)
    foreign = AdamW(nn.Linear(5, 5).parameters())
    assert load(path, foreign) is None and not foreign.state
    path.write_bytes(b"not a checkpoint")
    assert load(path, cold) is None and not cold.state


def test_a_write_cut_short_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    model, optimizer = trained(1)
    checkpointer = IslandCheckpointer(checkpoint_path(tmp_path, "island-0", 0), optimizer)
    checkpointer.save(1)
    checkpointer.close(30)

    def killed_mid_write(tensors, filename, metadata):
        with open(filename, "wb") as handle:
            handle.write(b"half a file")
        raise OSError("no space left on device")

    monkeypatch.setattr("diloco.worker.island_checkpoint.save_file", killed_mid_write)
    checkpointer.save(2)
    checkpointer.close(30)
    assert checkpointer.saved_step == 1
    assert [p.name for p in tmp_path.iterdir()] == ["island-0-rank0.safetensors"], "no temporary file left"
    _, restored = fresh_like(model)
    assert load(checkpointer.path, restored) == 1
