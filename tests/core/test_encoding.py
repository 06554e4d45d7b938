"""Specification of the wire encodings: exact sizes, round trips within the promised error, refusals."""

import math
import struct
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.config import MAX_BLOCK_SIZE
from diloco.core.encoding import (
    Encoding,
    EncodingError,
    accumulate,
    alignment,
    decode,
    decoded,
    encode,
    encode_into,
    encoded_nbytes,
    error_bound,
    validated,
)

ALL = [Encoding.FP32, Encoding.BF16, Encoding.INT8, Encoding.INT4]
QUANTISED = [Encoding.INT8, Encoding.INT4]
SHAPES = [(), (1,), (0,), (7,), (64,), (65,), (3, 5), (2, 3, 11), (1000,), (0, 4)]


def _random(shape, seed=0, magnitude=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * magnitude


def _assert_round_trip(x, encoding, block_size):
    data = encode(x, encoding, block_size)
    assert len(data) == encoded_nbytes(x.numel(), encoding, block_size)
    y = decode(data, x.shape, encoding, block_size)
    assert y.dtype == torch.float32 and y.shape == x.shape
    err = (y - x.float()).abs()
    bound = error_bound(x, encoding, block_size)
    assert bound.shape == x.shape
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    return y


@pytest.mark.parametrize("encoding", ALL)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block_size", [4, 64])
def test_round_trip_within_bound(encoding, shape, block_size):
    _assert_round_trip(_random(shape), encoding, block_size)


@pytest.mark.parametrize("encoding", ALL)
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1e6, 1e30])
def test_round_trip_across_magnitudes(encoding, magnitude):
    _assert_round_trip(_random((3, 67), seed=1, magnitude=magnitude), encoding, 32)


@pytest.mark.parametrize("encoding", QUANTISED)
def test_one_outlier_only_coarsens_its_own_block(encoding):
    x = _random((256,), seed=2)
    x[3] = 1e4
    y = _assert_round_trip(x, encoding, 128)
    assert torch.allclose(y[128:], x[128:], atol=float(x[128:].abs().max()) / 10)
    assert (y[:128] - x[:128]).abs().max() > (y[128:] - x[128:]).abs().max()


@pytest.mark.parametrize("encoding", QUANTISED)
def test_all_zero_block_decodes_to_zero_with_zero_scale(encoding):
    x = torch.cat([torch.zeros(8), _random((8,), seed=3)])
    data = encode(x, encoding, 8)
    assert struct.unpack_from("<f", data, 0)[0] == 0.0
    y = _assert_round_trip(x, encoding, 8)
    assert torch.equal(y[:8], torch.zeros(8))


def test_fp32_is_exact_and_raw():
    x = _random((5, 7), seed=4)
    data = encode(x, Encoding.FP32, 0)
    assert data == x.numpy().astype("<f4").tobytes()
    assert torch.equal(decode(data, x.shape, Encoding.FP32, 0), x)


def test_bf16_is_raw_round_to_nearest():
    x = torch.tensor([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5])
    data = encode(x, Encoding.BF16, 0)
    assert data == x.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    assert torch.equal(decode(data, [4], Encoding.BF16, 0), x.to(torch.bfloat16).float())


def test_input_dtypes_and_layouts_are_accepted():
    x = _random((6, 10), seed=5)
    for tensor in (x.to(torch.bfloat16), x.to(torch.float16), x.t(), x.requires_grad_()):
        for encoding in ALL:
            _assert_round_trip(tensor.detach(), encoding, 8)


def test_int8_layout_scales_then_values():
    x = torch.tensor([127.0, -63.5, 0.0, 254.0, 1.0])
    data = encode(x, Encoding.INT8, 3)
    assert data[:8] == struct.pack("<2f", 1.0, 2.0)
    assert list(struct.unpack("<5b", data[8:])) == [127, -64, 0, 127, 0]


def test_int4_nibble_packing_matches_hand_computation():
    data = encode(torch.tensor([1.0, -1.0, 7.0, -7.0]), Encoding.INT4, 4)
    # scale 7/7 = 1; element 2i in the low nibble, 2i+1 in the high one: (1, -1) -> 0xF1, (7, -7) -> 0x97.
    assert data == struct.pack("<f", 1.0) + bytes([0xF1, 0x97])
    assert decode(data, [4], Encoding.INT4, 4).tolist() == [1.0, -1.0, 7.0, -7.0]


def test_int4_odd_numel_pads_with_a_zero_nibble():
    data = encode(torch.tensor([2.0, -7.0, 7.0]), Encoding.INT4, 4)
    assert data == struct.pack("<f", 1.0) + bytes([0x92, 0x07])
    assert decode(data, [3], Encoding.INT4, 4).tolist() == [2.0, -7.0, 7.0]


@pytest.mark.parametrize(
    ("numel", "encoding", "block_size", "expected"),
    [
        (10, Encoding.FP32, 0, 40),
        (10, Encoding.BF16, 0, 20),
        (10, Encoding.INT8, 4, 3 * 4 + 10),
        (10, Encoding.INT8, 10, 4 + 10),
        (11, Encoding.INT4, 4, 3 * 4 + 6),
        (12, Encoding.INT4, 4, 3 * 4 + 6),
        (0, Encoding.INT4, 4, 0),
        (1, Encoding.INT4, 128, 4 + 1),
    ],
)
def test_encoded_nbytes_is_exact(numel, encoding, block_size, expected):
    assert encoded_nbytes(numel, encoding, block_size) == expected


def test_int4_compresses_at_least_seven_times_against_fp32():
    numel = 1 << 16
    assert encoded_nbytes(numel, Encoding.FP32, 0) / encoded_nbytes(numel, Encoding.INT4, 128) >= 7
    x = _random((numel,), seed=6)
    assert len(encode(x, Encoding.FP32, 0)) / len(encode(x, Encoding.INT4, 128)) >= 7


@pytest.mark.parametrize(
    ("encoding", "block_size"), [(Encoding.INT8, 0), (Encoding.INT8, -4), (Encoding.INT4, 0), (Encoding.INT4, 5)]
)
def test_bad_block_size_is_a_value_error(encoding, block_size):
    with pytest.raises(ValueError, match="block_size"):
        encoded_nbytes(8, encoding, block_size)
    with pytest.raises(ValueError, match="block_size"):
        encode(torch.ones(8), encoding, block_size)


@pytest.mark.parametrize("encoding", ALL)
@pytest.mark.parametrize("delta", [-1, 1])
def test_decode_refuses_wrong_length(encoding, delta):
    data = encode(_random((10,)), encoding, 4)
    bad = data[:-1] if delta < 0 else data + b"\0"
    with pytest.raises(EncodingError, match="expected"):
        decode(bad, [10], encoding, 4)


def test_decode_refuses_negative_dimension():
    with pytest.raises(EncodingError, match="negative"):
        decode(b"", [-1, 0], Encoding.FP32, 0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_decode_refuses_non_finite_fp32_and_bf16_values(bad):
    assert isinstance(decode(struct.pack("<2f", 1.0, 2.0), [2], Encoding.FP32, 0), torch.Tensor)
    with pytest.raises(EncodingError, match="NaN or Inf"):
        decode(struct.pack("<2f", 1.0, bad), [2], Encoding.FP32, 0)
    bf16 = torch.tensor([1.0, bad]).to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    with pytest.raises(EncodingError, match="NaN or Inf"):
        decode(bf16, [2], Encoding.BF16, 0)


@pytest.mark.parametrize("encoding", QUANTISED)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_decode_refuses_non_finite_scales(encoding, bad):
    data = bytearray(encode(_random((8,)), encoding, 4))
    struct.pack_into("<f", data, 4, bad)
    with pytest.raises(EncodingError, match="scale"):
        decode(data, [8], encoding, 4)


@pytest.mark.parametrize("encoding", QUANTISED)
def test_decode_refuses_values_that_overflow_when_scaled(encoding):
    data = bytearray(encode(torch.tensor([1.0, -1.0, 1.0, -1.0]), encoding, 4))
    struct.pack_into("<f", data, 0, 3e38)
    with pytest.raises(EncodingError, match="NaN or Inf value"):
        decode(data, [4], encoding, 4)


@pytest.mark.parametrize("encoding", ALL)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_encode_refuses_non_finite_input(encoding, bad):
    x = _random((9,))
    x[5] = bad
    with pytest.raises(EncodingError, match="NaN or Inf"):
        encode(x, encoding, 4)


def test_encode_refuses_bf16_overflow():
    with pytest.raises(EncodingError, match="NaN or Inf"):
        encode(torch.tensor([3.4e38]), Encoding.BF16, 0)


def test_decode_accepts_every_buffer_type_without_warnings_or_aliasing():
    x = _random((33,), seed=7)
    for encoding in ALL:
        data = encode(x, encoding, 8)
        for buf in (data, bytearray(data), memoryview(data), memoryview(bytearray(b"xx" + data))[2:]):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                y = decode(buf, [33], encoding, 8)
            assert torch.equal(y, decode(data, [33], encoding, 8))
        mutable = bytearray(data)
        y = decode(mutable, [33], encoding, 8)
        before = y.clone()
        mutable[:] = bytes(len(mutable))
        assert torch.equal(y, before)


def test_encode_does_not_modify_its_input():
    x = _random((100,), seed=8)
    before = x.clone()
    for encoding in ALL:
        encode(x, encoding, 16)
    assert torch.equal(x, before)


def test_a_uint8_tensor_is_decoded_in_place_when_aligned_and_copied_when_not():
    values = torch.randn(33)
    encoded = torch.frombuffer(bytearray(b"\0" + encode(values, Encoding.FP32, 0)), dtype=torch.uint8)
    aligned = encoded[1:].clone()
    decoded = decode(aligned, (33,), Encoding.FP32, 0)
    assert torch.equal(decoded, values)
    assert decoded.untyped_storage().data_ptr() == aligned.untyped_storage().data_ptr(), "no copy"
    misaligned = decode(encoded[1:], (33,), Encoding.FP32, 0)
    assert torch.equal(misaligned, values)


@pytest.mark.parametrize("encoding", QUANTISED)
@pytest.mark.parametrize("block_size", [MAX_BLOCK_SIZE + 2, 2**28, 2**32])
def test_a_block_size_beyond_the_bound_is_refused_before_anything_is_allocated(encoding, block_size):
    """The byte length alone cannot tell a block of 2^28 values from one of 64 over a small tensor (both are
    one scale), so the block size has a bound of its own."""
    numel = 2048
    data = struct.pack("<f", 0.01) + b"\x11" * (numel if encoding is Encoding.INT8 else numel // 2)
    with pytest.raises(EncodingError, match="block_size"):
        encoded_nbytes(numel, encoding, block_size)
    with pytest.raises(EncodingError, match="block_size"):
        decode(data, [numel], encoding, block_size)


@pytest.mark.parametrize("encoding", QUANTISED)
@pytest.mark.parametrize("numel", [1, 3, 64, 65])
def test_decode_allocates_no_more_than_the_tensor_whatever_the_block_size(encoding, numel):
    """A block larger than the tensor (the job's block size over a small tensor) is padded by no decoder:
    the result owns exactly its own values."""
    x = _random((numel,), seed=8)
    y = decode(encode(x, encoding, MAX_BLOCK_SIZE), [numel], encoding, MAX_BLOCK_SIZE)
    assert y.untyped_storage().nbytes() == 4 * numel
    assert bool(((y - x).abs() <= error_bound(x, encoding, MAX_BLOCK_SIZE)).all())


def test_an_empty_shape_whose_other_dimensions_overflow_is_refused():
    """Zero elements, so zero bytes, but strides beyond 64 bits: refused as malformed, not a crash."""
    with pytest.raises(EncodingError, match="beyond what a tensor can index"):
        decode(b"", [0, 2**40, 2**40], Encoding.FP32, 0)


# Chunks: what a shard decodes blockwise into one accumulator, and encodes chunk by chunk.

EVERY = [*ALL, Encoding.SPARSE]


def _chunks(numel: int, step: int) -> list[tuple[int, int]]:
    return [(start, min(numel, start + step)) for start in range(0, numel, step)]


@settings(max_examples=60, deadline=None)
@given(
    encoding=st.sampled_from(EVERY),
    numel=st.integers(0, 300),
    block_size=st.sampled_from([2, 4, 6, 16]),
    chunk_blocks=st.integers(1, 5),
    weight=st.sampled_from([1.0, 0.25, 0.7]),
    seed=st.integers(0, 2**16),
)
def test_chunk_by_chunk_is_the_whole_tensor_at_once(encoding, numel, block_size, chunk_blocks, weight, seed):
    """`encode_into` chunk by chunk writes `encode`'s bytes; `accumulate` with `first` and weight 1 is `decode`
    bit for bit, and with a weight adds weight × decode within float32 rounding."""
    top_k = 1 if encoding is Encoding.SPARSE else 0
    x = _random((numel,), seed=seed)
    data = encode(x, encoding, block_size, top_k)
    step = alignment(encoding, block_size) * chunk_blocks
    chunked = torch.empty(len(data), dtype=torch.uint8)
    for start, stop in _chunks(numel, step):
        encode_into(x[start:stop], chunked, start, numel, encoding, block_size, top_k)
    assert chunked.numpy().tobytes() == data
    source = validated(data, [numel], encoding, block_size, top_k)
    whole = decode(data, [numel], encoding, block_size, top_k)
    assert torch.equal(decoded(source), whole)
    out, total = torch.full((numel,), math.nan), torch.full((numel,), 0.5)
    for start, stop in _chunks(numel, step):
        accumulate(out[start:stop], source, start, first=True)
        accumulate(total[start:stop], source, start, weight)
    assert torch.equal(out, whole), "first mode overwrites, NaN included"
    torch.testing.assert_close(total, 0.5 + weight * whole, rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("encoding", EVERY)
def test_magnitude_bounds_every_decoded_value(encoding):
    x = _random((1000,), seed=3, magnitude=5.0)
    source = validated(encode(x, encoding, 16, 4), [1000], encoding, 16, 4)
    assert source.nbytes == encoded_nbytes(1000, encoding, 16, 4)
    assert float(decode(source.data, [1000], encoding, 16, 4).abs().max()) <= source.magnitude
    assert source.magnitude <= 1.2 * float(x.abs().max()) * (2.0 if encoding is Encoding.SPARSE else 1.0)


@pytest.mark.parametrize("encoding", QUANTISED)
def test_a_scale_whose_largest_value_may_overflow_is_decoded_to_see_whether_any_does(encoding):
    """A scale near float32's largest is fine when no value reaches beyond it: the magnitude is then exact."""
    data = bytearray(encode(torch.tensor([0.0, 0.0, 0.0, 0.0]), encoding, 4))
    struct.pack_into("<f", data, 0, 3e38)
    source = validated(data, [4], encoding, 4)
    assert source.magnitude == 0.0
    assert torch.equal(decoded(source), torch.zeros(4))


def test_a_chunk_off_its_alignment_is_refused():
    source = validated(encode(torch.ones(16), Encoding.INT4, 4), [16], Encoding.INT4, 4)
    with pytest.raises(ValueError, match="no chunk"):
        accumulate(torch.zeros(4), source, 2)
    with pytest.raises(ValueError, match="no chunk"):
        accumulate(torch.zeros(8), source, 12)
    with pytest.raises(ValueError, match="multiple of 4"):
        encode_into(torch.ones(4), torch.empty(24, dtype=torch.uint8), 2, 16, Encoding.INT4, 4)
