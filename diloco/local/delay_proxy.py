"""The round trip of a shaped link: a TCP relay that holds every chunk for half the round trip in each
direction before passing it on, in order (`wan.DelayLine`), between islands and a syncer. The kernel's netem
would do this, where it exists; this kernel has tbf but not netem. It runs on an event loop in a thread of
its own, serving listening sockets it is given (made in the hub namespace by `netns.IslandNetwork.listen`)
and connecting to its upstream from the host, where the syncers listen on loopback.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from types import TracebackType

from diloco.local.wan import DelayLine

log = logging.getLogger("diloco.local.delay_proxy")

CHUNK_BYTES = 64 * 1024


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """One direction: reads as data comes (so the delay never throttles the rate) and writes each chunk when
    it is due; the far side's end of stream is passed on once everything before it has been."""
    loop = asyncio.get_running_loop()
    line = DelayLine(delay)
    arrived = asyncio.Event()
    ended = False

    async def read() -> None:
        nonlocal ended
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                line.put(chunk, loop.time())
                arrived.set()
        finally:
            ended = True
            arrived.set()

    reading = asyncio.create_task(read())
    try:
        while True:
            wait = line.wait(loop.time())
            if wait is None:
                if ended:
                    break
                arrived.clear()
                await arrived.wait()
                continue
            if wait > 0:
                await asyncio.sleep(wait)
            for chunk in line.due(loop.time()):
                writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    finally:
        reading.cancel()


class DelayProxy:
    """Relays each connection to a listening socket to `upstream` (host, port), `delay` seconds each way."""

    def __init__(self, listeners: dict[socket.socket, tuple[str, int]], delay: float) -> None:
        self.listeners = listeners
        self.delay = delay
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._servers: list[asyncio.Server] = []

    async def _relay(self, upstream: tuple[str, int], down_reader: asyncio.StreamReader, down_writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream)
        except OSError as error:
            log.info("upstream unreachable", extra={"upstream": upstream, "error": str(error)})
            down_writer.close()
            return
        try:
            await asyncio.gather(_pump(down_reader, up_writer, self.delay), _pump(up_reader, down_writer, self.delay))
        except OSError:
            pass  # either side went away (a killed worker or syncer): drop both, as a router would
        except asyncio.CancelledError:
            pass  # the proxy is stopping: end quietly (asyncio logs a connection handler that ends cancelled)
        finally:
            for writer in (up_writer, down_writer):
                writer.close()

    async def _serve(self) -> None:
        for sock, upstream in self.listeners.items():
            server = await asyncio.start_server(lambda r, w, upstream=upstream: self._relay(upstream, r, w), sock=sock)
            self._servers.append(server)

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
