"""What a shard serves on Pull, beside the server that answers it: full replies encoded once per version and
encoding, the newest values' snapshot, and compressed differences (`diloco.core.compressed_pull`) made once
for every island that holds the same values (`replies`), with what each island then holds (`references`).

The server's lock guards the shard's state and these caches; `serve` takes it to read them and makes a
difference outside it, from a snapshot of the newest values, while merges step the fragment in place. Whether
an island needs a pull at all, and that it is live, is the server's to say.
Differences and full references are hashed on `threads` cores.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import cast

import torch

from diloco.core.compressed_pull import difference, values_digest
from diloco.core.config import TrainingConfig
from diloco.core.encoding import Encoding
from diloco.syncer.references import Reference, References
from diloco.syncer.replies import SharedReplies
from diloco.syncer.shard import ShardState, TensorSpec
from diloco.transport import wire
from diloco.transport.v1 import syncer_pb2 as pb


def fragment_version(incarnation: int, version: int) -> pb.FragmentVersion:
    """A fragment version as the wire names it: within a shard's incarnation."""
    return pb.FragmentVersion(incarnation=incarnation, version=version)


def _with_dtypes(payloads: Sequence[pb.TensorPayload], specs: Sequence[TensorSpec]) -> None:
    """Each payload names its tensor's dtype as the islands pushed it (a proto enum is its int at run time)."""
    for payload, spec in zip(payloads, specs):
        payload.dtype = cast(pb.DType, spec.dtype)


@dataclass(frozen=True)
class ServedPull:
    """A Pull reply as it goes out: serialized messages, the tensor bytes they carry, whether a difference."""

    messages: list[bytes]
    nbytes: int
    delta: bool


@dataclass(frozen=True)
class Snapshot:
    """A copy of a fragment's values at a version, never changed."""

    incarnation: int
    version: int
    values: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class _DeltaReply:
    """A difference as every island holding its base gets it, and what each then holds."""

    served: ServedPull
    reference: Reference


class Pulls:
    """The Pull replies of one shard and what it served each island."""

    def __init__(
        self,
        state: ShardState,
        config: TrainingConfig,
        lock: threading.Condition,
        *,
        chunk: int,
        threads: int,
        max_reference_bytes: int,
    ) -> None:
        self.state = state
        self.config = config
        self.chunk = chunk
        self.references = References(max_reference_bytes)
        self._lock = lock
        self._replies: dict[tuple[int, Encoding], tuple[int, list[bytes], int]] = {}
        self._snapshots: dict[int, Snapshot] = {}
        self._full_references: dict[int, Reference] = {}
        self._delta_replies: SharedReplies[_DeltaReply] = SharedReplies()
        self._hashing = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="syncer-hash")

    def close(self) -> None:
        self._hashing.shutdown()

    def serve(self, request: pb.PullRequest, encoding: Encoding, delta_encoding: Encoding | None) -> ServedPull:
        """The newest values of a seeded fragment for an island that holds older ones: a difference in
        `delta_encoding` when the island asked for one and the shard knows what it holds, else the full
        values in `encoding`."""
        index = request.fragment_id
        with self._lock:
            frag = self.state.seeded_fragment(index)
            if delta_encoding is not None and (held := self._held_reference(request)) is not None:
                newest, round_opened = self.snapshot(index), frag.round_opened
            else:
                _, messages, nbytes = self._full_reply(index, encoding)
                if delta_encoding is not None and request.island_id and encoding is Encoding.FP32:
                    self.references.record(request.island_id, index, self._full_reference(index))
                return ServedPull(messages, nbytes, delta=False)
        return self._delta_reply(request, held, newest, round_opened, delta_encoding)

    # The caller holds the lock unless said otherwise

    def snapshot(self, index: int) -> Snapshot:
        """The fragment's current float32 values, copied once per version: what differences are made from
        outside the lock while merges step the fragment in place, and what full pulls leave islands holding."""
        frag = self.state.seeded_fragment(index)
        snapshot = self._snapshots.get(index)
        if snapshot is None or (snapshot.incarnation, snapshot.version) != (self.state.incarnation, frag.version):
            snapshot = Snapshot(self.state.incarnation, frag.version, tuple(v.clone() for v in frag.values))
            self._snapshots[index] = snapshot
        return snapshot

    def _full_reply(self, index: int, encoding: Encoding) -> tuple[int, list[bytes], int]:
        """The serialized Pull reply for the fragment's current values in `encoding` (version, messages,
        tensor bytes), built once per version."""
        frag = self.state.seeded_fragment(index)
        cached = self._replies.get((index, encoding))
        if cached is None or cached[0] != frag.version:
            named = [(s.name, v) for s, v in zip(frag.specs, frag.values)]
            payloads, blobs = wire.tensor_payloads(named, encoding, self.config.block_size, self.config.top_k)
            _with_dtypes(payloads, frag.specs)
            version = fragment_version(self.state.incarnation, frag.version)
            messages = list(
                wire.fragment_messages(index, version, payloads, blobs, round_opened_seconds=frag.round_opened)
            )
            cached = (frag.version, messages, sum(len(b) for b in blobs))
            self._replies[(index, encoding)] = cached
        return cached

    def _full_reference(self, index: int) -> Reference:
        """The fragment's current values as a reference, with their digest, one per version shared by every
        island that pulls them in full (hashed only when one does: a difference needs no digest of them)."""
        snapshot = self.snapshot(index)
        ref = self._full_references.get(index)
        if ref is None or ref.values is not snapshot.values:
            digest = values_digest(snapshot.values, self._hashing.map)
            ref = Reference(snapshot.incarnation, snapshot.version, snapshot.values, digest)
            self._full_references[index] = ref
        return ref

    def _held_reference(self, request: pb.PullRequest) -> Reference | None:
        """What the island holds, when it says so and the shard knows exactly those values: what it last
        served the island, or (version unknown) the newest values themselves."""
        if not (request.HasField("held") and request.island_id):
            return None
        held = request.held
        if not held.HasField("version"):
            newest = self._full_reference(request.fragment_id)
            return newest if newest.digest == held.digest else None
        return self.references.match(
            request.island_id, request.fragment_id, held.version.incarnation, held.version.version, held.digest
        )

    def _delta_reply(
        self, request: pb.PullRequest, held: Reference, newest: Snapshot, round_opened: float, encoding: Encoding
    ) -> ServedPull:
        """The difference from `held` to `newest` in `encoding`, made once for every island that holds `held`
        (`SharedReplies`); records what the island will hold once it applies it. Called without the lock: it
        encodes, and takes the lock to record."""
        index = request.fragment_id
        named = request.held.HasField("version")  # the reply names its base only when the island did
        key = (encoding, held.incarnation, held.version, held.digest, named)

        def make() -> _DeltaReply:
            return self._make_delta_reply(index, held, newest, round_opened, encoding, request.held.version)

        reply = self._delta_replies.get(index, (newest.incarnation, newest.version), key, make)
        with self._lock:
            self.references.record(request.island_id, index, reply.reference)
        return reply.served

    def _make_delta_reply(
        self,
        index: int,
        held: Reference,
        newest: Snapshot,
        round_opened: float,
        encoding: Encoding,
        base: pb.FragmentVersion,
    ) -> _DeltaReply:
        """One pass over the fragment: the encoded difference, the values it gives and their digest."""
        frag = self.state.fragments[index]
        block_size, top_k = self.config.block_size, self.config.top_k
        made = difference(newest.values, held.values, encoding, block_size, top_k, self.chunk)
        named = [(spec.name, values) for spec, values in zip(frag.specs, newest.values)]
        payloads = wire.payloads_of(named, made.blobs, encoding, block_size, top_k)
        _with_dtypes(payloads, frag.specs)
        values = tuple(made.held)
        ref = Reference(newest.incarnation, newest.version, values, values_digest(values, self._hashing.map))
        messages = wire.fragment_messages(
            index,
            fragment_version(newest.incarnation, newest.version),
            payloads,
            made.blobs,
            delta_base=base,
            round_opened_seconds=round_opened,
        )
        return _DeltaReply(ServedPull(list(messages), sum(len(b) for b in made.blobs), delta=True), ref)
