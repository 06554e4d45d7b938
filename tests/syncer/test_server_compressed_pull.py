"""Compressed pulls from a real shard on loopback: after one full pull an island receives each newer version
as an int4 difference to what it holds, ends up with exactly the values the shard recorded for it, stays
within one quantisation step of the true values over many merges, and gets full values whenever the shard
cannot be sure what the island holds."""

from __future__ import annotations

import signal

import pytest
import torch
from syncer_harness import TOKEN, config_for, make_client, open_channel, random_values, wait_until

from diloco.core.compressed_pull import values_digest
from diloco.core.encoding import Encoding, encoded_nbytes, error_bound
from diloco.syncer import pulls as pulls_module
from diloco.transport.client import Held
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.v1 import syncer_pb2_grpc

pytestmark = pytest.mark.process

BLOCK = 32


def _held(pulled) -> Held:
    values = [t for _, t in pulled.tensors]
    return Held(pulled.version, values, values_digest(values))


def _merge_once(pusher, fragment: int, version: pb.FragmentVersion, seed: int) -> pb.FragmentVersion:
    """One merge of a random outer gradient (quorum 1); returns the new version."""
    pusher.push(
        fragment,
        base=version,
        tokens=100,
        inner_steps=10,
        sequence=seed,
        delta=random_values(seed, 0.05),
        encoding=Encoding.FP32,
        block_size=0,
    )
    want = version.version + 1
    return wait_until(lambda: (v := pusher.pull(fragment)[0]).version == want and v)


def _true_values(observer, fragment: int) -> list[torch.Tensor]:
    return [t for _, t in observer.pull(fragment)[1]]


@pytest.fixture
def shard(start_server):
    server = start_server(config_for(quorum=1, grace_seconds=0.0, block_size=BLOCK, max_staleness=1000))
    island = make_client(server.port, "island")
    pusher = make_client(server.port, "pusher")
    observer = make_client(server.port)
    yield server, island, pusher, observer
    for client in (island, pusher, observer):
        client.close()


def test_after_one_full_pull_each_version_comes_as_an_int4_difference_within_one_step(shard):
    server, island, pusher, observer = shard
    first = island.pull_delta(0, have=None, held=None, encoding=Encoding.INT4)
    assert not first.delta and first.wire_bytes == sum(4 * t.numel() for _, t in first.tensors)
    held, version = _held(first), first.version
    numel = sum(t.numel() for t in held.values)
    for step in range(12):
        version = _merge_once(pusher, 0, version, seed=step)
        pulled = island.pull_delta(0, have=held.version, held=held, encoding=Encoding.INT4)
        assert pulled.delta, f"version {version.version} came in full"
        assert pulled.version == version
        assert pulled.wire_bytes == sum(encoded_nbytes(t.numel(), Encoding.INT4, BLOCK) for t in held.values)
        assert pulled.wire_bytes < 4 * numel / 6
        truth = _true_values(observer, 0)
        got = [t for _, t in pulled.tensors]
        for g, t, h in zip(got, truth, held.values):
            bound = error_bound(t - h, Encoding.INT4, BLOCK) + t.abs() * 2.0**-23  # and the rounding of the sum
            assert torch.all((g - t).abs() <= bound), "more than one quantisation step off"
        held = _held(pulled)
    # The shard recorded exactly what the island holds: its record's checksum is the island's.
    ref = server.pulls.references.match("island", 0, held.version.incarnation, held.version.version, held.digest)
    assert ref is not None and all(torch.equal(a, b) for a, b in zip(ref.values, held.values))


def test_initial_values_equal_to_the_newest_come_back_as_a_difference_others_in_full(shard):
    """An island starting from the values the seeder seeded does not know their version; the shard compares
    them with its newest values and sends only a (zero) difference. Other initial values get full values."""
    _, island, pusher, observer = shard
    seeded = _true_values(observer, 0)
    same = island.pull_delta(0, have=None, held=Held(None, seeded, values_digest(seeded)), encoding=Encoding.INT4)
    assert same.delta and same.wire_bytes < sum(4 * t.numel() for t in seeded) / 6
    assert all(torch.equal(g, t) for (_, g), t in zip(same.tensors, seeded))
    other = [t + 1.0 for t in seeded]
    full = pusher.pull_delta(0, have=None, held=Held(None, other, values_digest(other)), encoding=Encoding.INT4)
    assert not full.delta and all(torch.equal(g, t) for (_, g), t in zip(full.tensors, seeded))
    # either way the shard now knows what each holds: the next version is a difference for both
    version = _merge_once(pusher, 0, same.version, seed=9)
    for client, pulled in ((island, same), (pusher, full)):
        again = client.pull_delta(0, have=pulled.version, held=_held(pulled), encoding=Encoding.INT4)
        assert again.delta and again.version == version


def test_an_island_that_is_current_gets_nothing(shard):
    _, island, _, _ = shard
    first = island.pull_delta(0, have=None, held=None, encoding=Encoding.INT4)
    held = _held(first)
    assert island.pull_delta(0, have=held.version, held=held, encoding=Encoding.INT4) is None


@pytest.mark.parametrize("lie", ["checksum", "version", "island"])
def test_values_the_shard_did_not_serve_this_island_get_full_values(shard, lie):
    server, island, pusher, observer = shard
    first = island.pull_delta(0, have=None, held=None, encoding=Encoding.INT4)
    held = _held(first)
    version = _merge_once(pusher, 0, first.version, seed=1)
    if lie == "checksum":
        held = Held(held.version, held.values, held.digest ^ 1)
    elif lie == "version":
        held = Held(version, held.values, held.digest)
        version = _merge_once(pusher, 0, version, seed=2)
    else:
        island = make_client(server.port, "stranger")
    pulled = island.pull_delta(0, have=held.version, held=held, encoding=Encoding.INT4)
    assert not pulled.delta and pulled.version == version
    assert all(torch.equal(g, t) for (_, g), t in zip(pulled.tensors, _true_values(observer, 0)))
    # and, from what it now holds, the next version is a difference again
    again = _merge_once(pusher, 0, version, seed=3)
    assert island.pull_delta(0, have=pulled.version, held=_held(pulled), encoding=Encoding.INT4).version == again
    if lie == "island":
        island.close()


def test_a_caller_that_did_not_ask_for_differences_never_gets_one(shard):
    server, _, _pusher, _ = shard
    channel = open_channel(server.port)
    stub = syncer_pb2_grpc.SyncerStub(channel)
    held = pb.HeldValues(version=pb.FragmentVersion(incarnation=server.state.incarnation, version=0), digest=0)
    request = pb.PullRequest(fragment_id=0, island_id="island", held=held)  # no delta encoding
    chunks = list(stub.Pull(request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30))
    assert not chunks[0].header.HasField("delta_base")
    channel.close()


def test_a_real_shard_process_serves_differences_and_full_values_after_a_restart(syncer_process):
    """`diloco-syncer` as a process: differences while it runs; after a SIGTERM restart it no longer knows
    what the island holds (references are not checkpointed), so the island's next pull is full and exact."""
    process = syncer_process(config_for(quorum=1, grace_seconds=0.0, block_size=BLOCK))
    with make_client(process.port, "seeder") as seeder:
        for p in (0, 1):
            seeder.seed(p, random_values(p))
    island = make_client(process.port, "island")
    pusher = make_client(process.port, "pusher")
    try:
        first = island.pull_delta(1, have=None, held=None, encoding=Encoding.INT4)
        version = _merge_once(pusher, 1, first.version, seed=5)
        pulled = island.pull_delta(1, have=first.version, held=_held(first), encoding=Encoding.INT4)
        assert pulled.delta and pulled.version == version
        held = _held(pulled)
        version = _merge_once(pusher, 1, version, seed=6)
        assert process.signal(signal.SIGTERM) == 0
        process.start()
        after = island.pull_delta(1, have=held.version, held=held, encoding=Encoding.INT4)
        assert not after.delta and after.version == version, "a clean restart keeps the incarnation and version"
        with make_client(process.port) as observer:
            assert all(torch.equal(g, t) for (_, g), t in zip(after.tensors, _true_values(observer, 1)))
    finally:
        island.close()
        pusher.close()


def test_islands_holding_the_same_values_get_one_difference_made_once(start_server, monkeypatch):
    """Islands that pulled the same version hold the same values: each next version is one pass over the
    fragment for all of them, and every island gets its bytes and ends up holding the same values."""
    made = []
    real = pulls_module.difference
    monkeypatch.setattr(pulls_module, "difference", lambda *args: made.append(1) or real(*args))
    server = start_server(config_for(quorum=1, grace_seconds=0.0, block_size=BLOCK, max_staleness=1000), threads=2)
    islands = [make_client(server.port, f"island-{i}") for i in range(4)]
    pusher = make_client(server.port, "pusher")
    try:
        held = [_held(island.pull_delta(0, have=None, held=None, encoding=Encoding.INT4)) for island in islands]
        version = held[0].version
        for step in range(3):
            version = _merge_once(pusher, 0, version, seed=step)
            pulled = [
                island.pull_delta(0, have=h.version, held=h, encoding=Encoding.INT4) for island, h in zip(islands, held)
            ]
            assert all(p.delta and p.version == version for p in pulled)
            held = [_held(p) for p in pulled]
            assert len({h.digest for h in held}) == 1, "every island holds the same values"
            assert len(made) == step + 1, "one difference per version, not one per island"
    finally:
        for client in (*islands, pusher):
            client.close()
