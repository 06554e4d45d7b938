"""Specification of the sparse encoding: the top-k of each block at 2 bits, its exact layout and size, round
trips (hypothesis) and the refusal of every payload no encoder writes."""

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core import sparse
from diloco.core.config import MAX_BLOCK_SIZE, TrainingConfig
from diloco.core.encoding import Encoding, EncodingError, bits_per_value, decode, encode, encoded_nbytes, error_bound


def _round_trip(x: torch.Tensor, block_size: int, top_k: int) -> torch.Tensor:
    data = encode(x, Encoding.SPARSE, block_size, top_k)
    assert len(data) == encoded_nbytes(x.numel(), Encoding.SPARSE, block_size, top_k)
    return decode(data, x.shape, Encoding.SPARSE, block_size, top_k)


def _payload(scales, levels, indices, index_bits) -> bytes:
    """A payload written by hand, as a hostile peer may write one."""
    pack = lambda values, width: np.packbits(  # noqa: E731
        ((np.array(values, dtype=np.int64)[:, None] >> np.arange(width)) & 1).astype(np.uint8).reshape(-1),
        bitorder="little",
    ).tobytes()
    return struct.pack(f"<{len(scales)}f", *scales) + pack(levels, 2) + pack(indices, index_bits)


def test_each_block_keeps_its_top_k_at_two_bits_and_the_rest_is_zero():
    x = torch.tensor([0.1, -3.0, 2.0, 0.5, 0.0, 0.0, 1.0, -0.2, 4.0])  # blocks of 4, 4 and a tail of 1
    y = _round_trip(x, block_size=4, top_k=2)
    # Block 0: max 3 gives scale 1.5; -3 → (0 - 1.5) · 1.5, 2 → (3 - 1.5) · 1.5. Block 1: 1 and -0.2 (scale
    # 0.5). The tail keeps its one value: scale 2, 4 → 1.5 · 2.
    assert y.tolist() == [0.0, -2.25, 2.25, 0.0, 0.0, 0.0, 0.75, -0.25, 3.0]


def test_the_layout_is_scales_then_two_bit_values_then_packed_indices():
    data = encode(torch.tensor([0.1, -3.0, 2.0, 0.5]), Encoding.SPARSE, 4, 2)
    assert data == _payload([1.5], [0, 3], [1, 2], index_bits=2)


@pytest.mark.parametrize(
    ("numel", "block_size", "top_k", "expected"),
    [
        (0, 128, 2, 0),
        (1, 128, 2, 4 + 1 + 1),  # one block; the tail keeps its only value
        (128, 128, 2, 4 + 1 + 2),  # 2 values: 4 bits, 2 indices of 7 bits
        (129, 128, 2, 8 + 1 + 3),  # 3 values: 6 bits, 21 index bits
        (4096 * 10, 4096, 64, 40 + 160 + 960),  # 640 values at 2 + 12 bits
        (5, 1, 1, 20 + 2 + 1),  # a block of one value still spends one index bit
    ],
)
def test_encoded_nbytes_is_exact(numel, block_size, top_k, expected):
    assert encoded_nbytes(numel, Encoding.SPARSE, block_size, top_k) == expected


def test_a_job_sends_a_sixtyfourth_of_its_values_and_under_a_tenth_of_int4s_bits():
    job = TrainingConfig(encoding=Encoding.SPARSE)
    assert job.top_k == 2 and job.top_k_fraction * job.block_size == job.top_k
    assert bits_per_value(Encoding.SPARSE, job.block_size, job.top_k) < bits_per_value(Encoding.INT4, 128) / 10
    assert TrainingConfig(top_k_fraction=1e-9).top_k == 1, "at least one value per block"


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=False), max_size=300),
    block_size=st.integers(1, 40),
    data=st.data(),
)
def test_round_trip_keeps_the_top_k_of_each_block_within_a_quarter_of_its_largest(values, block_size, data):
    top_k = data.draw(st.integers(1, block_size))
    x = torch.tensor(values, dtype=torch.float32)
    y = _round_trip(x, block_size, top_k)
    assert y.shape == x.shape
    for start in range(0, x.numel(), block_size):
        xb, yb = x[start : start + block_size], y[start : start + block_size]
        kept = yb != 0
        largest = float(xb.abs().max())
        assert int(kept.sum()) <= min(top_k, xb.numel())
        if largest > 0:
            assert int(kept.sum()) == min(top_k, xb.numel()), "a kept value never decodes to zero"
            assert bool((xb[~kept].abs() <= xb[kept].abs().min()).all()), "what is kept is the top-k"
        slack = largest * 2.0**-20 + torch.finfo(torch.float32).tiny
        assert bool(((yb - xb)[kept].abs() <= largest / 4 + slack).all())
        assert bool(((yb - xb).abs() <= error_bound(xb, Encoding.SPARSE, block_size, top_k) + slack).all())
        signed = kept & (xb.abs() > slack)  # a value lost in the scale's rounding may come back as +scale/2
        assert bool((torch.sign(yb[signed]) == torch.sign(xb[signed])).all()), "a sign is never flipped"


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(max_size=64), numel=st.integers(0, 64), block_size=st.integers(1, 16), data=st.data())
def test_any_bytes_of_the_right_length_decode_in_bounds_or_are_refused(payload, numel, block_size, data):
    top_k = data.draw(st.integers(1, block_size))
    expected = encoded_nbytes(numel, Encoding.SPARSE, block_size, top_k)
    raw = (payload * (expected // max(1, len(payload)) + 1))[:expected] if payload else bytes(expected)
    try:
        y = decode(raw, [numel], Encoding.SPARSE, block_size, top_k)
    except EncodingError:
        return
    assert y.shape == (numel,) and bool(torch.isfinite(y).all())
    assert int((y != 0).sum()) <= sparse.kept(numel, block_size, top_k)


@pytest.mark.parametrize(
    ("indices", "match"),
    [
        ([2, 2], "repeated or out of order"),
        ([3, 1], "repeated or out of order"),
        ([1, 6], "beyond its block"),  # three bits hold 5..7 too; the block has 5 values
    ],
)
def test_indices_no_encoder_writes_are_refused(indices, match):
    data = _payload([1.0], [0, 3], indices, index_bits=3)
    with pytest.raises(EncodingError, match=match):
        decode(data, [5], Encoding.SPARSE, 5, 2)


def test_an_index_beyond_a_short_tail_block_is_refused():
    """The tail of 3 values keeps 2 of indices 0..2; index 3 lies within a whole block's width, not the tensor."""
    data = _payload([1.0, 1.0], [0, 3, 1, 2], [0, 1, 0, 3], index_bits=2)
    with pytest.raises(EncodingError, match="beyond its block"):
        decode(data, [7], Encoding.SPARSE, 4, 2)


@pytest.mark.parametrize(("scale", "match"), [(math.nan, "NaN or Inf scale"), (math.inf, "NaN"), (-1.0, "negative")])
def test_a_scale_no_encoder_writes_is_refused(scale, match):
    with pytest.raises(EncodingError, match=match):
        decode(_payload([scale], [0, 3], [0, 1], index_bits=2), [4], Encoding.SPARSE, 4, 2)


def test_a_scale_whose_values_overflow_is_refused():
    with pytest.raises(EncodingError, match="NaN or Inf value"):
        decode(_payload([3e38], [0, 3], [0, 1], index_bits=2), [4], Encoding.SPARSE, 4, 2)


def test_a_wrong_length_is_refused():
    data = encode(torch.ones(8), Encoding.SPARSE, 4, 2)
    for bad in (data[:-1], data + b"\0"):
        with pytest.raises(EncodingError, match="expected"):
            decode(bad, [8], Encoding.SPARSE, 4, 2)


@pytest.mark.parametrize(
    ("block_size", "top_k", "match"),
    [(0, 1, "block_size"), (MAX_BLOCK_SIZE + 1, 1, "block_size"), (8, 0, "top_k"), (8, 9, "top_k")],
)
def test_parameters_no_encoder_uses_are_refused_before_anything_is_allocated(block_size, top_k, match):
    with pytest.raises(EncodingError, match=match):
        encoded_nbytes(16, Encoding.SPARSE, block_size, top_k)
    with pytest.raises(EncodingError, match=match):
        decode(b"", [16], Encoding.SPARSE, block_size, top_k)


def test_nan_is_refused_before_anything_is_sent():
    with pytest.raises(EncodingError, match="NaN"):
        encode(torch.tensor([1.0, math.nan, 0.0, 0.0]), Encoding.SPARSE, 4, 1)
