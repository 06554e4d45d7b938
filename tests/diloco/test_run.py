"""`diloco run` end to end: real syncer and worker processes on loopback, real kill -9 of workers."""

import json
import math

import pytest

from diloco.cli import main
from diloco.failures import FailureEvent, load_trace, save_trace

pytestmark = pytest.mark.process

INITIAL_LOSS = math.log(256)  # an untrained byte-level model


def run(tmp_path, name, *extra):
    out = tmp_path / name
    args = ["run", "--islands", "2", "--steps", "40", "--inner-steps", "10", "--eval-every", "20", "--quiet",
            "--out", str(out), *extra]
    assert main(args) == 0
    return json.loads((out / "summary.json").read_text()), out


def test_a_short_run_lowers_the_loss_and_faults_do_not_derail_it(tmp_path):
    (clean,), out = run(tmp_path, "clean")
    assert clean["final_loss"] < 3.5 < INITIAL_LOSS, "40 steps of 2 islands reach well below ln(256)"
    assert clean["kills"] == 0 and clean["restarts"] == 0
    assert 0.3 < clean["goodput"] <= 1.0
    assert (out / "loss.png").stat().st_size > 0

    trace = [FailureEvent(3.0, "worker:island-0/0", 1.0), FailureEvent(6.0, "worker:island-1/0", 1.0)]
    save_trace(tmp_path / "trace.json", trace)
    (faulty,), out = run(tmp_path, "faulty", "--trace", str(tmp_path / "trace.json"))
    assert faulty["kills"] == 2 and faulty["restarts"] == 2, "both workers were killed with SIGKILL and replaced"
    assert math.isfinite(faulty["final_loss"])
    assert faulty["final_loss"] < clean["final_loss"] + 0.5, "kills cost some steps, not the run"
    assert load_trace(out / "trace.json") == trace, "the trace the run replayed is kept beside its results"
