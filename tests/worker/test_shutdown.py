"""SIGTERM ends a worker cleanly: the step it is in finishes, the steps since each fragment's last sync reach
the shards within the grace period, the shards hear Leave, and the process exits 0."""

import signal
import subprocess
import time

import pytest
from learner_harness import make_config
from support import wait_until
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_pod_launcher import finish, start_pod
from worker_process import start_worker

from diloco.progress import StepEvent, read_events
from diloco.worker.shutdown import LEAVE_RESERVE_SECONDS, StopRequest


def test_the_flush_gets_the_grace_period_less_the_leave_reserve():
    stop = StopRequest(grace_seconds=30)
    assert not stop.requested and stop.flush_budget() <= 30 - LEAVE_RESERVE_SECONDS
    stop.signalled_at = time.monotonic() - 40
    assert stop.requested and stop.flush_budget() == 0.0


def test_a_short_grace_period_keeps_half_for_leave():
    stop = StopRequest(grace_seconds=4)
    assert stop.leave_reserve == 2 and stop.flush_budget() <= 2


def test_a_negative_grace_period_is_refused():
    with pytest.raises(ValueError, match="grace period"):
        StopRequest(grace_seconds=-1)


# H is far away: every token the shard merges came from the flush SIGTERM started. The island timeout is
# longer than the test: only Leave can take the island out of the live set.
FAR_SYNC = make_config(inner_steps=10_000, fragments=2, island_timeout_seconds=3600)


@pytest.mark.process
def test_sigterm_mid_round_pushes_the_last_steps_and_leaves_at_once(start_shards, tmp_path):
    config = FAR_SYNC
    shards = start_shards(config)
    progress = tmp_path / "progress"
    worker = start_worker(
        tmp_path,
        config,
        shards.targets[0],
        "island-3",
        "--progress-file",
        str(progress / "worker.jsonl"),
        env={"DILOCO_TERMINATION_GRACE_SECONDS": "60", "DILOCO_TENSORBOARD_DIR": str(tmp_path / "tensorboard")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: sum(isinstance(e, StepEvent) for e in read_events(progress)) >= 3, timeout=180)
        assert shards.live_islands(0) == ["island-3"]
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 0, stderr
    trained = sum(e.tokens for e in read_events(progress) if isinstance(e, StepEvent))
    assert trained > 0
    curves = EventAccumulator(str(tmp_path / "tensorboard" / "island-3"))
    curves.Reload()
    steps = [e.step for e in read_events(progress) if isinstance(e, StepEvent)]
    assert [e.step for e in curves.Scalars("loss")] == steps, "the island's curves, on its volume, to its last step"
    assert shards.status(0) == {0: (True, 1, trained), 1: (True, 1, trained)}
    with shards.client(0) as client:
        reply = client.status()
    assert "island-3" not in reply.live_islands and "island-3" in reply.left_islands


@pytest.mark.process
def test_sigterm_to_a_pod_of_two_ranks_stops_both_at_one_step_and_pushes_the_islands_steps(start_shards, tmp_path):
    shards = start_shards(FAR_SYNC)
    pod = start_pod(tmp_path, shards.targets[0], steps=1_000_000, config=FAR_SYNC)
    progress = tmp_path / "progress"
    try:
        wait_until(
            lambda: (
                {e.source.rank for e in read_events(progress) if isinstance(e, StepEvent) and e.step >= 3} == {0, 1}
            ),
            timeout=240,
            interval=0.5,
        )
        pod.send_signal(signal.SIGTERM)
        _, out = finish(pod)
    finally:
        pod.kill()
    steps = [e for e in read_events(progress) if isinstance(e, StepEvent)]
    last = {rank: max(e.step for e in steps if e.source.rank == rank) for rank in (0, 1)}
    assert last[0] == last[1], f"the ranks stopped at different steps: {last}\n{out}"
    trained = sum(e.tokens for e in steps)  # a push carries the island's tokens, every rank's
    assert shards.status(0) == {0: (True, 1, trained), 1: (True, 1, trained)}, out
    with shards.client(0) as client:
        assert "pod-island" in client.status().left_islands
