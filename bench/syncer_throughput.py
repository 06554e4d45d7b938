"""Merge-and-serve throughput of one syncer shard vs raw loopback sockets, measured side by side.

Ours: a real `diloco-syncer` process; N island processes each loop over the fragments, pushing an outer
gradient (real client, real encoding) and pulling the merged fragment back whenever it is newer. The
shard's own Prometheus counters give the tensor bytes it took in and served, over the measured window.
Baseline: the same number of processes streaming raw bytes over loopback TCP into one receiving process,
which is what the transport could carry on this machine at this moment.
Ceiling, for reference: the same island processes against a do-nothing Python gRPC server (same options,
same zero-copy deserializer) that drops every push and answers every pull with a prebuilt fragment: what
Python gRPC itself carries here, before the shard does any work.

Targets (issue: syncer): at least 1 GB/s per shard and a ratio of at least 0.3.
Usage: python bench/syncer_throughput.py [--islands 8] [--seconds 10] [--fragment-mib 16] [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import figures

if TYPE_CHECKING:
    from diloco.core.encoding import Encoding

TOKEN = "bench"
# Plaintext, asked for by name: the figures are the shard's own work beside a bare gRPC sink, both in the clear.
PLAINTEXT_ENV = {"DILOCO_INSECURE_PLAINTEXT": "1"}
T = TypeVar("T")
RAW_CHUNK = 4 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Baseline: raw loopback TCP, one receiving process, N sending processes.


def _raw_receiver(port: int, ready: mp.Event) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(64)
    ready.set()

    def drain(conn: socket.socket) -> None:
        view = memoryview(bytearray(RAW_CHUNK))
        while conn.recv_into(view):
            pass

    while True:
        conn, _ = server.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()


def _raw_sender(port: int, start: mp.Event, seconds: float, sent: mp.Queue) -> None:
    conn = socket.create_connection(("127.0.0.1", port))
    data = os.urandom(RAW_CHUNK)
    start.wait()
    deadline = time.monotonic() + seconds
    total = 0
    while time.monotonic() < deadline:
        conn.sendall(data)
        total += len(data)
    conn.close()
    sent.put(total)


def measure_raw(islands: int, seconds: float) -> float:
    """Bytes per second that `islands` processes push through loopback TCP into one process."""
    ctx = mp.get_context("spawn")
    port, ready, start, sent = free_port(), ctx.Event(), ctx.Event(), ctx.Queue()
    receiver = ctx.Process(target=_raw_receiver, args=(port, ready), daemon=True)
    receiver.start()
    ready.wait(30)
    senders = [ctx.Process(target=_raw_sender, args=(port, start, seconds, sent)) for _ in range(islands)]
    for s in senders:
        s.start()
    time.sleep(1.0)
    began = time.monotonic()
    start.set()
    total = sum(sent.get() for _ in senders)
    elapsed = time.monotonic() - began
    for s in senders:
        s.join()
    receiver.terminate()
    return total / elapsed


# Ours: a diloco-syncer process and N island processes.


def _island(
    index: int,
    target: str,
    fragments: int,
    numel: int,
    seconds: float,
    encoding: Encoding,
    block_size: int,
    seeded: mp.Event,
    ready: mp.Queue,
    start: mp.Event,
    done: mp.Queue,
) -> None:
    """A lean load generator: the delta is encoded and serialized once by the real wire code, each push
    re-sends it under a fresh sequence, and pulled bytes are counted, not decoded, so that on a shared
    machine the CPU goes to the shard, as it would with islands on their own hosts."""
    import grpc
    import torch

    from diloco.core.refusal import Refusal
    from diloco.transport import wire
    from diloco.transport.auth import bearer_metadata
    from diloco.transport.client import CHANNEL_OPTIONS, SyncerClient, _method
    from diloco.transport.codes import refusal_of
    from diloco.transport.tls import PLAINTEXT
    from diloco.transport.v1 import syncer_pb2 as pb

    island = f"island-{index}"
    client = SyncerClient(target, TOKEN, security=PLAINTEXT, island_id=island, retry_for=60)
    reply = client.join(fragments)
    if index == 0:
        for p in reply.unseeded_fragments:
            client.seed(p, [("w", torch.zeros(numel))])
        seeded.set()
    seeded.wait()
    bases = {p: client.pull(p)[0] for p in range(fragments)}
    delta = [("w", torch.randn(numel, generator=torch.Generator().manual_seed(index)) * 1e-3)]
    payloads, blobs = wire.tensor_payloads(delta, encoding, block_size)
    data = list(wire.push_messages(pb.PushHeader(), payloads, blobs))[1:]
    channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    push = channel.stream_unary(_method("PushDelta"), None, pb.PushReply.FromString)
    pull = channel.unary_stream(_method("Pull"), pb.PullRequest.SerializeToString, wire.parse_fragment_chunk)
    metadata = bearer_metadata(TOKEN)
    counts = {"pushes": 0, "refused": 0}
    ready.put(index)
    start.wait()
    deadline = time.monotonic() + seconds
    sequence = 0
    while time.monotonic() < deadline:
        for p in range(fragments):
            sequence += 1
            header = pb.PushHeader(
                island_id=island,
                fragment_id=p,
                base=bases[p],
                tokens=1000,
                inner_steps=10,
                sequence=sequence,
                tensors=payloads,
            )
            try:
                push(iter([pb.PushChunk(header=header).SerializeToString(), *data]), metadata=metadata)
                counts["pushes"] += 1
            except grpc.RpcError as error:
                if refusal_of(error.code()) is not Refusal.OUT_OF_STEP:
                    raise
                counts["refused"] += 1
            reply_parts = iter(pull(pb.PullRequest(fragment_id=p, have=bases[p], island_id=island), metadata=metadata))
            first = next(reply_parts, None)
            if first is not None:
                bases[p] = first.version
                for _ in reply_parts:
                    pass
    channel.close()
    client.close()
    done.put(counts)


def _sink_server(port: int, numel: int, ready: mp.Event, counters: mp.Array) -> None:
    """The do-nothing shard: the syncer's gRPC options, service names and deserializers, no state. Pushes are
    read and dropped; every pull gets the same prebuilt fragment (header + data) under a new version."""
    import itertools
    from concurrent import futures

    import grpc
    import torch

    from diloco.core.encoding import Encoding
    from diloco.syncer.server import HEADER_SLACK_BYTES, SERVICE_NAME
    from diloco.transport import wire
    from diloco.transport.v1 import syncer_pb2 as pb

    payloads, blobs = wire.tensor_payloads([("w", torch.zeros(numel))], Encoding.FP32, 0)
    data = list(wire.fragment_messages(0, pb.FragmentVersion(), payloads, blobs))[1:]
    versions = itertools.count(1)
    lock = threading.Lock()

    def count(index: int, nbytes: int) -> None:
        with lock:
            counters[index] += nbytes

    def join(request, context):
        return pb.JoinReply(
            shard_index=0,
            num_shards=1,
            owned_fragments=range(request.num_fragments),
            max_chunk_bytes=wire.MAX_CHUNK_BYTES,
        )

    def push(parts, context):
        count(0, sum(len(part.view) for part in parts if isinstance(part, wire.Data)))
        return pb.PushReply(current=pb.FragmentVersion(version=1))

    def pull(request, context):
        header = pb.FragmentHeader(
            fragment_id=request.fragment_id,
            tensors=payloads,
            version=pb.FragmentVersion(incarnation=1, version=next(versions)),
        )
        yield pb.FragmentChunk(header=header).SerializeToString()
        yield from data
        count(1, sum(len(b) for b in blobs))

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=32),
        options=[
            ("grpc.max_receive_message_length", wire.MAX_CHUNK_BYTES + HEADER_SLACK_BYTES),
            ("grpc.max_send_message_length", wire.MAX_CHUNK_BYTES + HEADER_SLACK_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE_NAME,
                {
                    "Join": grpc.unary_unary_rpc_method_handler(
                        join, pb.JoinRequest.FromString, pb.JoinReply.SerializeToString
                    ),
                    "PushDelta": grpc.stream_unary_rpc_method_handler(
                        push, wire.parse_push_chunk, pb.PushReply.SerializeToString
                    ),
                    "Pull": grpc.unary_stream_rpc_method_handler(pull, pb.PullRequest.FromString, None),
                },
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination()


def _drive_islands(
    target: str,
    islands: int,
    fragments: int,
    numel: int,
    seconds: float,
    encoding: Encoding,
    block_size: int,
    read: Callable[[], T],
    seeded: bool,
) -> tuple[T, T, float, list[dict]]:
    """Runs the island processes against `target` for `seconds` once all are connected; `read` gives the
    server's byte counters just before they start and just after they end. `seeded`: the server needs no
    seed from the first island."""
    ctx = mp.get_context("spawn")
    seeded_event, ready, start, done = ctx.Event(), ctx.Queue(), ctx.Event(), ctx.Queue()
    if seeded:
        seeded_event.set()
    procs = [
        ctx.Process(
            target=_island,
            args=(i, target, fragments, numel, seconds, encoding, block_size, seeded_event, ready, start, done),
        )
        for i in range(islands)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=120)
    before = read()
    began = time.monotonic()
    start.set()
    counts = [done.get(timeout=seconds + 120) for _ in procs]
    elapsed = time.monotonic() - began
    after = read()
    for proc in procs:
        proc.join()
    return before, after, elapsed, counts


def measure_sink(islands: int, seconds: float, fragments: int, numel: int, encoding_name: str) -> dict:
    """In and out bytes per second of the do-nothing server under the same island processes."""
    from diloco.core.config import TrainingConfig
    from diloco.core.encoding import Encoding

    encoding = Encoding(encoding_name)
    block_size = TrainingConfig().block_size
    ctx = mp.get_context("spawn")
    port = free_port()
    ready, counters = ctx.Event(), ctx.Array("d", 2)
    server = ctx.Process(target=_sink_server, args=(port, numel, ready, counters), daemon=True)
    server.start()
    if not ready.wait(300):
        raise RuntimeError("the do-nothing gRPC server did not start")
    before, after, elapsed, _ = _drive_islands(
        f"127.0.0.1:{port}",
        islands,
        fragments,
        numel,
        seconds,
        encoding,
        block_size,
        lambda: list(counters),
        seeded=True,
    )
    server.terminate()
    received, sent = after[0] - before[0], after[1] - before[1]
    return {"received_bps": received / elapsed, "sent_bps": sent / elapsed, "total_bps": (received + sent) / elapsed}


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = ("diloco_syncer_received_bytes_total", "diloco_syncer_sent_bytes_total")
    values = {name: 0.0 for name in (*wanted, "diloco_syncer_merges_total")}
    for line in text.splitlines():
        match = re.match(r"^(diloco_syncer_\w+?)(\{[^}]*\})?\s+([0-9.e+]+)$", line)
        if match and match.group(1) in values:
            values[match.group(1)] += float(match.group(3))
    return values


def measure_syncer(islands: int, seconds: float, fragments: int, numel: int, encoding_name: str) -> dict:
    from diloco.core.config import TrainingConfig
    from diloco.core.encoding import Encoding

    encoding = Encoding(encoding_name)
    config = TrainingConfig(
        fragments=fragments,
        inner_steps=100,
        overlap_steps=1,
        quorum=1,
        grace_seconds=0.5,
        max_staleness=16,
        encoding=encoding,
    )
    port, metrics_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "config.json"
        config_file.write_text(config.to_json())
        syncer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "diloco.syncer.main",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--config",
                str(config_file),
                "--log-level",
                "WARNING",
            ],
            env={**os.environ, **PLAINTEXT_ENV, "DILOCO_TOKEN": TOKEN},
        )
        try:
            before, after, elapsed, counts = _drive_islands(
                f"127.0.0.1:{port}",
                islands,
                fragments,
                numel,
                seconds,
                encoding,
                config.block_size,
                lambda: _scrape(metrics_port),
                seeded=False,
            )
        finally:
            syncer.terminate()
            syncer.wait(30)
    received = after["diloco_syncer_received_bytes_total"] - before["diloco_syncer_received_bytes_total"]
    sent = after["diloco_syncer_sent_bytes_total"] - before["diloco_syncer_sent_bytes_total"]
    return {
        "seconds": elapsed,
        "received_bps": received / elapsed,
        "sent_bps": sent / elapsed,
        "total_bps": (received + sent) / elapsed,
        "merges": after["diloco_syncer_merges_total"] - before["diloco_syncer_merges_total"],
        "pushes": sum(c["pushes"] for c in counts),
        "refused": sum(c["refused"] for c in counts),
    }


def plot(path: Path, raw: float, sink: dict, ours: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    bars = {
        "raw loopback TCP": raw,
        "do-nothing gRPC in+out": sink["total_bps"],
        "syncer in": ours["received_bps"],
        "syncer out": ours["sent_bps"],
        "syncer in+out": ours["total_bps"],
    }
    ax.barh(list(bars), [v / 1e9 for v in bars.values()], color=["grey", "silver", "tab:blue", "tab:blue", "tab:green"])
    ax.axvline(1.0, color="red", linestyle="--", label="target 1 GB/s")
    ax.set_xlabel("GB/s")
    ax.set_title("One syncer shard vs raw loopback, same run")
    ax.legend(loc="lower right")
    figures.save(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--islands", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--fragment-mib", type=float, default=16.0, help="fp32 size of one fragment")
    parser.add_argument("--encoding", default="fp32", choices=["fp32", "bf16", "int8", "int4"])
    parser.add_argument("--plot", type=Path, default=Path("out/bench/syncer_throughput.png"))
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    numel = int(args.fragment_mib * 1024 * 1024 / 4)

    load_before = os.getloadavg()[0]
    print(f"[bench] raw loopback: {args.islands} senders -> 1 receiver, {args.seconds:.0f} s", flush=True)
    raw = measure_raw(args.islands, args.seconds)
    print(f"[bench] do-nothing gRPC server: {args.islands} islands, same load, {args.seconds:.0f} s", flush=True)
    sink = measure_sink(args.islands, args.seconds, args.fragments, numel, args.encoding)
    print(
        f"[bench] syncer: {args.islands} islands, {args.fragments} fragments of {args.fragment_mib:g} MiB, "
        f"{args.encoding}, {args.seconds:.0f} s",
        flush=True,
    )
    ours = measure_syncer(args.islands, args.seconds, args.fragments, numel, args.encoding)
    ratio = ours["total_bps"] / raw
    print()
    print(f"{'measure':<34}{'value':>14}")
    print(f"{'raw loopback TCP (baseline)':<34}{raw / 1e9:>11.2f} GB/s")
    print(f"{'do-nothing gRPC server (in+out)':<34}{sink['total_bps'] / 1e9:>11.2f} GB/s")
    print(f"{'syncer received (pushes)':<34}{ours['received_bps'] / 1e9:>11.2f} GB/s")
    print(f"{'syncer sent (pulls)':<34}{ours['sent_bps'] / 1e9:>11.2f} GB/s")
    print(f"{'syncer merge-and-serve (in+out)':<34}{ours['total_bps'] / 1e9:>11.2f} GB/s")
    print(f"{'ratio ours / raw loopback':<34}{ratio:>14.2f}")
    print(f"{'ratio ours / do-nothing gRPC':<34}{ours['total_bps'] / sink['total_bps']:>14.2f}")
    print(f"{'ratio do-nothing gRPC / raw':<34}{sink['total_bps'] / raw:>14.2f}")
    print(f"{'merges / pushes / refused':<34}{int(ours['merges']):>6} / {ours['pushes']} / {ours['refused']}")
    load_after = os.getloadavg()[0]
    print(
        f"load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} cores"
        + (
            "  (other processes compete for the cores: the raw baseline suffers most, so read the ratios with"
            " care and compare with a quiet run)"
            if max(load_before, load_after) > (os.cpu_count() or 1)
            else ""
        )
    )
    print(
        f"targets: >= 1.00 GB/s ({'met' if ours['total_bps'] >= 1e9 else 'MISSED'}), "
        f"ratio >= 0.30 ({'met' if ratio >= 0.3 else 'MISSED'})"
    )
    if args.plot:
        plot(args.plot, raw, sink, ours)
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(
            json.dumps({"raw_bps": raw, "sink_bps": sink["total_bps"], "ratio": ratio, **ours}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
