"""The job's bearer token on every gRPC call, and the server-side check of it.

Health checks are exempt: kubelet's gRPC probes cannot send metadata, and health reveals nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import NoReturn, TypeVar

import grpc

from diloco.core.refusal import Refusal
from diloco.transport.codes import status_code
from diloco.transport.handlers import with_behavior

METADATA_KEY = "authorization"
EXEMPT_PREFIX = "/grpc.health.v1.Health/"

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that authenticates a client."""
    return ((METADATA_KEY, f"Bearer {token}"),)


def token_matches(metadata: tuple[tuple[str, str | bytes], ...] | None, token: str) -> bool:
    """Constant-time check of the bearer token in call metadata."""
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and value.startswith("Bearer "):
            return hmac.compare_digest(value[len("Bearer ") :].encode(), token.encode())
    return False


def _denying(handler: grpc.RpcMethodHandler[_Request, _Response]) -> grpc.RpcMethodHandler[_Request, _Response]:
    """A handler of the same shape as `handler` that refuses the call before reading anything."""

    def deny(_request_or_iterator: object, context: grpc.ServicerContext) -> NoReturn:
        context.abort(status_code(Refusal.UNAUTHENTICATED), "missing or wrong bearer token")

    return with_behavior(handler, deny)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call that does not carry the job's token with UNAUTHENTICATED."""

    def __init__(self, token: str, on_refused: Callable[[str], None] | None = None) -> None:
        """`on_refused(method)` is told of each refusal, so a server can count calls that never reach it."""
        if not token:
            raise ValueError("the job token must not be empty")
        self._token = token
        self._on_refused = on_refused

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[_Request, _Response] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Request, _Response] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIX):
            return handler
        if token_matches(handler_call_details.invocation_metadata, self._token):
            return handler
        if self._on_refused is not None:
            self._on_refused(handler_call_details.method)
        return _denying(handler)
