"""The failure simulator's event engine against closed forms, hand-computed traces and its own invariants."""

import math
from dataclasses import replace

import numpy as np
import pytest

from diloco.local.failure_trace import FailureEvent, load_trace, save_trace
from diloco.sim.engine import (
    SECONDS_PER_YEAR,
    SIM_TRAINING,
    Failures,
    MergeWait,
    Policy,
    SimConfig,
    run_policy,
    sample_failures,
    simulate,
)


def chip(at: float, index: int, downtime: float) -> FailureEvent:
    return FailureEvent(at, f"chip:{index}", downtime)


def kept_fraction(rate: float, save_every_s: float) -> float:
    """Share of an Exp(rate) up-time kept when progress is saved every `save_every_s` seconds and the rest lost.

    E[save · floor(U / save)] · rate = rate · save · e^(−rate·save) / (1 − e^(−rate·save)).
    """
    y = rate * save_every_s
    return y * math.exp(-y) / (1 - math.exp(-y))


def one(policy: Policy, config: SimConfig, seed: int = 0):
    return simulate(SimConfig(**{**config.__dict__, "policies": (policy,), "seeds": (seed,)}))[policy].runs[0]


# --- closed forms --------------------------------------------------------------------------------------------


def test_single_repairable_unit_uptime_and_goodput():
    # One group of N chips, interruptions at N/MTBI while up, down for D = reschedule + restart each time:
    # uptime = MTBF / (MTBF + MTTR) = 1 / (1 + λD); goodput also loses the steps since the last checkpoint.
    config = SimConfig(
        chips=1000,
        islands=1,
        mtbi_years=0.001,
        horizon_hours=24 * 30,
        checkpoint_steps=10,
        reschedule_seconds=10,
        restart_seconds=55,
    )
    rate = config.fleet_rate
    downtime = 65.0
    run = one(Policy.DP, config)
    assert run.uptime == pytest.approx(1 / (1 + rate * downtime), rel=0.02)
    assert run.goodput == pytest.approx(kept_fraction(rate, 10.0) / (1 + rate * downtime), rel=0.02)
    assert run.failures > 20_000


def test_non_elastic_goodput_is_one_over_one_plus_n_r_over_m():
    # With short steps (nothing lost to rollback) non-elastic DP keeps 1 / (1 + N·r/m) of its chip time.
    config = SimConfig(chips=1_200_000, islands=8, horizon_hours=24 * 7, step_seconds=(0.01,))
    r = config.reschedule_seconds + config.restart_seconds
    expected = 1 / (1 + config.chips * r / (config.mtbi_years * SECONDS_PER_YEAR))
    assert one(Policy.DP, config).goodput == pytest.approx(expected, abs=0.01)


def test_each_decoupled_learner_is_a_repairable_unit_that_keeps_whole_rounds():
    # With one fragment, K = 1 and a grace window shorter than tau steps no learner ever waits, so each is
    # a repairable unit (down reschedule + reform) that keeps H·floor(U / H) steps of each up-time U.
    config = SimConfig(
        chips=400_000,
        islands=4,
        horizon_hours=24 * 30,
        training=SIM_TRAINING.updated(fragments=1, inner_steps=20, overlap_steps=3, grace_seconds=2.0),
    )
    rate = config.fleet_rate / config.islands
    downtime = config.reschedule_seconds + config.reform_seconds
    run = one(Policy.DECOUPLED_DILOCO, config)
    assert run.uptime == pytest.approx(1 / (1 + rate * downtime), rel=0.005)
    assert run.goodput == pytest.approx(kept_fraction(rate, 20.0) / (1 + rate * downtime), rel=0.005)
    assert run.merges > 0 and run.contributors_per_merge >= 1


def test_streaming_fragments_lose_half_a_round_on_average():
    # With P staggered fragments a failure loses each fragment's steps since its own push: H/2 on average
    # when failures are rare against H, so the loss is rate·(H/2)·step per unit of up-time.
    config = SimConfig(
        chips=100_000, islands=4, horizon_hours=24 * 30, training=SIM_TRAINING.updated(inner_steps=16, fragments=4)
    )
    rate = config.fleet_rate / config.islands
    downtime = config.reschedule_seconds + config.reform_seconds
    run = one(Policy.DECOUPLED_DILOCO, config)
    assert run.goodput == pytest.approx((1 - rate * 8.0) / (1 + rate * downtime), rel=0.002)


def test_elastic_replica_is_a_repairable_unit_when_reforming_is_free():
    # With no re-forming pause, each replica of f chips is out for D after each of its failures (rate f/m).
    config = SimConfig(
        chips=400_000,
        islands=4,
        horizon_hours=24 * 30,
        reform_seconds=0.0,
        failure_chips=256,
        reschedule_seconds=3600.0,
        step_seconds=(0.001,),
    )
    per_replica = 256 * 3600.0 / SECONDS_PER_YEAR
    run = one(Policy.ELASTIC_DP, config)
    assert run.uptime == pytest.approx(1 / (1 + per_replica), abs=5e-4)
    assert run.goodput == pytest.approx(run.uptime, abs=5e-4)


def test_without_failures_only_lockstep_wastes_mixed_generations():
    # Generations of 1 s and 1.5 s steps dealt to 4 learners: lockstep (DP, synchronous DiLoCo) runs at the
    # slow pace, so fast chips idle: goodput = Σ c·s / (N·s_max) = (1 + 1.5) / (2 · 1.5). Decoupled: 1.
    config = SimConfig(chips=1000, islands=4, mtbi_years=1e12, horizon_hours=3, step_seconds=(1.0, 1.5))
    result = simulate(SimConfig(**{**config.__dict__, "seeds": (0,)}))
    lockstep = (1 + 1.5) / (2 * 1.5)
    assert result[Policy.DP].goodput == pytest.approx(lockstep)
    assert result[Policy.ELASTIC_DP].goodput == pytest.approx(lockstep)
    assert result[Policy.SYNC_DILOCO].goodput == pytest.approx(lockstep, abs=2e-3)
    assert result[Policy.DECOUPLED_DILOCO].goodput == pytest.approx(1.0)
    assert all(p.uptime == pytest.approx(1.0) for p in result.policies)


def test_speed_aware_learners_of_a_slow_generation_push_at_the_fast_cadence():
    # Generations of 1 s and 3 s steps, H = 12: with a fixed H the slow learners push every 36 s, the fast
    # every 12 s, and a grace window of 2 s seldom holds both; speed-aware, the slow run 4 steps per round
    # and every learner pushes every 12 s, so merges take in more of them, and none waits on its merge.
    training = SIM_TRAINING.updated(inner_steps=12, fragments=1, overlap_steps=1, grace_seconds=2.0)
    config = SimConfig(
        chips=1000, islands=4, mtbi_years=1e12, horizon_hours=1, step_seconds=(1.0, 3.0), training=training
    )
    paced = one(Policy.DECOUPLED_DILOCO, config)
    fixed = one(Policy.DECOUPLED_DILOCO, replace(config, training=training.updated(speed_aware=False)))
    assert paced.contributors_per_merge > fixed.contributors_per_merge + 0.5
    assert paced.goodput == pytest.approx(1.0)
    assert paced.goodput >= fixed.goodput


# --- hand-computed traces ------------------------------------------------------------------------------------


def test_one_failure_hand_computed():
    # 8 chips, 2 learners of 4, 1 s steps, 1000 s; chip 0 fails at 100.5 s, its replacement ready 50 s later.
    config = SimConfig(chips=8, islands=2, horizon_hours=1000 / 3600, failure_chips=2, trace=(chip(100.5, 0, 50.0),))
    result = simulate(config)
    # DP: 100 whole steps kept, down until 100.5 + 50 + 55 = 205.5, then 794 steps.
    assert result[Policy.DP].goodput == pytest.approx((100 + 794) / 1000)
    assert result[Policy.DP].uptime == pytest.approx((100.5 + 794.5) / 1000)
    # Elastic: 100 steps on 8 chips; re-form to 109.5; 41 steps on 6 chips until the rejoin at 150.5;
    # re-form to 159.5; 840 steps on 8 chips.
    assert result[Policy.ELASTIC_DP].goodput == pytest.approx((100 * 8 + 41 * 6 + 840 * 8) / 8000)
    # Decoupled (H = 16, P = 4): learner 0 is 4.5 steps past its round push at step 96, so its fragments,
    # pushed at phases 0, 4, 8 and 12, are 4.5, 0.5, 12.5 and 8.5 steps old (mean 6.5, lost); it is back at
    # 100.5 + 50 + 9 = 159.5.
    decoupled = result[Policy.DECOUPLED_DILOCO]
    assert decoupled.goodput == pytest.approx(4 * (100.5 - 6.5 + 840.5 + 1000) / 8000)
    assert decoupled.uptime == pytest.approx((4 * (100.5 + 840.5) + 4 * 1000) / 8000)
    assert all(p.runs[0].failures == 1 and p.runs[0].absorbed == 0 for p in result.policies)
    # Synchronous DiLoCo: learner 1 pushes at 112, waits 3 steps later at 115 for learner 0, who is back at
    # 159.5 and pushes 16 steps later; nothing learner 1 did is lost but it idles, so less than decoupled.
    assert result[Policy.SYNC_DILOCO].goodput < decoupled.goodput


def test_failure_on_a_group_already_down_is_absorbed():
    trace = (chip(100.5, 0, 50.0), chip(120.0, 1, 50.0))
    config = SimConfig(chips=8, islands=2, horizon_hours=1000 / 3600, failure_chips=2, trace=trace)
    result = simulate(config)
    counts = {p.policy: (p.runs[0].failures, p.runs[0].absorbed) for p in result.policies}
    # DP and learner 0 are down until 205.5 and 159.5; for elastic, chip 1 is in the replica of chips 0-1,
    # still out at 120 s. Each absorbs the second event, so its goodput is that of the first alone.
    assert counts == {policy: (1, 1) for policy in Policy}
    assert result[Policy.DP].goodput == pytest.approx((100 + 794) / 1000)


def test_failure_on_another_learner_costs_only_that_learner():
    trace = (chip(100.5, 0, 50.0), chip(120.0, 4, 50.0))
    config = SimConfig(chips=8, islands=2, horizon_hours=1000 / 3600, trace=trace)
    result = simulate(config)
    assert result[Policy.DECOUPLED_DILOCO].runs[0].failures == 2
    # DP absorbs the second one (the whole job is still down), so it stops once.
    assert result[Policy.DP].runs[0].failures == 1


# --- invariants ----------------------------------------------------------------------------------------------


def test_synchronous_diloco_is_decoupled_with_one_learner():
    config = SimConfig(chips=100_000, islands=1, mtbi_years=0.05, horizon_hours=12)
    failures = sample_failures(config, 3)
    sync = run_policy(Policy.SYNC_DILOCO, config, failures)
    decoupled = run_policy(Policy.DECOUPLED_DILOCO, config, failures)
    assert sync.goodput == pytest.approx(decoupled.goodput) and sync.uptime == pytest.approx(decoupled.uptime)


def test_policies_rank_as_their_coupling_on_the_same_failures():
    config = SimConfig(chips=1_200_000, islands=8, horizon_hours=6)
    failures = sample_failures(config, 7)
    goodput = {p: run_policy(p, config, failures).goodput for p in Policy}
    assert goodput[Policy.DP] < goodput[Policy.ELASTIC_DP] < goodput[Policy.DECOUPLED_DILOCO]
    assert goodput[Policy.SYNC_DILOCO] < goodput[Policy.DECOUPLED_DILOCO]


def test_quorum_and_grace_make_learners_wait():
    # With no overlap a learner waits after each push until its push is merged. K = 1 merges at once; a
    # larger quorum makes it wait for others' pushes (not monotonically in K: a quorum of all phase-locks the
    # learners, a quorum of half does not). Capping K by the live learners keeps even K = M above synchronous.
    base = SimConfig(
        chips=1_200_000, islands=8, horizon_hours=6, training=SIM_TRAINING.updated(overlap_steps=0, grace_seconds=0.0)
    )
    failures = sample_failures(base, 1)

    def quorum(k: int) -> SimConfig:
        return replace(base, training=base.training.updated(quorum=k))

    free = run_policy(Policy.DECOUPLED_DILOCO, quorum(1), failures)
    half = run_policy(Policy.DECOUPLED_DILOCO, quorum(4), failures)
    everyone = run_policy(Policy.DECOUPLED_DILOCO, quorum(8), failures)
    sync = run_policy(Policy.SYNC_DILOCO, base, failures)
    assert free.goodput > max(half.goodput, everyone.goodput)
    assert everyone.goodput > sync.goodput
    assert free.contributors_per_merge < half.contributors_per_merge < everyone.contributors_per_merge
    assert free.uptime == half.uptime == everyone.uptime == sync.uptime


def test_a_merge_of_learners_that_say_their_slack_waits_for_the_others_within_it_unless_grace_is_shorter():
    # tau = 3 steps of 1 s: a merge waits for late learners until 0.8 x 3 s after the first push, as the shard
    # does for pushes that say their slack. A graceSeconds longer than that changes nothing; unset is the same.
    # Waiting within the slack makes no learner wait.
    base = SimConfig(chips=1_200_000, islands=8, horizon_hours=6, training=SIM_TRAINING.updated(overlap_steps=3))
    failures = sample_failures(base, 2)

    def with_grace(grace: float | None):
        return run_policy(
            Policy.DECOUPLED_DILOCO, replace(base, training=base.training.updated(grace_seconds=grace)), failures
        )

    unset = with_grace(None)
    assert with_grace(10.0) == unset
    assert unset.goodput > run_policy(Policy.SYNC_DILOCO, base, failures).goodput


def test_a_learner_without_slack_is_never_kept_waiting_by_a_slower_one():
    # Learner 1 steps 2.5 times slower and pushes every 25 s; learner 0 every 10 s, blocking on each push
    # (tau = 0): its push has no slack, so its merges close as it pushes. When every merge waited out the
    # 2 s grace for the learner that had not pushed, 104 of 1000 chip-seconds were lost (goodput 0.896).
    training = SIM_TRAINING.updated(
        inner_steps=10, fragments=1, overlap_steps=0, quorum=1, grace_seconds=2.0, speed_aware=False
    )
    config = SimConfig(
        chips=2,
        islands=2,
        horizon_hours=500 / 3600,
        step_seconds=(1.0, 2.5),
        training=training,
        instant_failure_detection=True,
        policies=(Policy.DECOUPLED_DILOCO,),
    )
    assert simulate(config)[Policy.DECOUPLED_DILOCO].goodput == pytest.approx(1.0)


# --- failures: sampling and traces ---------------------------------------------------------------------------


def test_sampled_failures_are_a_poisson_process_over_the_fleet():
    config = SimConfig(chips=2_400_000, islands=8, horizon_hours=72)
    failures = sample_failures(config, 0)
    expected = config.fleet_rate * config.horizon_s  # ≈ 19,700
    assert abs(len(failures) - expected) < 5 * math.sqrt(expected)
    assert np.all(np.diff(failures.times) >= 0) and failures.times[-1] < config.horizon_s
    assert failures.chips.min() >= 0 and failures.chips.max() < config.chips
    assert np.all(failures.downtimes == config.reschedule_seconds)
    assert np.array_equal(sample_failures(config, 0).times, failures.times)


def test_saved_trace_replays_the_sampled_run_exactly(tmp_path):
    config = SimConfig(chips=600_000, islands=8, horizon_hours=4, seeds=(5,))
    sampled = simulate(config)
    path = tmp_path / "trace.json"
    save_trace(path, sample_failures(config, 5).events())
    events = load_trace(path)
    assert all(e.kind == "chip" for e in events) and len(events) > 100
    replayed = simulate(SimConfig(**{**config.__dict__, "trace": tuple(events)}))
    for policy in Policy:
        a, b = sampled[policy].runs[0], replayed[policy].runs[0]
        assert (a.goodput, a.uptime, a.failures, a.absorbed) == (b.goodput, b.uptime, b.failures, b.absorbed)
    assert replayed[Policy.DP].runs[0].seed is None


def test_learner_and_island_targets_strike_that_learners_first_chip():
    # The trace `diloco run` replays names workers of islands `island-<i>`: in the simulator the island is
    # learner i, and any of its ranks takes the whole learner out, as in the run.
    config = SimConfig(chips=8, islands=2, horizon_hours=1000 / 3600)
    trace = (FailureEvent(300.0, "worker:island-1/3", 50.0), FailureEvent(100.5, "learner:0", 50.0))
    failures = Failures.from_events(trace, config)
    assert failures.times.tolist() == [100.5, 300.0] and failures.chips.tolist() == [0, 4]
    by_worker = simulate(SimConfig(**{**config.__dict__, "trace": trace}))
    by_chip = simulate(SimConfig(**{**config.__dict__, "trace": (chip(100.5, 0, 50.0), chip(300.0, 4, 50.0))}))
    assert by_worker.policies == by_chip.policies
    assert by_worker[Policy.DECOUPLED_DILOCO].runs[0].failures == 2


@pytest.mark.parametrize(
    "target, message",
    [
        ("chip:8", "chip 8 is outside the fleet of 8"),
        ("learner:2", "learner 2 is outside 0..1"),
        ("worker:island-5/0", "learner 5 is outside 0..1"),
        ("worker:east/0", "island 'east' has no number"),
        ("syncer:0", "the simulator does not model syncer failures"),
    ],
)
def test_trace_events_the_fleet_cannot_have_are_refused(target, message):
    with pytest.raises(ValueError, match=f"trace event 1 \\({target} at 7 s\\): {message}"):
        SimConfig(chips=8, islands=2, trace=(chip(1.0, 0, 1.0), FailureEvent(7.0, target, 1.0)))


# --- what `diloco run` needs: start-up, and failures that strike a recovery ----------------------------------


def test_startup_is_paid_once_by_everyone_before_the_first_step():
    # 10 s of start-up out of 1000 s, no failures: 990 steps of 1 s, for every policy.
    config = SimConfig(chips=8, islands=2, horizon_hours=1000 / 3600, startup_seconds=10.0, trace=())
    result = simulate(config)
    for policy in Policy:
        assert result[policy].goodput == pytest.approx(0.99, abs=1e-9), policy
        assert result[policy].uptime == pytest.approx(0.99, abs=1e-9), policy


def test_a_failure_during_a_recovery_is_absorbed_or_starts_it_over():
    # DP (checkpoint every step): chip 0 fails at 100.5 s (down 50 s + restart 55 s, until 205.5 s), again at
    # 150 s, inside that recovery. Absorbed: as with one failure. Interrupting: up at 150 + 50 + 55 = 255 s.
    trace = (chip(100.5, 0, 50.0), chip(150.0, 5, 50.0))
    base = SimConfig(chips=8, islands=2, horizon_hours=1000 / 3600, trace=trace, policies=(Policy.DP,))
    absorbed = simulate(base)[Policy.DP].runs[0]
    restarted = simulate(SimConfig(**{**base.__dict__, "interrupt_recovery": True}))[Policy.DP].runs[0]
    assert absorbed.goodput == pytest.approx((100 + 794) / 1000) and absorbed.absorbed == 1
    assert restarted.goodput == pytest.approx((100 + 745) / 1000)
    assert (restarted.failures, restarted.absorbed) == (2, 0)


def test_a_learner_struck_while_restarting_is_back_later_and_loses_nothing_more():
    # Decoupled, learner 0 fails at 100.5 s and is due back at 100.5 + 50 + 9 = 159.5 s; struck again at
    # 150 s it is back at 150 + 50 + 9 = 209 s instead: 49.5 s more down, no progress lost twice.
    trace = (chip(100.5, 0, 50.0), chip(150.0, 1, 50.0))
    base = SimConfig(chips=8, islands=2, horizon_hours=1000 / 3600, trace=trace, policies=(Policy.DECOUPLED_DILOCO,))
    absorbed = simulate(base)[Policy.DECOUPLED_DILOCO].runs[0]
    restarted = simulate(SimConfig(**{**base.__dict__, "interrupt_recovery": True}))[Policy.DECOUPLED_DILOCO].runs[0]
    assert absorbed.goodput == pytest.approx(4 * (100.5 - 6.5 + 840.5 + 1000) / 8000)
    assert restarted.goodput == pytest.approx(4 * (100.5 - 6.5 + 791 + 1000) / 8000)
    assert restarted.uptime == pytest.approx((4 * (100.5 + 791) + 4 * 1000) / 8000)


def test_an_elastic_replica_struck_while_out_rejoins_later():
    # Replica of chips 0-1 out at 100.5 s until 150.5 s; struck again at 120 s it rejoins at 170 s.
    # 100 steps on 8 chips; re-form to 109.5; 60 steps on 6 chips to 169.5 (the step in flight at the
    # rejoin at 170 s is lost); re-form to 179; 821 steps on 8 chips.
    trace = (chip(100.5, 0, 50.0), chip(120.0, 1, 50.0))
    config = SimConfig(
        chips=8,
        islands=2,
        horizon_hours=1000 / 3600,
        failure_chips=2,
        trace=trace,
        policies=(Policy.ELASTIC_DP,),
        interrupt_recovery=True,
    )
    run = simulate(config)[Policy.ELASTIC_DP].runs[0]
    assert run.goodput == pytest.approx((100 * 8 + 60 * 6 + 821 * 8) / 8000)
    assert (run.failures, run.absorbed) == (2, 0)


def test_merge_latency_is_waited_out_by_a_learner_that_blocks_on_its_push():
    # tau = 0: a learner waits after each push until the merge reaches it. K = 1 and no grace merge at once,
    # and the reply takes 0.5 s: every round of 10 one-second steps costs 10.5 s, 100 rounds in 1050 s.
    # A learner that waits only a round later (as `diloco run`'s worker, which never blocks) has its reply
    # long before that.
    config = SimConfig(
        chips=2,
        islands=2,
        horizon_hours=1050 / 3600,
        training=SIM_TRAINING.updated(inner_steps=10, fragments=1, overlap_steps=0, grace_seconds=0.0),
        sync_latency_seconds=0.5,
        trace=(),
        policies=(Policy.DECOUPLED_DILOCO,),
    )
    run = simulate(config)[Policy.DECOUPLED_DILOCO].runs[0]
    assert run.goodput == pytest.approx(1000 / 1050)
    assert run.merges == 200
    never_waits = replace(config, merge_wait=MergeWait.ROUND)
    assert simulate(never_waits)[Policy.DECOUPLED_DILOCO].goodput == pytest.approx(1.0)


@pytest.mark.parametrize("timeout", [None, 1.5, 60.0])
def test_a_dead_learner_costs_the_others_nothing_while_the_syncer_counts_it_live(timeout):
    # Learner 0 dies at 59 s, 9 steps after its push at 50 s (50 steps kept), and stays down. Learner 1
    # blocks on each push (tau = 0), so its pushes carry no slack and their merges close at once, whether the
    # syncer knows learner 0 is gone (instant failure detection) or counts it live for its timeout. When a
    # merge waited out its window for a learner counted live, learner 1 lost 0.25 s at each push until the
    # timeout: 1.5 s with 60 s.
    training = SIM_TRAINING.updated(inner_steps=10, fragments=1, overlap_steps=0, grace_seconds=2.0)
    config = SimConfig(
        chips=2,
        islands=2,
        horizon_hours=1000 / 3600,
        training=training if timeout is None else training.updated(island_timeout_seconds=timeout),
        instant_failure_detection=timeout is None,
        trace=(chip(59.0, 0, 5000.0),),
        policies=(Policy.DECOUPLED_DILOCO,),
    )
    assert simulate(config)[Policy.DECOUPLED_DILOCO].goodput == pytest.approx((50 + 1000) / 2000)


@pytest.mark.parametrize(
    "overrides, knobs",
    [
        ({}, {"quorum": 9}),
        ({"chips": 4}, {}),
        ({}, {"fragments": 17}),
        ({}, {"overlap_steps": 17}),
        ({"step_seconds": (0.0,)}, {}),
        ({"seeds": ()}, {}),
        ({"startup_seconds": -1.0}, {}),
        ({"sync_latency_seconds": -0.1}, {}),
        ({}, {"island_timeout_seconds": -1.0}),
        ({"startup_seconds": float("nan")}, {}),
        ({"step_seconds": (1.0, float("nan"))}, {}),
    ],
)
def test_impossible_configurations_are_refused(overrides, knobs):
    # Simulator knobs are refused by SimConfig, training knobs by the TrainingConfig it is given (or, for the
    # quorum against the islands, by SimConfig).
    with pytest.raises(ValueError):
        SimConfig(**{"chips": 1000, "islands": 8, **overrides}, training=SIM_TRAINING.updated(**knobs))
