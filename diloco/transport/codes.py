"""Core's vocabulary in the wire contract's terms, stated once: each `Encoding` as its `diloco.v1.Encoding`
protobuf value, each `Refusal` as the gRPC status code a refused call ends with. Whatever sends or reads
them on the wire goes through here, so core stays free of gRPC and the generated code, and the server, the
client and the island cannot disagree."""

from __future__ import annotations

import grpc

from diloco.core.config import Encoding, EncodingError
from diloco.core.refusal import Refusal
from diloco.transport.v1 import syncer_pb2 as pb

_WIRE_ENCODINGS: dict[Encoding, pb.Encoding] = {
    Encoding.FP32: pb.FP32,
    Encoding.BF16: pb.BF16,
    Encoding.INT8: pb.INT8,
    Encoding.INT4: pb.INT4,
    Encoding.SPARSE: pb.SPARSE,
}
_ENCODINGS: dict[int, Encoding] = {value: encoding for encoding, value in _WIRE_ENCODINGS.items()}


def wire_encoding(encoding: Encoding) -> pb.Encoding:
    """The `diloco.v1.Encoding` value that names `encoding` on the wire."""
    return _WIRE_ENCODINGS[encoding]


def encoding_of(value: int) -> Encoding:
    """The encoding a peer named on the wire; EncodingError for ENCODING_UNSPECIFIED or a value not in the
    contract."""
    try:
        return _ENCODINGS[value]
    except KeyError:
        raise EncodingError(f"unknown encoding {value}") from None


_STATUS_CODES: dict[Refusal, grpc.StatusCode] = {
    Refusal.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.OUT_OF_STEP: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
_REFUSALS = {code: refusal for refusal, code in _STATUS_CODES.items()}


def status_code(refusal: Refusal) -> grpc.StatusCode:
    """The status code a call refused for `refusal` ends with."""
    return _STATUS_CODES[refusal]


def refusal_of(code: grpc.StatusCode) -> Refusal | None:
    """The refusal a failed call's status code stands for; None when the call failed otherwise (the shard
    unreachable, a deadline passed), which is the client's retries' business."""
    return _REFUSALS.get(code)
