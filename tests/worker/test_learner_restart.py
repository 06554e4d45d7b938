"""A learner given a checkpoint folder writes its optimizer state there every `checkpoint_every` inner steps
and when its run ends; a learner started again on that folder (a restarted island) resumes where the job is,
at the later of its checkpoint's step and the shards' count, with that optimizer state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from learner_harness import BATCH, make_config, tiny_model
from support import wait_until

from diloco.worker.island_checkpoint import checkpoint_path, load, optimizer_tensors

pytestmark = pytest.mark.process


def checkpointed(folder: Path, island_id: str) -> tuple[int | None, torch.optim.Optimizer]:
    """The step of rank 0's island checkpoint in `folder` (None: none yet) and its state, loaded into a
    fresh optimizer of the harness's model."""
    probe = torch.optim.AdamW(tiny_model(0).parameters())
    return load(checkpoint_path(folder, island_id, 0), probe), probe


def job_step(shards, islands: int = 1) -> int:
    """The step of the job's islands of BATCH-token steps, from the most tokens any fragment has merged."""
    return max(tokens for _, _, tokens in shards.status(0).values()) // (BATCH * islands)


def same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    mine, theirs = optimizer_tensors(a), optimizer_tensors(b)
    return mine.keys() == theirs.keys() and all(torch.equal(mine[name], theirs[name]) for name in mine)


def test_a_learner_checkpoints_every_n_inner_steps_and_when_its_run_ends(start_shards, island, tmp_path):
    shards = start_shards(make_config())
    a = island(shards, seed=1, name="island-a", checkpoint_dir=tmp_path, checkpoint_every=3)
    for step in (3, 6):  # each write waited for: one still running when the next falls due skips that one
        a.train(3)
        wait_until(lambda: checkpointed(tmp_path, "island-a")[0] == step, timeout=30)
    a.train(1)
    a.learner.flush()
    a.learner.close()
    step, state = checkpointed(tmp_path, "island-a")
    assert step == 7, "the end of the run, for the island that replaces it"
    assert same_state(state, a.optimizer)


def test_a_restarted_learner_resumes_at_the_jobs_step_with_its_checkpointed_optimizer_state(
    start_shards, island, tmp_path
):
    shards = start_shards(make_config())
    options = {"checkpoint_dir": tmp_path, "checkpoint_every": 6, "tokens_per_step": BATCH}
    island(shards, seed=1, name="island-a", **options).train(11)  # checkpoints at 6, then dies unclosed
    wait_until(lambda: checkpointed(tmp_path, "island-a")[0] == 6, timeout=30)
    counted = job_step(shards)
    assert counted > 6, "the shard merged steps the checkpoint has not seen"

    again = island(shards, seed=2, name="island-a", **options)
    assert again.learner.resume_step == again.learner.inner_step == counted, "the job's step, not 0"
    assert again.learner.resumed_warm
    assert same_state(checkpointed(tmp_path, "island-a")[1], again.optimizer), "the AdamW state of step 6"
    again.train(1)
    assert again.learner.inner_step == counted + 1


def test_a_learner_that_does_not_know_its_tokens_per_step_resumes_at_its_checkpoints_step(
    start_shards, island, tmp_path
):
    shards = start_shards(make_config())
    island(shards, seed=1, name="island-a", checkpoint_dir=tmp_path, checkpoint_every=4).train(5)
    wait_until(lambda: checkpointed(tmp_path, "island-a")[0] == 4, timeout=30)
    again = island(shards, seed=1, name="island-a", checkpoint_dir=tmp_path)
    assert (again.learner.resume_step, again.learner.resumed_warm) == (4, True)


def test_an_island_joining_late_without_a_checkpoint_starts_cold_at_the_jobs_step(start_shards, island, tmp_path):
    shards = start_shards(make_config())
    island(shards, seed=1, name="island-a").train(9)
    late = island(shards, seed=2, name="island-b", checkpoint_dir=tmp_path, tokens_per_step=BATCH)
    assert job_step(shards, islands=2) > 0
    assert (late.learner.resume_step, late.learner.resumed_warm) == (job_step(shards, islands=2), False)
    assert not late.optimizer.state
