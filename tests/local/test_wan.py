"""A shaped link as numbers: its token bucket, the delay proxy's schedule, and the link that puts a small model
where a large one stands on a real WAN."""

import pytest

from diloco.core.config import Encoding, TrainingConfig
from diloco.core.encoding import encoded_nbytes
from diloco.local.wan import MTU_BYTES, TCP_SHARE, DelayLine, Link, equivalent_link, sync_bytes_per_step, tbf


def test_a_link_is_shaped_when_it_limits_bandwidth_or_adds_a_round_trip():
    assert not Link().shaped
    assert Link(mbps=10).shaped
    assert Link(rtt_ms=50).shaped
    assert Link(rtt_ms=50).one_way_seconds == 0.025


@pytest.mark.parametrize("bad", [{"mbps": 0}, {"mbps": -1}, {"mbps": float("inf")}, {"rtt_ms": -1}])
def test_a_link_refuses_what_no_link_is(bad):
    with pytest.raises(ValueError, match="--link-mbps|--rtt-ms"):
        Link(**bad)


def test_syncs_behind_a_slow_link_are_given_what_tcp_keeps_of_its_rate_shared_by_the_fragments():
    """Every fragment's push may cross at once: each gets a share of what TCP keeps of the link, and the
    deadlines follow it (at 0.02 Mbit/s and 2 fragments, the link's rate over the fragments left a push
    past its deadline in a `diloco run`)."""
    config = TrainingConfig(fragments=4, inner_steps=100)
    assert Link(mbps=0.004).min_transfer_mbps(config) == pytest.approx(0.004 * TCP_SHARE / 4)
    assert Link(mbps=2000).min_transfer_mbps(config) == config.min_transfer_mbps, "the job's, when lower"
    assert Link(rtt_ms=50).min_transfer_mbps(config) == config.min_transfer_mbps


def test_the_token_bucket_runs_at_the_links_rate():
    assert tbf(2000).rate_bits == 2_000_000_000
    assert tbf(0.25).rate_bits == 250_000


def test_a_slow_links_bucket_still_holds_one_frame():
    bucket = tbf(0.01)
    assert bucket.burst_bytes == MTU_BYTES
    assert bucket.limit_bytes > bucket.burst_bytes, "a frame can queue behind the one being sent"


def test_a_fast_links_bucket_holds_a_timer_tick_of_its_rate():
    assert tbf(1000).burst_bytes == 500_000, "1 Gbit/s is 125 MB/s: 4 ms of it"


def test_the_bucket_as_tc_takes_it():
    assert tbf(8).tc_args() == ["tbf", "rate", "8000000bit", "burst", "4000", "limit", "54000"]


def test_the_delay_line_releases_each_chunk_its_delay_after_it_arrived_in_order():
    line = DelayLine(0.5)
    assert line.wait(0.0) is None
    line.put(b"a", now=1.0)
    line.put(b"b", now=1.2)
    assert line.wait(1.3) == pytest.approx(0.2)
    assert line.due(1.4) == []
    assert line.due(1.5) == [b"a"]
    assert line.due(2.0) == [b"b"]
    assert line.wait(2.0) is None


def test_the_delay_line_never_holds_a_chunk_behind_a_later_deadline():
    """Bandwidth is the tbf's alone: a burst that arrives together leaves together."""
    line = DelayLine(0.1)
    for i in range(100):
        line.put(bytes([i]), now=0.0)
    assert line.due(0.1) == [bytes([i]) for i in range(100)]


def test_a_delay_is_never_negative():
    with pytest.raises(ValueError):
        DelayLine(-0.1)


def test_sync_bytes_per_step_is_every_parameter_pushed_and_pulled_once_per_h_steps():
    config = TrainingConfig(inner_steps=100, encoding=Encoding.INT4)
    assert (
        sync_bytes_per_step(1_000_000, config) == 2 * encoded_nbytes(1_000_000, Encoding.INT4, config.block_size) / 100
    )


def test_the_equivalent_link_keeps_transfer_time_and_latency_the_same_number_of_steps():
    reference = Link(mbps=2000, rtt_ms=50)
    equivalent = equivalent_link(
        reference, reference_bytes_per_step=1e8, reference_step_seconds=1.0, bytes_per_step=1e4, step_seconds=0.5
    )
    assert equivalent.link.mbps == pytest.approx(2000 * 1e-4 * 2)
    assert equivalent.link.rtt_ms == pytest.approx(25)
    transfer_steps = 1e8 * 8 / 2000e6 / 1.0
    assert 1e4 * 8 / (equivalent.link.mbps * 1e6) / 0.5 == pytest.approx(transfer_steps)


def test_the_equivalent_link_needs_a_reference_bandwidth():
    with pytest.raises(ValueError, match="bandwidth"):
        equivalent_link(Link(rtt_ms=50), 1.0, 1.0, 1.0, 1.0)
