"""Core's vocabulary in the wire contract's terms, stated once: each `Encoding` as its `diloco.v1.Encoding`
protobuf value. Whatever sends or reads an encoding on the wire goes through here, so core stays free of the
generated code and the two sides cannot disagree."""

from __future__ import annotations

from diloco.core.encoding import Encoding, EncodingError
from diloco.transport.v1 import syncer_pb2 as pb

_WIRE_ENCODINGS: dict[Encoding, pb.Encoding.ValueType] = {
    Encoding.FP32: pb.FP32,
    Encoding.BF16: pb.BF16,
    Encoding.INT8: pb.INT8,
    Encoding.INT4: pb.INT4,
}
_ENCODINGS: dict[int, Encoding] = {value: encoding for encoding, value in _WIRE_ENCODINGS.items()}


def wire_encoding(encoding: Encoding) -> pb.Encoding.ValueType:
    """The `diloco.v1.Encoding` value that names `encoding` on the wire."""
    return _WIRE_ENCODINGS[encoding]


def encoding_of(value: int) -> Encoding:
    """The encoding a peer named on the wire; EncodingError for ENCODING_UNSPECIFIED or a value not in the
    contract."""
    try:
        return _ENCODINGS[value]
    except KeyError:
        raise EncodingError(f"unknown encoding {value}") from None
