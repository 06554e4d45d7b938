"""The failure simulator's event engine against closed forms, hand-computed traces and its own invariants."""

import math

import numpy as np
import pytest

from diloco.failure_sim import (
    SECONDS_PER_YEAR,
    FailureEvent,
    Failures,
    Policy,
    SimConfig,
    load_trace,
    run_policy,
    sample_failures,
    save_trace,
    simulate,
)


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
    config = SimConfig(chips=1000, learners=1, mtbi_years=0.001, horizon_hours=24 * 30, checkpoint_steps=10,
                       reschedule_s=10, restart_s=55)
    rate = config.fleet_rate
    downtime = 65.0
    run = one(Policy.DP, config)
    assert run.uptime == pytest.approx(1 / (1 + rate * downtime), rel=0.02)
    assert run.goodput == pytest.approx(kept_fraction(rate, 10.0) / (1 + rate * downtime), rel=0.02)
    assert run.failures > 20_000


def test_non_elastic_goodput_is_one_over_one_plus_n_r_over_m():
    # With short steps (nothing lost to rollback) non-elastic DP keeps 1 / (1 + N·r/m) of its chip time.
    config = SimConfig(chips=1_200_000, learners=8, horizon_hours=24 * 7, step_seconds=(0.01,))
    r = config.reschedule_s + config.restart_s
    expected = 1 / (1 + config.chips * r / (config.mtbi_years * SECONDS_PER_YEAR))
    assert one(Policy.DP, config).goodput == pytest.approx(expected, abs=0.01)


def test_each_decoupled_learner_is_a_repairable_unit_that_keeps_whole_rounds():
    # With one fragment, K = 1 and a grace window shorter than tau steps no learner ever waits, so each is
    # a repairable unit (down reschedule + reform) that keeps H·floor(U / H) steps of each up-time U.
    config = SimConfig(chips=400_000, learners=4, horizon_hours=24 * 30, fragments=1, sync_steps=20,
                       overlap_steps=3, grace_s=2.0)
    rate = config.fleet_rate / config.learners
    downtime = config.reschedule_s + config.reform_s
    run = one(Policy.DECOUPLED_DILOCO, config)
    assert run.uptime == pytest.approx(1 / (1 + rate * downtime), rel=0.005)
    assert run.goodput == pytest.approx(kept_fraction(rate, 20.0) / (1 + rate * downtime), rel=0.005)
    assert run.merges > 0 and run.contributors_per_merge >= 1


def test_streaming_fragments_lose_half_a_round_on_average():
    # With P staggered fragments a failure loses each fragment's steps since its own push: H/2 on average
    # when failures are rare against H, so the loss is rate·(H/2)·step per unit of up-time.
    config = SimConfig(chips=100_000, learners=4, horizon_hours=24 * 30, sync_steps=16, fragments=4)
    rate = config.fleet_rate / config.learners
    downtime = config.reschedule_s + config.reform_s
    run = one(Policy.DECOUPLED_DILOCO, config)
    assert run.goodput == pytest.approx((1 - rate * 8.0) / (1 + rate * downtime), rel=0.002)


def test_elastic_replica_is_a_repairable_unit_when_reforming_is_free():
    # With no re-forming pause, each replica of f chips is out for D after each of its failures (rate f/m).
    config = SimConfig(chips=400_000, learners=4, horizon_hours=24 * 30, reform_s=0.0, failure_chips=256,
                       reschedule_s=3600.0, step_seconds=(0.001,))
    per_replica = 256 * 3600.0 / SECONDS_PER_YEAR
    run = one(Policy.ELASTIC_DP, config)
    assert run.uptime == pytest.approx(1 / (1 + per_replica), abs=5e-4)
    assert run.goodput == pytest.approx(run.uptime, abs=5e-4)


def test_without_failures_only_lockstep_wastes_mixed_generations():
    # Generations of 1 s and 1.5 s steps dealt to 4 learners: lockstep (DP, synchronous DiLoCo) runs at the
    # slow pace, so fast chips idle: goodput = Σ c·s / (N·s_max) = (1 + 1.5) / (2 · 1.5). Decoupled: 1.
    config = SimConfig(chips=1000, learners=4, mtbi_years=1e12, horizon_hours=3, step_seconds=(1.0, 1.5))
    result = simulate(SimConfig(**{**config.__dict__, "seeds": (0,)}))
    lockstep = (1 + 1.5) / (2 * 1.5)
    assert result[Policy.DP].goodput == pytest.approx(lockstep)
    assert result[Policy.ELASTIC_DP].goodput == pytest.approx(lockstep)
    assert result[Policy.SYNC_DILOCO].goodput == pytest.approx(lockstep, abs=2e-3)
    assert result[Policy.DECOUPLED_DILOCO].goodput == pytest.approx(1.0)
    assert all(p.uptime == pytest.approx(1.0) for p in result.policies)


# --- hand-computed traces ------------------------------------------------------------------------------------


def test_one_failure_hand_computed():
    # 8 chips, 2 learners of 4, 1 s steps, 1000 s; chip 0 fails at 100.5 s, its replacement ready 50 s later.
    config = SimConfig(chips=8, learners=2, horizon_hours=1000 / 3600, failure_chips=2,
                       trace=(FailureEvent(100.5, 0, 50.0),))
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
    trace = (FailureEvent(100.5, 0, 50.0), FailureEvent(120.0, 1, 50.0))
    config = SimConfig(chips=8, learners=2, horizon_hours=1000 / 3600, failure_chips=2, trace=trace)
    result = simulate(config)
    counts = {p.policy: (p.runs[0].failures, p.runs[0].absorbed) for p in result.policies}
    # DP and learner 0 are down until 205.5 and 159.5; for elastic, chip 1 is in the replica of chips 0-1,
    # still out at 120 s. Each absorbs the second event, so its goodput is that of the first alone.
    assert counts == {policy: (1, 1) for policy in Policy}
    assert result[Policy.DP].goodput == pytest.approx((100 + 794) / 1000)


def test_failure_on_another_learner_costs_only_that_learner():
    trace = (FailureEvent(100.5, 0, 50.0), FailureEvent(120.0, 4, 50.0))
    config = SimConfig(chips=8, learners=2, horizon_hours=1000 / 3600, trace=trace)
    result = simulate(config)
    assert result[Policy.DECOUPLED_DILOCO].runs[0].failures == 2
    # DP absorbs the second one (the whole job is still down), so it stops once.
    assert result[Policy.DP].runs[0].failures == 1


# --- invariants ----------------------------------------------------------------------------------------------


def test_synchronous_diloco_is_decoupled_with_one_learner():
    config = SimConfig(chips=100_000, learners=1, mtbi_years=0.05, horizon_hours=12)
    failures = sample_failures(config, 3)
    sync = run_policy(Policy.SYNC_DILOCO, config, failures)
    decoupled = run_policy(Policy.DECOUPLED_DILOCO, config, failures)
    assert sync.goodput == pytest.approx(decoupled.goodput) and sync.uptime == pytest.approx(decoupled.uptime)


def test_policies_rank_as_their_coupling_on_the_same_failures():
    config = SimConfig(chips=1_200_000, learners=8, horizon_hours=6)
    failures = sample_failures(config, 7)
    goodput = {p: run_policy(p, config, failures).goodput for p in Policy}
    assert goodput[Policy.DP] < goodput[Policy.ELASTIC_DP] < goodput[Policy.DECOUPLED_DILOCO]
    assert goodput[Policy.SYNC_DILOCO] < goodput[Policy.DECOUPLED_DILOCO]


def test_quorum_and_grace_make_learners_wait():
    # With no overlap a learner waits after each push until its push is merged. K = 1 merges at once; a
    # larger quorum makes it wait for others' pushes (not monotonically in K: a quorum of all phase-locks the
    # learners, a quorum of half does not). Capping K by the live learners keeps even K = M above synchronous.
    base = SimConfig(chips=1_200_000, learners=8, horizon_hours=6, overlap_steps=0, grace_s=0.0)
    failures = sample_failures(base, 1)
    free = run_policy(Policy.DECOUPLED_DILOCO, SimConfig(**{**base.__dict__, "quorum": 1}), failures)
    half = run_policy(Policy.DECOUPLED_DILOCO, SimConfig(**{**base.__dict__, "quorum": 4}), failures)
    everyone = run_policy(Policy.DECOUPLED_DILOCO, SimConfig(**{**base.__dict__, "quorum": 8}), failures)
    sync = run_policy(Policy.SYNC_DILOCO, base, failures)
    assert free.goodput > max(half.goodput, everyone.goodput)
    assert everyone.goodput > sync.goodput
    assert free.contributors_per_merge < half.contributors_per_merge < everyone.contributors_per_merge
    assert free.uptime == half.uptime == everyone.uptime == sync.uptime


def test_a_long_grace_window_makes_a_quorum_of_one_wait():
    base = SimConfig(chips=1_200_000, learners=8, horizon_hours=6, overlap_steps=3)
    failures = sample_failures(base, 2)
    short = run_policy(Policy.DECOUPLED_DILOCO, SimConfig(**{**base.__dict__, "grace_s": 2.0}), failures)
    long = run_policy(Policy.DECOUPLED_DILOCO, SimConfig(**{**base.__dict__, "grace_s": 10.0}), failures)
    assert long.goodput < short.goodput
    assert long.contributors_per_merge > short.contributors_per_merge


# --- failures: sampling and traces ---------------------------------------------------------------------------


def test_sampled_failures_are_a_poisson_process_over_the_fleet():
    config = SimConfig(chips=2_400_000, learners=8, horizon_hours=72)
    failures = sample_failures(config, 0)
    expected = config.fleet_rate * config.horizon_s  # ≈ 19,700
    assert abs(len(failures) - expected) < 5 * math.sqrt(expected)
    assert np.all(np.diff(failures.times) >= 0) and failures.times[-1] < config.horizon_s
    assert failures.chips.min() >= 0 and failures.chips.max() < config.chips
    assert np.all(failures.downtimes == config.reschedule_s)
    assert np.array_equal(sample_failures(config, 0).times, failures.times)


def test_saved_trace_replays_the_sampled_run_exactly(tmp_path):
    config = SimConfig(chips=600_000, learners=8, horizon_hours=4, seeds=(5,))
    sampled = simulate(config)
    path = tmp_path / "trace.csv"
    save_trace(path, sample_failures(config, 5).events())
    replayed = simulate(SimConfig(**{**config.__dict__, "trace": load_trace(path, config)}))
    for policy in Policy:
        a, b = sampled[policy].runs[0], replayed[policy].runs[0]
        assert (a.goodput, a.uptime, a.failures, a.absorbed) == (b.goodput, b.uptime, b.failures, b.absorbed)
    assert replayed[Policy.DP].runs[0].seed is None


def test_trace_by_learner_with_default_downtime(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("time_s,learner,downtime_s\n300,1,\n100.5,0,50\n")
    config = SimConfig(chips=8, learners=2, horizon_hours=1000 / 3600)
    events = load_trace(path, config)
    assert events == (FailureEvent(300.0, 4, config.reschedule_s), FailureEvent(100.5, 0, 50.0))
    failures = Failures.from_events(events, config.horizon_s)
    assert failures.times.tolist() == [100.5, 300.0]
    first = simulate(SimConfig(**{**config.__dict__, "trace": events}))
    second = simulate(SimConfig(**{**config.__dict__, "trace": events}))
    assert first == second
    assert first[Policy.DECOUPLED_DILOCO].runs[0].failures == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("when,chip\n1,2\n", "time_s column"),
        ("time_s,chip\n1,99\n", ":2: chip outside"),
        ("time_s,learner\n1,5\n", ":2: learner 5 outside"),
        ("time_s,chip\nsoon,1\n", ":2:"),
    ],
)
def test_bad_trace_is_refused_with_its_line(tmp_path, text, message):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_trace(path, SimConfig(chips=8, learners=2))


@pytest.mark.parametrize(
    "overrides",
    [{"quorum": 9}, {"chips": 4}, {"fragments": 17}, {"overlap_steps": 17}, {"step_seconds": (0.0,)}, {"seeds": ()}],
)
def test_impossible_configurations_are_refused(overrides):
    with pytest.raises(ValueError):
        SimConfig(**{"chips": 1000, "learners": 8, **overrides})
