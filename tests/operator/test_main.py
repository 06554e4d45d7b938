"""The kopf wiring and the command line: which triggers reconcile, how an outcome reaches the job and the
metrics, and which namespaces are watched."""

import argparse
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kopf
import pytest
from kubernetes import client
from pydantic import ValidationError

from diloco.api.job import DiLoCoJobSpec
from diloco.operator import handlers, reconcile
from diloco.operator.events import Event
from diloco.operator.kube import ApiError, Kube, pooled
from diloco.operator.main import parse_args, watched_namespaces
from diloco.operator.metrics import OperatorMetrics
from diloco.operator.reconcile import PassOutcome


class PostedEvents:
    """The reconciler's EventRecorder: what the handler posted, as (job, type, reason, message)."""

    def __init__(self):
        self.posted = []

    def post(self, job, event, now):
        self.posted.append({"job": job.name, "type": event.type, "reason": event.reason, "message": event.message})


class FakeReconciler:
    def __init__(self, outcome=None, error=None):
        self.outcome, self.error, self.calls, self.events = outcome, error, [], PostedEvents()

    def reconcile(self, job, generation, spec, status, now):
        self.calls.append((job, generation, spec, status))
        if self.error:
            raise self.error
        return self.outcome


def sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0


def call(handler, **overrides):
    kwargs = dict(
        body={"metadata": {"name": "demo", "namespace": "ml"}},
        meta={"generation": 3},
        spec={"image": "x"},
        status={"phase": "Pending"},
        name="demo",
        namespace="ml",
        uid="u",
        patch={},
        logger=None,
        retry=0,
    )
    kwargs.update(overrides)
    handler(**kwargs)
    return kwargs


def test_every_trigger_runs_the_same_pass():
    registry = kopf.OperatorRegistry()
    handlers.register(registry, FakeReconciler(), OperatorMetrics(), interval=7)
    changing = {h.id: h.reason for h in registry._changing.get_all_handlers()}
    assert set(changing) == {"reconcile-on-resume", "reconcile-on-create", "reconcile-on-update"}
    (timer,) = registry._spawning.get_all_handlers()
    assert timer.id == "reconcile-on-timer" and timer.interval == 7
    selectors = {h.selector.group for h in [*registry._changing.get_all_handlers(), timer]}
    assert selectors == {"diloco.dev"}


def test_an_outcome_becomes_a_status_patch_events_and_metrics():
    outcome = PassOutcome(
        status={"phase": "Running"},
        events=(Event("Warning", "ApplyFailed", "Service/x: no"),),
        applied=("StatefulSet/demo-a", "Service/demo-a"),
        deleted=("Service/demo-b",),
        job_deleted=False,
    )
    reconciler, metrics = FakeReconciler(outcome), OperatorMetrics()
    kwargs = call(handlers._handler(reconciler, metrics, "timer"))
    posted = [{k: v for k, v in e.items() if k != "job"} for e in reconciler.events.posted]
    assert [e["job"] for e in reconciler.events.posted] == ["demo"]
    ((job, generation, _spec, status),) = reconciler.calls
    assert (job.name, job.namespace, job.uid, generation, status) == ("demo", "ml", "u", 3, {"phase": "Pending"})
    assert kwargs["patch"] == {"status": {"phase": "Running"}}
    assert posted == [{"type": "Warning", "reason": "ApplyFailed", "message": "Service/x: no"}]
    assert sample(metrics, "diloco_operator_reconciles_total", trigger="timer", result="ok") == 1
    assert sample(metrics, "diloco_operator_applied_objects_total", kind="StatefulSet") == 1
    assert sample(metrics, "diloco_operator_deleted_objects_total", kind="Service") == 1
    assert sample(metrics, "diloco_operator_errors_total", kind="ApplyFailed") == 1
    assert sample(metrics, "diloco_operator_reconcile_seconds_count") == 1


def test_a_deleted_job_gets_no_status_patch():
    outcome = PassOutcome(status={"phase": "Succeeded"}, events=(), applied=(), deleted=(), job_deleted=True)
    assert call(handlers._handler(FakeReconciler(outcome), OperatorMetrics(), "timer"))["patch"] == {}


def test_a_job_being_deleted_is_left_to_the_garbage_collector():
    reconciler, metrics = FakeReconciler(), OperatorMetrics()
    kwargs = call(
        handlers._handler(reconciler, metrics, "timer"),
        meta={"generation": 3, "deletionTimestamp": "2026-01-01T00:00:00Z"},
    )
    assert reconciler.calls == [] and kwargs["patch"] == {}
    assert sample(metrics, "diloco_operator_reconciles_total", trigger="timer", result="ok") == 0


def test_a_timer_skips_its_turn_while_a_pass_is_under_way_and_a_change_waits_for_it():
    outcome = PassOutcome(status={"phase": "Running"}, events=(), applied=(), deleted=(), job_deleted=False)
    reconciler, metrics, locks = FakeReconciler(outcome), OperatorMetrics(), handlers.PassLocks()
    under_way = locks.of("u")
    under_way.acquire()
    call(handlers._handler(reconciler, metrics, "timer", locks))
    assert reconciler.calls == []
    assert sample(metrics, "diloco_operator_reconciles_total", trigger="timer", result="skipped") == 1
    change = threading.Thread(target=call, args=(handlers._handler(reconciler, metrics, "update", locks),))
    change.start()
    change.join(0.2)
    assert change.is_alive() and reconciler.calls == []
    under_way.release()
    change.join(5)
    assert len(reconciler.calls) == 1
    call(handlers._handler(reconciler, metrics, "timer", locks), uid="other-job")
    assert len(reconciler.calls) == 2


def test_an_invalid_spec_is_reported_and_not_retried():
    try:
        DiLoCoJobSpec.model_validate({"image": "x", "islands": []})
    except ValidationError as error:
        invalid = error
    metrics = OperatorMetrics()
    reconciler = FakeReconciler(error=invalid)
    with pytest.raises(kopf.PermanentError):
        call(handlers._handler(reconciler, metrics, "update"))
    warned = reconciler.events.posted
    assert warned[0]["type"] == "Warning"
    assert warned[0]["reason"] == "InvalidSpec" and "islands" in warned[0]["message"]
    assert sample(metrics, "diloco_operator_reconciles_total", trigger="update", result="invalid") == 1


def test_other_failures_are_counted_posted_through_the_recorder_and_left_to_kopf_to_retry():
    metrics = OperatorMetrics()
    reconciler = FakeReconciler(error=RuntimeError("API down"))
    with pytest.raises(RuntimeError):
        call(handlers._handler(reconciler, metrics, "create"))
    assert sample(metrics, "diloco_operator_errors_total", kind="reconcile") == 1
    assert reconciler.events.posted == [
        {
            "job": "demo",
            "type": "Warning",
            "reason": "ReconcileFailed",
            "message": "a reconcile pass failed and will be retried: RuntimeError: API down",
        }
    ]


def test_a_pass_refused_because_the_namespace_is_going_posts_nothing_and_is_not_retried():
    """Its namespace began going after the pass looked: the API server refuses anything new there, and there is
    nothing to say about a job on its way out."""
    going = ApiError(
        403, 'events "demo.x" is forbidden: unable to create new content in namespace ml because it is being terminated'
    )
    metrics = OperatorMetrics()
    reconciler = FakeReconciler(error=going)
    kwargs = call(handlers._handler(reconciler, metrics, "timer"))
    assert reconciler.events.posted == [] and kwargs["patch"] == {}
    assert sample(metrics, "diloco_operator_reconciles_total", trigger="timer", result="skipped") == 1
    assert sample(metrics, "diloco_operator_errors_total", kind="reconcile") == 0


def test_kopf_settings():
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    assert settings.persistence.finalizer == "diloco.dev/finalizer" and settings.scanning.disabled
    assert settings.peering.lifetime == 60
    assert not settings.posting.enabled  # a failed pass is posted by the handler, aggregated
    handlers.configure(settings, peering_lifetime=7)
    assert settings.peering.lifetime == 7
    assert settings.execution.max_workers == handlers.PASSES_AT_ONCE


class SlowApi(BaseHTTPRequestHandler):
    """An API server that answers every GET with an empty object after a while, so calls overlap."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        time.sleep(0.2)
        body = json.dumps({"kind": "ConfigMap", "metadata": {"name": "x"}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


def pool_warnings(connections, caplog):
    """urllib3's warnings while as many calls as the operator's passes make at once go through a pool of
    `connections`, against a real HTTP server."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        configuration = client.Configuration(host=f"http://127.0.0.1:{server.server_port}")
        kube = Kube(pooled(configuration, connections))
        calls = handlers.connections_needed(reconcile.PARALLEL_CALLS)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="urllib3"), ThreadPoolExecutor(calls) as threads:
            for _ in range(2):  # a second round finds the connections the first kept, or not
                list(threads.map(lambda _: kube.get("ConfigMap", "ns", "x"), range(calls)))
        return [r.getMessage() for r in caplog.records if "pool is full" in r.getMessage()]
    finally:
        server.shutdown()
        thread.join(5)


def test_the_api_clients_pool_holds_every_call_the_operators_passes_make_at_once(caplog):
    """With many jobs, kopf runs PASSES_AT_ONCE passes, each making its calls in parallel: a pool sized for one
    pass's calls discarded connections with a warning each, over a hundred a minute with 15 jobs."""
    assert pool_warnings(reconcile.PARALLEL_CALLS, caplog), "the pool one pass needs is too small for all"
    assert pool_warnings(handlers.connections_needed(reconcile.PARALLEL_CALLS), caplog) == []


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([], {}, []),
        (["--all-namespaces"], {"DILOCO_WATCH_NAMESPACES": "a"}, []),
        (["-n", "a", "--namespace", "b"], {"DILOCO_WATCH_NAMESPACES": "c"}, ["a", "b"]),
        ([], {"DILOCO_WATCH_NAMESPACES": "team-a, team-b"}, ["team-a", "team-b"]),
        ([], {"DILOCO_WATCH_NAMESPACES": "*"}, []),
    ],
)
def test_watched_namespaces(argv, environ, expected):
    assert watched_namespaces(parse_args(argv), environ) == expected


def test_command_line_defaults_and_exclusions():
    args = parse_args([])
    assert (args.resync_seconds, args.metrics_port, args.liveness_port, args.peering) == (
        10.0,
        8000,
        8080,
        "diloco-operator",
    )
    assert isinstance(args, argparse.Namespace) and args.priority is None and not args.standalone
    assert args.peering_lifetime == 60 and parse_args(["--peering-lifetime", "5"]).peering_lifetime == 5
    for exclusive in (["-A", "-n", "x"], ["--standalone", "--peering", "p"]):
        with pytest.raises(SystemExit):
            parse_args(exclusive)
