"""What a learner refuses before it touches the network: missing settings, wrong use, foreign layouts."""

from __future__ import annotations

import pytest
import torch
from learner_harness import TOKEN, make_config, tiny_model

from diloco.transport.tls import PLAINTEXT
from diloco.worker.learner import CHECKPOINT_EVERY, Learner
from diloco.worker.stats import StatsRecorder
from diloco.worker.sync import fragment_values


def optimized_model():
    model = tiny_model(1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


POD_ENV = {
    "DILOCO_SYNCERS": "127.0.0.1:1",
    "DILOCO_ISLAND": "island-0",
    "DILOCO_TOKEN": TOKEN,
    "DILOCO_INSECURE_PLAINTEXT": "1",
}


@pytest.mark.parametrize("missing", ["DILOCO_SYNCERS", "DILOCO_ISLAND"])
def test_from_env_names_a_missing_variable(monkeypatch, missing):
    for name, value in POD_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(missing)
    with pytest.raises(ValueError, match=missing):
        Learner.from_env(*optimized_model())


def test_from_env_splits_the_shard_list_and_reads_the_config(monkeypatch):
    config = make_config(inner_steps=8, mix_alpha=0.25)
    monkeypatch.setenv("DILOCO_SYNCERS", " shard-0:50051, shard-1:50051 ,")
    monkeypatch.setenv("DILOCO_ISLAND", "island-3")
    monkeypatch.setenv("DILOCO_TOKEN", TOKEN)
    monkeypatch.setenv("DILOCO_CONFIG", config.to_json())
    monkeypatch.setenv("DILOCO_INSECURE_PLAINTEXT", "1")
    learner = Learner.from_env(*optimized_model())
    assert learner.syncers == ["shard-0:50051", "shard-1:50051"]
    assert learner.island_id == "island-3"
    assert learner.config == config


def test_from_env_checkpoints_every_so_many_steps_as_told(monkeypatch, tmp_path):
    for name, value in {**POD_ENV, "DILOCO_CHECKPOINT_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    assert Learner.from_env(*optimized_model()).checkpoint_every == CHECKPOINT_EVERY
    monkeypatch.setenv("DILOCO_CHECKPOINT_EVERY", "7")
    assert Learner.from_env(*optimized_model()).checkpoint_every == 7


def test_optimizer_steps_before_start_are_not_inner_steps():
    model, optimizer = optimized_model()
    learner = Learner(
        model, optimizer, make_config(), syncers=["127.0.0.1:1"], token=TOKEN, security=PLAINTEXT, island_id="a"
    )
    model(torch.ones(1, 8)).sum().backward()
    learner.report(tokens=1)
    optimizer.step()
    assert learner.inner_step == 0 and learner.stats.inner_steps == 0


def test_more_fragments_than_tensors_is_refused():
    with pytest.raises(ValueError, match="fragments"):
        Learner(
            *optimized_model(),
            make_config(inner_steps=8, fragments=8, overlap_steps=0),
            syncers=["127.0.0.1:1"],
            token=TOKEN,
            security=PLAINTEXT,
            island_id="a",
        )


def test_a_fragment_of_another_model_is_refused():
    with pytest.raises(ValueError, match="same model"):
        fragment_values(0, ("0.weight", "0.bias"), [("0.weight", torch.zeros(1)), ("1.bias", torch.zeros(1))])


def test_stats_refuse_unknown_counters():
    recorder = StatsRecorder()
    recorder.add(syncs_pushed=1, bytes_pushed=10)
    with pytest.raises(AttributeError):
        recorder.add(syncs_pushd=1)
    snapshot = recorder.snapshot()
    assert (snapshot.syncs_pushed, snapshot.bytes_pushed) == (1, 10)
