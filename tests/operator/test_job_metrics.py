"""Per-job gauges: what each reconcile pass's status says about a job, labelled by namespace and job, and
gone with the job."""

import kopf
from prometheus_client import CollectorRegistry, generate_latest

from diloco.api.job import DiLoCoJobStatus, Phase
from diloco.operator import handlers
from diloco.operator.job_metrics import JobMetrics
from diloco.operator.metrics import OperatorMetrics
from diloco.operator.reconcile import LEFT_ALONE, PassOutcome, status_patch

SINCE = "2026-01-01T12:00:00Z"
STATUS = {
    "phase": "Degraded",
    "conditions": [
        {"type": "Ready", "status": "False", "reason": "IslandsNotReady", "lastTransitionTime": SINCE},
        {"type": "Degraded", "status": "True", "reason": "IslandsNotReady", "lastTransitionTime": SINCE},
    ],
    "islandsReady": "1/2",
    "islands": [
        {"name": "a", "desired": 2, "ready": 2, "restarts": 1, "preemptions": 0, "loss": 3.25},
        {"name": "b", "desired": 2, "ready": 1, "restarts": 2, "preemptions": 3},
    ],
    "syncer": {"shards": 2, "ready": 2, "reachable": 2},
    "outerStep": 7,
    "tokens": 123456,
    "loss": 3.5,
    "goodput": 0.75,
    "startTime": None,
}


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def observed(status=STATUS, namespace="ml", job="demo"):
    registry = CollectorRegistry()
    jobs = JobMetrics(registry)
    jobs.observe(namespace, job, status)
    return registry, jobs


def test_a_jobs_phase_is_one_series_per_phase_set_to_1_for_the_current_one():
    registry, _ = observed()
    assert value(registry, "diloco_job_phase", namespace="ml", job="demo", phase="Degraded") == 1
    assert value(registry, "diloco_job_phase", namespace="ml", job="demo", phase="Running") == 0


def test_conditions_read_1_while_true():
    registry, _ = observed()
    assert value(registry, "diloco_job_condition", namespace="ml", job="demo", type="Degraded") == 1
    assert value(registry, "diloco_job_condition", namespace="ml", job="demo", type="Ready") == 0


def test_the_jobs_progress_and_islands_are_gauges_labelled_by_namespace_and_job():
    registry, _ = observed()
    job = {"namespace": "ml", "job": "demo"}
    assert value(registry, "diloco_job_islands_desired", **job) == 2
    assert value(registry, "diloco_job_islands_ready", **job) == 1
    assert value(registry, "diloco_job_restarts", **job) == 3
    assert value(registry, "diloco_job_preemptions", **job) == 3
    assert value(registry, "diloco_job_outer_step", **job) == 7
    assert value(registry, "diloco_job_tokens", **job) == 123456
    assert value(registry, "diloco_job_goodput", **job) == 0.75
    assert value(registry, "diloco_job_loss", **job) == 3.5
    assert value(registry, "diloco_job_syncer_shards_ready", **job) == 2
    assert value(registry, "diloco_job_island_pods_ready", **job, island="b") == 1
    assert value(registry, "diloco_job_island_preemptions", **job, island="b") == 3
    assert value(registry, "diloco_job_island_loss", **job, island="a") == 3.25


def test_what_the_status_does_not_know_yet_has_no_series():
    registry, _ = observed({"phase": "Pending", "islandsReady": "0/2", "goodput": None, "loss": None})
    job = {"namespace": "ml", "job": "demo"}
    assert value(registry, "diloco_job_goodput", **job) is None and value(registry, "diloco_job_loss", **job) is None
    assert value(registry, "diloco_job_phase", **job, phase="Pending") == 1


def test_a_deleted_jobs_series_and_a_removed_islands_go():
    registry, jobs = observed()
    jobs.observe("ml", "other", STATUS)
    jobs.observe("ml", "demo", {**STATUS, "islands": STATUS["islands"][:1]})
    assert value(registry, "diloco_job_island_restarts", namespace="ml", job="demo", island="b") is None
    jobs.forget("ml", "demo")
    exposed = generate_latest(registry).decode()
    assert 'job="demo"' not in exposed and 'job="other"' in exposed


def test_each_pass_reports_the_status_it_wrote_and_a_deleted_job_is_forgotten():
    outcome = PassOutcome(status=STATUS, events=(), applied=(), deleted=(), job_deleted=False)
    metrics = OperatorMetrics()
    reconcile = handlers._handler(FakeReconciler(outcome), metrics, "timer")
    reconcile(meta={"generation": 1}, spec={}, status={}, name="demo", namespace="ml", uid="u", patch={})
    assert value(metrics.registry, "diloco_job_outer_step", namespace="ml", job="demo") == 7
    reconcile(
        meta={"deletionTimestamp": "2026-01-01T00:00:00Z"},
        spec={},
        status={},
        name="demo",
        namespace="ml",
        uid="u",
        patch={},
    )
    assert value(metrics.registry, "diloco_job_outer_step", namespace="ml", job="demo") is None


def test_a_job_deleted_at_once_is_forgotten_when_the_watch_reports_it():
    registry, metrics = kopf.OperatorRegistry(), OperatorMetrics()
    handlers.register(registry, FakeReconciler(), metrics, interval=7)
    metrics.jobs.observe("ml", "demo", STATUS)
    (watching,) = registry._watching.get_all_handlers()
    watching.fn(event={"type": "MODIFIED", "object": {}}, namespace="ml", name="demo")
    assert value(metrics.registry, "diloco_job_outer_step", namespace="ml", job="demo") == 7
    watching.fn(event={"type": "DELETED", "object": {}}, namespace="ml", name="demo")
    assert value(metrics.registry, "diloco_job_outer_step", namespace="ml", job="demo") is None


class FakeReconciler:
    def __init__(self, outcome=None):
        self.outcome, self.events = outcome, None

    def reconcile(self, job, generation, spec, status, now):
        return self.outcome


def test_a_status_as_a_pass_patches_it_nulls_included_reads_back():
    registry, _ = observed(status_patch(DiLoCoJobStatus(phase=Phase.RUNNING, outer_step=3)))
    assert value(registry, "diloco_job_phase", namespace="ml", job="demo", phase="Running") == 1
    assert value(registry, "diloco_job_outer_step", namespace="ml", job="demo") == 3


def test_a_pass_that_leaves_the_status_alone_leaves_the_series_too():
    metrics = OperatorMetrics()
    metrics.jobs.observe("ml", "demo", STATUS)
    reconcile = handlers._handler(FakeReconciler(LEFT_ALONE), metrics, "timer")
    reconcile(meta={"generation": 1}, spec={}, status={}, name="demo", namespace="ml", uid="u", patch={})
    assert value(metrics.registry, "diloco_job_outer_step", namespace="ml", job="demo") == 7
