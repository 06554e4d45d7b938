"""Goodput counts only compute whose steps reached the final model, against all allocated worker time."""

import pytest

from diloco.local.goodput import account, ddp_useful_seconds, diloco_useful_seconds, eval_curve
from diloco.progress import EvalEvent, RoundEvent, Source, StepEvent


def step(pid, n, t, seconds=1.0, sync=0.0, island="island-0", rank=0):
    source = Source(island=island, rank=rank, mode="diloco", pid=pid)
    return StepEvent(t, source, step=n, loss=1.0, tokens=10, seconds=seconds, sync_seconds=sync)


def merged(pid, fragment, began_at, outcome="MERGED", island="island-0"):
    source = Source(island=island, rank=0, mode="diloco", pid=pid)
    return RoundEvent(0.0, source, fragment=fragment, began_at=began_at, outcome=outcome)


def evaluated(n, loss):
    return EvalEvent(0.0, Source(island="island-0", rank=0, mode="diloco", pid=1), step=n, loss=loss)


def test_steps_count_per_fragment_whose_later_push_merged():
    events = [step(1, n, n) for n in range(1, 7)] + [merged(1, 0, 4), merged(1, 1, 2)]
    # steps 1-2: both fragments merged after them; steps 3-4: only fragment 0; steps 5-6: neither.
    assert diloco_useful_seconds(events, fragments=2) == pytest.approx(2 * 1.0 + 2 * 0.5)


def test_unmerged_rounds_and_time_blocked_on_syncs_count_nothing():
    events = [step(1, 1, 1, seconds=3.0, sync=2.0), step(1, 2, 2), merged(1, 0, 2, outcome="ABANDONED")]
    assert diloco_useful_seconds(events, fragments=1) == 0.0
    events.append(merged(1, 0, 2))
    assert diloco_useful_seconds(events, fragments=1) == pytest.approx(1.0 + 1.0)


def test_a_killed_process_loses_its_unmerged_steps_but_not_its_merged_ones():
    before_kill = [step(1, n, n) for n in range(1, 5)] + [merged(1, 0, 2)]
    after_restart = [step(2, n, 10 + n) for n in range(1, 3)] + [merged(2, 0, 2)]
    assert diloco_useful_seconds(before_kill + after_restart, fragments=1) == pytest.approx(2 + 2)


def test_ddp_counts_the_last_execution_of_each_step_only():
    first = [step(1, n, n) for n in range(1, 6)]  # crashed after step 5, checkpoint at 3
    rerun = [step(2, n, 10 + n) for n in range(4, 8)]
    assert ddp_useful_seconds(first + rerun) == pytest.approx(7.0)


def test_allocation_runs_from_job_start_to_each_slot_end_and_goodput_divides():
    events = [
        step(1, 1, 110.0, island="island-0"),
        step(2, 1, 120.0, island="island-1"),
        merged(1, 0, 1, island="island-0"),
        merged(2, 0, 1, island="island-1"),
    ]
    acct = account(events, mode="diloco", slots=2, fragments=1, started_at=100.0, tokens_per_eval_step=20)
    assert acct.allocated_seconds == pytest.approx(10 + 20)
    assert acct.goodput == pytest.approx(2.0 / 30.0)
    assert (acct.tokens_trained, acct.process_starts) == (20, 2)


def test_eval_curve_averages_islands_at_each_step():
    events = [evaluated(10, 3.0), evaluated(10, 2.0), evaluated(20, 1.5)]
    assert eval_curve(events, tokens_per_eval_step=100) == [(1000, 2.5), (2000, 1.5)]
