"""A gRPC method handler with its behavior replaced: the same shape (unary or streaming each way) and the
same (de)serializers, which is what an interceptor or a generic handler returns to refuse a call, or to
look at it before it runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")

_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def behavior_of(handler: grpc.RpcMethodHandler[Any, Any]) -> Callable[..., Any]:
    """The function that serves the handler's calls, whatever its shape."""
    behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    assert behavior is not None  # a handler has exactly one
    return behavior


def with_behavior(
    handler: grpc.RpcMethodHandler[_Request, _Response], behavior: Callable[..., Any]
) -> grpc.RpcMethodHandler[_Request, _Response]:
    """`handler` with `behavior(request_or_iterator, context)` serving its calls instead."""
    make = _KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(
        behavior, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
