"""Failure traces are data: deterministic for a seed, validated, saved and loaded unchanged, and one format for
`diloco run` (worker and syncer targets) and `diloco simulate` (chip and learner targets)."""

import json

import pytest

from diloco.local.failure_trace import (
    FailureEvent,
    chip_target,
    learner_target,
    load_trace,
    random_trace,
    save_trace,
    syncer_target,
    worker_target,
)

WORKERS = [worker_target(f"island-{i}", 0) for i in range(4)]


def test_random_trace_is_deterministic_for_a_seed_and_bounded_in_time():
    a = random_trace(seed=3, duration=60, mean_interval=5, workers=WORKERS, downtime=2)
    b = random_trace(seed=3, duration=60, mean_interval=5, workers=WORKERS, downtime=2)
    assert a == b and a == sorted(a)
    assert all(0 <= e.at < 60 and e.target in WORKERS and e.downtime == 2 for e in a)
    assert 4 <= len(a) <= 25, "about 12 kills expected at one per 5 s over 60 s"


def test_no_interval_means_no_worker_kills_but_syncer_kills_stay():
    trace = random_trace(seed=0, duration=60, mean_interval=0, workers=WORKERS, downtime=2, syncer_kills=[(10.0, 0)])
    assert trace == [FailureEvent(10.0, "syncer:0", 2.0)]


def test_trace_round_trips_through_a_file_exactly(tmp_path):
    trace = random_trace(seed=1, duration=30, mean_interval=3, workers=WORKERS, downtime=1.5)
    trace += [FailureEvent(0.1 + 0.2, chip_target(7), 1 / 3), FailureEvent(4.0, learner_target(2), 0.0)]
    save_trace(tmp_path / "t.json", trace)
    assert load_trace(tmp_path / "t.json") == sorted(trace)
    text = (tmp_path / "t.json").read_text()
    assert len(text.splitlines()) == len(trace) + 2, "one event per line"
    assert json.loads(text)[0] == {"at": trace[0].at, "target": trace[0].target, "downtime": trace[0].downtime}


def test_an_empty_trace_is_a_valid_file(tmp_path):
    save_trace(tmp_path / "empty.json", [])
    assert load_trace(tmp_path / "empty.json") == []


def test_targets_say_what_they_name():
    worker = FailureEvent(1.0, worker_target("pool-a", 3), 1.0)
    assert (worker.kind, worker.island, worker.index) == ("worker", "pool-a", 3)
    assert (FailureEvent(1.0, syncer_target(2), 1.0).kind, FailureEvent(1.0, syncer_target(2), 1.0).index) == (
        "syncer",
        2,
    )
    assert FailureEvent(1.0, learner_target(5), 1.0).index == 5
    assert FailureEvent(1.0, chip_target(1_199_999), 1.0).index == 1_199_999
    with pytest.raises(ValueError, match="not a worker target"):
        _ = FailureEvent(1.0, chip_target(0), 1.0).island


@pytest.mark.parametrize(
    "target", ["island-1", "worker:", "worker:island-1", "worker:island-1/x", "pod:x", "chip:-1", "learner:a", ""]
)
def test_bad_targets_are_refused(target):
    with pytest.raises(ValueError, match="worker:<island>/<rank>, syncer:<shard>, learner:<index> or chip:<index>"):
        FailureEvent(1.0, target, 1.0)


@pytest.mark.parametrize("at, downtime", [(-1.0, 1.0), (1.0, -0.5), (float("nan"), 1.0)])
def test_negative_or_missing_times_are_refused(at, downtime):
    with pytest.raises(ValueError, match="non-negative"):
        FailureEvent(at, "chip:0", downtime)


@pytest.mark.parametrize(
    "text, message",
    [
        ("time_s,chip\n1,2\n", "not a JSON failure trace"),
        ('{"at": 1}', "a trace is a JSON list"),
        ('[{"at": 1, "target": "chip:0"}]', "event 0: an event is"),
        (
            '[{"at": 1, "target": "chip:0", "downtime": 1}, {"at": "soon", "target": "chip:1", "downtime": 1}]',
            "event 1: could not convert",
        ),
        ('[{"at": 1, "target": "gpu:0", "downtime": 1}]', "event 0: a failure target is"),
    ],
)
def test_bad_trace_files_are_refused_with_the_events_position(tmp_path, text, message):
    path = tmp_path / "trace.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_trace(path)


def test_diloco_run_refuses_a_trace_naming_processes_it_does_not_have(tmp_path, capsys):
    # A simulator trace (chip targets) or a kill of an island the job lacks would silently kill nothing.
    from diloco.cli import main

    for target in ("chip:3", "worker:island-7/0", "syncer:1"):
        save_trace(tmp_path / "t.json", [FailureEvent(5.0, target, 1.0)])
        code = main(["run", "--islands", "2", "--trace", str(tmp_path / "t.json"), "--out", str(tmp_path / "out")])
        assert code == 2
        assert f"{target} (at 5 s) is not a process of this job" in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "refused before anything started"
