"""Goodput counts only compute whose steps reached the final model, against all allocated worker time."""

from dataclasses import replace

import pytest

from diloco.local.goodput import (
    Losses,
    account,
    ddp_useful_seconds,
    diloco_useful_seconds,
    eval_curve,
    island_leaders,
    train_curve,
)
from diloco.progress import EvalEvent, MergeEvent, PushEvent, RoundEvent, Source, StartEvent, StepEvent


def step(pid, n, t, seconds=1.0, sync=0.0, island="island-0", rank=0):
    source = Source(island=island, rank=rank, mode="diloco", pid=pid)
    return StepEvent(t, source, step=n, loss=1.0, tokens=10, seconds=seconds, sync_seconds=sync)


def merged(pid, fragment, began_at, outcome="MERGED", island="island-0"):
    source = Source(island=island, rank=0, mode="diloco", pid=pid)
    return RoundEvent(0.0, source, fragment=fragment, began_at=began_at, outcome=outcome)


def pushed(pid, fragment, began_at, sequence, island="island-0", base_version=0):
    source = Source(island=island, rank=0, mode="diloco", pid=pid)
    return PushEvent(0.0, source, fragment=fragment, began_at=began_at, incarnation=1, base_version=base_version,
                     sequence=sequence)  # fmt: skip


def shard_merged(fragment, *pushes):
    """A shard's record of a merge of `pushes`, each (island, base version, sequence)."""
    source = Source(island="shard-0", rank=0, mode="syncer", pid=99)
    keys = tuple((island, 1, base, sequence) for island, base, sequence in pushes)
    return MergeEvent(0.0, source, fragment=fragment, version=1, pushes=keys)


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


def test_a_push_a_shard_merged_after_its_process_was_killed_counts_its_steps():
    """Killed at step 4 after pushing at 3: the process never heard the merge, the shard recorded it."""
    killed = [step(1, n, n) for n in range(1, 5)] + [pushed(1, 0, 3, sequence=11)]
    assert diloco_useful_seconds(killed, fragments=1) == 0.0
    assert diloco_useful_seconds([*killed, shard_merged(0, ("island-0", 0, 11))], fragments=1) == pytest.approx(3)


def test_only_the_pushes_a_shard_names_count_by_fragment_island_base_and_sequence():
    killed = [step(1, n, n) for n in range(1, 5)] + [pushed(1, 0, 3, sequence=11)]
    for other in [
        shard_merged(1, ("island-0", 0, 11)),  # another fragment
        shard_merged(0, ("island-1", 0, 11)),  # another island
        shard_merged(0, ("island-0", 1, 11)),  # another base
        shard_merged(0, ("island-0", 0, 12)),  # another push
    ]:
        assert diloco_useful_seconds([*killed, other], fragments=1) == 0.0


def test_a_shards_merges_take_no_worker_slot():
    events = [step(1, 1, 110.0), pushed(1, 0, 1, sequence=5), shard_merged(0, ("island-0", 0, 5))]
    acct = account(events, mode="diloco", slots=1, fragments=1, started_at=100.0, tokens_per_eval_step=10)
    assert acct.allocated_seconds == pytest.approx(10) and acct.goodput == pytest.approx(0.1)
    assert acct.process_starts == 1


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


def test_the_time_that_was_not_useful_is_told_apart_and_adds_up():
    """One slot: a process starts 2 s late, steps 1-4, has its push at step 2 merged and is killed; 4 s later
    its successor steps 3-5, half of step 4 blocked on a sync, and hears its push at 5 merged 1 s after."""
    killed = [step(1, n, 102.0 + n) for n in range(1, 5)] + [replace(merged(1, 0, 2), t=104.5)]
    successor = [step(2, 3, 111.0), step(2, 4, 112.0, sync=0.5), step(2, 5, 113.0), replace(merged(2, 0, 5), t=114.0)]
    acct = account(killed + successor, mode="diloco", slots=1, fragments=1, started_at=100.0, tokens_per_eval_step=10)
    assert (acct.allocated_seconds, acct.useful_seconds) == pytest.approx((14.0, 2.0 + 2.5))
    assert acct.losses == Losses(first_start=2.0, restarting=4.0, lost_steps=2.0, blocked=0.5, other=1.0)
    assert sum(acct.losses.shares(acct.allocated_seconds).values()) + acct.goodput == pytest.approx(1.0)


def test_a_slot_that_never_stepped_lost_its_whole_time_to_starting():
    started = StartEvent(105.0, Source(island="island-1", rank=0, mode="diloco", pid=3), step=0, world=1)
    events = [step(1, 1, 110.0), replace(merged(1, 0, 1), t=110.0), started]
    acct = account(events, mode="diloco", slots=3, fragments=1, started_at=100.0, tokens_per_eval_step=10)
    # island-0 started in 9 s; island-1 (a process that never stepped) for its 5 s; a silent slot for all 10.
    assert acct.losses.first_start == pytest.approx(9.0 + 5.0 + 10.0)


def test_eval_curve_averages_islands_at_each_step():
    events = [evaluated(10, 3.0), evaluated(10, 2.0), evaluated(20, 1.5)]
    assert eval_curve(events, tokens_per_eval_step=100) == [(1000, 2.5), (2000, 1.5)]


def test_a_push_merged_after_its_island_was_killed_counts_for_every_rank_of_it():
    """Two ranks killed together at step 4 after rank 0 pushed at 3: only rank 0 pushes, and no rank heard
    the merge, yet both ranks' steps 1-3 are in the global model."""
    rank0 = [step(1, n, n) for n in range(1, 5)] + [pushed(1, 0, 3, sequence=11)]
    rank1 = [step(2, n, n, rank=1) for n in range(1, 5)]
    events = [*rank0, *rank1, shard_merged(0, ("island-0", 0, 11))]
    assert diloco_useful_seconds(events, fragments=1) == pytest.approx(3 + 3)


def test_another_rank_takes_its_credit_from_the_rank_0_that_lived_beside_it():
    """The island re-formed at t=10: the second rank 1 is not credited with the first rank 0's push."""
    first = [step(1, n, n) for n in range(1, 5)] + [step(2, n, n, rank=1) for n in range(1, 5)]
    second = [step(3, n, 10 + n) for n in range(1, 3)] + [step(4, n, 10 + n, rank=1) for n in range(1, 3)]
    events = [*first, *second, pushed(1, 0, 3, sequence=11), shard_merged(0, ("island-0", 0, 11))]
    assert diloco_useful_seconds(events, fragments=1) == pytest.approx(3 + 3)
    assert island_leaders(events) == {2: 1, 4: 3}


def test_the_training_curve_is_the_loss_the_workers_reported_in_the_order_their_steps_ended():
    """The loss a loop of one's own reports is the only one the run sees: cut into runs of steps, each at the
    tokens trained by its end; a step without a loss (NaN, before the loop reported one) is left out."""
    losses = [4.0, 3.0, 2.0, 1.0, float("nan")]
    events = [
        replace(step(pid=1 + i % 2, n=i, t=float(i), island=f"island-{i % 2}"), loss=loss)
        for i, loss in enumerate(losses)
    ]
    assert train_curve(reversed(events), points=2) == [(20, 3.5), (40, 1.5)]
    assert train_curve(events, points=10) == [(10, 4.0), (20, 3.0), (30, 2.0), (40, 1.0)], "a point a step at most"
    assert train_curve([], points=10) == []
