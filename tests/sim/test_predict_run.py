"""The failure simulator, fed this machine's measured parameters and a run's failure trace, predicts what
`diloco run --compare` measures on that trace: Decoupled DiLoCo's goodput within a generous band, on a run
that ranks decoupled above both baselines. A much smaller version of bench/simulate_vs_run.py (2 islands,
130 steps, two scripted kills); real processes, real kill -9."""

import pytest

from diloco.cli import main
from diloco.local.failure_trace import FailureEvent, save_trace
from diloco.sim.engine import Policy
from diloco.sim.predict_run import check

pytestmark = pytest.mark.process

# Each island starts in ~3-5 s here, then trains 130 steps for ~9-13 s. The first kill lands early in
# training (or in start-up: the comparison holds either way); the second lands when data-parallel, relaunched
# after the first, trains again, and island-1 still trains: data-parallel pays both kills with both
# workers, Decoupled DiLoCo each with one island.
TRACE = [FailureEvent(4.0, "worker:island-0/0", 0.5), FailureEvent(11.0, "worker:island-1/0", 0.5)]
# The run's own goodput moves by several points with where a kill lands in a step, a round or a start-up,
# and the simulator's prediction was off by up to 0.09 here; 0.2 leaves room for that and still fails a
# simulator that ignored start-up (it predicts ≈ 0.87 for decoupled here).
TOLERANCE = 0.2


def test_simulator_predicts_decoupled_goodput_on_a_run_that_ranks_it_first(tmp_path):
    save_trace(tmp_path / "trace.json", TRACE)
    run_dir = tmp_path / "run"
    args = [
        "run",
        "--compare",
        "--trace",
        str(tmp_path / "trace.json"),
        "--islands",
        "2",
        "--steps",
        "130",
        "--batch-size",
        "8",
        "--inner-steps",
        "10",
        "--fragments",
        "1",
        "--overlap-steps",
        "2",
        "--grace-seconds",
        "1",
        "--eval-every",
        "1000",
        "--quiet",
        "--out",
        str(run_dir),
    ]
    assert main(args) == 0

    result = check(run_dir, TOLERANCE)
    by_mode = result.by_mode()
    assert set(by_mode) == {"diloco", "sync-diloco", "ddp"}
    assert all(p.measured.kills == 2 for p in result.predictions), "every mode replayed both kills"
    assert by_mode["diloco"].policy is Policy.DECOUPLED_DILOCO and by_mode["ddp"].policy is Policy.DP
    assert by_mode["ddp"].measured.relaunches >= 2, "data-parallel relaunched every worker after a kill"

    measured = {mode: p.measured.goodput for mode, p in by_mode.items()}
    predicted = {mode: p.predicted for mode, p in by_mode.items()}
    assert measured["diloco"] > measured["sync-diloco"] and measured["diloco"] > measured["ddp"], measured
    assert abs(predicted["diloco"] - measured["diloco"]) <= TOLERANCE, (predicted, measured)
    # Not asserted: the predicted order of sync-diloco and decoupled. The simulator's islands step in
    # lockstep, so a barrier costs them the merge latency it is given (now the mean wait at a barrier, which
    # includes waiting for the other island: its sync-diloco error fell from +0.07..+0.19 to +0.04 in one
    # run), and with restarts of 1.4 s the two kills of this short trace cost too little for the order to
    # be more than noise; bench/simulate_vs_run.py's longer trace is where the ranking is checked.
    print("\n" + result.parameters() + "\n" + result.table())
