"""The phase: Failed wins over Succeeded, which wins over Suspended; otherwise Running with everything ready,
Degraded once training has started and something is not, Pending before; a finished job stays finished.
Each change is announced by an Event."""

from status_builders import at

from diloco.api.job import DiLoCoJobStatus, IslandStatus, Phase, Reform
from diloco.operator.policies.phase import (
    Readiness,
    degraded_detail,
    next_phase,
    readiness,
    transition_events,
)

ALL_READY = Readiness(islands=2, running_islands=2, whole_islands=2, syncers_ready=True, detail="")
ONE_SHORT = Readiness(islands=2, running_islands=2, whole_islands=1, syncers_ready=True, detail="island b: 0/1")
NOTHING = Readiness(islands=2, running_islands=2, whole_islands=0, syncers_ready=False, detail="all down")


def phase_after(previous, ready=ALL_READY, *, failure=None, success=None, suspend=False, seconds=10):
    return next_phase(previous, ready, failure=failure, success=success, suspend=suspend, now=at(seconds))


def test_readiness_counts_whole_islands_among_those_that_should_run():
    reforming = Reform(reason="Failure", since=at(0), hold_until=at(5))
    islands = [
        IslandStatus(name="a", desired=2, ready=2),
        IslandStatus(name="b", desired=2, ready=1),
        IslandStatus(name="c", desired=1, ready=1, reform=reforming),
        IslandStatus(name="d", desired=0, ready=0),
    ]
    ready = readiness(islands, [1], syncers_ready=False)
    assert (ready.islands, ready.running_islands, ready.whole_islands, ready.islands_ready) == (4, 3, 1, "1/3")
    assert ready.detail == (
        "island b: 1/2 pods ready; island c: 1/1 pods ready (re-forming: Failure); syncer shard 1 not ready"
    )
    assert not ready.can_train and not ready.all_ready
    assert ALL_READY.can_train and ALL_READY.all_ready
    assert ONE_SHORT.can_train and not ONE_SHORT.all_ready


def test_the_degraded_detail_names_eight_parts_and_counts_the_rest():
    islands = [IslandStatus(name=f"i{k}", desired=1) for k in range(10)]
    detail = degraded_detail(islands, [0])
    assert detail.startswith("island i0: 0/1 pods ready; island i1") and detail.endswith("; and 3 more")
    assert degraded_detail([IslandStatus(name="a", desired=1, ready=1)], []) == ""


def test_pending_until_training_can_start_then_running_or_degraded():
    pending = phase_after(DiLoCoJobStatus(), NOTHING)
    assert (pending.phase, pending.start_time, pending.events) == (Phase.PENDING, None, ())
    started = phase_after(DiLoCoJobStatus(), ONE_SHORT)
    assert (started.phase, started.start_time) == (Phase.DEGRADED, at(10))
    running = phase_after(DiLoCoJobStatus(phase=Phase.DEGRADED, start_time=at(0)))
    assert (running.phase, running.start_time) == (Phase.RUNNING, at(0))
    down = phase_after(DiLoCoJobStatus(phase=Phase.RUNNING, start_time=at(0)), NOTHING)
    assert down.phase is Phase.DEGRADED and down.completion_time is None


def test_failure_wins_over_success_which_wins_over_suspension():
    running = DiLoCoJobStatus(phase=Phase.RUNNING, start_time=at(0))
    failed = phase_after(running, failure="too many restarts", success="done", suspend=True)
    assert (failed.phase, failed.start_time, failed.completion_time) == (Phase.FAILED, at(0), at(10))
    assert [(e.type, e.reason, e.message) for e in failed.events] == [
        ("Warning", "RestartBudgetExhausted", "too many restarts")
    ]
    succeeded = phase_after(running, success="done", suspend=True)
    assert (succeeded.phase, succeeded.completion_time) == (Phase.SUCCEEDED, at(10))
    assert [(e.type, e.reason, e.message) for e in succeeded.events] == [("Normal", "StopConditionReached", "done")]
    suspended = phase_after(running, suspend=True)
    assert (suspended.phase, suspended.completion_time) == (Phase.SUSPENDED, None)


def test_a_finished_job_stays_finished_and_says_nothing_more():
    done = DiLoCoJobStatus(phase=Phase.SUCCEEDED, start_time=at(0), completion_time=at(5))
    after = phase_after(done, failure="too many restarts", suspend=True, seconds=20)
    assert (after.phase, after.start_time, after.completion_time, after.events) == (
        Phase.SUCCEEDED,
        at(0),
        at(5),
        (),
    )


def test_transitions_are_announced():
    def said(previous, phase):
        return [(e.type, e.reason, e.message) for e in transition_events(previous, phase, "island b: 0/1")]

    assert said(Phase.PENDING, Phase.RUNNING) == [
        ("Normal", "Running", "phase Pending -> Running: every island and syncer shard is ready")
    ]
    assert said(Phase.RUNNING, Phase.DEGRADED) == [("Warning", "Degraded", "phase Running -> Degraded: island b: 0/1")]
    assert said(Phase.RUNNING, Phase.RUNNING) == [] and said(Phase.PENDING, Phase.PENDING) == []
    assert said(Phase.RUNNING, Phase.SUSPENDED) == [
        ("Normal", "Suspended", "spec.suspend is true: islands scaled to zero")
    ]
    assert said(Phase.SUSPENDED, Phase.RUNNING) == [("Normal", "Resumed", "spec.suspend is false: islands scaled up")]
    assert said(Phase.SUSPENDED, Phase.DEGRADED) == [("Normal", "Resumed", "spec.suspend is false: islands scaled up")]
