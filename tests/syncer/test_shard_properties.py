"""Properties of the shard's rules under arbitrary sequences of calls (hypothesis state machine): joins,
leaves, seeds, pushes, pulls and merges, with valid and invalid arguments, in any order and at any time.
After every step: a refused call changed nothing, values and momentum are finite, pending memory is one
fragment per island that pushed and within the shard's byte bound, and the Status reply and the checkpoint's
state dict build. On failure hypothesis prints the steps and the `@reproduce_failure` blob;
`pytest --hypothesis-seed=N` replays a seed."""

import threading
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from diloco.core.config import TrainingConfig
from diloco.syncer.server import SyncerServer
from diloco.syncer.shard import PushKey, Refused, ShardState, TensorSpec
from diloco.transport.auth import AcceptedTokens
from diloco.transport.v1 import syncer_pb2 as pb

pytestmark = pytest.mark.fuzz

INCARNATION = 7
SPECS = (TensorSpec("w", (2,), pb.FLOAT32), TensorSpec("b", (1,), pb.FLOAT32))
OTHER_SPECS = {
    "wrong shape": (TensorSpec("w", (3,), pb.FLOAT32), TensorSpec("b", (1,), pb.FLOAT32)),
    "wrong name": (TensorSpec("x", (2,), pb.FLOAT32), TensorSpec("b", (1,), pb.FLOAT32)),
    "wrong dtype": (TensorSpec("w", (2,), pb.BFLOAT16), TensorSpec("b", (1,), pb.FLOAT32)),
    "too few": SPECS[:1],
}
STATUS_LIMIT = 4 * 1024 * 1024  # a Status reply must fit the message limit of every client
PENDING_BOUND = 3 * 3 * 4  # three pending deltas of SPECS' three float32 values: fewer than the islands could push

# Mostly valid arguments, so that sequences reach merges; the rest are what a hostile island may send.
islands = st.one_of(st.sampled_from("abc"), st.sampled_from("abcd"), st.sampled_from(["", "not an id!", "x" * 300]))
fragments = st.one_of(st.integers(0, 1), st.integers(0, 1), st.integers(-1, 3))  # owned: 0..2 of 3; 2 unseeded
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)  # what the wire lets through: any finite value
small = st.floats(-10, 10, width=32)
counts = st.one_of(st.integers(1, 1000), st.integers(1, 1000), st.integers(0, 2**64 - 1))  # uint64 on the wire


def _bytes(tensors: list[torch.Tensor]) -> tuple[bytes, ...]:
    return tuple(t.numpy().tobytes() for t in tensors)


def fingerprint(shard: ShardState) -> tuple:
    """Everything a call could change, comparable by value."""
    fragments = tuple(
        (
            f.index,
            f.specs,
            f.version,
            _bytes(f.values),
            _bytes(f.momentum),
            tuple(sorted((i, p.key, p.tokens, p.inner_steps, _bytes(p.delta)) for i, p in f.pending.items())),
            f.quorum_since,
            tuple(sorted(f.merged_keys, key=repr)),
            f.last_merge_unix,
            f.last_contributors,
            f.max_staleness_seen,
            f.tokens_merged,
        )
        for f in shard.fragments.values()
    )
    return (tuple(sorted(shard.islands.items())), tuple(sorted(shard.left)), shard.rejected_pushes, fragments)


class ShardCalls(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        config = TrainingConfig(
            fragments=3,
            inner_steps=10,
            overlap_steps=1,
            quorum=2,
            grace_seconds=5.0,
            max_staleness=2,
            island_timeout_seconds=100.0,
        )
        self.shard = ShardState(
            config, shard_index=0, num_shards=1, incarnation=INCARNATION, max_pending_bytes=PENDING_BOUND
        )
        self.now = 0.0
        self.pushed: set[str] = set()

    @initialize()
    def seeded_and_joined(self):
        for fragment in (0, 1):
            assert self.shard.seed(fragment, SPECS, [torch.zeros(2), torch.zeros(1)])
        for island in "ab":
            self.shard.join(island, self.now)

    def attempt(self, call) -> bool:
        """Makes the call; a refusal must leave the shard exactly as it was. True when the call was taken."""
        before = fingerprint(self.shard)
        try:
            call()
        except Refused:
            assert fingerprint(self.shard) == before, "a refused call changed the shard"
            return False
        return True

    @rule(seconds=st.floats(0, 200))
    def time_passes(self, seconds):
        self.now += seconds

    @rule(island=islands)
    def join(self, island):
        self.attempt(lambda: self.shard.join(island, self.now))

    @rule(island=islands)
    def leave(self, island):
        self.attempt(lambda: self.shard.leave(island))

    @rule(fragment=fragments, values=st.lists(finite, min_size=3, max_size=3), specs=st.booleans())
    def seed(self, fragment, values, specs):
        tensors = [torch.tensor(values[:2]), torch.tensor(values[2:])]
        self.attempt(lambda: self.shard.seed(fragment, SPECS if specs else (), tensors))

    @rule(
        island=islands,
        fragment=fragments,
        behind=st.integers(-1, 4),
        other_incarnation=st.booleans(),
        sequence=st.integers(0, 3),
        tokens=counts,
        inner_steps=counts,
        delta=st.lists(st.one_of(small, finite), min_size=3, max_size=3),
        specs=st.sampled_from([None, None, None, *OTHER_SPECS]),
    )
    def push(self, island, fragment, behind, other_incarnation, sequence, tokens, inner_steps, delta, specs):
        frag = self.shard.fragments.get(fragment)
        base = max(0, (frag.version if frag else 0) - behind)
        key = PushKey(island, INCARNATION + other_incarnation, base, sequence)
        tensors = [torch.tensor(delta[:2]), torch.tensor(delta[2:])]
        shape = SPECS if specs is None else OTHER_SPECS[specs]
        taken = self.attempt(lambda: self.shard.submit(key, fragment, shape, tensors, tokens, inner_steps, self.now))
        if taken:
            self.pushed.add(island)
        event(f"push {'taken' if taken else 'refused'}")

    @rule(island=islands, fragment=fragments)
    def pull(self, island, fragment):
        def call():
            if island:
                self.shard.check_island(island)
            self.shard.seeded_fragment(fragment)
            self.shard.touch(island, self.now)

        self.attempt(call)

    @rule()
    def merge_what_is_due(self):
        for index in self.shard.poll(self.now):
            event(f"merge {self.shard.merge(index, self.now).dropped or 'applied'}")

    @rule(fragment=fragments)
    def merge_at_once(self, fragment):
        """A merge of whatever is pending, as after a grace window: its result may overflow float32."""
        frag = self.shard.fragments.get(fragment)
        if frag is not None and frag.pending:
            event(f"merge {self.shard.merge(fragment, self.now).dropped or 'applied'}")

    @invariant()
    def values_stay_finite(self):
        for frag in self.shard.fragments.values():
            for tensor in (*frag.values, *frag.momentum):
                assert bool(torch.isfinite(tensor).all()), f"fragment {frag.index} holds a non-finite value"

    @invariant()
    def pending_memory_is_one_fragment_per_island_that_pushed(self):
        for frag in self.shard.fragments.values():
            assert set(frag.pending) <= self.pushed
            for pending in frag.pending.values():
                assert [tuple(d.shape) for d in pending.delta] == [s.shape for s in frag.specs]
            assert sum(d.numel() * 4 for p in frag.pending.values() for d in p.delta) <= len(self.pushed) * frag.nbytes
        held = sum(d.numel() * 4 for f in self.shard.fragments.values() for p in f.pending.values() for d in p.delta)
        assert held <= PENDING_BOUND

    @invariant()
    def status_and_checkpoint_build(self):
        server = SimpleNamespace(
            _cond=threading.Condition(), state=self.shard, clock=lambda: self.now, tokens=AcceptedTokens.of("t")
        )
        reply = SyncerServer.status(server)  # the Status RPC's own code, on this state
        assert len(reply.SerializeToString()) < STATUS_LIMIT
        assert self.shard.to_state_dict(clean=False)["incarnation"] == INCARNATION


ShardCalls.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_shard_calls = ShardCalls.TestCase
