"""Specification of how core's vocabulary travels: every encoding has one protobuf value and back, and a value
outside the contract is refused wherever a peer sends it."""

import pytest

from diloco.core.encoding import Encoding, EncodingError
from diloco.transport.codes import encoding_of, wire_encoding
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.wire import WireError, read_fragment_stream


def test_encoding_wire_values():
    assert [wire_encoding(e) for e in Encoding] == [pb.FP32, pb.BF16, pb.INT8, pb.INT4]
    assert [encoding_of(v) for v in (pb.FP32, pb.BF16, pb.INT8, pb.INT4)] == list(Encoding)


@pytest.mark.parametrize("value", [pb.ENCODING_UNSPECIFIED, 99])
def test_unknown_encoding_is_refused(value):
    with pytest.raises(EncodingError, match="unknown encoding"):
        encoding_of(value)
    payload = pb.TensorPayload(name="w", shape=[4], dtype=pb.FLOAT32, encoding=value, block_size=4, byte_length=16)
    with pytest.raises(WireError, match="unknown encoding"):
        read_fragment_stream([pb.FragmentChunk(header=pb.FragmentHeader(tensors=[payload])), memoryview(b"\0" * 16)])
