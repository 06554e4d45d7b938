"""An island of two ranks (gloo, separate processes) against a real shard: only rank 0 talks to the
syncer, and every rank ends with the same parameters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from island_rank import RANK_TOKENS
from learner_harness import make_config
from support import tls_env

pytestmark = pytest.mark.process

SCRIPT = Path(__file__).with_name("island_rank.py")


def test_two_rank_island_mixes_in_step_and_pushes_from_rank_0(start_shards, tmp_path):
    shards = start_shards(make_config())
    steps = 11
    outs = [tmp_path / f"rank{rank}.pt" for rank in (0, 1)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                str(rank),
                "2",
                str(tmp_path / "store"),
                shards.targets[0],
                shards.config.to_json(),
                str(steps),
                str(outs[rank]),
            ],
            cwd=tmp_path,
            env={**os.environ, **tls_env(tmp_path / "tls", server=False)},
        )
        for rank in (0, 1)
    ]
    try:
        codes = [proc.wait(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert codes == [0, 0]

    leader, other = (torch.load(out, weights_only=False) for out in outs)
    assert torch.equal(leader["after_start"], other["after_start"]), "start() gives every rank the global values"
    assert torch.equal(leader["final"], other["final"])
    assert not torch.equal(leader["final"], leader["after_start"])

    assert leader["stats"]["syncs_pushed"] >= 4 and leader["stats"]["bytes_pushed"] > 0
    assert other["stats"]["syncs_pushed"] == 0 and other["stats"]["bytes_pushed"] == 0
    assert other["stats"]["bytes_pulled"] == 0
    for key in ("syncs_merged", "syncs_resynced", "syncs_failed", "versions"):
        assert leader["stats"][key] == other["stats"][key], key
    # Else the group's gloo threads outlive destroy_process_group() and can abort the process at its exit.
    assert leader["group_references_kept"] == other["group_references_kept"] == 0, "a closed learner lets go"
    assert leader["stats"]["syncs_merged"] >= 4

    status = shards.status(0)
    island_tokens = sum(RANK_TOKENS)
    for p in (0, 1):
        _seeded, version, tokens = status[p]
        assert version >= 2 and leader["stats"]["versions"][p].version == version
        # every push carries both ranks' tokens: a whole number of steps of the island's 17 tokens
        assert tokens > 0 and tokens % island_tokens == 0
