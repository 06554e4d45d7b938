"""Island accounting from observations: pods and nodes as observed, failures (charged to the restart budget)
versus preemptions (never charged), and when an island re-forms."""

import pytest
from status_builders import T0, at, pod

from diloco.api.job import IslandSpec
from diloco.operator.island_accounting import (
    HEALTHY,
    NodeState,
    account_island,
    nodes_to_check,
    observe_node,
    observe_pod,
)

ISLAND = IslandSpec(name="a", replicas=2)


def step(previous, pods, *, now=T0, nodes=None, revision=None, active=True, backoff=10, island=ISLAND, workload=None):
    return account_island(previous, island, pods, nodes or {}, revision, active, backoff, now, workload)


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
    owned = raw_pod()
    owned["metadata"]["ownerReferences"] = [{"kind": "StatefulSet", "uid": "sts-1", "controller": True}]
    assert observe_pod(owned).owner == "sts-1" and observed.owner is None
    assert (observed.node, observed.revision, observed.ip) == ("n-7", "job-a-abc", "10.1.2.3")


def test_observe_pod_says_how_a_container_last_ended():
    observed = observe_pod(
        raw_pod(
            containerStatuses=[
                {"lastState": {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": "2026-01-01T00:00:01Z"}}},
                {
                    "state": {
                        "terminated": {"exitCode": 137, "reason": "OOMKilled", "finishedAt": "2026-01-01T00:00:09Z"}
                    }
                },
            ]
        )
    )
    assert observed.last_exit == "exit code 137 (OOMKilled)"
    assert observe_pod(raw_pod()).last_exit is None


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


def test_observe_pod_sees_containers_lost_with_their_node():
    """As the kubelet reports a container it found gone from the runtime after its node rebooted."""
    lost = {"exitCode": 137, "reason": "ContainerStatusUnknown"}
    assert observe_pod(
        raw_pod(containerStatuses=[{"restartCount": 1, "lastState": {"terminated": lost}}])
    ).lost_with_node
    oom = {"exitCode": 137, "reason": "OOMKilled"}
    assert not observe_pod(
        raw_pod(containerStatuses=[{"restartCount": 1, "lastState": {"terminated": oom}}])
    ).lost_with_node


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


def test_the_failure_event_names_each_failed_pod_and_how_it_ended():
    account = step(settled(), [pod(0, restarts=1, exit="exit code 137 (OOMKilled)"), pod(1)], now=at(5))
    (event,) = account.events
    assert event.reason == "IslandFailed"
    assert event.message.startswith("island a: pod job-a-0 restarted, exit code 137 (OOMKilled); restarts 1;")
    six = IslandSpec(name="a", replicas=6)
    before = settled([pod(k) for k in range(6)], island=six)
    many = step(before, [pod(k, restarts=1) for k in range(6)], now=at(5), island=six)
    assert "pod job-a-3 restarted; and 2 more pods failed; restarts 1;" in many.events[0].message


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


def test_containers_lost_with_their_node_and_restarted_are_a_preemption():
    """A rebooted node, or a datacenter back from an outage, restarts the island's containers: no fault of the
    trainer's, so it is not charged; the island re-forms at once while some of its pods run on in the old
    world."""
    previous = settled()
    account = step(previous, [pod(0, restarts=1, lost=True), pod(1)], now=at(5))
    assert (account.status.preemptions, account.status.restarts) == (1, 0)
    assert account.status.reform.reason == "Preemption" and account.status.reform.hold_until == at(5)
    assert [e.reason for e in account.events] == ["IslandPreempted"]


@pytest.mark.parametrize("replicas", [1, 2])
def test_an_island_restarted_whole_with_its_nodes_is_not_re_formed(replicas):
    """Every pod restarted in place: its ranks all start anew, as a re-form would start them."""
    island = IslandSpec(name="a", replicas=replicas)
    previous = settled([pod(i) for i in range(replicas)], island=island)
    back = [pod(i, restarts=1, lost=True) for i in range(replicas)]
    account = step(previous, back, now=at(5), island=island)
    assert (account.status.preemptions, account.status.restarts) == (replicas, 0)
    assert account.status.reform is None and account.replicas == replicas
    assert [e.reason for e in account.events] == ["IslandPreempted"]
    again = step(account.status, back, now=at(7), island=island)
    assert again.events == () and again.status.preemptions == replicas


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


@pytest.mark.parametrize("recreated", [False, True], ids=["gone", "recreated"])
def test_pods_that_vanish_with_their_statefulset_are_not_counted(recreated):
    """A StatefulSet deleted by hand takes its pods along and the operator recreates it (a new UID): the pods
    were not the island's to lose, like a preemption, and are charged nothing."""
    previous = settled([pod(0, owner="sts-1"), pod(1, owner="sts-1")], workload="sts-1")
    now = "sts-2" if recreated else None
    terminating = step(previous, [pod(0, owner="sts-1", phase="Failed", terminating=True)], workload=now, now=at(5))
    assert terminating.status.restarts == 0 and terminating.events == ()
    gone = step(terminating.status, [], workload=now, now=at(10))
    assert gone.status.restarts == 0 and gone.status.preemptions == 0 and gone.events == ()
    assert gone.replicas == 2 and gone.status.reform is None
    fresh = step(gone.status, [pod(0, "n0", owner="sts-2"), pod(1, "n1", owner="sts-2")], workload="sts-2", now=at(20))
    assert fresh.status.restarts == 0 and fresh.events == ()


def test_a_pod_lost_under_the_same_statefulset_is_still_a_failure():
    previous = settled([pod(0, owner="sts-1"), pod(1, owner="sts-1")], workload="sts-1")
    account = step(previous, [pod(0, owner="sts-1")], workload="sts-1", now=at(5))
    assert account.status.restarts == 1 and [e.reason for e in account.events] == ["IslandFailed"]


def test_a_new_template_revision_re_forms_the_island_uncounted():
    previous = settled()
    account = step(previous, [pod(0), pod(1)], revision="a-2", now=at(1))
    assert account.status.reform.reason == "Update" and account.replicas == 0
    assert account.status.restarts == 0 and [e.reason for e in account.events] == ["IslandUpdating"]
    current = step(settled(), [pod(0, revision="a-2"), pod(1, revision="a-2")], revision="a-2", now=at(1))
    assert current.status.reform is None
