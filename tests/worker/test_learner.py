"""Learners against real syncer shards on loopback: merging, sharding, late joiners, shard restarts, slow
islands and refused pushes."""

from __future__ import annotations

import threading
import time
from collections import Counter

import grpc
import pytest
import torch
from learner_harness import BATCH, TOKEN, flat_params, make_config, tiny_model
from prometheus_client import CollectorRegistry
from support import TEST_PKI, tls_env

from diloco.core.encoding import Encoding, encoded_nbytes
from diloco.syncer.server import SyncerServer
from diloco.worker.learner import Learner
from diloco.worker.metrics import WorkerCollector

pytestmark = pytest.mark.process
LABELS = {"island": "island-a", "rank": "0", "mode": "diloco"}


def pulled_params(shards, learner) -> dict[str, torch.Tensor]:
    """Every tensor of the model as the owning shard serves it now."""
    values = {}
    for p in range(shards.config.fragments):
        with shards.client(p % shards.count) as client:
            _, named = client.pull(p)
        values.update(named)
    return values


def test_two_islands_merge_and_move_toward_each_other(start_shards, island):
    config = make_config(encoding="int4", block_size=8)
    shards = start_shards(config)
    a = island(shards, seed=1, name="island-a")
    b = island(shards, seed=2, name="island-b")
    assert torch.equal(flat_params(a.model), flat_params(b.model)), "both start from the global values"

    # The same two islands (same start, same data, same inner optimizer) without any syncing.
    alone = [tiny_model(0), tiny_model(0)]
    for model in alone:
        model.load_state_dict(a.model.state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in alone]
    data = [torch.Generator().manual_seed(1001), torch.Generator().manual_seed(1002)]
    teachers = [torch.randn(8, 4, generator=g) for g in data]

    steps = 24
    for _ in range(steps):
        a.train(1)
        b.train(1)
        for model, optimizer, gen, teacher in zip(alone, optimizers, data, teachers):
            x = torch.randn(BATCH, 8, generator=gen)
            torch.nn.functional.mse_loss(model(x), x @ teacher).backward()
            optimizer.step()
            optimizer.zero_grad()

    synced = (flat_params(a.model) - flat_params(b.model)).norm()
    apart = (flat_params(alone[0]) - flat_params(alone[1])).norm()
    assert synced < 0.5 * apart, f"synced islands are {synced:.4f} apart, unsynced ones {apart:.4f}"

    status = shards.status(0)
    for p in (0, 1):
        seeded, version, tokens = status[p]
        assert seeded and version >= steps // config.inner_steps, f"fragment {p} at version {version}"
        assert tokens > 0
    for learner in (a.learner, b.learner):
        stats = learner.stats
        assert stats.inner_steps == steps and stats.tokens == steps * BATCH
        assert stats.syncs_pushed >= steps // config.inner_steps * 2 - 2
        assert stats.syncs_merged > 0 and stats.syncs_failed == 0
        assert stats.bytes_pushed > 0 and stats.bytes_pulled > 0
        assert stats.blocked_seconds > 0
        assert all(stats.versions[p].version > 0 for p in (0, 1))
    # int4 with 8-element blocks: a byte per 2 values plus a float32 scale per block, far below fp32.
    numel = sum(p.numel() for p in a.model.parameters())
    assert a.learner.stats.bytes_pushed < a.learner.stats.syncs_pushed * numel * 4 / 2


def test_sparse_islands_train_through_a_shard_sending_a_few_values_of_each_block(start_shards, island):
    config = make_config(encoding="sparse", block_size=16, top_k_fraction=1 / 8)
    shards = start_shards(config)
    a = island(shards, seed=1, name="island-a")
    b = island(shards, seed=2, name="island-b")
    start = pulled_params(shards, a.learner)
    for _ in range(24):
        a.train(1)
        b.train(1)

    served = pulled_params(shards, a.learner)
    moved = sum(int((served[name] != value).sum()) for name, value in start.items())
    assert moved > 0 and all(bool(torch.isfinite(v).all()) for v in served.values())
    assert min(a.losses[-4:]) < a.losses[0], "island a learns its task while it syncs sparsely"
    sizes = [p.numel() for p in a.model.parameters()]
    sparse_model = sum(encoded_nbytes(n, Encoding.SPARSE, config.block_size, config.top_k) for n in sizes)
    int4_model = sum(encoded_nbytes(n, Encoding.INT4, config.block_size) for n in sizes)
    for learner in (a.learner, b.learner):
        stats = learner.stats
        assert stats.syncs_merged > 0 and stats.syncs_failed == 0 and stats.feedback_lost_values == 0
        # A push is one fragment: two values of each 16 at 2 bits and 4 index bits, and a scale per block.
        assert stats.bytes_pushed <= stats.syncs_pushed * sparse_model
        assert sparse_model < int4_model / 2


def test_a_sparse_island_starting_on_merged_fragments_declares_its_held_back_values_lost(start_shards, island):
    """An island starting without its error-feedback buffers on fragments the job has merged into may be a
    restart that lost them: it says so and counts the values dropped, every parameter's here."""
    shards = start_shards(make_config(encoding="sparse", block_size=16, top_k_fraction=1 / 8))
    first = island(shards, seed=1, name="island-a")
    first.train(9)
    assert first.learner.stats.feedback_lost_values == 0, "its first start found nothing merged"
    again = island(shards, seed=1, name="island-b")
    assert again.learner.stats.feedback_lost_values == sum(p.numel() for p in again.model.parameters())


def test_a_sparse_island_restarted_with_its_saved_buffers_loses_nothing(start_shards, island):
    """The buffers an island checkpoint saved, restored before the replacement starts, are the ones it sends
    from; only a fragment whose buffer did not come back is declared lost."""
    shards = start_shards(make_config(encoding="sparse", block_size=16, top_k_fraction=1 / 8))
    first = island(shards, seed=1, name="island-a")
    first.train(9)
    saved = first.learner.error_feedback.named()
    again = island(shards, seed=1, name="island-b", start=False)
    again.learner.restore_error_feedback(saved)
    again.learner.start()
    assert again.learner.stats.feedback_lost_values == 0
    for p in range(shards.config.fragments):
        before, after = first.learner.error_feedback.held_back(p), again.learner.error_feedback.held_back(p)
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    partly = island(shards, seed=1, name="island-c", start=False)
    partly.learner.restore_error_feedback({name: t for name, t in saved.items() if not name.startswith("0.")})
    partly.learner.start()
    first_layer = sum(p.numel() for p in partly.model[0].parameters())  # fragment 0: layer 0 of the two
    assert partly.learner.stats.feedback_lost_values == first_layer


def test_fragments_go_to_the_shard_that_owns_them(start_shards, island):
    shards = start_shards(make_config(), count=2)
    one = island(shards, seed=1, name="island-a")
    one.train(8)  # fragment 1 pushed at steps 2 and 6, fragment 0 at steps 4 and 8

    by_shard = [shards.status(0), shards.status(1)]
    assert sorted(by_shard[0]) == [0] and sorted(by_shard[1]) == [1]
    for p, status in enumerate(by_shard):
        seeded, version, tokens = status[p]
        assert seeded and version == 2 and tokens > 0
    versions = one.learner.stats.versions
    assert versions[1].version == 2
    assert versions[0].version == 1, "the merge of step 8's push is mixed in τ = 1 step later"
    one.train(1)
    assert one.learner.stats.versions[0].version == 2


def test_shards_listed_out_of_order_are_refused(start_shards, island):
    shards = start_shards(make_config(), count=2)
    swapped = island(shards, seed=1, name="island-a", start=False, syncers=shards.targets[::-1])
    with pytest.raises(ValueError, match="index order"):
        swapped.learner.start()


def test_late_island_starts_from_the_global_values(start_shards, island):
    shards = start_shards(make_config())
    early = island(shards, seed=1, name="island-a")
    early.train(9)
    assert all(v.version == 2 for v in early.learner.stats.versions.values())

    late = island(shards, seed=7, name="island-b", start=False)
    own_init = {name: p.detach().clone() for name, p in late.model.named_parameters()}
    late.learner.start()

    served = pulled_params(shards, late.learner)
    for name, param in late.model.named_parameters():
        assert torch.equal(param.detach(), served[name]), name
        assert not torch.equal(param.detach(), own_init[name]), name
    assert {p: v.version for p, v in late.learner.stats.versions.items()} == {0: 2, 1: 2}


def test_training_goes_on_while_the_shard_restarts(start_shards, island):
    shards = start_shards(make_config())
    one = island(shards, seed=1, name="island-a")
    one.train(8)
    before = shards.status(0)

    shards.stop(0)
    for _ in range(12):
        one.train(1, wait=False)
        time.sleep(0.01)
    shards.start(0, shards.ports[0])

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        v.version <= before[p][1] + 1 for p, v in one.learner.stats.versions.items()
    ):
        one.train(1, wait=False)
        time.sleep(0.01)

    after = shards.status(0)
    for p in (0, 1):
        assert after[p][1] > before[p][1] + 1, f"fragment {p}: {before[p][1]} -> {after[p][1]}"
        assert one.learner.stats.versions[p].version > before[p][1] + 1


def test_a_slow_island_does_not_hold_back_merges(start_shards, island):
    shards = start_shards(make_config(quorum=1))
    fast = island(shards, seed=1, name="fast")
    slow = island(shards, seed=2, name="slow")

    for i in range(40):
        fast.train(1)
        if i % 5 == 4:
            slow.train(1)

    assert slow.learner.stats.inner_steps == 8
    fast_stats = fast.learner.stats
    assert fast_stats.syncs_merged >= 16, fast_stats
    status = shards.status(0)
    assert all(status[p][1] >= 10 for p in (0, 1)), status


def test_a_push_gives_the_shard_a_round_of_slack_not_tau_steps(start_shards, island):
    """An island never blocks on a merge (it mixes one in at the first step from τ on that finds it in), so it
    can wait for one until it pushes the fragment again: its pushes say a round of steps less its last sync,
    which bounds how long a shard holds a merge open for late islands."""
    shards = start_shards(make_config(quorum=2, inner_steps=12, overlap_steps=1))
    early = island(shards, seed=1, name="early")
    island(shards, seed=2, name="late")  # joined, so the merge waits for its push

    for _ in range(12):  # steps of about 20 ms, so that the step time the push measured is the one read below
        early.train(1, wait=False)
        time.sleep(0.02)

    fragments = shards.servers[0].state.fragments.values()
    deadline = time.monotonic() + 10
    while not (pending := [f.pending["early"] for f in fragments if "early" in f.pending]):
        assert time.monotonic() < deadline, "the push never reached the shard"
        time.sleep(0.01)
    step_seconds = early.learner.snapshot().step_seconds
    assert step_seconds > 0
    assert all(p.slack == pytest.approx(12 * step_seconds, rel=0.25) for p in pending), "the first push has no sync"


def train_one_fast_one_slow(start_shards, island, steps: int, **config: object):
    """Two islands at H=12, the slow one stepping once per five of the fast one's."""
    shards = start_shards(make_config(quorum=1, inner_steps=12, overlap_steps=1, **config))
    fast = island(shards, seed=1, name="fast")
    slow = island(shards, seed=2, name="slow")
    for i in range(steps):
        fast.train(1)
        if i % 5 == 4:
            slow.train(1)
    return fast, slow


def test_a_speed_aware_slow_island_runs_fewer_inner_steps_per_round(start_shards, island):
    """The slow island steps once per five of the fast one's: it learns the fast one's cadence from the
    shard and runs fewer inner steps per round, and its pushes say so; the fast one runs the full H."""
    fast, slow = train_one_fast_one_slow(start_shards, island, steps=150)

    assert fast.learner.round_steps == 12
    assert slow.learner.round_steps < 12 and slow.learner.stats.round_steps == slow.learner.round_steps
    stats = slow.learner.stats
    assert stats.round_inner_steps < 12 * stats.rounds_begun, "its pushes claim the fewer steps they trained"
    assert stats.syncs_merged > 30 // 12 * 2, "so it pushes more often than a fixed H would"


def test_speed_awareness_off_keeps_h_whatever_the_speed(start_shards, island):
    _, slow = train_one_fast_one_slow(start_shards, island, steps=100, speed_aware=False)
    assert slow.learner.round_steps == 12


def test_an_island_that_finished_holds_back_no_merge(start_shards, island):
    """K = M = 2: once b has closed, a's rounds merge on their own instead of waiting for b to time out."""
    shards = start_shards(make_config(quorum=2))
    a = island(shards, seed=1, name="a")
    b = island(shards, seed=2, name="b")
    b.learner.close()
    with shards.client(0) as observer:
        status = observer.status()
    assert (list(status.live_islands), list(status.left_islands)) == (["a"], ["b"])

    a.train(4)  # both fragments fall due (H=4, P=2); each round is answered before the next step
    assert {p: version for p, (_, version, _) in shards.status(0).items()} == {0: 1, 1: 1}
    assert a.learner.stats.syncs_abandoned == 0, a.learner.stats


def test_a_flushing_island_leaves_once_the_shards_hold_its_pushes_not_once_they_merge(start_shards, island):
    """So that the islands still training hold no merge for one that pushes no more."""
    shards = start_shards(make_config(quorum=2, grace_seconds=60.0))
    a = island(shards, seed=1, name="a")
    island(shards, seed=2, name="b")
    a.train(1)
    a.learner.flush(timeout=3.0)  # its pushes cannot merge: b is live and not in, and the window is 60 s
    with shards.client(0) as observer:
        status = observer.status()
    assert (list(status.live_islands), list(status.left_islands)) == (["b"], ["a"])
    assert [f.pending for f in status.fragments] == [1, 1], "a's pushes wait for the next merge"
    assert (a.learner.stats.syncs_pushed, a.learner.stats.syncs_merged) == (2, 0)


def test_a_process_that_needs_no_merged_model_ends_once_its_pushes_are_handed_over(start_shards, island):
    """The built-in trainer's end: its last merges are the shards' to make, and once the last island has left
    they are made before its Leave is answered, so the global model is ready to export."""
    shards = start_shards(make_config(quorum=2, grace_seconds=60.0))
    a = island(shards, seed=1, name="a")
    b = island(shards, seed=2, name="b")
    for each in (a, b):
        each.train(1)
        flushing = threading.Thread(target=each.learner.flush, kwargs={"wait_for_merges": False}, daemon=True)
        flushing.start()
        flushing.join(timeout=30)  # waiting for a merge would take the whole 60 s flush timeout
        assert not flushing.is_alive(), "flush waited for merges the process does not need"
    with shards.client(0) as observer:
        status = observer.status()
    assert (list(status.live_islands), sorted(status.left_islands)) == ([], ["a", "b"])
    assert [(f.version.version, f.last_contributors, f.pending) for f in status.fragments] == [(1, 2, 0), (1, 2, 0)]
    assert (a.learner.stats.syncs_pushed, a.learner.stats.syncs_merged) == (2, 0)


def test_the_last_steps_of_a_fragment_whose_round_is_out_at_the_end_follow_that_round(start_shards, island):
    """Its steps since that push are pushed against the merge the round brings back, not dropped."""
    shards = start_shards(make_config(quorum=2, grace_seconds=60.0))
    a = island(shards, seed=1, name="a")
    b = island(shards, seed=2, name="b")
    a.train(3, wait=False)  # fragment 1's round, pushed at step 2, waits for b (K = 2)
    flushing = threading.Thread(target=a.learner.flush, kwargs={"wait_for_merges": False}, daemon=True)
    flushing.start()
    b.train(2, wait=False)  # b's push of fragment 1 lets the merge a's round waits for happen
    flushing.join(timeout=30)
    assert not flushing.is_alive()
    b.learner.flush(wait_for_merges=False)
    merged = {
        (p, k.island, k.sequence)
        for p, fragment in shards.servers[0].state.fragments.items()
        for k in fragment.merged_keys
    }
    assert Counter(p for p, island_id, _ in merged if island_id == "a") == {0: 1, 1: 2}
    assert shards.servers[0].state.fragments[1].version == 2, "a's step 3 went into a second merge"


def test_a_round_begun_at_the_last_step_is_not_waited_for(start_shards, island):
    """Its push already carries every step of its fragment."""
    shards = start_shards(make_config(quorum=2, grace_seconds=60.0))
    a = island(shards, seed=1, name="a")
    island(shards, seed=2, name="b")
    a.train(2, wait=False)  # fragment 1's round begins at step 2 and waits for b (K = 2), which never pushes
    flushing = threading.Thread(target=a.learner.flush, kwargs={"wait_for_merges": False}, daemon=True)
    flushing.start()
    flushing.join(timeout=30)  # waiting for that round would take the whole 60 s flush timeout
    assert not flushing.is_alive()
    assert a.learner.stats.syncs_pushed == 2, "fragment 1 at step 2, fragment 0 at the flush"


def test_each_push_is_reported_by_the_name_the_shard_merges_it_under(start_shards, island):
    """What lets goodput count the steps of a push whose island was killed before it heard the merge."""
    shards = start_shards(make_config())
    pushes = []
    a = island(shards, seed=1, name="a", on_push=pushes.append)
    a.train(8)  # H=4, P=2: four rounds, each answered before the next step
    reported = [(r.fragment, r.began_at_step, ("a", r.incarnation, r.base_version, r.sequence)) for r in pushes]
    merged = {
        (p, (k.island, k.incarnation, k.base_version, k.sequence))
        for p, fragment in shards.servers[0].state.fragments.items()
        for k in fragment.merged_keys
    }
    assert [(p, step) for p, step, _ in reported] == [(1, 2), (0, 4), (1, 6), (0, 8)]
    assert {(p, key) for p, _, key in reported} == merged


def test_a_synchronous_island_does_not_wait_at_the_start_for_islands_that_finished(start_shards, island):
    """A sync-DiLoCo island restarted after the others left starts at once rather than after sync_timeout."""
    shards = start_shards(make_config(quorum=2))
    island(shards, seed=2, name="b").learner.close()
    late = island(shards, seed=1, name="a", start=False, synchronous=True, sync_timeout=600.0)
    starting = threading.Thread(target=late.learner.start, daemon=True)
    starting.start()
    starting.join(timeout=60)
    assert not starting.is_alive(), "the start barrier waited for an island that had left"


def test_a_refused_push_rebases_on_fresh_values(start_shards, island):
    shards = start_shards(make_config(max_staleness=0))
    a = island(shards, seed=1, name="island-a")
    b = island(shards, seed=2, name="island-b")
    a.train(2)  # fragment 1 is due at step 2: merged into version 1
    assert shards.status(0)[1][1] == 1

    b.train(2)  # b's push is based on version 0, one merge behind a bound of 0: refused, b pulls again
    before = {name: p.detach().clone() for name, p in b.model.named_parameters()}
    b.train(1)  # τ = 1 step after the push: b mixes the fresh values in

    stats = b.learner.stats
    assert stats.syncs_resynced == 1 and stats.syncs_failed == 0
    assert stats.versions[1].version == 1
    assert shards.status(0)[1][1] == 1, "the refused delta was not merged"
    assert any(not torch.equal(before[n], p.detach()) for n, p in b.model.named_parameters())


def test_a_shard_that_lost_its_state_is_seeded_again(start_shards, island):
    shards = start_shards(make_config(), checkpoints=False)
    one = island(shards, seed=1, name="island-a")
    one.train(4)
    shards.stop(0)
    shards.start(0, shards.ports[0])
    assert shards.status(0)[0][0] is False, "a shard without a checkpoint starts unseeded"

    one.train(9)  # steps 6 and 8 re-seed and re-base both fragments; 10 and 12 push, 11 and 13 mix

    status = shards.status(0)
    stats = one.learner.stats
    assert all(status[p][0] and status[p][1] >= 1 for p in (0, 1)), status
    assert stats.syncs_resynced == 2 and stats.syncs_failed == 0
    assert all(stats.versions[p].version == status[p][1] for p in (0, 1))
    assert shards.live_islands(0) == ["island-a"], "the island joined the new shard again"


def test_a_dead_shard_costs_rounds_not_steps(start_shards, island):
    shards = start_shards(make_config())
    one = island(shards, seed=1, name="island-a", retry_for=0.3)
    one.train(1)
    shards.stop(0)

    one.train(4)  # the rounds of steps 2 and 4 fail once the client's retries run out

    stats = one.learner.stats
    assert stats.inner_steps == 5
    assert stats.syncs_failed == 2 and stats.syncs_pushed == 0, stats
    one.learner.close()


def test_closing_beside_a_dead_shard_does_not_wait_out_the_retries(start_shards, island):
    shards = start_shards(make_config())
    one = island(shards, seed=1, name="island-a", retry_for=60.0, close_timeout=30.0)
    one.train(1)
    shards.stop(0)
    one.train(1, wait=False)  # step 2's round now retries its push against the dead shard, for up to a minute

    started = time.monotonic()
    one.learner.close()

    assert time.monotonic() - started < 10.0, "close waited on the push's retries instead of stopping them"
    assert one.learner.wait_for_syncs(0.0), "a round is still retrying after close"


def test_from_env_reads_what_the_operator_injects(start_shards, tmp_path, monkeypatch):
    shards = start_shards(make_config())
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("DILOCO_SYNCERS", shards.targets[0])
    monkeypatch.setenv("DILOCO_TOKEN_FILE", str(token_file))
    for name, value in tls_env(tmp_path / "tls", server=False).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DILOCO_ISLAND", "island-env")
    monkeypatch.setenv("DILOCO_CONFIG", shards.config.to_json())
    model = tiny_model(1)
    learner = Learner.from_env(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        learner.start()
        assert shards.status(0)[0][0], "the learner joined with the token from the file and seeded"
        with shards.client(0) as client:
            assert "island-env" in client.status().live_islands
    finally:
        learner.close()


def test_a_wrong_token_fails_start(start_shards, island):
    shards = start_shards(make_config())
    intruder = island(shards, seed=1, name="island-a", start=False, token="wrong")
    with pytest.raises(grpc.RpcError) as refused:
        intruder.learner.start()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_rounds_the_shards_refuse_for_the_islands_token_are_counted_and_dated_for_the_operator(start_shards, island):
    """After a rotation the island was left out of, its pushes are refused while its ranks step on: the trainer
    says so on its metrics port (the time of the last refusal after that of the last sync), which is how the
    operator tells such an island from one that trains."""
    shards = start_shards(make_config())
    one = island(shards, seed=1, name="island-a", retry_for=0.3)
    one.train(3)  # the round of step 2 merged and came back at step 3
    synced = one.learner.snapshot().last_sync_unix
    assert synced > 0 and one.learner.stats.syncs_refused == 0
    port = shards.ports[0]
    shards.stop(0)
    rotated = SyncerServer(
        shards.config,
        shard_index=0,
        num_shards=1,
        token="rotated-token",
        security=TEST_PKI.server,
        port=port,
        checkpoint_dir=shards.checkpoint_dir,
    )
    rotated.start()
    shards.servers[0] = rotated

    one.train(4)

    stats = one.learner.stats
    assert stats.syncs_refused == stats.syncs_failed == 2, stats
    assert stats.last_refusal_unix > one.learner.snapshot().last_sync_unix == synced
    registry = CollectorRegistry()
    registry.register(WorkerCollector(one.learner.snapshot))
    assert registry.get_sample_value("diloco_worker_refused_syncs_total", LABELS) == 2
    assert registry.get_sample_value("diloco_worker_last_refusal_timestamp_seconds", LABELS) == stats.last_refusal_unix
