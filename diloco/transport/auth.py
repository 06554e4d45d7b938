"""The job's bearer token on every gRPC call, and the server-side check of it.

A server accepts a set of tokens (`AcceptedTokens`), usually one: while a job's token is rotated it accepts
the old and the new, so that no client is refused whichever it holds, and drops the old once none holds it.
Health checks are exempt: kubelet's gRPC probes cannot send metadata, and health reveals nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn, TypeVar

import grpc

from diloco.core.refusal import Refusal
from diloco.transport.codes import status_code
from diloco.transport.handlers import with_behavior

METADATA_KEY = "authorization"
EXEMPT_PREFIX = "/grpc.health.v1.Health/"

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


def token_fingerprint(token: str) -> str:
    """Names a token without revealing it (a truncated digest of 256 random-looking bits): what a shard says it
    accepts (Status), and what a pod template says it holds."""
    return hashlib.sha256(b"diloco token fingerprint\0" + token.encode()).hexdigest()[:16]


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that authenticates a client."""
    return ((METADATA_KEY, f"Bearer {token}"),)


def token_matches(metadata: tuple[tuple[str, str | bytes], ...] | None, tokens: str | Iterable[str]) -> bool:
    """Constant-time check of the bearer token in call metadata against each of `tokens` (or the one)."""
    accepted = (tokens,) if isinstance(tokens, str) else tuple(tokens)
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and value.startswith("Bearer "):
            presented = value[len("Bearer ") :].encode()
            # Every token compared, so the time taken says nothing of which one (if any) matched.
            return sum(hmac.compare_digest(presented, token.encode()) for token in accepted) > 0
    return False


class AcceptedTokens:
    """The bearer tokens a server accepts: fixed, or those in a file (one per line, as a mounted Secret holds
    them), read again whenever the file changes (looked at most once per `recheck` seconds), so that a Secret
    updated in place adds a rotated job's new token beside the old one, and later drops the old, without a
    restart. A file that cannot be read, or that holds no token, leaves the last tokens in force."""

    def __init__(
        self,
        tokens: Iterable[str] = (),
        path: Path | None = None,
        recheck: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.recheck = recheck
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._checked = clock()
        self._tokens = tuple(dict.fromkeys(t for t in tokens if t))
        if path is not None:
            self._reload(path)
        if not self._tokens:
            raise ValueError("the job token must not be empty")

    @classmethod
    def of(cls, tokens: str | AcceptedTokens) -> AcceptedTokens:
        """`tokens` as accepted tokens: a single token accepted alone."""
        return tokens if isinstance(tokens, AcceptedTokens) else cls((tokens,))

    def _reload(self, path: Path) -> None:
        try:
            stat = os.stat(path)  # follows the symlink a Secret volume swaps to publish new contents
            seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if seen == self._seen:
                return
            tokens = tuple(dict.fromkeys(line.strip() for line in path.read_text().splitlines() if line.strip()))
        except OSError:
            return
        self._seen = seen
        if tokens:
            self._tokens = tokens

    def current(self) -> tuple[str, ...]:
        """The tokens accepted now, in the file's order."""
        if self.path is not None:
            with self._lock:
                now = self._clock()
                if now - self._checked >= self.recheck:
                    self._checked = now
                    self._reload(self.path)
        return self._tokens


def _denying(handler: grpc.RpcMethodHandler[_Request, _Response]) -> grpc.RpcMethodHandler[_Request, _Response]:
    """A handler of the same shape as `handler` that refuses the call before reading anything."""

    def deny(_request_or_iterator: object, context: grpc.ServicerContext) -> NoReturn:
        context.abort(status_code(Refusal.UNAUTHENTICATED), "missing or wrong bearer token")

    return with_behavior(handler, deny)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call that does not carry one of the accepted tokens with UNAUTHENTICATED."""

    def __init__(self, tokens: str | AcceptedTokens, on_refused: Callable[[str], None] | None = None) -> None:
        """`tokens`: the job's token, or those accepted (`AcceptedTokens`); `on_refused(method)` is told of each
        refusal, so a server can count calls that never reach it."""
        if not tokens:
            raise ValueError("the job token must not be empty")
        self._tokens = AcceptedTokens.of(tokens)
        self._on_refused = on_refused

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[_Request, _Response] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Request, _Response] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIX):
            return handler
        if token_matches(handler_call_details.invocation_metadata, self._tokens.current()):
            return handler
        if self._on_refused is not None:
            self._on_refused(handler_call_details.method)
        return _denying(handler)
