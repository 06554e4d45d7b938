"""Specification of compressed pulls' arithmetic: the island and the shard agree bit for bit on what the
island holds, and feeding each pull's error into the next keeps the island within one quantisation step of
the shard's values however many versions go by."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.compressed_pull import DIGEST_LEAF_BYTES, apply_delta, difference, values_digest
from diloco.core.encoding import Encoding, decode, encode, error_bound
from diloco.transport import wire
from diloco.transport.v1 import syncer_pb2 as pb

SHAPES = [(64, 33), (7,), ()]


def _random(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * scale for shape in SHAPES]


def _decoded_by_the_island(blobs, held, encoding, block_size, top_k):
    """What an island decodes from a Pull reply of `blobs`: the real wire path."""
    named = [(str(i), h) for i, h in enumerate(held)]
    payloads, _ = wire.tensor_payloads(named, encoding, block_size, top_k)
    messages = wire.fragment_messages(0, pb.FragmentVersion(version=1), payloads, blobs, max_chunk=1000)
    return [t for _, t in wire.read_fragment_stream(wire.parse_fragment_chunk(m) for m in messages)[1]]


def _through_the_wire(differences, encoding, block_size):
    """What an island decodes from a Pull reply carrying `differences`: the real wire path."""
    payloads, blobs = wire.tensor_payloads([(str(i), d) for i, d in enumerate(differences)], encoding, block_size)
    messages = wire.fragment_messages(
        0, pb.FragmentVersion(version=1), payloads, blobs, max_chunk=1000, delta_base=pb.FragmentVersion(version=0)
    )
    header, tensors = wire.read_fragment_stream(wire.parse_fragment_chunk(m) for m in messages)
    assert header.HasField("delta_base") and header.delta_base.version == 0
    return blobs, [t for _, t in tensors]


class TestChecksum:
    def test_names_the_exact_float32_bytes_in_order(self):
        values = _random(0)
        crc = values_digest(values)
        assert values_digest([v.clone() for v in values]) == crc
        assert values_digest(list(reversed(values))) != crc
        flipped = [v.clone() for v in values]
        flipped[0].view(-1).view(torch.int32)[5] ^= 1  # one bit of one value
        assert values_digest(flipped) != crc

    def test_refuses_values_that_are_not_float32(self):
        with pytest.raises(ValueError, match="float32"):
            values_digest([torch.zeros(3, dtype=torch.float64)])


class TestAgreement:
    @pytest.mark.parametrize("encoding", [Encoding.FP32, Encoding.BF16, Encoding.INT8, Encoding.INT4, Encoding.SPARSE])
    def test_island_and_shard_compute_the_same_values_bit_for_bit(self, encoding):
        held = _random(1)
        new = [h + d for h, d in zip(held, _random(2, 0.01))]
        shard = difference(new, held, encoding, 32, 4, chunk=300)
        island = apply_delta(held, _decoded_by_the_island(shard.blobs, held, encoding, 32, 4))
        assert all(torch.equal(a, b) for a, b in zip(island, shard.held))
        assert values_digest(island) == values_digest(shard.held)
        if encoding is not Encoding.SPARSE:  # sparse sends a block's top k: the rest waits for the next pull
            for got, want, h in zip(island, new, held):
                assert torch.all((got - want).abs() <= error_bound(want - h, encoding, 32) + want.abs() * 2.0**-23)

    @settings(max_examples=40, deadline=None)
    @given(
        encoding=st.sampled_from([Encoding.BF16, Encoding.INT8, Encoding.INT4, Encoding.SPARSE]),
        sizes=st.lists(st.integers(0, 90), min_size=1, max_size=3),
        chunk=st.integers(1, 50),
        seed=st.integers(0, 2**16),
    )
    def test_one_pass_chunk_by_chunk_is_the_difference_encoded_whole(self, encoding, sizes, chunk, seed):
        """The shard's pass sends the bytes of `encode(new − held)` and records `held + decode(them)`."""
        g = torch.Generator().manual_seed(seed)
        held = [torch.randn(n, generator=g) for n in sizes]
        new = [h + 0.1 * torch.randn(h.shape, generator=g) for h in held]
        shard = difference(new, held, encoding, 4, 2, chunk=chunk)
        assert shard.blobs == [encode(n - h, encoding, 4, 2) for n, h in zip(new, held)]
        want = apply_delta(held, [decode(b, h.shape, encoding, 4, 2) for b, h in zip(shard.blobs, held)])
        assert all(torch.equal(a, b) for a, b in zip(shard.held, want))

    def test_the_digest_is_the_same_however_its_leaves_are_hashed(self):
        values = [torch.randn(DIGEST_LEAF_BYTES // 4 * 2 + 5), torch.randn(3)]  # three leaves, then one
        with ThreadPoolExecutor(4) as pool:
            assert values_digest(values, pool.map) == values_digest(values)

    def test_apply_refuses_a_difference_of_another_layout(self):
        held = _random(1)
        with pytest.raises(ValueError, match="shape"):
            apply_delta(held, [torch.zeros(3), *held[1:]])
        with pytest.raises(ValueError, match="tensors"):
            apply_delta(held, held[:2])

    def test_apply_leaves_the_held_values_untouched(self):
        held = _random(1)
        before = [h.clone() for h in held]
        apply_delta(held, _random(2))
        assert all(torch.equal(a, b) for a, b in zip(held, before))


def test_error_feedback_keeps_the_island_within_one_step_of_the_shard_over_many_versions():
    """θ drifts for 300 versions; the island only ever receives int4 differences. Its error stays within
    the bound of the last difference, whereas applying int4 updates without feedback drifts away."""
    block = 32
    theta = _random(3)
    held = [t.clone() for t in theta]
    naive = [t.clone() for t in theta]
    worst_ratio, naive_error = 0.0, 0.0
    for version in range(300):
        update = _random(1000 + version, 0.01)
        previous = theta
        theta = [t + u for t, u in zip(theta, update)]
        differences = [t - h for t, h in zip(theta, held)]
        held = difference(theta, held, Encoding.INT4, block).held
        for t, h, d in zip(theta, held, differences):
            bound = error_bound(d, Encoding.INT4, block) + t.abs() * 2.0**-23  # and the rounding of the sum
            worst_ratio = max(worst_ratio, float(((t - h).abs() / bound).max()))
        naive_blobs, _ = _through_the_wire([t - p for t, p in zip(theta, previous)], Encoding.INT4, block)
        naive = apply_delta(naive, [decode(b, n.shape, Encoding.INT4, block) for b, n in zip(naive_blobs, naive)])
        naive_error = max(float((t - n).abs().max()) for t, n in zip(theta, naive))
    assert worst_ratio <= 1.0
    final_error = max(float((t - h).abs().max()) for t, h in zip(theta, held))
    assert naive_error > 5 * final_error, (naive_error, final_error)
