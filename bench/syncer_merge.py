"""A shard merging and serving fragments at the sizes users train: ours beside today's path and a plain copy.

For fragments of 16 M and 62 M parameters (500 M with --sizes), int4 and sparse pushes, 4 and 16 islands, on
the shard's own code without the gRPC streams (their cost is bench/syncer_throughput.py's), alternating in one
run:
- merge: N pushes checked as they arrive (`validated`, what the wire does), then one merge of them
  (`ShardState.submit` and `merge`): decoded, weighted, stepped into the fragment by the outer optimizer;
- pull: N islands that hold the previous version pull the new one as a compressed difference
  (`SyncerServer.pull` without the stream): the first pull snapshots the newest values and makes the
  difference, the others are sent its bytes. "first" is that one pull, "per pull" all N over N;
- copy: a plain copy (torch `copy_`, into a 256 MiB buffer piece by piece) of the bytes the work reads and
  writes, the memory bound. A merge: the N pushes, and the values and momentum read and written (4 int4
  pushes: 18.1 bytes a parameter). A pull's first: the newest values snapshotted (read, written), newest and
  held read, the difference and the values it gives written, those read again for their digest (int4: 24.5);
- before: today's path, the code as it was on main before this change, copied below (`Before*`, the one
  deliberate copy of product code in the project; unchanged parts, the outer step and the wire's framing, are
  imported): each push decoded to float32 as it arrives, their weighted mean, the step on clones of values
  and momentum, a finiteness check; each island's pull its own difference, encoded, decoded, added and
  hashed. It holds a float32 copy of every push and one difference per island, so it runs only where that
  fits in --max-gib (not at 500 M) and its pulls are timed on two islands (each island's is the same work).

Every figure is CPU seconds (all threads: core-seconds), the best of --repeats, with the load average beside
it. Then the shard's CPU per round (one merge of N islands and their N pulls) against fragment size (PNG), and a
12 B-parameter model at P = 24 (fragments of 500 M) at H = 24 steps of 1 s: how many 16-core shards merge and
serve a round in a quarter of it, assuming the work scales over a shard's cores as torch's threads (not
measured here).
Targets (issue 31): merge of 4 int4 pushes within 3x of its copy, a served pull within 2x of its copy.

Usage: python bench/syncer_merge.py [--sizes 16e6,62e6] [--islands 4,16] [--encodings int4,sparse]
       [--threads 1] [--repeats 2] [--max-gib 7] [--plot PNG] [--quick]
The default takes about 12 minutes on 2 busy cores; at 500 M (--sizes 500e6) a configuration takes about 3
and a peak of 9.5 GiB (--max-gib counts tensors only).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import figures

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as diloco-syncer runs (syncer/main.py), before torch allocates
import numpy as np
import torch

from diloco.core.compressed_pull import values_digest
from diloco.core.config import TrainingConfig
from diloco.core.encoding import Encoding, encode, encoded_nbytes, validated
from diloco.core.merge import CHUNK
from diloco.core.outer_optimizer import outer_momentum, outer_step
from diloco.syncer.server import SyncerServer
from diloco.syncer.shard import PushKey, ShardState, TensorSpec
from diloco.transport import wire
from diloco.transport.codes import wire_encoding
from diloco.transport.tls import PLAINTEXT
from diloco.transport.v1 import syncer_pb2 as pb

GIB = 1024**3
COPY_BUFFER = 256 * 1024**2
TENSOR = 16 * 1024**2  # elements of a fragment's tensors (a 4096 x 4096 matrix), the last one shorter
ROUND_STEPS, STEP_SECONDS, BUDGET = 24, 1.0, 0.25  # the projection: H = 24 one-second steps, a quarter of a round
MODEL, FRAGMENTS, SHARD_CORES = 12e9, 24, 16


def clock() -> float:
    """CPU seconds of this process, all its threads: what the work costs a shard's cores. On a machine shared
    with other work, wall time would add the time spent waiting for a core."""
    return time.process_time()


def load() -> float:
    return os.getloadavg()[0]


def best(times: list[float]) -> float:
    return min(times) if times else math.nan


def fragment_shapes(numel: int) -> list[tuple[int, ...]]:
    shapes = [(4096, TENSOR // 4096)] * (numel // TENSOR)
    return shapes + ([(numel % TENSOR,)] if numel % TENSOR else [])


def random_fragment(shapes: Sequence[tuple[int, ...]], seed: int, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).mul_(scale) for shape in shapes]


# The copy: the memory bound of moving the same bytes.


class Copier:
    """Copies buffers into one 256 MiB destination, piece by piece: every byte read from and written to memory
    once (the destination is larger than this machine's caches)."""

    def __init__(self) -> None:
        self.destination = torch.empty(COPY_BUFFER, dtype=torch.uint8)

    def copy(self, buffers: Sequence[torch.Tensor]) -> int:
        copied = 0
        for buffer in buffers:
            flat = buffer.reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), COPY_BUFFER):
                piece = flat[start : start + COPY_BUFFER]
                self.destination[: piece.numel()].copy_(piece)
                copied += piece.numel()
        return copied


# Before: today's path, as it was on main before this change (the deliberate copy; see the docstring).


def before_int4_values(packed: torch.Tensor) -> torch.Tensor:
    values = torch.empty(2 * packed.numel(), dtype=torch.int8)
    values[0::2] = (packed << 4).view(torch.int8) >> 4
    values[1::2] = packed.view(torch.int8) >> 4
    return values


def before_encode(tensor: torch.Tensor, encoding: Encoding, block_size: int, top_k: int) -> bytes:
    flat = tensor.detach().reshape(-1).to(torch.float32)
    if encoding is Encoding.SPARSE:
        return before_sparse_encode(flat, block_size, top_k)
    numel = flat.numel()
    nblocks = math.ceil(numel / block_size)
    pad = nblocks * block_size - numel
    blocks = (torch.nn.functional.pad(flat, (0, pad)) if pad else flat).view(nblocks, block_size)
    lo, hi = torch.aminmax(blocks, dim=1)
    scales = torch.maximum(hi, -lo) / 7
    if not (bool(torch.isfinite(scales.sum())) or bool(torch.isfinite(scales).all())):
        raise ValueError("cannot encode NaN or Inf values")
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
    q = torch.div(blocks, divisor).round_().clamp_(-7, 7).to(torch.int8).view(-1)
    nibbles = q.view(torch.uint8) & 0x0F
    values = (nibbles[0::2] | (nibbles[1::2] << 4))[: (numel + 1) // 2]
    return b"".join((scales.cpu().numpy().data, values.cpu().numpy().data))


def before_decode(raw: torch.Tensor, numel: int, encoding: Encoding, block_size: int, top_k: int) -> torch.Tensor:
    if encoding is Encoding.SPARSE:
        return before_sparse_decode(raw, numel, block_size, top_k)
    split = 4 * math.ceil(numel / block_size)
    scales = raw[:split].view(torch.float32)
    if not (bool(torch.isfinite(scales.sum())) or bool(torch.isfinite(scales).all())):
        raise ValueError("NaN or Inf scale")
    q = before_int4_values(raw[split:])[:numel]
    out = q.to(torch.float32)
    whole = numel // block_size
    head = whole * block_size
    out[:head].view(whole, block_size).mul_(scales[:whole].unsqueeze(1))
    out[head:].mul_(scales[whole:])
    if not (bool(torch.isfinite(out.sum())) or bool(torch.isfinite(out).all())):
        raise ValueError("NaN or Inf value")
    return out


def before_pack(values: np.ndarray, width: int) -> bytes:
    bits = (values[:, None] >> np.arange(width, dtype=values.dtype)) & 1
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little").tobytes()


def before_unpack(raw: np.ndarray, count: int, width: int) -> np.ndarray:
    bits = np.unpackbits(raw, bitorder="little", count=count * width).reshape(count, width).astype(np.int64)
    return bits @ (1 << np.arange(width, dtype=np.int64))


def before_sparse_encode(flat: torch.Tensor, block_size: int, top_k: int) -> bytes:
    numel = flat.numel()
    nblocks = math.ceil(numel / block_size)
    magnitude = torch.nn.functional.pad(flat.abs(), (0, nblocks * block_size - numel), value=-1.0)
    index = magnitude.view(nblocks, block_size).topk(top_k, dim=1, sorted=False).indices.sort(dim=1).values
    position = index + torch.arange(nblocks).unsqueeze(1) * block_size
    chosen = (position < numel).view(-1)
    values = torch.nn.functional.pad(flat, (0, nblocks * block_size - numel))[position]
    scales = values.abs().amax(dim=1) / 2
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
    levels = torch.floor(values / divisor).clamp_(-2, 1).add_(2).to(torch.uint8).view(-1)[chosen]
    kept_index = index.view(-1)[chosen].numpy()
    width = max(1, (block_size - 1).bit_length())
    return b"".join(
        (
            scales.numpy().astype("<f4").tobytes(),
            before_pack(levels.numpy(), 2),
            before_pack(kept_index.astype(np.int64), width),
        )
    )


def before_sparse_decode(raw: torch.Tensor, numel: int, block_size: int, top_k: int) -> torch.Tensor:
    nblocks = math.ceil(numel / block_size)
    whole, tail = divmod(numel, block_size)
    count = whole * top_k + min(top_k, tail)
    value_bytes = math.ceil(count * 2 / 8)
    split = 4 * nblocks
    array = raw.numpy()
    scales = torch.from_numpy(array[:split].view("<f4").astype(np.float32))
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError("bad scale")
    width = max(1, (block_size - 1).bit_length())
    levels = torch.from_numpy(before_unpack(array[split : split + value_bytes], count, 2))
    index = torch.from_numpy(before_unpack(array[split + value_bytes :], count, width))
    per_block = torch.full((whole + bool(tail),), top_k, dtype=torch.int64)
    if tail:
        per_block[-1] = min(top_k, tail)
    block = torch.arange(per_block.numel()).repeat_interleave(per_block)
    limit = torch.clamp(numel - block * block_size, max=block_size)
    same_block = block[1:] == block[:-1]
    if bool((index >= limit).any()) or bool((same_block & (index[1:] <= index[:-1])).any()):
        raise ValueError("bad index")
    out = torch.zeros(numel, dtype=torch.float32)
    out[block * block_size + index] = (levels.to(torch.float32) - 1.5) * scales[block]
    if not bool(torch.isfinite(out).all()):
        raise ValueError("NaN or Inf value")
    return out


def before_digest(values: Sequence[torch.Tensor]) -> int:
    digest = hashlib.blake2b(digest_size=8)
    for value in values:
        digest.update(value.detach().cpu().contiguous().reshape(-1).numpy().data)
    return int.from_bytes(digest.digest(), "little")


@dataclass
class BeforeShard:
    """Today's merge and pull of one fragment: float32 pushes, a merged gradient, a step on clones."""

    config: TrainingConfig
    values: list[torch.Tensor]
    momentum: list[torch.Tensor]
    round_progress: float = 0.0
    pending: list[list[torch.Tensor]] = field(default_factory=list)

    def push(self, blobs: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]]) -> None:
        c = self.config
        decoded = [
            before_decode(b, math.prod(s), c.encoding, c.block_size, c.top_k).view(s) for b, s in zip(blobs, shapes)
        ]
        self.pending.append([d.to(torch.float32) for d in decoded])

    def merge(self) -> None:
        weights = [1.0 / len(self.pending)] * len(self.pending)
        merged = []
        for j in range(len(self.pending[0])):
            out = torch.mul(self.pending[0][j], weights[0])
            for delta, weight in zip(self.pending[1:], weights[1:]):
                out.add_(delta[j], alpha=weight)
            merged.append(out)
        values = [v.clone() for v in self.values]
        momentum = [m.clone() for m in self.momentum]
        outer = self.config.outer
        self.round_progress = outer_step(
            values,
            momentum,
            merged,
            lr=outer.lr,
            momentum_coef=outer_momentum(self.config),
            nesterov=outer.nesterov,
            share=1.0,
            round_progress=self.round_progress,
        )
        self.pending = []
        if all(bool(torch.isfinite(t).all()) for t in [*values, *momentum]):
            self.values, self.momentum = values, momentum

    def pull(self, held: Sequence[torch.Tensor]) -> tuple[list[bytes], list[torch.Tensor], int]:
        """One island's compressed pull as the shard served it: its own difference, encoded, applied, hashed."""
        c = self.config
        differences = [torch.sub(v, h) for v, h in zip(self.values, held)]
        blobs = [before_encode(d, c.encoding, c.block_size, c.top_k) for d in differences]
        named = [(str(i), d) for i, d in enumerate(differences)]
        payloads = wire.payloads_of(named, blobs, c.encoding, c.block_size, c.top_k)
        after = [
            torch.add(
                h,
                before_decode(
                    torch.frombuffer(bytearray(b), dtype=torch.uint8), h.numel(), c.encoding, c.block_size, c.top_k
                ).view(h.shape),
            )
            for b, h in zip(blobs, held)
        ]
        digest = before_digest(after)
        list(wire.fragment_messages(0, pb.FragmentVersion(version=1), payloads, blobs))
        return blobs, after, digest


# Ours: the shard's own code.


@dataclass
class Figures:
    """Seconds (best of the repeats) and the bytes the copy baseline moved, for one configuration."""

    numel: int
    encoding: Encoding
    islands: int
    merge: list[float] = field(default_factory=list)
    merge_copy: list[float] = field(default_factory=list)
    merge_bytes: int = 0
    merge_before: list[float] = field(default_factory=list)
    pull_first: list[float] = field(default_factory=list)
    pull_all: list[float] = field(default_factory=list)
    pull_copy: list[float] = field(default_factory=list)
    pull_bytes: int = 0
    pull_before: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def round_seconds(self) -> float:
        """A round's shard CPU: one merge of the N islands and their N pulls."""
        return best(self.merge) + best(self.pull_all)

    @property
    def round_seconds_before(self) -> float:
        return best(self.merge_before) + self.islands * best(self.pull_before)


def config_for(encoding: Encoding) -> TrainingConfig:
    """One fragment, a quorum of one and staleness never refused: every push of the bench is merged."""
    return TrainingConfig(encoding=encoding, quorum=1, max_staleness=1000, fragments=1, inner_steps=24, overlap_steps=0)


def pushes_of(shapes: Sequence[tuple[int, ...]], islands: int, config: TrainingConfig) -> list[list[torch.Tensor]]:
    """Each island's encoded outer gradient (bytes as uint8 tensors, as the wire's reader hands them over): one
    delta encoded once, its bytes copied to each island's own buffers. A merge's work depends on the bytes'
    length and layout, not their values, and encoding a 500 M delta per island would take most of the run."""
    blobs = []
    for j, shape in enumerate(shapes):
        delta = random_fragment([shape], seed=1000 + j, scale=1e-3)[0]
        data = encode(delta, config.encoding, config.block_size, config.top_k)
        blobs.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        del delta
    return [[blob.clone() for blob in blobs] for _ in range(islands)]


def merge_ours(
    shard: ShardState,
    pushes: list[list[torch.Tensor]],
    shapes: Sequence[tuple[int, ...]],
    specs: list[TensorSpec],
    now: float,
) -> float:
    """One round's merge as the shard does it: each push checked as the wire hands it over, taken, merged."""
    c = shard.config
    frag = shard.fragments[0]
    started = clock()
    for island, blobs in enumerate(pushes):
        checked = [validated(b, s, c.encoding, c.block_size, c.top_k) for b, s in zip(blobs, shapes)]
        key = PushKey(f"island-{island}", shard.incarnation, frag.version, int(now))
        shard.submit(key, 0, specs, checked, 1000, c.inner_steps, now)
    shard.merge(0, now)
    return clock() - started


def pull_request(island: str, version: pb.FragmentVersion | None, digest: int, encoding: Encoding) -> pb.PullRequest:
    held = pb.HeldValues(digest=digest) if version is None else pb.HeldValues(version=version, digest=digest)
    return pb.PullRequest(fragment_id=0, island_id=island, held=held, delta_encoding=wire_encoding(encoding))


def pull_ours(server: SyncerServer, islands: int, held: tuple[pb.FragmentVersion | None, int]) -> tuple[float, float]:
    """All N islands' pulls of the newest version from `held`: (the first's seconds, all of them)."""
    encoding = server.config.encoding
    started = clock()
    first = math.nan
    for island in range(islands):
        served = server.pull(pull_request(f"island-{island}", *held, encoding), Encoding.FP32, encoding)
        assert served is not None and served.delta, "a compressed pull"
        if island == 0:
            first = clock() - started
    return first, clock() - started


def held_by_islands(server: SyncerServer) -> tuple[pb.FragmentVersion, int]:
    """What the islands hold after their last pull, as they name it: the shard's record of what it sent them
    (reading it spares the bench an island's decoding and hashing)."""
    ref = server.pulls.references._entries[("island-0", 0)]
    return pb.FragmentVersion(incarnation=ref.incarnation, version=ref.version), ref.digest


def measure(numel: int, encoding: Encoding, islands: int, args: argparse.Namespace, copier: Copier) -> Figures:
    """Merges first, then (their pushes and the momentum freed: a pull reads neither) pulls, so that neither
    holds the other's memory."""
    config = config_for(encoding)
    shapes = fragment_shapes(numel)
    specs = [TensorSpec(f"t{j}", shape, pb.FLOAT32) for j, shape in enumerate(shapes)]
    out = Figures(numel, encoding, islands)
    push_bytes = sum(encoded_nbytes(math.prod(s), encoding, config.block_size, config.top_k) for s in shapes)
    merge_gib = (8 * numel + islands * push_bytes) / GIB  # values, momentum, the pushes
    pull_gib = 12 * numel / GIB  # values (the snapshot), held values and the values a pull gives
    before_gib = (20 * numel + islands * (4 * numel + push_bytes)) / GIB  # and float32 pushes, their mean, clones
    if max(merge_gib, pull_gib) > args.max_gib:
        out.skipped.append(f"needs {max(merge_gib, pull_gib):.1f} GiB > --max-gib {args.max_gib:g}")
        return out
    run_before = before_gib <= args.max_gib
    if not run_before:
        out.skipped.append(f"before: needs {before_gib:.1f} GiB > --max-gib {args.max_gib:g}")
    server = SyncerServer(config, shard_index=0, num_shards=1, token="bench", security=PLAINTEXT, threads=args.threads)
    shard = server.state
    shard.seed(0, specs, random_fragment(shapes, seed=1, scale=0.02))
    for island in range(islands):
        shard.join(f"island-{island}", 0.0)
    frag = shard.fragments[0]
    frag.momentum = random_fragment(shapes, seed=2, scale=1e-3)  # a job under way: momentum of earlier rounds
    pushes = pushes_of(shapes, islands, config)
    out.merge_bytes = islands * push_bytes + 16 * numel  # pushes read; values and momentum read and written
    before = BeforeShard(config, [v.clone() for v in frag.values], [m.clone() for m in frag.momentum])
    for repeat in range(args.repeats):
        out.loads.append(load())
        gc.collect()
        touched = [*(b for p in pushes for b in p), *frag.values, *frag.values, *frag.momentum, *frag.momentum]
        started = clock()
        copier.copy(touched)
        out.merge_copy.append(clock() - started)
        del touched
        out.merge.append(merge_ours(shard, pushes, shapes, specs, float(repeat + 1)))
        if run_before:
            gc.collect()
            started = clock()
            for blobs in pushes:
                before.push(blobs, shapes)
            before.merge()
            out.merge_before.append(clock() - started)
    difference_blobs = pushes[0]  # as many bytes as a difference in this encoding
    del pushes, before
    frag.momentum = []
    gc.collect()
    # The islands start from the seeded values (the shard finds them by digest): their first difference is 0.
    held: tuple[pb.FragmentVersion | None, int] = (None, values_digest(frag.values))
    pull_ours(server, islands, held)
    for _ in range(args.repeats):
        out.loads.append(load())
        held = held_by_islands(server)
        for value in frag.values:  # a new version (any change: the pull's work does not depend on it)
            value.mul_(1 + 1e-4)
        frag.version += 1
        gc.collect()
        # snapshot (read, written), newest and held read, difference and result written, result read (digest)
        reference = server.pulls.references._entries[("island-0", 0)].values
        touched = [*frag.values, *frag.values, *frag.values, *reference, *difference_blobs, *frag.values, *frag.values]
        started = clock()
        out.pull_bytes = copier.copy(touched)
        out.pull_copy.append(clock() - started)
        del touched
        if run_before:
            before_pulls = BeforeShard(config, frag.values, [])
            timed = []
            for _ in range(min(2, islands)):  # each island's pull is the same work
                started = clock()
                before_pulls.pull(reference)
                timed.append(clock() - started)
            out.pull_before.append(sum(timed) / len(timed))
            del before_pulls
        del reference
        # The first pull snapshots the newest values (merges step them in place). Taken here on its own, by the
        # shard's code, so that the fragment can then be that snapshot: the bench holds no fourth copy.
        started = clock()
        snapshot = server.pulls.snapshot(0)
        snapshotted = clock() - started
        frag.values = list(snapshot.values)
        del snapshot
        first, total = pull_ours(server, islands, held)
        out.pull_first.append(snapshotted + first)
        out.pull_all.append(snapshotted + total)
    out.loads.append(load())
    del server, shard, frag, difference_blobs
    gc.collect()
    return out


# Reporting.


def ratio(a: float, b: float) -> str:
    return f"{a / b:6.2f}x" if b and math.isfinite(a) and math.isfinite(b) else "   n/a"


def seconds(value: float) -> str:
    return f"{value:8.3f}" if math.isfinite(value) else "     n/a"


def report(results: list[Figures], args: argparse.Namespace) -> None:
    print()
    print(f"torch threads {args.threads}, chunk {CHUNK * args.threads} elements; CPU seconds, best of {args.repeats}")
    header = (
        f"{'fragment':>9} {'enc':>6} {'N':>3} | {'merge':>8} {'copy':>8} {'before':>8} {'/copy':>7} {'before/ours':>11}"
        f" | {'pull 1st':>8} {'per pull':>8} {'copy':>8} {'before':>8} {'1st/copy':>8} {'per/copy':>8}"
        f" {'before/ours':>11} | load"
    )
    print(header)
    for f in results:
        name = f"{f.numel / 1e6:.0f} M"
        if not f.merge:
            print(f"{name:>9} {f.encoding.value:>6} {f.islands:>3} | skipped: {'; '.join(f.skipped)}")
            continue
        per_pull = best(f.pull_all) / f.islands
        print(
            f"{name:>9} {f.encoding.value:>6} {f.islands:>3} | {seconds(best(f.merge))} {seconds(best(f.merge_copy))}"
            f" {seconds(best(f.merge_before))} {ratio(best(f.merge), best(f.merge_copy)):>7}"
            f" {ratio(best(f.merge_before), best(f.merge)):>11}"
            f" | {seconds(best(f.pull_first))} {seconds(per_pull)} {seconds(best(f.pull_copy))}"
            f" {seconds(best(f.pull_before))} {ratio(best(f.pull_first), best(f.pull_copy)):>8}"
            f" {ratio(per_pull, best(f.pull_copy)):>8} {ratio(best(f.pull_before), per_pull):>11}"
            f" | {min(f.loads):.1f}-{max(f.loads):.1f}"
        )
        for note in f.skipped:
            print(f"{'':>21}({note})")
    print(
        "copy: a plain copy of the bytes the merge (the pushes; values and momentum read and written) or the first "
        "pull (snapshot, newest, held, difference, result, digest) touches"
    )


def plot(results: list[Figures], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    measured = [f for f in results if f.merge]
    for (encoding, islands), style in zip(sorted({(f.encoding.value, f.islands) for f in measured}), "os^vD*"):
        runs = sorted(
            (f for f in measured if (f.encoding.value, f.islands) == (encoding, islands)), key=lambda f: f.numel
        )
        sizes = [f.numel / 1e6 for f in runs]
        ax.plot(sizes, [f.round_seconds for f in runs], f"-{style}", label=f"ours {encoding} N={islands}")
        old = [(f.numel / 1e6, f.round_seconds_before) for f in runs if f.merge_before]
        if old:
            ax.plot(*zip(*old), f"--{style}", color="grey", label=f"before {encoding} N={islands}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("fragment size (M parameters)")
    ax.set_ylabel("shard CPU per round (core-s)")
    ax.set_title("One merge of N islands and their N pulls")
    ax.legend(fontsize=7)
    figures.save(fig, path)


def project(results: list[Figures], args: argparse.Namespace) -> None:
    """A 12 B model at P = 24: each fragment merges its islands and serves their pulls once a round."""
    round_seconds = ROUND_STEPS * STEP_SECONDS
    budget = BUDGET * round_seconds
    print()
    print(
        f"Projection: {MODEL / 1e9:.0f} B parameters, P = {FRAGMENTS} ({MODEL / FRAGMENTS / 1e6:.0f} M a fragment), "
        f"H = {ROUND_STEPS} steps of {STEP_SECONDS:g} s: a round of {round_seconds:g} s, merged and served within "
        f"{budget:g} s"
    )
    largest = max((f.numel for f in results if f.merge), default=0)
    for f in (f for f in results if f.merge and f.numel == largest):
        core_seconds = f.round_seconds * args.threads / f.numel  # per parameter and round
        fragment_seconds = core_seconds * MODEL / FRAGMENTS / SHARD_CORES
        per_shard = math.floor(budget / fragment_seconds)
        cores_per_billion = core_seconds * 1e9 / budget
        line = f"  {f.encoding.value} N={f.islands}: {core_seconds * 1e9:.1f} core-s per billion parameters a round, "
        line += (
            f"{cores_per_billion:.1f} shard cores per billion parameters; a fragment's round {fragment_seconds:.2f} s"
        )
        if per_shard:
            shards = math.ceil(FRAGMENTS / min(per_shard, FRAGMENTS))
            line += (
                f" on {SHARD_CORES} cores: {min(per_shard, FRAGMENTS)} fragments a shard, {shards} shard(s) of "
                f"{SHARD_CORES} cores ({shards * SHARD_CORES} cores)"
            )
        else:
            line += f" on {SHARD_CORES} cores is over {budget:g} s: more fragments (P) or shards of more cores"
        print(line)
    print(
        f"  (from the {largest / 1e6:.0f} M figures at {args.threads} thread(s), assuming the work scales over "
        f"{SHARD_CORES} cores as torch's threads do: not measured on this machine)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="16e6,62e6",
        help="fragment sizes in parameters, comma-separated (500e6: a peak of about 9.5 GiB)",
    )
    parser.add_argument("--islands", default="4,16")
    parser.add_argument("--encodings", default="int4,sparse")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a shard's cores)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-gib", type=float, default=7.0, help="skip what needs more tensor memory than this")
    parser.add_argument("--plot", type=Path, default=Path("out/bench/syncer_merge.png"))
    parser.add_argument("--quick", action="store_true", help="small fragments, a smoke test of the bench itself")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats = "1e6,4e6", 2
    torch.set_num_threads(args.threads)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    islands = [int(n) for n in args.islands.split(",")]
    encodings = [Encoding(e) for e in args.encodings.split(",")]
    print(f"load average {load():.1f} on {os.cpu_count()} cores; torch {torch.__version__}", flush=True)
    copier = Copier()
    results = []
    for numel in sizes:
        for encoding in encodings:
            for n in islands:
                print(f"[bench] {numel / 1e6:.0f} M parameters, {encoding.value}, {n} islands", flush=True)
                results.append(measure(numel, encoding, n, args, copier))
    report(results, args)
    project(results, args)
    plot(results, args.plot)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    print(f"plot: {args.plot}; peak memory {peak:.1f} GiB; load average now {load():.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
