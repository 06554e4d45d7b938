"""Where a restarted island resumes: the step, from what the shards report, and the optimizer state, from the
newest checkpoint any of its ranks holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trained_model import trained
from warm_rank import ISLAND

from diloco.transport.v1 import syncer_pb2 as pb
from diloco.worker.island import Island
from diloco.worker.island_checkpoint import checkpoint_path, optimizer_tensors, write_atomically
from diloco.worker.warm_start import Source, job_step, newest_checkpoint, restore_island, resume_at

SCRIPT = Path(__file__).with_name("warm_rank.py")


def status(tokens_merged: list[int], live: list[str], left: tuple[str, ...] = ()) -> pb.StatusReply:
    fragments = [pb.FragmentStatus(fragment_id=i, tokens_merged=t) for i, t in enumerate(tokens_merged)]
    return pb.StatusReply(fragments=fragments, live_islands=live, left_islands=list(left))


def test_a_new_job_starts_at_step_zero():
    assert job_step([status([0, 0], ["island-0"])], tokens_per_step=2048) == 0
    assert job_step([], tokens_per_step=2048) == 0


def test_the_step_is_the_tokens_merged_per_island_in_this_islands_steps():
    """Two shards, three islands (one of them finished and left): the most-merged fragment has 3 x 40 steps."""
    statuses = [
        status([3 * 40 * 100, 3 * 30 * 100], ["island-0", "island-1"], ["island-2"]),
        status([3 * 35 * 100], ["island-0", "island-1"], ["island-2"]),
    ]
    assert job_step(statuses, tokens_per_step=100) == 40


def test_an_island_of_bigger_steps_resumes_at_fewer_of_them():
    assert job_step([status([4000], ["a", "b"])], tokens_per_step=100) == 20
    assert job_step([status([4000], ["a", "b"])], tokens_per_step=200) == 10


def test_tokens_per_step_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        job_step([], tokens_per_step=0)


def test_an_island_resumes_at_the_later_of_the_jobs_step_and_its_checkpoints():
    def statuses():
        return [status([4000], ["a", "b"])]  # 20 steps of 100 tokens each

    assert resume_at(Island(None), 12, statuses, tokens_per_step=100) == 20
    assert resume_at(Island(None), 25, statuses, tokens_per_step=100) == 25
    assert resume_at(Island(None), None, statuses, tokens_per_step=100) == 20, "no checkpoint: a late joiner"


def test_an_island_that_does_not_know_its_tokens_per_step_resumes_at_its_checkpoints_step():
    def statuses():
        raise AssertionError("the shards' count is of no use without the tokens per step")

    assert resume_at(Island(None), 25, statuses, tokens_per_step=None) == 25
    assert resume_at(Island(None), None, statuses, tokens_per_step=None) == 0


def test_the_island_takes_the_newest_checkpoint_of_any_rank():
    assert newest_checkpoint([None, 10, 20]) == Source(rank=2, step=20)
    assert newest_checkpoint([30, None, 20]) == Source(rank=0, step=30)


def test_among_checkpoints_of_one_step_the_lowest_rank_serves():
    assert newest_checkpoint([None, 20, 20]) == Source(rank=1, step=20)


def test_an_island_none_of_whose_ranks_has_a_checkpoint_trains_cold():
    assert newest_checkpoint([None, None]) is None
    assert newest_checkpoint([]) is None


def save(folder: Path, rank: int, steps: int) -> None:
    write_atomically(checkpoint_path(folder, ISLAND, rank), optimizer_tensors(trained(steps)[1]), steps)


def test_a_single_rank_island_restores_its_own_checkpoint_or_trains_cold(tmp_path):
    _, optimizer = trained(0)
    assert restore_island(Island(None), optimizer, checkpoint_path(tmp_path, ISLAND, 0)) is None
    assert not optimizer.state
    save(tmp_path, 0, steps=4)
    assert restore_island(Island(None), optimizer, checkpoint_path(tmp_path, ISLAND, 0)) == 4
    assert restore_island(Island(None), trained(0)[1], None) is None, "no checkpoint folder"


@pytest.mark.process
def test_ranks_without_the_newest_checkpoint_take_it_from_the_rank_that_has_it(tmp_path):
    """Three gloo ranks: rank 0's checkpoint was lost with its pod, rank 1's is older (it was stopped
    first), rank 2's is the newest. Every rank ends with rank 2's state and step."""
    save(tmp_path, 1, steps=3)
    save(tmp_path, 2, steps=6)
    outs = [tmp_path / f"rank{rank}.pt" for rank in range(3)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(rank), "3", str(tmp_path / "store"), str(tmp_path), str(outs[rank])],
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(3)
    ]
    try:
        codes = [proc.wait(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert codes == [0, 0, 0]

    newest = optimizer_tensors(trained(6)[1])
    for out in outs:
        taken = torch.load(out, weights_only=False)
        assert taken["step"] == 6
        assert taken["state"].keys() == newest.keys()
        assert all(torch.equal(taken["state"][name], value) for name, value in newest.items())
