"""The connections to a TLS server that made no call: those gRPC refused in the handshake, counted without
a handshake-failure hook, which gRPC's Python API does not have.

gRPC refuses a connection that fails the handshake (a client without the server's CA, one with a certificate
of another CA, one speaking plaintext) before any call exists, and tells Python neither the outcome nor its
reason. Two things Python can know exactly: each handshake begun (gRPC asks the certificate fetcher once per
connection, refused ones included: `tls.add_port`), and each connection that made a call (the call's
`ServicerContext.peer()`, named among the server's live sockets by gRPC's channelz, so that a new connection
from the address of a closed one counts again). Handshakes begun minus connections that made a call are the
connections refused in the handshake, with those still handshaking or that closed before a call.

Channelz is read in-process through grpcio's own bindings (grpcio-channelz serves the same functions over
gRPC); they are outside grpcio's typed API, so they are read here and nowhere else.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from diloco.transport.handlers import behavior_of, with_behavior

log = logging.getLogger("diloco.transport.connections")

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")

_PAGE = 100
_cygrpc: Any = importlib.import_module("grpc._cython.cygrpc")


def _pages(read: Callable[[int], str], key: str, id_key: str) -> Iterator[dict[str, Any]]:
    """The refs of one channelz listing, page by page (each page starts after the last id seen)."""
    start = 0
    while True:
        page = json.loads(read(start))
        refs: list[dict[str, Any]] = page.get(key, [])
        yield from refs
        if page.get("end", True) or not refs:
            return
        start = int(refs[-1][id_key]) + 1


def _server_ids() -> list[int]:
    servers = _pages(lambda start: _cygrpc.channelz_get_servers(start), "server", "serverId")
    return [int(server["ref"]["serverId"]) for server in servers]


def _sockets(server_id: int) -> dict[str, int]:
    """The server's live connections: socket id by peer address, as `ServicerContext.peer()` writes it."""
    refs = _pages(lambda start: _cygrpc.channelz_get_server_sockets(server_id, start, _PAGE), "socketRef", "socketId")
    return {ref["name"].removeprefix("chttp2 "): int(ref["socketId"]) for ref in refs}


def _local_port(socket_id: int) -> int:
    socket = json.loads(_cygrpc.channelz_get_socket(socket_id))["socket"]
    return int(socket["local"]["tcpipAddress"]["port"])


class ConnectionWatch(grpc.ServerInterceptor):
    """Tells `on_handshake` of each TLS handshake begun (pass `handshake_begun` to `tls.add_port`) and
    `on_first_call` of each connection's first call, so that a server can count the connections that made
    no call. Put it first among a server's interceptors: a call another one refuses still made a call."""

    def __init__(self, on_handshake: Callable[[], None], on_first_call: Callable[[], None]) -> None:
        self._on_handshake = on_handshake
        self._on_first_call = on_first_call
        self._lock = threading.Lock()
        self.port = 0
        """The server's port, told once it is bound: which of a process's servers is this one."""
        self._server_id: int | None = None
        self._live: dict[str, int] = {}
        self._called: set[int] = set()
        self._begun_lock = threading.Lock()
        self._begun = 0
        self._listed_after = -1  # the handshakes begun when `_live` was read

    def handshake_begun(self) -> None:
        """A new connection: the next call reads the server's live connections afresh. Told from gRPC's own
        threads mid-handshake, so it takes only a lock under which nothing calls into gRPC."""
        with self._begun_lock:
            self._begun += 1
        self._on_handshake()

    def _refresh(self, peer: str) -> None:
        """Reads the server's live connections; the first time, finds which server is this one: the one with
        a connection from `peer` (calling now, so live) on `port`."""
        if self._server_id is None:
            for server_id in _server_ids():
                socket_id = _sockets(server_id).get(peer)
                if socket_id is not None and _local_port(socket_id) == self.port:
                    self._server_id = server_id
                    break
            else:
                raise LookupError(f"no server on port {self.port} has a connection from {peer}")
        self._live = _sockets(self._server_id)
        self._called &= set(self._live.values())

    def _called_first(self, peer: str) -> bool:
        """Whether this call from `peer` is the first on its connection (False when the connection is gone
        before it could be named: it counts as one that made no call)."""
        with self._lock:
            begun = self._begun
            if begun != self._listed_after or peer not in self._live:
                self._refresh(peer)
                self._listed_after = begun
            connection = self._live.get(peer)
            if connection is None or connection in self._called:
                return False
            self._called.add(connection)
        return True

    def _noting(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(behavior)  # keeps what gRPC reads from the behavior (`experimental_thread_pool`)
        def noted(request_or_iterator: object, context: grpc.ServicerContext) -> Any:
            try:
                first = self._called_first(context.peer())
            except (LookupError, ValueError):  # counting must never cost a call; a wrong count shows in tests
                log.exception("cannot tell the connection of a call", extra={"peer": context.peer()})
                first = False
            if first:
                self._on_first_call()
            return behavior(request_or_iterator, context)

        return noted

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[_Request, _Response] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Request, _Response] | None:
        handler = continuation(handler_call_details)
        return None if handler is None else with_behavior(handler, self._noting(behavior_of(handler)))
