"""What one island's push can do to a merge, against a real shard: tokens no inner steps could produce are
refused, counters stay within their wire fields so Status always answers (also after a restart from a
checkpoint, and from one written before tokens were bounded), and a merge that would make the fragment
non-finite is refused with the fragment as it was, while the islands go on."""

from __future__ import annotations

import signal

import grpc
import pytest
import torch
from syncer_harness import ReferenceFragment, config_for, fragment_values, make_client, random_values, wait_until

from diloco.core.encoding import Encoding
from diloco.syncer import checkpoint
from diloco.transport.client import SyncerClient
from diloco.transport.fields import MAX_INNER_STEPS, MAX_TOKENS
from diloco.transport.v1 import syncer_pb2 as pb

pytestmark = pytest.mark.process

U64 = 2**64 - 1
RETRY_SECONDS = 5.0  # a Status the shard cannot answer fails the test instead of being retried for minutes


def push(client: SyncerClient, base: pb.FragmentVersion, delta, *, tokens: int, inner_steps: int, sequence: int):
    return client.push(
        0,
        base=base,
        tokens=tokens,
        inner_steps=inner_steps,
        sequence=sequence,
        delta=delta,
        encoding=Encoding.FP32,
        block_size=0,
    )


def fragment_state(observer: SyncerClient) -> tuple:
    """Fragment 0 as Status reports it, and the values a pull serves."""
    status = observer.status()
    f = next(f for f in status.fragments if f.fragment_id == 0)
    version, values = observer.pull(0)
    return (f.version.version, f.pending, f.last_contributors, f.tokens_merged), (version.version, values)


def test_tokens_no_inner_steps_could_produce_are_refused_and_change_nothing(start_server):
    server = start_server(config_for(quorum=2, grace_seconds=30.0))
    with make_client(server.port, "a") as island, make_client(server.port, retry_for=RETRY_SECONDS) as observer:
        island.join(2)
        base = observer.pull(0)[0]
        before = fragment_state(observer)
        for tokens, inner_steps in ((10 * 2**32 + 1, 10), (1, 0)):
            with pytest.raises(grpc.RpcError) as refused:
                push(island, base, fragment_values(0.1), tokens=tokens, inner_steps=inner_steps, sequence=1)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"{tokens} tokens in {inner_steps} inner steps" in refused.value.details()
        after = fragment_state(observer)
        assert after[0] == before[0] and after[1][0] == before[1][0]
        assert all(torch.equal(got, want) for (_, got), (_, want) in zip(after[1][1], before[1][1]))
        assert observer.status().rejected_pushes == 2


def test_status_answers_after_the_largest_claims_before_and_after_a_restart(syncer_process):
    process = syncer_process(config_for(quorum=2, grace_seconds=30.0))
    with make_client(process.port) as seeder:
        seeder.seed(0, fragment_values())
        seeder.seed(1, fragment_values())
    islands = {name: make_client(process.port, name) for name in "ab"}
    with make_client(process.port, retry_for=RETRY_SECONDS) as observer:
        for client in islands.values():
            client.join(2)
        base = observer.pull(0)[0]
        for client in islands.values():  # as many tokens as a push may claim, in as many inner steps
            push(client, base, fragment_values(0.1), tokens=MAX_TOKENS, inner_steps=MAX_INNER_STEPS, sequence=1)
        wait_until(lambda: observer.pull(0)[0].version == 1)
        merged = fragment_state(observer)[0]
        assert merged[2:] == (2, 2 * MAX_TOKENS), "one merge of the two largest claims"
    for client in islands.values():
        client.close()
    assert process.signal(signal.SIGTERM) == 0
    process.start()
    with make_client(process.port, retry_for=RETRY_SECONDS) as observer:
        assert fragment_state(observer)[0] == merged


def test_status_answers_for_a_checkpoint_written_before_tokens_were_bounded(syncer_process):
    process = syncer_process(config_for())
    with make_client(process.port) as seeder:
        seeder.seed(0, fragment_values())
        seeder.seed(1, fragment_values())
    assert process.signal(signal.SIGTERM) == 0
    path = checkpoint.checkpoint_path(process.checkpoint_dir, 0, 1)
    saved = checkpoint.load(path)
    saved["fragments"][0]["tokens_merged"] = 2**70  # what accepting two pushes of 2^69 tokens used to leave
    saved["fragments"][1]["max_staleness_seen"] = 2**40
    checkpoint.save(path, saved)
    process.start()
    with make_client(process.port, retry_for=RETRY_SECONDS) as observer:
        fragments = {f.fragment_id: f for f in observer.status().fragments}
    assert fragments[0].tokens_merged == U64
    assert fragments[1].max_staleness_seen == 2**32 - 1


def test_a_merge_that_would_not_be_finite_is_refused_and_the_islands_go_on(start_server):
    config = config_for(quorum=2, grace_seconds=30.0)
    server = start_server(config)
    islands = {name: make_client(server.port, name) for name in "ab"}
    with make_client(server.port, retry_for=RETRY_SECONDS) as observer:
        for client in islands.values():
            client.join(2)
        base = observer.pull(0)[0]
        before = fragment_state(observer)
        for name, client in islands.items():  # finite deltas whose outer step overflows float32
            reply = push(client, base, fragment_values(3e38), tokens=100, inner_steps=10, sequence=1)
            assert not reply.duplicate, f"{name}'s push is taken: the merge is refused later, not the push"
        wait_until(lambda: observer.status().rejected_pushes == 2)
        after = fragment_state(observer)
        assert after[0] == before[0], "version, pending, contributors and tokens as they were"
        assert after[1][0] == before[1][0]
        for (_, got), (_, want) in zip(after[1][1], before[1][1]):
            assert torch.equal(got, want) and torch.isfinite(got).all()
        dropped = server.metrics.registry.get_sample_value(
            "diloco_syncer_rejected_pushes_total", {"reason": "non_finite"}
        )
        assert dropped == 2
        reference = ReferenceFragment(config, fragment_values())
        deltas = {"a": (fragment_values(0.1), 100), "b": (fragment_values(-0.3), 300)}
        for name, client in islands.items():  # the islands push again from the base they hold
            delta, tokens = deltas[name]
            assert not push(client, base, delta, tokens=tokens, inner_steps=20, sequence=2).duplicate
        wait_until(lambda: observer.pull(0)[0].version == 1)
        reference.merge(list(deltas.values()))
        reference.assert_matches(observer.pull(0)[1])
        assert observer.pull(0, have=base)[0].version == 1, "a later pull succeeds"
    for client in islands.values():
        client.close()


def test_a_huge_finite_delta_is_left_out_and_the_honest_islands_keep_moving_the_fragment(start_server):
    """Island c pushes values near the float32 limit in the second round: the merge leaves it out, the fragment
    stays where honest deltas put it, and the next rounds merge as usual."""
    config = config_for(quorum=3, grace_seconds=30.0)
    server = start_server(config, seed=False)
    islands = {name: make_client(server.port, name) for name in "abc"}
    with make_client(server.port, retry_for=RETRY_SECONDS) as observer:
        for p in (0, 1):
            observer.seed(p, random_values(p))
        for client in islands.values():
            client.join(2)
        for version in range(3):
            base = observer.pull(0)[0]
            for i, (name, client) in enumerate(islands.items()):
                huge = version == 1 and name == "c"
                delta = fragment_values(3e38) if huge else random_values(10 * version + i, 0.01)
                push(client, base, delta, tokens=100, inner_steps=10, sequence=version)
            wait_until(lambda v=version: observer.pull(0)[0].version == v + 1)
            values = observer.pull(0)[1]
            assert all(t.abs().max() < 10 for _, t in values), f"after merge {version + 1}: the fragment blew up"
            outliers = server.metrics.registry.get_sample_value("diloco_syncer_outlier_contributions_total")
            assert outliers == (0 if version == 0 else 1), "only c's delta is left out, and counted once"
        assert observer.status().rejected_pushes == 1, "c's push, left out; no merge was dropped"
    for client in islands.values():
        client.close()


def test_a_fragment_recovers_by_itself_after_a_dropped_merge(start_server):
    """Two islands push deltas near the float32 limit once: the fragment and its momentum become huge, and
    momentum carries the fragment towards the limit round after round until a merge overflows and is dropped.
    The next merge of small honest deltas lands: the momentum restarted with the drop."""
    server = start_server(config_for(quorum=2, grace_seconds=30.0))
    islands = {name: make_client(server.port, name) for name in "ab"}
    with make_client(server.port, retry_for=RETRY_SECONDS) as observer:
        for client in islands.values():
            client.join(2)
        for sequence in range(12):
            base = observer.pull(0)[0]
            fill = 1e38 if sequence == 0 else 0.01
            for client in islands.values():
                push(client, base, fragment_values(fill), tokens=100, inner_steps=10, sequence=sequence)
            wait_until(lambda b=base: observer.pull(0)[0].version > b.version or observer.status().rejected_pushes)
            if observer.status().rejected_pushes:
                break
        assert observer.status().rejected_pushes == 2, "momentum took the fragment past the float32 limit"
        base = observer.pull(0)[0]
        for client in islands.values():
            push(client, base, fragment_values(0.01), tokens=100, inner_steps=10, sequence=100)
        wait_until(lambda: observer.pull(0)[0].version == base.version + 1 or observer.status().rejected_pushes > 2)
        assert observer.status().rejected_pushes == 2, "the merge after the dropped one was dropped too"
        assert all(torch.isfinite(t).all() for _, t in observer.pull(0)[1])
    for client in islands.values():
        client.close()
