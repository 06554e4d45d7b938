"""The islands a real shard knows: ids that left or went silent are forgotten after a bound, in memory and in
checkpoints, so a long job never fills the bound on known ids; and ids that joined but never pushed do not
shrink the share of a round a real merge stands for."""

from __future__ import annotations

import time

import grpc
import pytest
from syncer_harness import ReferenceFragment, config_for, fragment_values, make_client, random_values, wait_until

from diloco.core.encoding import Encoding
from diloco.core.island_id import FORGET_AFTER_TIMEOUTS
from diloco.syncer import checkpoint, shard

pytestmark = pytest.mark.process

TIMEOUT = 0.3  # islandTimeoutSeconds: ids unheard of for FORGET_AFTER_TIMEOUTS of these are forgotten


def test_ids_that_left_or_went_silent_are_forgotten_and_new_ones_join(start_server, monkeypatch, tmp_path):
    monkeypatch.setattr(shard, "MAX_KNOWN_ISLANDS", 6)
    server = start_server(config_for(island_timeout_seconds=TIMEOUT), checkpoint_dir=tmp_path / "ckpt")
    with make_client(server.port, retry_for=5.0) as observer:
        clients = [make_client(server.port, f"old-{i}") for i in range(6)]
        for client in clients:
            client.join(2)
        for client in clients[:3]:
            client.leave(5.0)
        with make_client(server.port, "new-0") as late:
            with pytest.raises(grpc.RpcError) as refused:
                late.join(2)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            time.sleep(FORGET_AFTER_TIMEOUTS * TIMEOUT + 0.2)
            late.join(2)  # the old ids, left or silent, are forgotten
        status = observer.status()
        assert list(status.live_islands) == ["new-0"] and not status.left_islands
        server.save_checkpoint(clean=False)
        saved = checkpoint.load(checkpoint.checkpoint_path(tmp_path / "ckpt", 0, 1))
        assert set(saved["islands"]) == {"new-0"} and not saved["left"]
        for client in clients:
            client.close()


def test_ids_that_never_push_do_not_shrink_the_merge_share(start_server):
    # The idle ids must stay live from their second join until the status at the end: 102 joins and a merge
    # take well over a second on a loaded machine, so the timeout is a few seconds.
    timeout = 4.0
    config = config_for(quorum=2, grace_seconds=0.5, island_timeout_seconds=timeout)
    server = start_server(config)
    islands = {name: make_client(server.port, name) for name in "ab"}
    idle = [make_client(server.port, f"idle-{i}") for i in range(100)]
    with make_client(server.port, retry_for=5.0) as observer:
        for client in [*islands.values(), *idle]:
            client.join(2)
        time.sleep(timeout + 0.1)  # beyond an island timeout since they joined, the idle ids join again to stay live
        for client in [*islands.values(), *idle]:
            client.join(2)
        base = observer.pull(0)[0]
        deltas = {"a": (random_values(1, 0.1), 100), "b": (random_values(2, 0.1), 300)}
        for name, client in islands.items():
            delta, tokens = deltas[name]
            client.push(
                0,
                base=base,
                tokens=tokens,
                inner_steps=10,
                sequence=0,
                delta=delta,
                encoding=Encoding.FP32,
                block_size=0,
            )
        wait_until(lambda: observer.pull(0)[0].version == 1)
        reference = ReferenceFragment(config, fragment_values())
        reference.merge(list(deltas.values()), live=2)  # the whole round: a and b are every island that pushes
        reference.assert_matches(observer.pull(0)[1])
        assert len(observer.status().live_islands) == 102
    for client in [*islands.values(), *idle]:
        client.close()


def test_a_checkpoint_from_before_ids_were_forgotten_resumes():
    config = config_for()
    state = shard.ShardState(config, 0, 1, incarnation=1)
    state.islands = {"a": 100.0}
    saved = state.to_state_dict(clean=True)
    saved["left"] = ["b"]  # as written before: a list of the ids that left
    del saved["contributed"]
    resumed = shard.ShardState.from_state_dict(config, 0, 1, saved, new_incarnation=2)
    assert resumed.left == {"b": 100.0} and resumed.contributed == {"a", "b"}
