"""`diloco run --hostile-islands 1`: 4 islands, the last replaced for the whole run by a client with the job's
token and CA that pushes deltas of 1e38 for every fragment each round, pushes with Inf, 1e-300, negative
and NaN seconds per step, 2^64 - 1 inner steps and Inf values, and joins thousands of island ids; against
the same run of the 3 honest islands alone (same seed, same data shards)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from diloco.cli import main
from diloco.export.model_files import load
from diloco.progress import DoneEvent, MergeEvent, read_events

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]

HONEST = ("island-0", "island-1", "island-2")
LOSS_BOUND = 1.02
"""The issue's bound: the final loss with the hostile client within 2% of the run without it."""


def run(out, *extra):
    args = ["run", "--steps", "100", "--inner-steps", "10", "--eval-every", "100", "--quiet", "--out", str(out)]
    assert main([*args, *extra]) == 0, "the run completed (no timeout, every honest island finished)"
    (summary,) = json.loads((out / "summary.json").read_text())
    return summary


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    hostile = run(folder / "hostile", "--islands", "4", "--hostile-islands", "1")
    alone = run(folder / "alone", "--islands", "3")
    return hostile, alone, folder / "hostile" / "diloco"


def test_the_honest_islands_train_on_and_the_shard_refuses_the_hostile_client_or_leaves_it_out(runs):
    hostile, _, out = runs
    report = hostile["hostile"]["hostile:island-3"]
    calls = report["calls"]
    assert report["rounds"] >= 10 and report["ids_used"] >= 1000, "it misbehaved for the whole run"
    assert calls.get("push huge OK", 0) >= 10, "its huge finite deltas were taken, to be left out"
    for bad in ("step_seconds=inf", "step_seconds=1e-300", "step_seconds=-1.0", "step_seconds=nan"):
        assert calls.get(f"push {bad} INVALID_ARGUMENT", 0) >= 1, bad
    assert calls.get("push inner_steps=2^64-1 INVALID_ARGUMENT", 0) >= 10
    assert calls.get("push Inf values INVALID_ARGUMENT", 0) >= 10
    assert not any(call.startswith("push") and call.endswith(" OK") for call in calls if "huge" not in call)
    assert hostile["rejected"].get("field", 0) >= 20 and hostile["rejected"].get("malformed", 0) >= 10
    # Whether its ids outgrow the 4096 a shard knows at once depends on the run's length (ids are forgotten after
    # 4 island timeouts): tests/syncer/test_known_islands.py checks that refusal.
    # Its pending push is replaced by its next one until a merge comes, so not every huge push is left out.
    assert hostile["outliers"] >= 1, "its huge deltas were left out of the merges"

    assert hostile["restarts"] == 0, "no honest island crashed, and the shard never died"
    assert set(hostile["round_steps"]) == set(HONEST)
    events = read_events(out / "progress")
    done = {e.source.island: e for e in events if isinstance(e, DoneEvent) and e.source.rank == 0}
    assert set(done) == set(HONEST) and all(e.learner.rounds_begun >= 4 for e in done.values())
    merged = {key[0] for e in read_events(out / "merges") if isinstance(e, MergeEvent) for key in e.pushes}
    assert set(HONEST) <= merged, "every honest island's pushes were merged"
    assert "island-3" not in merged, "none of the hostile client's deltas was merged"
    assert load(out / "model").config["outer_steps"] >= 4, "the global model took outer steps"
    tensors = load_file(out / "model" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in tensors.values()), "every fragment stayed finite"
    assert math.isfinite(hostile["final_loss"])


def test_the_final_loss_is_within_two_percent_of_the_run_without_the_hostile_client(runs):
    hostile, alone, _ = runs
    print(f"final loss with the hostile client {hostile['final_loss']:.4f}, without {alone['final_loss']:.4f}")
    assert hostile["final_loss"] <= LOSS_BOUND * alone["final_loss"]
