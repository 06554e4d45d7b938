"""Specification of how core's vocabulary travels: every encoding has one protobuf value and back, a value
outside the contract is refused wherever a peer sends it, and every kind of refusal has one status code."""

import grpc
import pytest

from diloco.core.encoding import Encoding, EncodingError
from diloco.core.refusal import Refusal
from diloco.transport.codes import encoding_of, refusal_of, status_code, wire_encoding
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.wire import WireError, read_fragment_stream


def test_encoding_wire_values():
    assert [wire_encoding(e) for e in Encoding] == [pb.FP32, pb.BF16, pb.INT8, pb.INT4, pb.SPARSE]
    assert [encoding_of(v) for v in (pb.FP32, pb.BF16, pb.INT8, pb.INT4, pb.SPARSE)] == list(Encoding)


@pytest.mark.parametrize("value", [pb.ENCODING_UNSPECIFIED, 99])
def test_unknown_encoding_is_refused(value):
    with pytest.raises(EncodingError, match="unknown encoding"):
        encoding_of(value)
    payload = pb.TensorPayload(name="w", shape=[4], dtype=pb.FLOAT32, encoding=value, block_size=4, byte_length=16)
    with pytest.raises(WireError, match=r"tensors\[0\]\.encoding: must be one of"):
        read_fragment_stream([pb.FragmentChunk(header=pb.FragmentHeader(tensors=[payload])), memoryview(b"\0" * 16)])


def test_each_refusal_travels_as_its_status_code_and_back():
    codes = [status_code(r) for r in Refusal]
    assert codes == [
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ]
    assert [refusal_of(c) for c in codes] == list(Refusal)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK])
def test_a_call_that_failed_otherwise_is_no_refusal(code):
    assert refusal_of(code) is None
