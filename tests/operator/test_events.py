"""Repeated Events aggregate: the same Event posted again is one object whose count and lastTimestamp grow,
found again by its name after a restart, with a bounded memory of recent ones."""

from __future__ import annotations

import datetime

from diloco.operator.event_recorder import EventRecorder
from diloco.operator.events import (
    MAX_FAILURE_DETAIL,
    Event,
    RecentEvents,
    event_name,
    first_occurrence,
    reconcile_failed,
    repetition,
)
from diloco.operator.kube import ApiError
from diloco.operator.naming import JobRef

JOB = JobRef(name="job", namespace="ns", uid="uid-1")
FAILED = Event("Warning", "ApplyFailed", "StatefulSet/job-a: forbidden")
T0 = datetime.datetime(2025, 1, 1, 12, 0, tzinfo=datetime.UTC)


class FakeEvents:
    """The Event endpoints of the API server: create refuses an existing name (None), patch merges."""

    def __init__(self) -> None:
        self.stored: dict[str, dict] = {}
        self.calls: list[str] = []

    def create(self, obj):
        self.calls.append("create")
        name = obj["metadata"]["name"]
        if name in self.stored:
            return None
        self.stored[name] = dict(obj)
        return obj

    def get(self, kind, namespace, name):
        self.calls.append("get")
        return self.stored.get(name)

    def patch(self, kind, namespace, name, body):
        self.calls.append("patch")
        if name not in self.stored:
            return None
        self.stored[name].update(body)
        return self.stored[name]


def at(minutes: int) -> datetime.datetime:
    return T0 + datetime.timedelta(minutes=minutes)


def test_the_name_is_the_event_itself_on_its_job():
    assert event_name(JOB, FAILED) == event_name(JobRef(name="job", namespace="ns", uid="uid-1"), FAILED)
    assert event_name(JOB, FAILED).startswith("job.")
    others = {
        event_name(JobRef(name="job", namespace="ns", uid="uid-2"), FAILED),
        event_name(JOB, Event("Normal", FAILED.reason, FAILED.message)),
        event_name(JOB, Event(FAILED.type, "DeleteFailed", FAILED.message)),
        event_name(JOB, Event(FAILED.type, FAILED.reason, "other")),
    }
    assert event_name(JOB, FAILED) not in others and len(others) == 4


def test_first_occurrence_counts_one_and_a_repetition_patches_count_and_last_time():
    body = first_occurrence(JOB, FAILED, T0)
    assert body["count"] == 1 and body["firstTimestamp"] == body["lastTimestamp"] == "2025-01-01T12:00:00Z"
    assert body["involvedObject"] == {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "name": "job",
        "namespace": "ns",
        "uid": "uid-1",
    }
    assert repetition(4, at(3)) == {"count": 5, "lastTimestamp": "2025-01-01T12:03:00Z"}


def test_recent_events_are_bounded_least_recently_used_dropped():
    recent = RecentEvents(size=2)
    recent.remember("a", 1)
    recent.remember("b", 1)
    assert recent.count("a") == 1
    recent.remember("c", 1)
    assert len(recent) == 2 and recent.count("b") is None and recent.count("a") == 1


def test_the_same_event_posted_five_times_is_one_event_counted_five():
    kube = FakeEvents()
    recorder = EventRecorder(kube)
    for minute in range(5):
        recorder.post(JOB, FAILED, at(minute))
    (stored,) = kube.stored.values()
    assert stored["count"] == 5
    assert stored["firstTimestamp"] == "2025-01-01T12:00:00Z" and stored["lastTimestamp"] == "2025-01-01T12:04:00Z"
    assert kube.calls == ["create"] + ["patch"] * 4


def test_a_restarted_or_forgetful_operator_finds_the_event_again():
    kube = FakeEvents()
    for minute in range(3):
        EventRecorder(kube).post(JOB, FAILED, at(minute))
    (stored,) = kube.stored.values()
    assert stored["count"] == 3 and stored["lastTimestamp"] == "2025-01-01T12:02:00Z"
    forgetful = EventRecorder(kube, RecentEvents(size=1))
    other = Event("Normal", "Created", "created 1: Service/job-syncer-0")
    for minute in (3, 4):
        forgetful.post(JOB, FAILED, at(minute))
        forgetful.post(JOB, other, at(minute))
    assert sorted(e["count"] for e in kube.stored.values()) == [2, 5]


def test_an_event_expired_meanwhile_starts_again_and_a_refusal_is_not_raised():
    kube = FakeEvents()
    recorder = EventRecorder(kube)
    recorder.post(JOB, FAILED, at(0))
    kube.stored.clear()
    recorder.post(JOB, FAILED, at(90))
    (stored,) = kube.stored.values()
    assert stored["count"] == 1 and stored["firstTimestamp"] == "2025-01-01T13:30:00Z"

    def refuse(*_):
        raise ApiError(403, "forbidden")

    kube.patch = refuse
    recorder.post(JOB, FAILED, at(91))
    assert stored["count"] == 1


def test_passes_that_fail_alike_post_the_same_event_naming_the_error():
    first = reconcile_failed(ApiError(403, 'pods is forbidden: cannot list resource "pods"\nmore detail'))
    again = reconcile_failed(ApiError(403, 'pods is forbidden: cannot list resource "pods"\nother detail'))
    assert first == again and event_name(JOB, first) == event_name(JOB, again)
    assert (first.type, first.reason) == ("Warning", "ReconcileFailed")
    assert first.message.endswith('ApiError: HTTP 403: pods is forbidden: cannot list resource "pods"')
    assert reconcile_failed(KeyError()).message.endswith(": KeyError")
    assert len(reconcile_failed(RuntimeError("x" * 5000)).message) < MAX_FAILURE_DETAIL + 64
