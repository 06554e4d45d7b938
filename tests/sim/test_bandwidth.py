"""The bandwidth model: hand-checked arithmetic, and Streaming DiLoCo's orders of magnitude.

Streaming DiLoCo (arXiv 2501.18512) reports ≈ 1–5 Gbit/s for 95% compute utilisation where data-parallel
needs ≈ 100–400 Gbit/s. With step times from compute (6 · params · 2M tokens at 2·10^17 FLOP/s per site) our
model lands in both ranges for 1B, 10B and 100B parameters.
"""

import pytest

from diloco.core.config import Encoding, TrainingConfig
from diloco.core.encoding import bits_per_value
from diloco.sim import bandwidth

SIZES = (1e9, 1e10, 1e11)


@pytest.mark.parametrize("params", SIZES)
def test_data_parallel_needs_hundreds_of_gbits(params):
    step = bandwidth.step_seconds(params)
    assert 100 <= bandwidth.required_gbps(bandwidth.data_parallel(), params, step, 0.95) <= 400


@pytest.mark.parametrize("params", SIZES)
@pytest.mark.parametrize("scheme", [bandwidth.streaming_diloco(100, 4, 5), bandwidth.streaming_diloco(16, 4, 3)])
def test_streaming_diloco_needs_a_few_gbits(params, scheme):
    step = bandwidth.step_seconds(params)
    need = bandwidth.required_gbps(scheme, params, step, 0.95)
    assert 1 <= need <= 5
    assert bandwidth.required_gbps(bandwidth.data_parallel(), params, step, 0.95) / need > 40


def test_plain_diloco_sits_between():
    step = bandwidth.step_seconds(1e10)
    dp, plain, streaming = (
        bandwidth.required_gbps(s, 1e10, step, 0.95)
        for s in (bandwidth.data_parallel(), bandwidth.diloco(100), bandwidth.streaming_diloco(100, 4, 5))
    )
    assert streaming < plain < dp


def test_hand_computed_data_parallel():
    # 1B bf16 params between 2 sites: 2·(1/2)·1e9·16 = 1.6e10 bits a step; a 1 s step hides 1 s, and 95%
    # utilisation allows 1/19 s more: 1.6e10 / (1 + 1/19) s = 15.2 Gbit/s.
    assert bandwidth.transfer_bits(bandwidth.data_parallel(), 1e9, 2) == 1.6e10
    assert bandwidth.required_gbps(bandwidth.data_parallel(), 1e9, 1.0, 0.95) == pytest.approx(16 * 19 / 20)
    # Eight sites: each link carries 2·7/8 of the payload.
    assert bandwidth.transfer_bits(bandwidth.data_parallel(), 1e9, 8) == pytest.approx(2.8e10)


def test_hand_computed_streaming():
    # 1B params, P=4 fragments of 4 bits: 1e9 bits every 25 steps, hidden behind 5 steps of 1 s, plus 25/19 s.
    scheme = bandwidth.streaming_diloco(100, 4, 5)
    assert bandwidth.transfer_bits(scheme, 1e9, 2) == 1e9
    assert bandwidth.required_gbps(scheme, 1e9, 1.0, 0.95) == pytest.approx(1 / (5 + 25 / 19))


@pytest.mark.parametrize(
    "scheme", [bandwidth.data_parallel(), bandwidth.diloco(100), bandwidth.streaming_diloco(100, 4, 5)]
)
@pytest.mark.parametrize("target", [0.5, 0.9, 0.95, 0.99])
def test_utilisation_at_the_required_bandwidth_is_the_target(scheme, target):
    need = bandwidth.required_gbps(scheme, 1e10, 0.5, target, sites=4)
    assert bandwidth.utilisation_at(scheme, 1e10, 0.5, need, sites=4) == pytest.approx(target)
    assert bandwidth.utilisation_at(scheme, 1e10, 0.5, need * 2, sites=4) > target
    assert bandwidth.utilisation_at(scheme, 1e10, 0.5, need / 2, sites=4) < target


def test_a_fast_enough_link_keeps_compute_fully_busy():
    assert bandwidth.utilisation_at(bandwidth.streaming_diloco(100, 4, 5), 1e9, 1.0, 1.0) == 1.0


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5])
def test_utilisation_target_must_be_a_fraction(bad):
    with pytest.raises(ValueError):
        bandwidth.required_gbps(bandwidth.data_parallel(), 1e9, 1.0, bad)


def test_a_link_needs_two_sites():
    with pytest.raises(ValueError):
        bandwidth.transfer_bits(bandwidth.data_parallel(), 1e9, 1)


def test_sparse_outer_gradients_need_a_tenth_of_the_bandwidth_of_int4():
    """The job's encoding sets the bits per value: sparse sends 2 of 128 values at 2 + 7 bits, plus a scale."""
    job = TrainingConfig(encoding=Encoding.SPARSE)
    bits = bits_per_value(job.encoding, job.block_size, job.top_k)
    assert bits == (32 + 2 * (2 + 7)) / 128 and bits_per_value(Encoding.INT4, 128) == 4.25
    step = bandwidth.step_seconds(1e10)
    int4 = bandwidth.required_gbps(bandwidth.streaming_diloco(100, 4, 5, 4.25), 1e10, step, 0.95)
    sparse = bandwidth.required_gbps(bandwidth.streaming_diloco(100, 4, 5, bits), 1e10, step, 0.95)
    assert sparse < int4 / 10
