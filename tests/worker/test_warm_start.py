"""The step a restarted island resumes at, from what the shards report."""

from __future__ import annotations

import pytest

from diloco.transport.v1 import syncer_pb2 as pb
from diloco.worker.warm_start import job_step


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
