"""Job status and decisions from observations, end to end through `decide`: phases and conditions, the stop
condition, the restart budget, suspension, goodput and the TTL (each policy alone: tests/operator/policies)."""

import pytest
from status_builders import at, pod

from diloco.api.job import DiLoCoJobSpec, DiLoCoJobStatus, IslandStatus, Phase
from diloco.operator.job_status import FragmentReport, Observation, ShardObservation, decide
from diloco.operator.policies.island_training import TrainerReport

# --- phases, conditions and decisions ------------------------------------------------------------


def job_spec(**overrides) -> DiLoCoJobSpec:
    data = {
        "image": "img",
        "training": {"innerSteps": 20, "fragments": 2, "overlapSteps": 1},
        "islands": [{"name": "a", "replicas": 2}, {"name": "b", "replicas": 1}],
        "failurePolicy": {"restartBudget": 1, "backoffSeconds": 0},
    }
    data.update(overrides)
    return DiLoCoJobSpec.model_validate(data)


def shards(*fragments, ready=True, live=("a", "b"), lineage=0):
    """One shard reporting (fragment, version, tokens) triples."""
    reports = tuple(FragmentReport(f, v, t, 1_767_268_800.0) for f, v, t in fragments)
    return [ShardObservation(shard=0, ready=ready, fragments=reports, live_islands=frozenset(live), lineage=lineage)]


def healthy(**extra) -> Observation:
    pods = {"a": [pod(0), pod(1)], "b": [pod(0, island="b")]}
    return Observation(pods=pods, shards=shards((0, 3, 300), (1, 2, 250)), **extra)


def run(spec, observations, start=0.0, every=10.0, status=None):
    status = status or DiLoCoJobStatus()
    decisions = []
    for i, observation in enumerate(observations):
        decision = decide(spec, 1, status, observation, at(start + i * every), job="job")
        decisions.append(decision)
        status = decision.status
    return decisions


def condition(status, kind):
    return next(c for c in status.conditions if c.type == kind)


def test_pending_until_syncers_and_islands_are_ready_then_running():
    spec = job_spec()
    nothing = Observation(shards=[ShardObservation(0, ready=False)])
    first, second = run(spec, [nothing, healthy()])
    assert first.status.phase is Phase.PENDING and first.status.start_time is None
    assert first.scale.islands == {"a": 2, "b": 1} and first.scale.syncers == 1
    status = second.status
    assert status.phase is Phase.RUNNING and status.start_time == at(10)
    assert status.islands_ready == "2/2" and status.syncer.ready == 1 and status.syncer.reachable == 1
    assert condition(status, "Ready").status == "True" and condition(status, "Degraded").status == "False"
    assert [(f.fragment, f.version, f.tokens) for f in status.fragments] == [(0, 3, 300), (1, 2, 250)]
    assert (status.outer_step, status.tokens) == (2, 250)
    assert status.islands[0].last_sync == at(10) and status.observed_generation == 1
    assert first.events == ()
    assert [(e.type, e.reason, e.message) for e in second.events] == [
        ("Normal", "Running", "phase Pending -> Running: every island and syncer shard is ready")
    ]


def test_an_island_short_of_pods_degrades_the_job_and_says_which():
    spec = job_spec()
    missing = Observation(pods={"a": [pod(0)], "b": [pod(0, island="b")]}, shards=shards((0, 3, 1), (1, 3, 1)))
    _, degraded = run(spec, [healthy(), missing])
    assert degraded.status.phase is Phase.DEGRADED and degraded.status.islands_ready == "1/2"
    assert condition(degraded.status, "Degraded").status == "True"
    assert "island a: 1/2 pods ready" in condition(degraded.status, "Degraded").message
    assert condition(degraded.status, "Ready").status == "False"
    assert [(e.type, e.reason, e.message) for e in degraded.events][-1] == (
        "Warning",
        "Degraded",
        "phase Running -> Degraded: island a: 1/2 pods ready (re-forming: Failure)",
    )
    assert "Degraded" not in [e.reason for e in run(spec, [missing], status=degraded.status)[0].events]


def test_a_degraded_message_names_a_few_islands_and_counts_the_rest():
    spec = job_spec(islands=[{"name": f"i{k:02d}"} for k in range(20)])
    (pending,) = run(spec, [Observation(shards=shards((0, 0, 0), (1, 0, 0)))])
    message = condition(pending.status, "Ready").message
    assert message.startswith("island i00: 0/1 pods ready; island i01") and message.endswith("; and 12 more")


def test_exhausting_the_restart_budget_fails_the_job_for_good():
    spec = job_spec()

    def crash(n):
        return Observation(
            pods={"a": [pod(0, restarts=n), pod(1)], "b": [pod(0, island="b")]}, shards=shards((0, 1, 1), (1, 1, 1))
        )

    decisions = run(spec, [healthy(), crash(1), Observation(shards=shards((0, 1, 1), (1, 1, 1))), crash(3)])
    assert decisions[1].status.phase is not Phase.FAILED and decisions[1].status.islands[0].restarts == 1
    failed = decisions[3]
    assert failed.status.phase is Phase.FAILED and failed.status.completion_time == at(30)
    assert failed.scale.islands == {"a": 0, "b": 0} and failed.scale.syncers == 1
    assert "RestartBudgetExhausted" in [e.reason for e in failed.events]
    assert condition(failed.status, "Failed").status == "True"
    later = run(spec, [healthy(), Observation(), healthy()], start=40, status=failed.status)
    assert all(d.status.phase is Phase.FAILED for d in later)
    assert all(d.scale.islands == {"a": 0, "b": 0} for d in later)
    assert [d.scale.syncers for d in later] == [1, 0, 1]  # the shards go once no island pod is left
    assert later[-1].status.completion_time == at(30)


def crash_loop(n):
    """Island a's rank 0 has restarted `n` times, last with exit code 1."""
    return Observation(
        pods={"a": [pod(0, restarts=n, exit="exit code 1 (Error)"), pod(1)], "b": [pod(0, island="b")]},
        shards=shards((0, 1, 1), (1, 1, 1)),
    )


def test_the_failed_condition_names_the_island_and_its_last_failure_and_keeps_saying_so():
    spec = job_spec()
    decisions = run(spec, [healthy(), crash_loop(2), healthy(), healthy()])
    failed = decisions[1].status
    assert failed.phase is Phase.FAILED
    message = condition(failed, "Failed").message
    assert "islands ['a']" in message and "restartBudget 1" in message
    assert "pod job-a-0 restarted, exit code 1 (Error)" in message
    assert all(condition(d.status, "Failed").message == message for d in decisions[2:])


PATHS = {
    "pending": [Observation(shards=[ShardObservation(0, ready=False)])],
    "running": [healthy()],
    "degraded": [healthy(), Observation(pods={"a": [pod(0)]}, shards=shards((0, 1, 1), (1, 1, 1)))],
    "failed": [healthy(), crash_loop(2)],
    "failed, later passes": [healthy(), crash_loop(2), healthy(), Observation()],
    "succeeded": [Observation(pods=healthy().pods, shards=shards((0, 9, 9), (1, 9, 9)))],
    "succeeded, later passes": [Observation(pods=healthy().pods, shards=shards((0, 9, 9), (1, 9, 9))), Observation()],
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("suspend", [False, True])
def test_no_decided_condition_has_an_empty_message(path, suspend):
    spec = job_spec(suspend=suspend, stopCondition={"outerSteps": 9})
    for decision in run(spec, PATHS[path]):
        assert decision.status.conditions
        for c in decision.status.conditions:
            assert c.message, f"{decision.status.phase.value}: condition {c.type}={c.status} has no message"


def test_preemptions_never_fail_the_job():
    spec = job_spec()
    observations = []
    for i in range(5):
        fresh = [pod(0, f"c{i}"), pod(1, f"d{i}")]
        preempted = [pod(0, f"c{i}"), pod(1, f"d{i}", disrupted=True, terminating=True)]
        for pods in (fresh, preempted, []):
            observations.append(
                Observation(pods={"a": pods, "b": [pod(0, island="b")]}, shards=shards((0, 1, 1), (1, 1, 1)))
            )
    last = run(spec, observations)[-1]
    assert last.status.phase is Phase.DEGRADED
    assert last.status.islands[0].restarts == 0 and last.status.islands[0].preemptions == 5


def test_stop_condition_on_outer_steps_succeeds_and_winds_down():
    spec = job_spec(stopCondition={"outerSteps": 5})
    partial = Observation(pods=healthy().pods, shards=shards((0, 7, 10)))
    reached = Observation(pods=healthy().pods, shards=shards((0, 7, 10), (1, 5, 9)))
    first, second, third = run(spec, [partial, reached, healthy()])
    assert first.status.phase is Phase.PENDING or first.status.phase is Phase.RUNNING
    assert first.status.outer_step == 0
    assert second.status.phase is Phase.SUCCEEDED and second.status.completion_time == at(10)
    assert second.scale.islands == {"a": 0, "b": 0}
    assert "StopConditionReached" in [e.reason for e in second.events]
    assert condition(second.status, "Complete").status == "True"
    assert third.status.phase is Phase.SUCCEEDED and third.scale.islands == {"a": 0, "b": 0}


def test_a_finished_job_keeps_its_shards_until_its_island_pods_are_gone():
    """Islands get SIGTERM first and push their last steps; the shards that take them go afterwards."""
    spec = job_spec(stopCondition={"outerSteps": 5})
    reached = Observation(pods=healthy().pods, shards=shards((0, 7, 10), (1, 5, 9)))
    terminating = Observation(pods={"a": [pod(0, terminating=True)]}, shards=healthy().shards)
    gone = Observation(shards=healthy().shards)
    decisions = run(spec, [reached, terminating, gone])
    assert [d.status.phase for d in decisions] == [Phase.SUCCEEDED] * 3
    assert [d.scale.syncers for d in decisions] == [1, 1, 0]


def test_a_succeeded_job_exports_its_model_once_its_shards_have_stopped():
    spec = job_spec(stopCondition={"outerSteps": 5}, export={"claimName": "models"})
    reached = Observation(pods=healthy().pods, shards=shards((0, 7, 10), (1, 5, 9)))
    islands_gone = Observation(shard_pods=1)
    shards_gone = Observation()
    exporting = Observation(export_job={"status": {"active": 1}})
    exported = Observation(export_job={"status": {"succeeded": 1}})
    decisions = run(spec, [reached, islands_gone, shards_gone, exporting, exported])
    assert [d.scale.syncers for d in decisions] == [1, 0, 0, 0, 0]
    assert [d.scale.export for d in decisions] == [False, False, True, True, True]
    assert [d.status.export.phase.value for d in decisions] == ["Pending", "Pending", "Pending", "Running", "Succeeded"]
    assert decisions[-1].status.export.location == "models:/job"


def test_suspend_scales_islands_to_zero_keeps_syncers_and_resume_brings_them_back():
    spec, suspended_spec = job_spec(), job_spec(suspend=True)
    running = run(spec, [healthy()])[-1].status
    suspended = decide(suspended_spec, 2, running, healthy(), at(10), job="job")
    assert suspended.status.phase is Phase.SUSPENDED
    assert suspended.scale.islands == {"a": 0, "b": 0} and suspended.scale.syncers == 1
    assert [e.reason for e in suspended.events] == ["Suspended"]
    assert condition(suspended.status, "Suspended").status == "True"
    gone = decide(suspended_spec, 2, suspended.status, Observation(shards=healthy().shards), at(20), job="job")
    assert gone.status.islands[0].restarts == 0 and gone.status.islands_ready == "0/0"
    resumed = decide(spec, 3, gone.status, Observation(shards=healthy().shards), at(30), job="job")
    assert resumed.scale.islands == {"a": 2, "b": 1} and "Resumed" in [e.reason for e in resumed.events]
    assert resumed.status.phase is Phase.DEGRADED


def test_goodput_is_ready_over_desired_pod_seconds_while_training():
    spec = job_spec()
    half = Observation(
        pods={"a": [pod(0)], "b": [pod(0, island="b", ready=False)]}, shards=shards((0, 1, 1), (1, 1, 1))
    )
    decisions = run(spec, [healthy(), half, healthy()])
    assert decisions[0].status.goodput is None
    assert decisions[1].status.goodput == pytest.approx(1.0)
    assert decisions[2].status.goodput == 0.667, "(30 + 10) / 60, as kubectl get prints it"
    assert decisions[2].status.ready_pod_seconds == 40 and decisions[2].status.desired_pod_seconds == 60
    away = decide(spec, 1, decisions[2].status, healthy(), at(20 + 600), job="job")
    assert away.status.desired_pod_seconds == decisions[2].status.desired_pod_seconds


def test_losses_and_last_sync_per_island():
    spec = job_spec()
    seen = Observation(
        pods=healthy().pods,
        shards=shards((0, 1, 1), (1, 1, 1), live=("a",)),
        trainers={"a": TrainerReport(loss=2.0), "b": TrainerReport(loss=3.0)},
    )
    first, second = run(spec, [seen, Observation(pods=healthy().pods, trainers={"a": TrainerReport(loss=1.0)})])
    assert first.status.loss == pytest.approx(2.5)
    long = Observation(pods=healthy().pods, trainers={"a": TrainerReport(loss=2.123456789)})
    assert run(spec, [long])[0].status.loss == 2.1235, "as kubectl get prints it"
    assert [i.last_sync for i in first.status.islands] == [at(0), None]
    assert [i.loss for i in second.status.islands] == [1.0, 3.0]
    assert second.status.islands[0].last_sync == at(0)


def test_an_unreachable_shard_keeps_its_fragments_last_progress():
    spec = job_spec()
    unreachable = Observation(pods=healthy().pods, shards=[ShardObservation(0, ready=True)])
    first, second = run(spec, [healthy(), unreachable])
    assert second.status.fragments == first.status.fragments and second.status.syncer.reachable == 0


def test_a_finished_job_is_deleted_once_its_ttl_expires():
    done = DiLoCoJobStatus(phase=Phase.SUCCEEDED, completion_time=at(0))
    spec = job_spec(ttlSecondsAfterFinished=60)
    assert not decide(spec, 1, done, Observation(), at(59), job="job").delete
    expired = decide(spec, 1, done, Observation(), at(60), job="job")
    assert expired.delete and "TTLExpired" in [e.reason for e in expired.events]
    assert expired.scale.islands == {"a": 0, "b": 0}


def test_status_entries_follow_the_spec_islands():
    spec = job_spec()
    status = run(spec, [healthy()])[-1].status
    fewer = job_spec(islands=[{"name": "b", "replicas": 1}])
    decision = decide(fewer, 2, status, healthy(), at(10), job="job")
    assert [i.name for i in decision.status.islands] == ["b"] and set(decision.scale.islands) == {"b"}


def test_island_status_round_trips_through_json():
    status = run(job_spec(), [healthy(), healthy()])[-1].status
    assert DiLoCoJobStatus.model_validate_json(status.model_dump_json(by_alias=True)) == status
    assert isinstance(status.islands[0], IslandStatus)


# --- a syncer that refuses the operator or does not answer ---------------------------------------


def two_shards(error: str | None = None) -> Observation:
    """Shard 0 answers; shard 1's pod is ready and its Status call fails with `error` (None: it answers)."""
    reports = (FragmentReport(0, 1, 1, 1_767_268_800.0),)
    second = ShardObservation(1, ready=True, error=error) if error else ShardObservation(1, True, ())
    return Observation(
        pods=healthy().pods,
        shards=[ShardObservation(0, ready=True, fragments=reports, live_islands=frozenset("ab")), second],
    )


def test_a_shard_refusing_the_jobs_token_is_not_ready_and_conditions_name_it():
    spec = job_spec(syncer={"shards": 2})
    decision = run(spec, [two_shards(), two_shards("UNAUTHENTICATED: invalid bearer token")])[-1]
    conditions = {c.type: c for c in decision.status.conditions}
    assert decision.status.phase is Phase.DEGRADED and conditions["Ready"].status == "False"
    assert conditions["Degraded"].reason == "SyncerRefused"
    assert (
        "syncer shard 1 refuses the operator: UNAUTHENTICATED: invalid bearer token" in conditions["Degraded"].message
    )


def test_an_unreachable_shard_is_named_in_the_conditions():
    spec = job_spec(syncer={"shards": 2})
    decision = run(spec, [two_shards(), two_shards("UNAVAILABLE: connection refused")])[-1]
    conditions = {c.type: c for c in decision.status.conditions}
    assert decision.status.syncer.reachable == 1
    assert "syncer shard 1 unreachable: UNAVAILABLE: connection refused" in conditions["Ready"].message


# --- rolling a pod-template change through the islands ---------------------------------------------


def rolling(pods, live=("a", "b")):
    """A pass after the islands' StatefulSets took a new template (revisions a-2, b-2)."""
    return Observation(
        pods=pods, shards=shards((0, 3, 300), (1, 2, 250), live=live), update_revisions={"a": "a-2", "b": "b-2"}
    )


def reasons(decision):
    return [e.reason for e in decision.events]


def test_a_template_change_re_forms_one_island_at_a_time_each_after_it_synced_again():
    spec = job_spec()
    status = run(spec, [healthy()])[-1].status
    old_b = [pod(0, island="b")]
    first = decide(spec, 2, status, rolling({"a": [pod(0), pod(1)], "b": old_b}), at(10), job="job")
    assert first.scale.islands == {"a": 0, "b": 1}, "b trains on while a re-forms"
    assert [e.message for e in first.events if e.reason == "IslandUpdating"] == [
        "island a: pod template changed; re-forming the island"
    ]

    back = decide(spec, 2, first.status, rolling({"b": old_b}, live=("b",)), at(20), job="job")
    assert back.scale.islands == {"a": 2, "b": 1} and back.status.islands[0].rolled_at == at(20)

    new_a = [pod(0, revision="a-2"), pod(1, revision="a-2")]
    unsynced = decide(spec, 2, back.status, rolling({"a": new_a, "b": old_b}, live=("b",)), at(30), job="job")
    assert unsynced.scale.islands == {"a": 2, "b": 1} and "IslandUpdating" not in reasons(unsynced)

    synced = decide(spec, 2, unsynced.status, rolling({"a": new_a, "b": old_b}), at(40), job="job")
    assert "IslandUpdated" in reasons(synced) and synced.status.islands[0].rolled_at is None
    following = decide(spec, 2, synced.status, rolling({"a": new_a, "b": old_b}), at(50), job="job")
    assert following.scale.islands == {"a": 2, "b": 0} and "IslandUpdating" in reasons(following)


def test_max_unavailable_re_forms_that_many_islands_at_once():
    spec = job_spec(updateStrategy={"maxUnavailable": 2})
    status = run(spec, [healthy()])[-1].status
    both = decide(spec, 2, status, rolling({"a": [pod(0), pod(1)], "b": [pod(0, island="b")]}), at(10), job="job")
    assert both.scale.islands == {"a": 0, "b": 0}


def test_suspending_mid_roll_forgets_the_roll():
    spec = job_spec()
    status = run(spec, [healthy()])[-1].status
    first = decide(spec, 2, status, rolling({"a": [pod(0), pod(1)], "b": [pod(0, island="b")]}), at(10), job="job")
    back = decide(spec, 2, first.status, rolling({"b": [pod(0, island="b")]}, live=("b",)), at(20), job="job")
    assert back.status.islands[0].rolled_at is not None
    suspended = decide(job_spec(suspend=True), 3, back.status, rolling({}), at(30), job="job")
    assert all(i.rolled_at is None and i.reform is None for i in suspended.status.islands)


# --- Ready means the islands train ---------------------------------------------------------------


def test_an_island_whose_pushes_are_refused_is_not_ready_though_its_pods_are_and_the_job_says_which_and_why():
    spec = job_spec()
    refused = TrainerReport(last_sync_unix=at(5).timestamp(), last_refusal_unix=at(15).timestamp())
    first, second, third = run(spec, [healthy(), healthy(trainers={"b": refused}), healthy(trainers={"b": refused})])
    assert first.status.phase is Phase.RUNNING
    status = second.status
    island_b = status.islands[1]
    assert (island_b.ready, island_b.reason) == (1, "PushesRefused") and "UNAUTHENTICATED" in island_b.message
    assert status.phase is Phase.DEGRADED and status.islands_ready == "1/2"
    ready, degraded = condition(status, "Ready"), condition(status, "Degraded")
    assert (ready.status, ready.reason) == ("False", "PushesRefused")
    assert (degraded.status, degraded.reason) == ("True", "PushesRefused")
    assert "island b: PushesRefused: the syncer shards refuse its token" in degraded.message
    warnings = [(e.reason, e.message) for e in second.events if e.type == "Warning"]
    assert warnings[0][0] == "PushesRefused" and warnings[0][1].startswith("island b: the syncer shards refuse")
    assert "PushesRefused" not in [e.reason for e in third.events], "said once, when it starts"


def test_an_unschedulable_island_says_what_the_scheduler_says_in_its_status_and_the_jobs_conditions():
    spec = job_spec(islands=[{"name": "a", "replicas": 1, "acceleratorsPerPod": 16}])
    message = "0/5 nodes are available: 5 Insufficient nvidia.com/gpu."
    stuck = Observation(
        pods={"a": [pod(0, phase="Pending", ready=False, node=None, unschedulable=message)]},
        shards=shards((0, 0, 0), (1, 0, 0)),
    )
    (decision,) = run(spec, [stuck])
    status = decision.status
    assert status.phase is Phase.PENDING
    assert (status.islands[0].reason, status.islands[0].message) == (
        "Unschedulable",
        f"pod job-a-0: {message}"[:63] + "…",
    )
    ready = condition(status, "Ready")
    assert ready.reason == "Unschedulable" and f"island a: Unschedulable: pod job-a-0: {message}" in ready.message
    assert [(e.type, e.reason) for e in decision.events] == [("Warning", "Unschedulable")]


# --- a shard that lost its state ---------------------------------------------------------------------


def test_a_shard_that_lost_its_state_is_loud_and_the_stop_condition_goes_on_from_where_it_was():
    spec = job_spec(stopCondition={"outerSteps": 30})
    pods = healthy().pods
    trained = Observation(pods=pods, shards=shards((0, 25, 2500), (1, 26, 2600)))
    lost = Observation(pods=pods, shards=shards((0, 0, 0), (1, 1, 100)))
    after = Observation(pods=pods, shards=shards((0, 4, 400), (1, 5, 500)))
    done = Observation(pods=pods, shards=shards((0, 5, 500), (1, 6, 600)))
    kept, lost_pass, later, finished = run(spec, [trained, lost, after, done])
    assert kept.status.outer_step == 25 and condition(kept.status, "SyncerStateLost").status == "False"
    status = lost_pass.status
    assert (status.carried_outer_steps, status.carried_tokens) == (25, 2500)
    assert (status.outer_step, status.tokens) == (25, 2500), "progress does not go back"
    state = condition(status, "SyncerStateLost")
    assert (state.status, state.reason) == ("True", "VersionRegressed")
    assert "syncer shard 0 came back without its state: fragments 0 (25 -> 0), 1 (26 -> 1)" in state.message
    assert status.syncer.last_state_loss == at(10)
    assert "SyncerStateLost" in [e.reason for e in lost_pass.events if e.type == "Warning"]
    assert later.status.outer_step == 29 and later.status.phase is Phase.RUNNING
    assert condition(later.status, "SyncerStateLost") == state.model_copy(update={"observed_generation": 1})
    assert finished.status.phase is Phase.SUCCEEDED and finished.status.outer_step == 30


def test_a_shard_seen_only_once_its_new_state_passed_the_old_one_is_still_a_loss():
    spec = job_spec(stopCondition={"outerSteps": 60})
    pods = healthy().pods
    trained = Observation(pods=pods, shards=shards((0, 25, 2500), (1, 26, 2600), lineage=0xAA))
    passed = Observation(pods=pods, shards=shards((0, 30, 3000), (1, 31, 3100), lineage=0xBB))
    kept, lost_pass = run(spec, [trained, passed])
    assert [s.lineage for s in kept.status.syncer.lineages] == ["00000000000000aa"]
    status = lost_pass.status
    assert condition(status, "SyncerStateLost").status == "True"
    assert "fragments 0 (25 -> 0), 1 (26 -> 0)" in condition(status, "SyncerStateLost").message
    assert (status.outer_step, status.tokens) == (55, 5500), "the old state's merges and the new state's"
    assert (status.carried_outer_steps, status.carried_tokens) == (25, 2500), "the least its fragments lost"
