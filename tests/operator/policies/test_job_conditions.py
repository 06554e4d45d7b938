"""Five conditions follow the phase: one holds per phase but Pending, the others give the phase as their reason
(Ready, while it does not hold, why where the job knows it). SyncerStateLost records a shard's loss of its
state for good. A condition's transition time moves only when it starts or stops holding."""

import pytest
from status_builders import at

from diloco.api.job import Phase
from diloco.operator.policies.job_conditions import condition_states, set_condition, update_conditions


def test_condition_transition_times_move_only_on_change():
    conditions = set_condition([], "Ready", False, "Pending", "", at(0), 1)
    same = set_condition(conditions, "Ready", False, "Degraded", "x", at(10), 2)
    assert same[0].last_transition_time == at(0) and same[0].reason == "Degraded"
    flipped = set_condition(same, "Ready", True, "Running", "", at(20), 2)
    assert flipped[0].last_transition_time == at(20) and len(flipped) == 1


@pytest.mark.parametrize(
    ("phase", "holding", "reason"),
    [
        (Phase.PENDING, None, None),
        (Phase.RUNNING, "Ready", "Running"),
        (Phase.DEGRADED, "Degraded", "PartiallyReady"),
        (Phase.SUSPENDED, "Suspended", "Suspended"),
        (Phase.SUCCEEDED, "Complete", "StopConditionReached"),
        (Phase.FAILED, "Failed", "RestartBudgetExhausted"),
    ],
)
def test_one_condition_holds_per_phase_but_pending_and_the_others_give_the_phase(phase, holding, reason):
    states = condition_states(phase, "island a: 1/2 pods ready")
    assert [s.type for s in states] == ["Ready", "Degraded", "Suspended", "Complete", "Failed"]
    assert [(s.type, s.reason) for s in states if s.holds] == ([(holding, reason)] if holding else [])
    for state in states:
        if not state.holds:
            assert state.reason == ("NotSuspended" if state.type == "Suspended" else phase.value)


def test_ready_and_degraded_say_what_is_not_ready():
    running, degraded, pending = (
        {s.type: s.message for s in condition_states(phase, "syncer shard 0 not ready")}
        for phase in (Phase.RUNNING, Phase.DEGRADED, Phase.PENDING)
    )
    assert running["Ready"] == "every island and syncer shard is ready" and running["Degraded"] == "phase Running"
    assert degraded["Ready"] == degraded["Degraded"] == "syncer shard 0 not ready"
    assert pending["Ready"] == "syncer shard 0 not ready"
    assert {s.message for s in condition_states(Phase.PENDING, "")} == {"phase Pending"}


def test_a_finished_job_says_why_in_its_holding_condition():
    failed = {s.type: s.message for s in condition_states(Phase.FAILED, "", outcome="islands ['a'] exceeded")}
    assert failed["Failed"] == "islands ['a'] exceeded" and failed["Complete"] == "phase Failed"
    assert {s.type: s.message for s in condition_states(Phase.SUCCEEDED, "")}["Complete"] == "the job succeeded"


def test_updating_sets_every_condition_for_the_generation():
    first = update_conditions([], Phase.RUNNING, "", at(0), 3)
    assert [(c.type, c.status) for c in first] == [
        ("Ready", "True"),
        ("Degraded", "False"),
        ("Suspended", "False"),
        ("Complete", "False"),
        ("Failed", "False"),
        ("SyncerStateLost", "False"),
    ]
    assert {c.observed_generation for c in first} == {3}
    later = update_conditions(first, Phase.DEGRADED, "island a: 0/1 pods ready", at(10), 4)
    moved = {c.type: c.last_transition_time for c in later}
    assert moved == {
        "Ready": at(10),
        "Degraded": at(10),
        "Suspended": at(0),
        "Complete": at(0),
        "Failed": at(0),
        "SyncerStateLost": at(0),
    }


def test_ready_gives_why_an_island_does_not_train_as_its_reason_while_it_does_not_hold():
    states = {s.type: s for s in condition_states(Phase.DEGRADED, "island a: PushesRefused: ...", "PushesRefused")}
    assert (states["Ready"].holds, states["Ready"].reason) == (False, "PushesRefused")
    assert (states["Degraded"].holds, states["Degraded"].reason) == (True, "PushesRefused")
    pending = {s.type: s for s in condition_states(Phase.PENDING, "island a: Unschedulable: ...", "Unschedulable")}
    assert pending["Ready"].reason == "Unschedulable" and pending["Degraded"].reason == "Pending"
    suspended = {s.type: s for s in condition_states(Phase.SUSPENDED, "", "NotSyncing")}
    assert suspended["Ready"].reason == "Suspended"


def test_a_lost_shard_state_is_a_condition_that_stays_true_with_what_was_lost():
    kept = update_conditions([], Phase.RUNNING, "", at(0), 1)
    assert next(c for c in kept if c.type == "SyncerStateLost").reason == "StateKept"
    lost = update_conditions(kept, Phase.RUNNING, "", at(10), 1, state_lost="shard 0 came back without its state")
    condition = next(c for c in lost if c.type == "SyncerStateLost")
    assert (condition.status, condition.reason, condition.last_transition_time) == ("True", "VersionRegressed", at(10))
    later = update_conditions(lost, Phase.RUNNING, "", at(500), 2)
    assert next(c for c in later if c.type == "SyncerStateLost") == condition.model_copy(
        update={"observed_generation": 2}
    )
