"""A misbehaving island for `diloco run --hostile-islands N`: a process that holds the job's token and CA and
talks to the shards over TLS as an island does, for the whole run, and does everything an island must not.

Every round, for every fragment, it pulls the newest values (as an island would, so its pushes name a real
base and the tensors the fragment holds) and pushes:
- a delta of huge finite values (|x| = 1e38, near the float32 limit) with a valid header claiming the most
  tokens a push may: taken, and left out of every merge as an outlier against its peers (`diloco.core.robust`);
- with `sybil_pushes`, the same under an island id it has never used before (one per round), joined first:
  several huge deltas in one merge outvote the outlier bound's median, which holds only while honest islands are most
  of what a fragment merges, so this is off unless asked for;
- deltas whose seconds per inner step are Inf, 1e-300, negative or NaN, whose inner steps are 2^64 - 1,
  and whose values are Inf: refused at the wire (`diloco.transport.fields`, `diloco.transport.wire`).
Between rounds it joins `ids_per_round` fresh island ids (thousands over a run) and keeps pulling. It counts
what each call came back with and writes the counts as JSON when it is stopped (SIGTERM), for the run (and a
test) to check that its pushes were refused or left out and nothing else went wrong for the shards.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import torch

from diloco.core.config import TrainingConfig
from diloco.core.encoding import Encoding
from diloco.core.merge import MAX_TOKENS_PER_INNER_STEP
from diloco.transport import tls, wire
from diloco.transport.auth import bearer_metadata
from diloco.transport.client import CHANNEL_OPTIONS, SyncerClient
from diloco.transport.v1 import syncer_pb2 as pb

HUGE = 1e38
"""A finite float32 near its limit (3.4e38): a diverged or hostile island's delta."""
BAD_STEP_SECONDS = (math.inf, 1e-300, -1.0, math.nan)
ABSURD_INNER_STEPS = 2**64 - 1
CALL_TIMEOUT = 20.0


def _method(name: str) -> str:
    return f"/{pb.DESCRIPTOR.services_by_name['Syncer'].full_name}/{name}"


class HostileIsland:
    """One misbehaving island against the shards at `targets` (fragment p lives on shard p mod n)."""

    def __init__(
        self,
        targets: Sequence[str],
        token: str,
        security: tls.Security,
        config: TrainingConfig,
        name: str,
        *,
        ids_per_round: int = 200,
        round_seconds: float = 1.0,
        sybil_pushes: bool = False,
        stop: threading.Event | None = None,
    ) -> None:
        self.config = config
        self.name = name
        self.ids_per_round = ids_per_round
        self.round_seconds = round_seconds
        self.stop = stop or threading.Event()
        self.metadata = bearer_metadata(token)
        self.counts: Counter[str] = Counter()  # "<call> <outcome>": OK, or the status code's name
        self.sybil_pushes = sybil_pushes
        self.ids_used = 0
        self.rounds = 0
        self.sequence = 0
        self.readers = [
            SyncerClient(t, token, security=security, island_id=name, timeout=CALL_TIMEOUT, retry_for=0.0)
            for t in targets
        ]
        self.channels = [tls.channel(t, security, CHANNEL_OPTIONS) for t in targets]
        self.join_calls: list[Callable[..., pb.JoinReply]] = [
            c.unary_unary(_method("Join"), pb.JoinRequest.SerializeToString, pb.JoinReply.FromString)
            for c in self.channels
        ]
        self.push_calls: list[Callable[..., pb.PushReply]] = [
            c.stream_unary(_method("PushDelta"), None, pb.PushReply.FromString) for c in self.channels
        ]

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        for channel in self.channels:
            channel.close()

    def _call(self, what: str, call: Callable[[], object]) -> object | None:
        try:
            reply = call()
        except grpc.RpcError as error:
            self.counts[f"{what} {error.code().name}"] += 1
            return None
        except (wire.WireError, ValueError) as error:  # a reply the client refused to read
            self.counts[f"{what} {type(error).__name__}"] += 1
            return None
        self.counts[f"{what} OK"] += 1
        return reply

    def _new_id(self) -> str:
        self.ids_used += 1
        return f"{self.name}-x{self.ids_used}"

    def join(self, shard: int, island: str) -> None:
        request = pb.JoinRequest(island_id=island, num_fragments=self.config.fragments)
        self._call("join", lambda: self.join_calls[shard](request, timeout=CALL_TIMEOUT, metadata=self.metadata))

    def push(
        self,
        what: str,
        shard: int,
        island: str,
        fragment: int,
        base: pb.FragmentVersion,
        delta: Sequence[tuple[str, torch.Tensor]],
        *,
        inner_steps: int,
        step_seconds: float,
    ) -> None:
        self.sequence += 1  # each push a new one: a repeated sequence is answered as the duplicate it is
        payloads, _ = wire.tensor_payloads([(n, torch.zeros_like(t)) for n, t in delta], Encoding.FP32, 0)
        # The bytes are the values' own, as a hostile client writes them: the encoder would refuse Inf.
        blobs = [t.to(torch.float32).contiguous().numpy().tobytes() for _, t in delta]
        header = pb.PushHeader(
            island_id=island,
            fragment_id=fragment,
            base=base,
            tokens=min(inner_steps * MAX_TOKENS_PER_INNER_STEP, 2**64 - 1),  # the most a push may claim
            inner_steps=inner_steps,
            sequence=self.sequence,
            step_seconds=step_seconds,
        )
        self._call(
            what,
            lambda: self.push_calls[shard](
                wire.push_messages(header, payloads, blobs), timeout=CALL_TIMEOUT, metadata=self.metadata
            ),
        )

    def one_round(self) -> None:
        shards = len(self.readers)
        h = self.config.inner_steps
        for shard in range(shards):
            self.join(shard, self.name)
        for fragment in range(self.config.fragments):
            if self.stop.is_set():
                return
            shard = fragment % shards
            pulled = self._call("pull", lambda r=self.readers[shard], f=fragment: r.pull(f))
            if not isinstance(pulled, tuple):  # not seeded yet, or refused
                continue
            base, values = pulled
            huge = [(n, torch.full_like(v, HUGE)) for n, v in values]
            self.push("push huge", shard, self.name, fragment, base, huge, inner_steps=h, step_seconds=0.5)
            if self.sybil_pushes:
                sybil = self._new_id()
                self.join(shard, sybil)
                self.push("push huge new id", shard, sybil, fragment, base, huge, inner_steps=h, step_seconds=0.5)
            bad = BAD_STEP_SECONDS[self.rounds % len(BAD_STEP_SECONDS)]
            what = f"push step_seconds={bad!r}"
            self.push(what, shard, self.name, fragment, base, huge, inner_steps=h, step_seconds=bad)
            self.push(
                "push inner_steps=2^64-1",
                shard,
                self.name,
                fragment,
                base,
                huge,
                inner_steps=ABSURD_INNER_STEPS,
                step_seconds=0.5,
            )
            inf = [(n, torch.full_like(v, math.inf)) for n, v in values]
            self.push("push Inf values", shard, self.name, fragment, base, inf, inner_steps=h, step_seconds=0.5)
        for _ in range(self.ids_per_round):
            if self.stop.is_set():
                return
            island = self._new_id()
            self.join(self.ids_used % shards, island)
        self.rounds += 1

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            self.one_round()
            self.stop.wait(max(0.0, self.round_seconds - (time.monotonic() - started)))

    def report(self) -> dict[str, object]:
        return {"name": self.name, "rounds": self.rounds, "ids_used": self.ids_used, "calls": dict(self.counts)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--syncers", required=True, help="comma-separated host:port of every shard, in order")
    p.add_argument("--token-file", required=True)
    p.add_argument("--tls-ca-file", required=True)
    p.add_argument("--config", required=True, help="the job's configuration file")
    p.add_argument("--name", required=True, help="the island id it pushes under")
    p.add_argument("--report", type=Path, required=True, help="where the counts go when it is stopped")
    p.add_argument("--ids-per-round", type=int, default=200)
    p.add_argument("--round-seconds", type=float, default=1.0)
    p.add_argument(
        "--sybil-pushes",
        action="store_true",
        help="also push the huge delta under a new island id each round: a client with the token can outvote the "
        "outlier bound's median this way (README, hardening)",
    )
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    security = tls.load(
        tls.Role.CLIENT, ca_file=args.tls_ca_file, cert_file=None, key_file=None, mutual=False, insecure_plaintext=False
    )
    token = Path(args.token_file).read_text().split()[0]
    island = HostileIsland(
        args.syncers.split(","),
        token,
        security,
        TrainingConfig.from_json(Path(args.config).read_text()),
        args.name,
        ids_per_round=args.ids_per_round,
        round_seconds=args.round_seconds,
        sybil_pushes=args.sybil_pushes,
        stop=stop,
    )
    try:
        island.run()
    finally:
        args.report.write_text(json.dumps(island.report(), indent=1))
        island.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
