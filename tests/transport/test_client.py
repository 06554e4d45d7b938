"""The syncer client's retries: they ride out an unreachable shard, and end the moment their owner stops."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from support import TEST_PKI

from diloco.transport.client import Backoff, SyncerClient


def unused_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_set_stop_ends_a_retrying_call_with_its_last_error():
    stop = threading.Event()
    client = SyncerClient(
        f"127.0.0.1:{unused_loopback_port()}",
        "token",
        security=TEST_PKI.client,
        island_id="island-a",
        timeout=1.0,
        retry_for=300.0,
        backoff=Backoff(initial=1.0, maximum=5.0),
        stop=stop,
    )
    outcome: dict[str, object] = {}

    def call() -> None:
        try:
            client.status()
        except grpc.RpcError as error:
            outcome["code"] = error.code()
        outcome["at"] = time.monotonic()

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.5)
    assert caller.is_alive(), "the call should still be retrying the unreachable shard"
    stopped_at = time.monotonic()
    stop.set()
    caller.join(10.0)
    client.close()

    assert not caller.is_alive(), "the call kept retrying after stop was set"
    assert outcome["code"] == grpc.StatusCode.UNAVAILABLE
    assert outcome["at"] - stopped_at < 5.0


def test_without_stop_a_call_gives_up_only_after_retry_for():
    client = SyncerClient(
        f"127.0.0.1:{unused_loopback_port()}",
        "token",
        security=TEST_PKI.client,
        island_id="island-a",
        timeout=0.5,
        retry_for=1.0,
        backoff=Backoff(initial=0.05, maximum=0.2),
    )
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        client.status()
    client.close()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started >= 1.0
