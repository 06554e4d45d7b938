"""Tokens per second and model FLOPs utilisation, as the worker reports them."""

from __future__ import annotations

import pytest

from diloco.worker.throughput import ThroughputMeter, peak_flops


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
    ],
)
def test_known_accelerators_have_their_dense_bf16_peak(name, tflops):
    assert peak_flops(name) == tflops * 1e12


def test_an_unknown_device_has_no_peak_unless_one_is_given():
    assert peak_flops("cpu") is None
    assert peak_flops("cpu", override_tflops=2.0) == 2e12
    assert peak_flops("NVIDIA H100 80GB HBM3", override_tflops=500.0) == 500e12, "the override wins"


def test_the_rate_covers_the_last_steps_and_the_island_is_every_rank():
    meter = ThroughputMeter(flops_per_token=1e9, peak=1e13, island_size=4, window=2)
    meter.record(tokens=1000, seconds=10.0)  # a slow first step leaves the window
    meter.record(tokens=1000, seconds=1.0)
    rate = meter.record(tokens=1000, seconds=1.0)
    assert rate.tokens_per_second == 1000.0
    assert rate.island_tokens_per_second == 4000.0
    assert rate.mfu == pytest.approx(1000.0 * 1e9 / 1e13)


def test_no_mfu_without_a_peak_and_no_rate_before_a_step():
    meter = ThroughputMeter(flops_per_token=1e9, peak=None, island_size=1)
    assert meter.rate().tokens_per_second == 0.0
    assert meter.record(tokens=10, seconds=1.0).mfu is None
