"""The syncer client's retries: they ride out an unreachable shard, and end the moment their owner stops."""

from __future__ import annotations

import math
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch
from support import TEST_PKI

from diloco.core.encoding import Encoding
from diloco.transport import wire
from diloco.transport.client import Backoff, Held, SyncerClient
from diloco.transport.tls import PLAINTEXT
from diloco.transport.v1 import syncer_pb2 as pb


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


def broken_shard(methods: dict[str, grpc.RpcMethodHandler]) -> tuple[grpc.Server, SyncerClient]:
    """A server answering the Syncer `methods` as given, on loopback, and an island's client of it."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("diloco.v1.Syncer", methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = SyncerClient(f"127.0.0.1:{port}", "token", security=PLAINTEXT, island_id="island-a", timeout=5.0)
    return server, client


def test_a_reply_with_a_field_out_of_its_rule_is_refused_by_the_island_naming_the_field():
    """A broken shard answers a push with a cadence of Inf: the island's client refuses the reply (the pace
    computation behind it never sees the value) with a WireError naming the field."""

    def push(requests, _context) -> pb.PushReply:
        for _ in requests:  # the whole push is read, as a shard would
            pass
        return pb.PushReply(cadence_step_seconds=math.inf)

    server, client = broken_shard(
        {"PushDelta": grpc.stream_unary_rpc_method_handler(push, None, pb.PushReply.SerializeToString)}
    )
    try:
        with pytest.raises(wire.WireError) as refused:
            client.push(
                0,
                base=pb.FragmentVersion(),
                tokens=10,
                inner_steps=1,
                sequence=0,
                delta=[("w", torch.zeros(4))],
                encoding=Encoding.FP32,
                block_size=0,
            )
        assert refused.value.field == "cadence_step_seconds"
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        client.close()
        server.stop(None)


@pytest.mark.parametrize("reply", ["values", "difference"])
def test_pulled_values_that_are_not_finite_are_refused_and_the_island_keeps_its_own(reply):
    """A broken shard answers a pull with Inf among the values, or with a finite difference that takes the values
    the island holds beyond float32: the island's client refuses the reply (its round fails and it trains on with
    its own values) rather than mix in values it would train on as NaN."""
    version, base = pb.FragmentVersion(incarnation=1, version=2), pb.FragmentVersion(incarnation=1, version=1)
    held = Held(base, [torch.full((3,), 3e38)], 0)

    def pull(_request, _context):
        payloads, _ = wire.tensor_payloads([("w", torch.zeros(3))], Encoding.FP32, 0)
        if reply == "values":
            blobs = [torch.tensor([1.0, math.inf, 3.0]).numpy().tobytes()]  # as no encoder of ours writes them
            yield from wire.fragment_messages(0, version, payloads, blobs)
        else:
            blobs = [torch.full((3,), 3e38).numpy().tobytes()]
            yield from wire.fragment_messages(0, version, payloads, blobs, delta_base=base)

    server, client = broken_shard({"Pull": grpc.unary_stream_rpc_method_handler(pull, pb.PullRequest.FromString, None)})
    try:
        with pytest.raises(wire.WireError, match="NaN or Inf|beyond float32") as refused:
            client.pull_delta(0, have=base, held=held, encoding=Encoding.FP32, expect_bytes=12)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        client.close()
        server.stop(None)
