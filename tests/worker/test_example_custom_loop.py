"""examples/custom_loop/train.py as a pod runs it, against a real shard: two islands of the user's own loop
(a character GRU, four micro-batches per step, a scheduler, a GradScaler) train together, the shard merges
their steps, and their loss falls. Here beside the worker tests, whose shards it uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from learner_harness import TOKEN, make_config
from support import tls_env

pytestmark = pytest.mark.process

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_loop" / "train.py"
STEPS = 60


def test_the_custom_loop_example_trains_as_islands_of_a_job(start_shards, tmp_path):
    config = make_config(inner_steps=10)
    shards = start_shards(config)
    env = {
        **os.environ,
        **tls_env(tmp_path / "tls", server=False),
        "DILOCO_SYNCERS": shards.targets[0],
        "DILOCO_TOKEN": TOKEN,
        "DILOCO_CONFIG": config.to_json(),
        "OMP_NUM_THREADS": "1",
    }
    islands = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--steps", str(STEPS)],
            env={**env, "DILOCO_ISLAND": name},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("island-a", "island-b")
    ]
    for island in islands:
        out, err = island.communicate(timeout=240)
        assert island.returncode == 0, err
        losses = [json.loads(line)["loss"] for line in out.splitlines()]
        assert len(losses) == STEPS // 10
        assert losses[-1] < 0.8 * losses[0], f"the loss did not fall: {losses}"
    fragments = shards.status(0)
    assert all(version >= 2 for _, version, _ in fragments.values()), fragments
    assert shards.live_islands(0) == [], "both islands said Leave"
