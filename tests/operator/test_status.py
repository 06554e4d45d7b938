"""Status and decisions from observations: pod accounting (failures vs preemptions, re-forming), phases and
conditions, the stop condition, the restart budget, suspension, goodput and the TTL."""

import datetime

import pytest

from diloco.api.job import (
    DiLoCoJobSpec,
    DiLoCoJobStatus,
    FragmentProgress,
    IslandSpec,
    IslandStatus,
    Phase,
    StopCondition,
)
from diloco.operator.accounting import (
    HEALTHY,
    NodeState,
    PodObservation,
    account_island,
    nodes_to_check,
    observe_node,
    observe_pod,
)
from diloco.operator.status import (
    FragmentReport,
    Observation,
    ShardObservation,
    decide,
    set_condition,
    stop_reached,
    ttl_expires_at,
)

T0 = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def pod(
    ordinal,
    uid=None,
    *,
    island="a",
    restarts=0,
    phase="Running",
    ready=True,
    disrupted=False,
    terminating=False,
    node="node-1",
    revision="a-1",
    clean=False,
):
    return PodObservation(
        name=f"job-{island}-{ordinal}",
        island=island,
        ordinal=ordinal,
        uid=uid or f"{island}-{ordinal}-u1",
        restarts=restarts,
        phase=phase,
        ready=ready and not terminating,
        terminating=terminating,
        disrupted=disrupted,
        node=node,
        revision=revision,
        ip=f"10.0.0.{ordinal + 1}",
        last_exit_clean=clean,
    )


ISLAND = IslandSpec(name="a", replicas=2)


def step(previous, pods, *, now=T0, nodes=None, revision=None, active=True, backoff=10, island=ISLAND):
    return account_island(previous, island, pods, nodes or {}, revision, active, backoff, now)


def settled(pods=None, **kwargs):
    """The island after a first, uneventful pass over `pods` (two healthy ready pods by default)."""
    return step(None, pods if pods is not None else [pod(0), pod(1)], **kwargs).status


# --- observing pods and nodes -------------------------------------------------------------------


def raw_pod(name="job-a-1", labels=None, **status):
    return {
        "metadata": {
            "name": name,
            "uid": "u-1",
            "labels": {"diloco.dev/island": "a", "controller-revision-hash": "job-a-abc", **(labels or {})},
        },
        "spec": {"nodeName": "n-7"},
        "status": {"phase": "Running", "podIP": "10.1.2.3", **status},
    }


def test_observe_pod_reads_what_accounting_needs():
    observed = observe_pod(
        raw_pod(
            labels={"apps.kubernetes.io/pod-index": "1"},
            conditions=[{"type": "Ready", "status": "True"}, {"type": "DisruptionTarget", "status": "True"}],
            containerStatuses=[
                {"name": "trainer", "restartCount": 2, "lastState": {"terminated": {"exitCode": 137}}},
                {"name": "sidecar", "restartCount": 1},
            ],
        )
    )
    assert (observed.island, observed.ordinal, observed.uid, observed.restarts) == ("a", 1, "u-1", 3)
    assert observed.ready and observed.disrupted and not observed.terminating and not observed.last_exit_clean
    assert (observed.node, observed.revision, observed.ip) == ("n-7", "job-a-abc", "10.1.2.3")


def test_observe_pod_falls_back_to_the_name_and_skips_foreign_pods():
    assert observe_pod(raw_pod(name="job-a-12")).ordinal == 12
    terminating = raw_pod(conditions=[{"type": "Ready", "status": "True"}])
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not observe_pod(terminating).ready and observe_pod(terminating).terminating
    syncer_pod = raw_pod(name="job-syncer-0-7d9f-x2")
    del syncer_pod["metadata"]["labels"]["diloco.dev/island"]
    assert observe_pod(syncer_pod) is None


def test_observe_pod_sees_a_clean_exit():
    clean = raw_pod(containerStatuses=[{"restartCount": 1, "lastState": {"terminated": {"exitCode": 0}}}])
    assert observe_pod(clean).last_exit_clean


def test_observe_node():
    assert observe_node(None) == NodeState(exists=False) and not observe_node(None).healthy
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert observe_node(ready).healthy
    assert not observe_node({"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}).healthy
    assert not observe_node({**ready, "spec": {"unschedulable": True}}).healthy


def test_nodes_are_looked_up_only_for_unexplained_losses():
    previous = settled([pod(0, node="n0"), pod(1, node="n1")])
    assert nodes_to_check(previous.pods, [pod(0, node="n0"), pod(1, node="n1")]) == set()
    assert nodes_to_check(previous.pods, [pod(0, node="n0")]) == {"n1"}
    assert nodes_to_check(previous.pods, [pod(0, node="n0"), pod(1, "new", node="n2")]) == {"n1"}
    assert nodes_to_check(previous.pods, [pod(0, node="n0"), pod(1, phase="Failed", node="n1")]) == {"n1"}


# --- failures, preemptions, re-forming -----------------------------------------------------------


def test_first_sight_charges_no_history():
    account = step(None, [pod(0, restarts=5), pod(1)])
    assert account.status.restarts == 0 and account.replicas == 2 and account.events == ()
    assert [r.restarts for r in account.status.pods] == [5, 0]


def test_a_container_restart_is_one_failure_and_re_forms_the_island_after_the_backoff():
    previous = settled()
    account = step(previous, [pod(0, restarts=1), pod(1)], now=at(5))
    assert account.status.restarts == 1 and account.status.preemptions == 0
    assert account.status.reform.reason == "Failure" and account.status.reform.hold_until == at(15)
    assert account.replicas == 0
    assert [e.reason for e in account.events] == ["IslandFailed"]

    winding_down = step(account.status, [pod(0, restarts=1, terminating=True)], now=at(20))
    assert winding_down.replicas == 0 and winding_down.status.restarts == 1
    gone_early = step(account.status, [], now=at(10))
    assert gone_early.replicas == 0 and gone_early.status.reform is not None
    back = step(gone_early.status, [], now=at(16))
    assert back.replicas == 2 and back.status.reform is None
    assert [e.reason for e in back.events] == ["IslandReformed"]


def test_collateral_restarts_of_peers_count_once_but_a_crash_loop_counts_every_time():
    previous = settled()
    peers_fail_together = step(previous, [pod(0, restarts=1), pod(1, restarts=1)], now=at(5))
    assert peers_fail_together.status.restarts == 1
    single = IslandSpec(name="a", replicas=1)
    lone = settled([pod(0)], island=single)
    crash_loop = step(lone, [pod(0, restarts=3)], now=at(5), island=single)
    assert crash_loop.status.restarts == 3


def test_a_preempted_pod_is_not_charged_nor_are_the_failures_it_causes():
    previous = step(settled(), [pod(0), pod(1, disrupted=True, terminating=True)], now=at(1)).status
    assert previous.restarts == 0 and previous.pods[1].disrupted
    account = step(previous, [pod(0, restarts=1), pod(1, "u2", ready=False)], now=at(2))
    assert account.status.restarts == 0 and account.status.preemptions == 1
    assert account.status.reform.reason == "Preemption" and account.status.reform.hold_until == at(2)
    assert [e.reason for e in account.events] == ["IslandPreempted"]


@pytest.mark.parametrize(
    ("node", "preempted"),
    [
        (NodeState(exists=False), True),
        (NodeState(exists=True, ready=False), True),
        (NodeState(exists=True, schedulable=False), True),
        (HEALTHY, False),
    ],
)
def test_a_vanished_pod_is_judged_by_its_node(node, preempted):
    previous = settled([pod(0, node="n0"), pod(1, node="n1")])
    account = step(previous, [pod(0, node="n0"), pod(1, "u2", node="n2")], nodes={"n1": node}, now=at(3))
    assert (account.status.preemptions, account.status.restarts) == ((1, 0) if preempted else (0, 1))


def test_a_failed_pod_counts_once():
    previous = settled()
    failed = step(previous, [pod(0), pod(1, phase="Failed", ready=False)], now=at(1), backoff=0)
    assert failed.status.restarts == 1
    gone = step(failed.status, [pod(0, terminating=True)], now=at(2))
    assert gone.status.restarts == 1 and gone.status.preemptions == 0


def test_a_failed_pod_on_a_lost_node_is_a_preemption():
    previous = settled([pod(0), pod(1, node="dead")])
    account = step(previous, [pod(0), pod(1, phase="Failed", node="dead")], nodes={"dead": NodeState(False)})
    assert (account.status.preemptions, account.status.restarts) == (1, 0)


def test_a_clean_exit_is_not_a_failure():
    previous = settled()
    account = step(previous, [pod(0, restarts=1, clean=True), pod(1)], now=at(1))
    assert account.status.restarts == 0 and account.status.reform is None and account.replicas == 2


def test_pods_removed_on_purpose_are_not_counted():
    previous = settled()
    suspended = step(previous, [pod(0, terminating=True)], active=False, now=at(1))
    assert suspended.replicas == 0 and suspended.status.desired == 0 and suspended.status.restarts == 0
    resumed_with_nothing = step(suspended.status, [], active=True, now=at(2))
    assert resumed_with_nothing.status.restarts == 0 and resumed_with_nothing.replicas == 2
    smaller = IslandSpec(name="a", replicas=1)
    scaled_down = step(previous, [pod(0)], island=smaller, now=at(3))
    assert scaled_down.status.restarts == 0 and scaled_down.status.preemptions == 0


def test_a_new_template_revision_re_forms_the_island_uncounted():
    previous = settled()
    account = step(previous, [pod(0), pod(1)], revision="a-2", now=at(1))
    assert account.status.reform.reason == "Update" and account.replicas == 0
    assert account.status.restarts == 0 and [e.reason for e in account.events] == ["IslandUpdating"]
    current = step(settled(), [pod(0, revision="a-2"), pod(1, revision="a-2")], revision="a-2", now=at(1))
    assert current.status.reform is None


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


def shards(*fragments, ready=True, live=("a", "b")):
    """One shard reporting (fragment, version, tokens) triples."""
    reports = tuple(FragmentReport(f, v, t, 1_767_268_800.0) for f, v, t in fragments)
    return [ShardObservation(shard=0, ready=ready, fragments=reports, live_islands=frozenset(live))]


def healthy(**extra) -> Observation:
    pods = {"a": [pod(0), pod(1)], "b": [pod(0, island="b")]}
    return Observation(pods=pods, shards=shards((0, 3, 300), (1, 2, 250)), **extra)


def run(spec, observations, start=0.0, every=10.0, status=None):
    status = status or DiLoCoJobStatus()
    decisions = []
    for i, observation in enumerate(observations):
        decision = decide(spec, 1, status, observation, at(start + i * every))
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
    assert failed.scale.islands == {"a": 0, "b": 0} and failed.scale.syncers == 0
    assert "RestartBudgetExhausted" in [e.reason for e in failed.events]
    assert condition(failed.status, "Failed").status == "True"
    later = run(spec, [healthy(), healthy()], start=40, status=failed.status)
    assert all(d.status.phase is Phase.FAILED for d in later)
    assert all(d.scale.islands == {"a": 0, "b": 0} and d.scale.syncers == 0 for d in later)
    assert later[-1].status.completion_time == at(30)


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
    assert second.scale.islands == {"a": 0, "b": 0} and second.scale.syncers == 0
    assert "StopConditionReached" in [e.reason for e in second.events]
    assert condition(second.status, "Complete").status == "True"
    assert third.status.phase is Phase.SUCCEEDED and third.scale.syncers == 0


def test_stop_reached():
    two = [
        FragmentProgress(fragment=0, shard=0, version=9, tokens=1000),
        FragmentProgress(fragment=1, shard=0, version=4, tokens=800),
    ]
    assert stop_reached(StopCondition(outer_steps=4), two, 2)
    assert stop_reached(StopCondition(outer_steps=5), two, 2) is None
    assert "800 tokens" in stop_reached(StopCondition(tokens=800), two, 2)
    assert stop_reached(StopCondition(tokens=801), two, 2) is None
    assert stop_reached(StopCondition(outer_steps=1), two[:1], 2) is None
    assert stop_reached(StopCondition(), two, 2) is None


def test_suspend_scales_islands_to_zero_keeps_syncers_and_resume_brings_them_back():
    spec, suspended_spec = job_spec(), job_spec(suspend=True)
    running = run(spec, [healthy()])[-1].status
    suspended = decide(suspended_spec, 2, running, healthy(), at(10))
    assert suspended.status.phase is Phase.SUSPENDED
    assert suspended.scale.islands == {"a": 0, "b": 0} and suspended.scale.syncers == 1
    assert [e.reason for e in suspended.events] == ["Suspended"]
    assert condition(suspended.status, "Suspended").status == "True"
    gone = decide(suspended_spec, 2, suspended.status, Observation(shards=healthy().shards), at(20))
    assert gone.status.islands[0].restarts == 0 and gone.status.islands_ready == "0/0"
    resumed = decide(spec, 3, gone.status, Observation(shards=healthy().shards), at(30))
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
    assert decisions[2].status.goodput == pytest.approx((30 + 10) / 60)
    away = decide(spec, 1, decisions[2].status, healthy(), at(20 + 600))
    assert away.status.desired_pod_seconds == decisions[2].status.desired_pod_seconds


def test_losses_and_last_sync_per_island():
    spec = job_spec()
    seen = Observation(
        pods=healthy().pods, shards=shards((0, 1, 1), (1, 1, 1), live=("a",)), losses={"a": 2.0, "b": 3.0}
    )
    first, second = run(spec, [seen, Observation(pods=healthy().pods, losses={"a": 1.0})])
    assert first.status.loss == pytest.approx(2.5)
    assert [i.last_sync for i in first.status.islands] == [at(0), None]
    assert [i.loss for i in second.status.islands] == [1.0, 3.0]
    assert second.status.islands[0].last_sync == at(0)


def test_an_unreachable_shard_keeps_its_fragments_last_progress():
    spec = job_spec()
    unreachable = Observation(pods=healthy().pods, shards=[ShardObservation(0, ready=True)])
    first, second = run(spec, [healthy(), unreachable])
    assert second.status.fragments == first.status.fragments and second.status.syncer.reachable == 0


def test_condition_transition_times_move_only_on_change():
    conditions = set_condition([], "Ready", False, "Pending", "", at(0), 1)
    same = set_condition(conditions, "Ready", False, "Degraded", "x", at(10), 2)
    assert same[0].last_transition_time == at(0) and same[0].reason == "Degraded"
    flipped = set_condition(same, "Ready", True, "Running", "", at(20), 2)
    assert flipped[0].last_transition_time == at(20) and len(flipped) == 1


def test_ttl_after_finishing():
    running = DiLoCoJobStatus(phase=Phase.RUNNING)
    assert ttl_expires_at(running, 60) is None
    done = DiLoCoJobStatus(phase=Phase.SUCCEEDED, completion_time=at(0))
    assert ttl_expires_at(done, None) is None and ttl_expires_at(done, 60) == at(60)
    spec = job_spec(ttlSecondsAfterFinished=60)
    assert not decide(spec, 1, done, Observation(), at(59)).delete
    expired = decide(spec, 1, done, Observation(), at(60))
    assert expired.delete and "TTLExpired" in [e.reason for e in expired.events]
    assert expired.scale.islands == {"a": 0, "b": 0}


def test_status_entries_follow_the_spec_islands():
    spec = job_spec()
    status = run(spec, [healthy()])[-1].status
    fewer = job_spec(islands=[{"name": "b", "replicas": 1}])
    decision = decide(fewer, 2, status, healthy(), at(10))
    assert [i.name for i in decision.status.islands] == ["b"] and set(decision.scale.islands) == {"b"}


def test_island_status_round_trips_through_json():
    status = run(job_spec(), [healthy(), healthy()])[-1].status
    assert DiLoCoJobStatus.model_validate_json(status.model_dump_json(by_alias=True)) == status
    assert isinstance(status.islands[0], IslandStatus)
