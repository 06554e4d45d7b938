"""The shard process's own settings: how many cores it works on."""

import os

import pytest

from diloco.syncer.main import parse_args, threads


def test_a_shard_works_on_the_cores_it_is_given_else_every_one_it_may_run_on(monkeypatch):
    assert threads(16) == 16
    assert threads(0) == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="threads"):
        threads(-1)
    monkeypatch.setenv("DILOCO_SYNCER_THREADS", "12")
    assert parse_args([]).threads == 12, "as the operator sets it from the shard's CPU request"
    assert parse_args(["--threads", "3"]).threads == 3
