"""How long a call may take: a base plus its bytes at the job's slowest transfer rate, so a push over a slow
link gets the time its bytes need instead of a fixed minute; and the deadlines the client sends follow it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch
from support import TEST_PKI

from diloco.core.config import TrainingConfig
from diloco.core.encoding import Encoding
from diloco.transport import tls
from diloco.transport.client import SyncerClient
from diloco.transport.deadlines import BASE_SECONDS, call_timeout, patience_options, quiet_seconds, transfer_seconds
from diloco.transport.v1 import syncer_pb2 as pb


def test_a_call_without_bytes_gets_the_base():
    assert call_timeout(0, 0.5) == BASE_SECONDS == 60.0


def test_a_call_gets_its_bytes_at_the_slowest_rate_beyond_the_base():
    assert transfer_seconds(1_000_000, 8.0) == 1.0
    assert call_timeout(1_000_000, 8.0, base=5.0) == 6.0


def test_the_push_that_never_merged_in_the_wan_bench_fits_its_deadline():
    """At a tenth of the 2 Gbit/s equivalent (0.004977 Mbit/s) a fragment's int4 push of 105 kB took 170 s,
    beyond the fixed 60 s; with the job's rate set at the link's, its deadline covers it."""
    push_bytes, link_mbps = 105_000, 0.004977
    assert transfer_seconds(push_bytes, link_mbps) > BASE_SECONDS
    assert call_timeout(push_bytes, link_mbps) > transfer_seconds(push_bytes, link_mbps)


def test_by_default_a_tenth_of_2_gbits_carries_a_12b_models_fragment_in_time():
    """A 12B model cut in 4 fragments pushes 1.5 GB in int4; a tenth of 2 Gbit/s is 200 Mbit/s, shared by the
    4 fragments' calls at once."""
    fragment_int4_bytes = 12e9 / 4 / 2
    needs = transfer_seconds(int(fragment_int4_bytes), 200.0 / 4)
    assert call_timeout(int(fragment_int4_bytes), TrainingConfig().min_transfer_mbps) > needs


def test_a_quiet_peer_is_given_a_whole_chunk_at_the_slowest_rate_and_never_less_than_the_base():
    """A 4 MiB chunk is handed over only once whole: at 0.5 Mbit/s it comes 67 s after the last."""
    assert quiet_seconds(0.5) == pytest.approx(67.1, abs=0.1)
    assert quiet_seconds(1000.0) == BASE_SECONDS


def test_grpc_waits_for_a_pings_answer_as_long_as_for_a_quiet_peer():
    """Over a saturated 0.02 Mbit/s link an island's ping answers queued behind its pushes for over a minute,
    and gRPC dropped the connection (GOAWAY ping_timeout) mid-push: a `diloco run` never merged."""
    patience = round(quiet_seconds(0.01) * 1000)
    assert patience > 3_000_000
    options = dict(patience_options(0.01))
    assert options == {"grpc.keepalive_timeout_ms": patience, "grpc.http2.ping_timeout_ms": patience}


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_a_rate_that_is_not_positive_is_refused(rate):
    with pytest.raises(ValueError, match="positive"):
        transfer_seconds(1, rate)


class Recorder:
    """A shard stand-in that answers PushDelta, Pull and Status and records the time each call had left."""

    def __init__(self) -> None:
        self.remaining: dict[str, float] = {}

    def push(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushReply:
        self.remaining["PushDelta"] = context.time_remaining()
        for _ in chunks:
            pass
        return pb.PushReply()

    def pull(self, _request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        self.remaining["Pull"] = context.time_remaining()
        return iter(())

    def status(self, _request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        self.remaining["Status"] = context.time_remaining()
        return pb.StatusReply(num_shards=1)  # a reply within the contract: the client checks it


@pytest.fixture
def recorder():
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handlers = {
        "PushDelta": grpc.stream_unary_rpc_method_handler(recorder.push, None, pb.PushReply.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(recorder.pull, pb.PullRequest.FromString, None),
        "Status": grpc.unary_unary_rpc_method_handler(
            recorder.status, pb.StatusRequest.FromString, pb.StatusReply.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("diloco.v1.Syncer", handlers),))
    port = tls.add_port(server, "127.0.0.1:0", TEST_PKI.server)
    server.start()
    yield recorder, port
    server.stop(0).wait()


def test_the_client_sends_each_call_the_deadline_of_its_bytes(recorder):
    """1 MB at 0.008 Mbit/s takes 1000 s: a push of it, and a pull expecting it, may take that beyond the base;
    Status, which moves no tensors, gets the base."""
    shard, port = recorder
    base, rate, floats = 10.0, 0.008, 250_000
    with SyncerClient(
        f"127.0.0.1:{port}", "token", security=TEST_PKI.client, island_id="a", timeout=base, min_transfer_mbps=rate
    ) as client:
        client.push(
            0,
            base=pb.FragmentVersion(),
            tokens=1,
            inner_steps=1,
            sequence=1,
            delta=[("w", torch.zeros(floats))],
            encoding=Encoding.FP32,
            block_size=0,
        )
        assert client.pull(0, expect_bytes=4 * floats) is None
        client.status()
    needs = call_timeout(4 * floats, rate, base)
    assert needs == pytest.approx(1010.0)
    # what the server reads is the deadline as gRPC carries it: less the time taken, rounded up to its units
    assert shard.remaining == {
        "PushDelta": pytest.approx(needs, abs=30.0),
        "Pull": pytest.approx(needs, abs=30.0),
        "Status": pytest.approx(base, abs=1.0),
    }
