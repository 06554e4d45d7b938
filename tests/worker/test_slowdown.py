"""An island's emulated slowness: against its own compute time, or against the emulated device's step time."""

from __future__ import annotations

import random
import statistics

import pytest

from diloco.worker.slowdown import jitter_seconds, overran, pause_seconds


def test_without_a_reference_a_step_sleeps_its_slowdown_less_one_times_its_own_time():
    assert pause_seconds(0.2, slowdown=3.0, reference=None) == pytest.approx(0.4)
    assert pause_seconds(0.2, slowdown=1.0, reference=None) == 0.0


def test_with_a_reference_every_step_lasts_its_slowdown_times_the_reference_whatever_its_compute():
    for compute in (0.1, 0.3, 0.45):
        assert compute + pause_seconds(compute, slowdown=3.0, reference=0.5) == pytest.approx(1.5)
        assert compute + pause_seconds(compute, slowdown=1.0, reference=0.5) == pytest.approx(0.5)


def test_a_step_whose_compute_exceeds_the_emulated_devices_time_keeps_its_own_and_overruns():
    assert pause_seconds(0.7, slowdown=1.0, reference=0.5) == 0.0
    assert overran(0.7, slowdown=1.0, reference=0.5)
    assert not overran(0.7, slowdown=3.0, reference=0.5)
    assert not overran(9.0, slowdown=3.0, reference=None), "without a reference nothing overruns"


def test_a_jittered_step_sleeps_a_random_share_of_its_time_up_to_twice_the_jitter():
    rng = random.Random(0)
    pauses = [jitter_seconds(0.2, 0.3, None, rng) for _ in range(2000)]
    assert all(0.0 <= p <= 0.2 * 0.6 for p in pauses)
    assert statistics.mean(pauses) == pytest.approx(0.2 * 0.3, rel=0.05), "on average jitter x its time longer"
    assert jitter_seconds(0.2, 0.3, 0.5, random.Random(1)) <= 0.5 * 0.6, "a share of the reference's time"
    assert jitter_seconds(0.2, 0.0, None, rng) == 0.0
    with pytest.raises(ValueError, match="jitter"):
        jitter_seconds(0.2, -0.1, None, rng)
