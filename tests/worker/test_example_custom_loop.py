"""examples/custom_loop/train.py as a pod runs it, against a real shard: two islands of the user's own loop
(a character GRU, four micro-batches per step, a scheduler, a GradScaler) train together, the shard merges
their steps, and their loss falls; an island killed with SIGKILL comes back where the job is. Here beside
the worker tests, whose shards it uses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from learner_harness import TOKEN, make_config
from safetensors import safe_open
from support import tls_env, wait_until

pytestmark = pytest.mark.process

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_loop" / "train.py"
STEPS = 60
# The example's defaults: 8 rows of 32 characters per micro-batch, 4 micro-batches a step, peak lr 3e-3.
TOKENS_PER_STEP = 4 * 8 * 32
PEAK_LR = 3e-3


def island_env(shards, folder: Path, name: str) -> dict[str, str]:
    return {
        **os.environ,
        **tls_env(folder / "tls", server=False),
        "DILOCO_SYNCERS": shards.targets[0],
        "DILOCO_TOKEN": TOKEN,
        "DILOCO_CONFIG": shards.config.to_json(),
        "DILOCO_ISLAND": name,
        "OMP_NUM_THREADS": "1",
    }


def records(out: str) -> tuple[dict, list[dict]]:
    """The example's first line (where it resumed) and its step lines."""
    start, *steps = (json.loads(line) for line in out.splitlines())
    return start, steps


def last_step(printed: Path) -> int:
    """The last step the example has printed so far to the file `printed` (0 before any)."""
    lines = printed.read_text().rpartition("\n")[0].splitlines()  # whole lines only
    return json.loads(lines[-1]).get("step", 0) if lines else 0


def test_the_custom_loop_example_trains_as_islands_of_a_job(start_shards, tmp_path):
    shards = start_shards(make_config(inner_steps=10))
    islands = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--steps", str(STEPS)],
            env=island_env(shards, tmp_path, name),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("island-a", "island-b")
    ]
    for island in islands:
        out, err = island.communicate(timeout=240)
        assert island.returncode == 0, err
        start, steps = records(out)
        # A new job: at step 0, or for the island that joins second, at the steps the first has had merged.
        assert not start["warm"] and start["resumed_at"] < STEPS // 2, start
        assert start["lr"] == pytest.approx(PEAK_LR * min(1.0, (start["resumed_at"] + 1) / 20)), "the warmup there"
        assert steps[-1]["step"] == STEPS
        losses = [s["loss"] for s in steps]
        assert losses[-1] < 0.8 * losses[0], f"the loss did not fall: {losses}"
    fragments = shards.status(0)
    assert all(version >= 2 for _, version, _ in fragments.values()), fragments
    assert shards.live_islands(0) == [], "both islands said Leave"


def test_a_killed_island_of_the_example_resumes_at_the_jobs_step_warm(start_shards, tmp_path):
    """The island checkpoints every 10 steps into DILOCO_CHECKPOINT_DIR (as the operator sets it), gets
    SIGKILL past step 50, and is started again with the same settings (a container restart): it resumes at
    the job's step as the shard counts it, not at 0, with its AdamW state, its warmup schedule at that step,
    and a loss near the one it left off at rather than a cold start's."""
    shards = start_shards(make_config(inner_steps=10))
    env = {**island_env(shards, tmp_path, "island-a"), "DILOCO_CHECKPOINT_DIR": str(tmp_path / "island")}
    env["DILOCO_CHECKPOINT_EVERY"] = "10"
    command = [sys.executable, str(EXAMPLE), "--steps", "100", "--warmup", "100", "--log-every", "5"]
    printed = tmp_path / "first.out"
    with printed.open("w") as out:
        first = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: last_step(printed) >= 50, timeout=240)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    _, before = records(printed.read_text())
    with safe_open(str(tmp_path / "island" / "island-a-rank0.safetensors"), framework="pt") as checkpoint:
        checkpointed = int(checkpoint.metadata()["step"])
    counted = max(tokens for _, _, tokens in shards.status(0).values()) // TOKENS_PER_STEP
    assert checkpointed >= 10 and counted >= 30, (checkpointed, counted)

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr
    start, after = records(again.stdout)
    assert start["warm"], "the AdamW state came back from the checkpoint"
    assert start["resumed_at"] == max(checkpointed, counted), "the job's step, not 0"
    assert start["lr"] == pytest.approx(PEAK_LR * (start["resumed_at"] + 1) / 100), "the warmup at that step"
    assert after[0]["step"] > start["resumed_at"] and after[-1]["step"] == 100
    assert len(after) == 100 // 5 - start["resumed_at"] // 5, "no step trained again, none skipped"
    left_at, cold = before[-1]["loss"], before[0]["loss"]
    assert after[0]["loss"] < left_at + 0.25 * (cold - left_at), (cold, left_at, after[0]["loss"])


@pytest.mark.gpu
def test_the_custom_loop_example_trains_on_cuda_in_fp16_through_its_grad_scaler(start_shards, tmp_path):
    """On a GPU the example autocasts to fp16 and steps through an enabled GradScaler, which skips the
    optimizer step (and so the learner's inner step) whenever a scaled gradient overflows: the island still
    counts exactly its steps, merges, and learns."""
    shards = start_shards(make_config(inner_steps=10))
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", str(STEPS)],
        env=island_env(shards, tmp_path, "island-gpu"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr
    start, steps = records(run.stdout)
    assert start["device"] == "cuda" and start["fp16"], start
    assert steps[-1]["step"] == STEPS
    losses = [s["loss"] for s in steps]
    print(f"\nthe example on cuda in fp16: loss {losses[0]} -> {losses[-1]}")
    assert losses[-1] < 0.8 * losses[0], f"the loss did not fall: {losses}"
    assert all(version >= 2 for _, version, _ in shards.status(0).values())
