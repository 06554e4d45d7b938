"""An island's optimizer state on disk, with its error-feedback buffers: written whole or not at all, read back
into a fresh optimizer and learner."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from learner_harness import make_config
from torch import nn
from trained_model import trained
from worker_process import start_worker

from diloco.worker.adamw import AdamW
from diloco.worker.error_feedback import ErrorFeedback
from diloco.worker.island_checkpoint import (
    IslandCheckpointer,
    checkpoint_path,
    load,
    load_error_feedback,
    optimizer_tensors,
)


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


def test_the_error_feedback_buffers_are_saved_beside_the_optimizer_state_and_read_back_apart(tmp_path):
    model, optimizer = trained(2)
    feedback = ErrorFeedback()
    held = [torch.randn(8, 4), torch.randn(8)]
    feedback.accepted(1, held, [torch.zeros_like(t) for t in held])
    checkpointer = IslandCheckpointer(checkpoint_path(tmp_path, "island-0", 0), optimizer, feedback)
    checkpointer.save(2)
    checkpointer.close(30)
    _, restored = fresh_like(model)
    assert load(checkpointer.path, restored) == 2, "the optimizer's restore passes over the buffers"
    saved = load_error_feedback(checkpointer.path)
    assert sorted(saved) == ["1.0", "1.1"] and all(torch.equal(saved[f"1.{i}"], t) for i, t in enumerate(held))


def test_no_checkpoint_or_one_without_buffers_restores_no_error_feedback(tmp_path):
    _, optimizer = trained(1)
    path = checkpoint_path(tmp_path, "island-0", 0)
    assert load_error_feedback(path) == {}, "nothing saved yet"
    checkpointer = IslandCheckpointer(path, optimizer)
    checkpointer.save(1)
    checkpointer.close(30)
    assert load_error_feedback(path) == {}, "an island without the sparse encoding keeps none"
    path.write_bytes(b"not a checkpoint")
    assert load_error_feedback(path) == {}


@pytest.mark.process
def test_a_restarted_sparse_worker_sends_on_from_the_buffers_it_checkpointed(start_shards, tmp_path):
    """`diloco-worker` with the sparse encoding, run three times as island-0 against one shard: the second
    run restores the buffers the first checkpointed at its last step; the third, its checkpoint deleted,
    declares as many values lost as the second restored."""
    config = make_config(encoding="sparse", block_size=16, top_k_fraction=1 / 8)
    shards = start_shards(config)
    folder = tmp_path / "island-checkpoints"
    path = checkpoint_path(folder, "island-0", 0)

    def logs_of_a_run(steps: int) -> dict[str, dict]:
        """The worker's log lines about its error feedback, by message, after it trained up to `steps`."""
        flags = ["--steps", str(steps), "--checkpoint-dir", str(folder), "--checkpoint-every", "4"]
        flags += ["--eval-every", "1000", "--max-data-bytes", "200000"]
        worker = start_worker(
            tmp_path, config, shards.targets[0], "island-0", *flags, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        _, stderr = worker.communicate(timeout=240)
        assert worker.returncode == 0, stderr.decode()
        lines = [json.loads(line) for line in stderr.decode().splitlines() if line.startswith("{")]
        return {line["message"].split(":")[0]: line for line in lines if "error feedback" in line["message"]}

    assert logs_of_a_run(8) == {}, "a first start has nothing to restore or lose"
    assert load_error_feedback(path), "the first run checkpointed its buffers"
    again = logs_of_a_run(12)
    assert list(again) == ["error feedback restored from the island checkpoint"]
    restored = again["error feedback restored from the island checkpoint"]
    assert restored["fragments"] == [0, 1] and restored["values"] > 0
    path.unlink()
    cold = logs_of_a_run(16)
    assert list(cold) == ["error feedback lost"] and cold["error feedback lost"]["values"] == restored["values"]
