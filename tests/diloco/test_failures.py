"""Failure traces are data: deterministic for a seed, validated, and saved and loaded unchanged."""

import pytest

from diloco.failures import FailureEvent, load_trace, random_trace, save_trace, worker_target

WORKERS = [worker_target(f"island-{i}", 0) for i in range(4)]


def test_random_trace_is_deterministic_for_a_seed_and_bounded_in_time():
    a = random_trace(seed=3, duration=60, mean_interval=5, workers=WORKERS, downtime=2)
    b = random_trace(seed=3, duration=60, mean_interval=5, workers=WORKERS, downtime=2)
    assert a == b and a == sorted(a)
    assert all(0 <= e.at < 60 and e.target in WORKERS and e.downtime == 2 for e in a)
    assert 4 <= len(a) <= 25, "about 12 kills expected at one per 5 s over 60 s"


def test_no_interval_means_no_worker_kills_but_syncer_kills_stay():
    trace = random_trace(seed=0, duration=60, mean_interval=0, workers=WORKERS, downtime=2,
                         syncer_kills=[(10.0, 0)])
    assert trace == [FailureEvent(10.0, "syncer:0", 2.0)]


def test_trace_round_trips_through_a_file(tmp_path):
    trace = random_trace(seed=1, duration=30, mean_interval=3, workers=WORKERS, downtime=1.5)
    save_trace(tmp_path / "t.json", trace)
    assert load_trace(tmp_path / "t.json") == trace


@pytest.mark.parametrize("target", ["island-1", "worker:", "pod:x", ""])
def test_bad_targets_are_refused(target):
    with pytest.raises(ValueError, match="worker:<island>/<rank> or syncer:<shard>"):
        FailureEvent(1.0, target, 1.0)
