"""A real syncer shard on loopback driven by real clients: quorum and grace over the wire, idempotent pushes,
pulls in every encoding, concurrent islands, several shards, Prometheus metrics and gRPC health."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from syncer_harness import (
    SHAPES,
    TOKEN,
    ReferenceFragment,
    config_for,
    free_port,
    make_client,
    open_channel,
    random_values,
    versions,
    wait_until,
)

from diloco.core.encoding import Encoding, decode, encode, error_bound
from diloco.progress import MergeEvent, ProgressWriter, Source, read_events
from diloco.syncer import checkpoint
from diloco.syncer.metrics import SyncerMetrics
from diloco.transport.auth import bearer_metadata
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.v1 import syncer_pb2_grpc

pytestmark = pytest.mark.process


def push(client, fragment, base, delta, *, tokens=100, sequence=0, encoding=Encoding.FP32, block_size=32):
    return client.push(
        fragment,
        base=base,
        tokens=tokens,
        inner_steps=10,
        sequence=sequence,
        delta=delta,
        encoding=encoding,
        block_size=block_size,
    )


def fragment_status(client, fragment: int) -> pb.FragmentStatus:
    return next(f for f in client.status().fragments if f.fragment_id == fragment)


def seed_random(port: int, fragments, seed: int = 0) -> dict[int, list[tuple[str, torch.Tensor]]]:
    seeded = {}
    with make_client(port, "") as client:
        for p in fragments:
            seeded[p] = random_values(seed + p)
            assert client.seed(p, seeded[p]).accepted
    return seeded


def joined(port: int, islands: str, fragments: int) -> dict[str, object]:
    clients = {name: make_client(port, name) for name in islands}
    for client in clients.values():
        client.join(fragments)
    return clients


@pytest.fixture
def clients():
    """Closes the clients a test opens."""
    opened = []
    yield opened
    for group in opened:
        for client in group.values():
            client.close()


class HeldClock:
    """The shard's clock: real time, except that a test can hold it still, so a grace window cannot end
    before the test has done what it needs to; releasing it lets real time (and the grace window) run on."""

    def __init__(self) -> None:
        self._held: float | None = None

    def hold(self) -> None:
        self._held = time.time()

    def release(self) -> None:
        self._held = None

    def __call__(self) -> float:
        held = self._held
        return time.time() if held is None else held


class TestQuorumAndGrace:
    def test_merge_waits_for_quorum_then_applies_the_token_weighted_nesterov_step(self, start_server, clients):
        config = config_for(quorum=2, grace_seconds=0.2)
        server = start_server(config, seed=False)
        seeded = seed_random(server.port, range(2))
        islands = joined(server.port, "abc", 2)
        clients.append(islands)
        base = islands["a"].pull(0)[0]

        da, db = random_values(10, 0.1), random_values(11, 0.1)
        reply = push(islands["a"], 0, base, da, tokens=100)
        assert not reply.duplicate and reply.current.version == 0 and reply.staleness == 0
        time.sleep(0.5)  # longer than the grace window: one push is below the quorum of two, whatever the wait
        status = fragment_status(islands["a"], 0)
        assert status.version.version == 0 and status.pending == 1

        # b's delta goes int8 on the wire: the shard merges what it decoded.
        push(islands["b"], 0, base, db, tokens=300, encoding=Encoding.INT8, block_size=config.block_size)
        wait_until(lambda: fragment_status(islands["a"], 0).version.version >= 1)
        status = fragment_status(islands["a"], 0)
        assert (status.version.version, status.pending, status.last_contributors) == (1, 0, 2)
        assert status.tokens_merged == 400 and status.last_merge_unix > 0

        db_decoded = [
            (n, decode(encode(t, Encoding.INT8, config.block_size), t.shape, Encoding.INT8, config.block_size))
            for n, t in db
        ]
        reference = ReferenceFragment(config, seeded[0])
        reference.merge([(da, 100), (db_decoded, 300)], live=3)  # c is live: the merge is 2/3 of a round
        version, values = islands["c"].pull(0)
        assert version.version == 1
        reference.assert_matches(values)
        # By hand for one element: the first round opens with no momentum and takes its share s = 2/3 of the
        # gradient, seed − lr·s·g; the look-ahead waits for the round to complete.
        g, s = (da[0][1][0, 0] * 100 + db_decoded[0][1][0, 0] * 300) / 400, 2 / 3
        expected = seeded[0][0][1][0, 0] - config.outer.lr * s * g
        assert values[0][1][0, 0].item() == pytest.approx(expected.item(), abs=1e-5)

        untouched = islands["c"].pull(1)
        assert untouched[0].version == 0
        assert all(torch.equal(got, want) for (_, got), (_, want) in zip(untouched[1], seeded[1]))

    def test_grace_window_is_bounded_and_a_silent_island_never_blocks(self, start_server, clients):
        clock = HeldClock()
        config = config_for(quorum=1, grace_seconds=0.5)
        server = start_server(config, clock=clock)
        islands = joined(server.port, "abc", 2)
        clients.append(islands)
        base = islands["a"].pull(0)[0]

        clock.hold()  # the grace window opened by a's push cannot close before b has pushed too
        push(islands["a"], 0, base, random_values(1, 0.1), tokens=10)
        push(islands["b"], 0, base, random_values(2, 0.1), tokens=20)
        time.sleep(0.3)
        status = fragment_status(islands["a"], 0)
        assert (status.version.version, status.pending) == (0, 2), "c is live: the shard waits out the grace window"

        clock.release()  # c never pushes; the window ends and the merge goes ahead without it
        wait_until(lambda: fragment_status(islands["a"], 0).version.version >= 1, timeout=10)
        status = fragment_status(islands["a"], 0)
        assert (status.version.version, status.last_contributors, status.pending, status.tokens_merged) == (1, 2, 0, 30)
        assert set(islands["a"].status().live_islands) == {"a", "b", "c"}

    def test_an_island_that_leaves_is_waited_for_no_longer(self, start_server, clients):
        clock = HeldClock()
        server = start_server(config_for(quorum=3, grace_seconds=0.5), clock=clock)
        islands = joined(server.port, "abc", 2)
        clients.append(islands)
        base = islands["a"].pull(0)[0]

        clock.hold()  # no grace window or island timeout can end now: only c's leave can release the merge
        push(islands["a"], 0, base, random_values(1, 0.1), tokens=10)
        push(islands["b"], 0, base, random_values(2, 0.1), tokens=20)
        time.sleep(0.3)
        assert fragment_status(islands["a"], 0).pending == 2, "K = 3 and c is live: the merge waits for c"

        islands["c"].leave(timeout=10)
        status = fragment_status(islands["a"], 0)
        assert (status.version.version, status.last_contributors) == (1, 2), "made before c's Leave was answered"
        status = islands["a"].status()
        assert (list(status.live_islands), list(status.left_islands)) == (["a", "b"], ["c"])

        islands["c"].join(2)  # a restarted c counts again
        status = islands["a"].status()
        assert (list(status.live_islands), list(status.left_islands)) == (["a", "b", "c"], [])


class TestIdempotency:
    def test_duplicate_while_pending_counts_once(self, start_server, clients):
        config = config_for(quorum=2, grace_seconds=60.0)
        server = start_server(config)
        islands = joined(server.port, "ab", 2)
        clients.append(islands)
        base = islands["a"].pull(0)[0]
        seed = [(n, torch.zeros(s)) for n, s in SHAPES.items()]

        da = random_values(3, 0.1)
        first = push(islands["a"], 0, base, da, tokens=100, sequence=5)
        again = push(islands["a"], 0, base, random_values(4, 5.0), tokens=100, sequence=5)  # a retry: same key
        assert not first.duplicate and again.duplicate
        assert fragment_status(islands["a"], 0).pending == 1

        db = random_values(5, 0.1)
        push(islands["b"], 0, base, db, tokens=50)  # every live island has reported: merge now
        wait_until(lambda: fragment_status(islands["a"], 0).version.version == 1)
        status = fragment_status(islands["a"], 0)
        assert status.tokens_merged == 150 and status.last_contributors == 2
        reference = ReferenceFragment(config, seed)
        reference.merge([(da, 100), (db, 50)])
        reference.assert_matches(islands["a"].pull(0)[1])

    def test_each_merge_is_recorded_with_the_pushes_in_it(self, start_server, clients, tmp_path):
        """What goodput accounting reads: which pushes reached the global model, named as they were sent,
        whether or not the island lived to hear of the merge."""
        shard = Source(island="shard-0", rank=0, mode="syncer", pid=1)
        progress = ProgressWriter(tmp_path / "merges.jsonl", shard)
        server = start_server(config_for(quorum=2, grace_seconds=60.0), progress=progress)
        islands = joined(server.port, "ab", 2)
        clients.append(islands)
        base = islands["a"].pull(0)[0]
        push(islands["a"], 0, base, random_values(3, 0.1), sequence=5)
        push(islands["b"], 0, base, random_values(4, 0.1), sequence=9)
        wait_until(lambda: fragment_status(islands["a"], 0).version.version == 1)
        (merge,) = wait_until(lambda: [e for e in read_events(tmp_path) if isinstance(e, MergeEvent)], timeout=10)
        assert (merge.fragment, merge.version, merge.source) == (0, 1, shard)
        assert set(merge.pushes) == {("a", base.incarnation, 0, 5), ("b", base.incarnation, 0, 9)}

    def test_retry_after_the_merge_is_a_duplicate(self, start_server, clients):
        config = config_for(quorum=1, grace_seconds=60.0)
        server = start_server(config)
        islands = joined(server.port, "a", 2)
        clients.append(islands)
        base = islands["a"].pull(0)[0]
        delta = random_values(6, 0.1)

        assert not push(islands["a"], 0, base, delta, tokens=100, sequence=1).duplicate
        wait_until(lambda: fragment_status(islands["a"], 0).version.version == 1)
        merged_values = islands["a"].pull(0)[1]

        again = push(islands["a"], 0, base, delta, tokens=100, sequence=1)
        assert again.duplicate and again.current.version == 1
        time.sleep(0.3)
        status = fragment_status(islands["a"], 0)
        assert (status.version.version, status.pending, status.tokens_merged) == (1, 0, 100)
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(islands["a"].pull(0)[1], merged_values))


class TestPull:
    @pytest.mark.parametrize("encoding", [Encoding.FP32, Encoding.BF16, Encoding.INT8, Encoding.INT4])
    def test_pull_sends_nothing_when_current_and_the_values_otherwise(self, start_server, encoding):
        config = config_for(block_size=32)
        server = start_server(config, seed=False)
        seeded = seed_random(server.port, range(2))
        with make_client(server.port, "a") as client:
            version, values = client.pull(1, encoding=encoding)
            assert version.version == 0 and version.incarnation != 0
            assert [n for n, _ in values] == list(SHAPES)
            for (name, got), (_, want) in zip(values, seeded[1]):
                assert got.shape == want.shape and got.dtype == torch.float32
                bound = error_bound(want, encoding, config.block_size)
                assert torch.all((got - want).abs() <= bound), f"{name} beyond the {encoding.name} bound"
                if encoding == Encoding.FP32:
                    assert torch.equal(got, want)

            assert client.pull(1, have=version, encoding=encoding) is None
            other_incarnation = pb.FragmentVersion(incarnation=version.incarnation + 1, version=0)
            assert client.pull(1, have=other_incarnation, encoding=encoding) is not None
            assert client.pull(1, have=pb.FragmentVersion(incarnation=version.incarnation, version=7)) is not None

            push(client, 1, version, random_values(7, 0.1))
            wait_until(lambda: fragment_status(client, 1).version.version == 1)
            newer = client.pull(1, have=version, encoding=encoding)
            assert newer is not None and newer[0].version == 1
            assert client.pull(1, have=newer[0], encoding=encoding) is None


class TestConcurrentIslands:
    def test_eight_islands_pushing_several_rounds(self, start_server):
        config = config_for(quorum=2, grace_seconds=0.1, max_staleness=16)
        server = start_server(config)
        rounds, errors = 3, []
        replies: dict[str, list[tuple[int, pb.PushReply]]] = {}
        seen: dict[str, list[tuple[int, int]]] = {}
        start = threading.Barrier(8)

        def island(name: str, index: int) -> None:
            try:
                with make_client(server.port, name) as client:
                    client.join(2)
                    replies[name], seen[name] = [], []
                    start.wait(timeout=30)
                    for r in range(rounds):
                        for p in (0, 1):
                            version, values = client.pull(p)
                            seen[name].append((p, version.version))
                            assert all(torch.isfinite(t).all() for _, t in values)
                            reply = push(
                                client,
                                p,
                                version,
                                random_values(100 * index + 10 * r + p, 0.01),
                                tokens=10 + index,
                                sequence=r,
                                encoding=Encoding.INT4,
                            )
                            replies[name].append((p, reply))
            except Exception as error:  # reported below, with the island's name
                errors.append((name, repr(error)))

        threads = [threading.Thread(target=island, args=(f"island-{i}", i)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        assert errors == [], errors

        all_replies = [reply for rs in replies.values() for _, reply in rs]
        assert len(all_replies) == 8 * rounds * 2, "every push got a reply: accepted or duplicate, never refused"
        assert sum(not r.duplicate for r in all_replies) >= 8 * rounds  # retries aside, pushes are taken
        for name, observed in seen.items():
            for p in (0, 1):
                got = [v for q, v in observed if q == p]
                assert got == sorted(got), f"{name} saw fragment {p} go backwards: {got}"

        with make_client(server.port) as client:
            # Pushes have stopped; once no fragment holds a quorum's worth of pending pushes, nothing merges.
            wait_until(lambda: all(f.pending < config.quorum for f in client.status().fragments))
            status = {f.fragment_id: f for f in client.status().fragments}
            for p in (0, 1):
                version, values = client.pull(p)
                assert status[p].version == version
                assert version.version >= 1
                assert max(r.current.version for rs in replies.values() for q, r in rs if q == p) <= version.version
                assert status[p].tokens_merged <= sum(10 + i for i in range(8)) * rounds
                assert all(torch.isfinite(t).all() for _, t in values)
            assert len(client.status().live_islands) == 8


class TestJoinAndSeed:
    def test_join_reports_owned_and_unseeded_fragments_and_seed_is_first_wins(self, start_server):
        config = config_for(fragments=3)
        server = start_server(config, seed=False)
        first, second = random_values(1), random_values(2)
        with make_client(server.port, "a") as client:
            reply = client.join(3)
            assert (reply.shard_index, reply.num_shards) == (0, 1)
            assert list(reply.owned_fragments) == [0, 1, 2] and list(reply.unseeded_fragments) == [0, 1, 2]
            assert reply.max_chunk_bytes == 4 * 1024 * 1024
            assert client.status().live_islands == ["a"]

            with pytest.raises(grpc.RpcError) as not_seeded:
                client.pull(1)
            assert not_seeded.value.code() == grpc.StatusCode.FAILED_PRECONDITION

            accepted = client.seed(1, first)
            assert accepted.accepted and accepted.version.version == 0
            assert list(client.join(3).unseeded_fragments) == [0, 2]
            refused = client.seed(1, second)
            assert not refused.accepted and refused.version == accepted.version
            version, values = client.pull(1)
            assert all(torch.equal(got, want) for (_, got), (_, want) in zip(values, first))

            with pytest.raises(grpc.RpcError) as not_seeded_push:
                push(client, 0, pb.FragmentVersion(incarnation=version.incarnation), first)
            assert not_seeded_push.value.code() == grpc.StatusCode.FAILED_PRECONDITION

            with pytest.raises(grpc.RpcError) as layout:
                client.join(4)
            assert layout.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class TestShards:
    def test_each_shard_owns_its_fragments_and_refuses_the_others(self, start_server):
        config = config_for(fragments=4)
        shards = [start_server(config, shard_index=i, num_shards=2) for i in (0, 1)]
        with make_client(shards[0].port, "a") as zero, make_client(shards[1].port, "a") as one:
            for client, owned in ((zero, [0, 2]), (one, [1, 3])):
                reply = client.join(4)
                assert reply.num_shards == 2 and list(reply.owned_fragments) == owned
                assert list(reply.unseeded_fragments) == []
                assert sorted(f.fragment_id for f in client.status().fragments) == owned

            base = one.pull(1)[0]
            for call in (
                lambda: push(zero, 1, base, random_values(1, 0.1)),
                lambda: zero.pull(1),
                lambda: zero.seed(1, random_values(1)),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert zero.status().rejected_pushes == 3

            assert not push(one, 1, base, random_values(1, 0.1)).duplicate
            wait_until(lambda: versions(one)[1][1] == 1)
            assert {p: v for p, (_, v) in versions(zero).items()} == {0: 0, 2: 0}


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class TestObservability:
    def test_prometheus_metrics_move(self, start_server, clients):
        metrics = SyncerMetrics()
        metrics_port = free_port()
        metrics.serve(metrics_port, addr="127.0.0.1")
        config = config_for(quorum=1, grace_seconds=0.0)
        server = start_server(config, metrics=metrics)
        islands = joined(server.port, "a", 2)
        clients.append(islands)
        a = islands["a"]
        before = scrape(metrics_port)
        assert before[("diloco_syncer_received_bytes_total", ())] > 0, "the seeds were received"

        base0 = a.pull(0)[0]
        push(a, 0, base0, random_values(1, 0.1), sequence=1)
        wait_until(lambda: versions(a)[0][1] == 1)
        push(a, 0, base0, random_values(2, 0.1), sequence=2)  # one version behind: staleness 1
        wait_until(lambda: versions(a)[0][1] == 2)
        a.pull(0)
        with pytest.raises(grpc.RpcError):
            push(a, 0, base0, [("w", torch.zeros(3))])  # refused: wrong layout
        with pytest.raises(grpc.RpcError):
            push(a, 9, base0, random_values(3))  # refused: unknown fragment
        with open_channel(server.port) as channel, pytest.raises(grpc.RpcError):
            wrong_token = bearer_metadata("not the job's")
            syncer_pb2_grpc.SyncerStub(channel).Status(pb.StatusRequest(), metadata=wrong_token, timeout=10)

        after = wait_until(lambda: (m := scrape(metrics_port))[("diloco_syncer_live_islands", ())] == 1 and m)
        grew = lambda name, labels=(): after.get((name, labels), 0) - before.get((name, labels), 0)  # noqa: E731
        assert grew("diloco_syncer_merges_total", (("fragment", "0"),)) == 2
        assert after[("diloco_syncer_fragment_version", (("fragment", "0"),))] == 2
        tensor_bytes = sum(torch.Size(s).numel() * 4 for s in SHAPES.values())
        assert grew("diloco_syncer_received_bytes_total") == 2 * tensor_bytes
        assert grew("diloco_syncer_sent_bytes_total") == 2 * tensor_bytes
        assert grew("diloco_syncer_pushes_total", (("result", "accepted"),)) == 2
        assert grew("diloco_syncer_push_staleness_count") == 2
        assert grew("diloco_syncer_push_staleness_bucket", (("le", "0.0"),)) == 1
        assert grew("diloco_syncer_push_staleness_bucket", (("le", "1.0"),)) == 2
        assert grew("diloco_syncer_push_staleness_sum") == 1
        assert grew("diloco_syncer_rejected_pushes_total", (("reason", "shape"),)) == 1
        assert grew("diloco_syncer_rejected_pushes_total", (("reason", "unknown_fragment"),)) == 1
        assert grew("diloco_syncer_rejected_pushes_total", (("reason", "unauthenticated"),)) == 1
        assert grew("diloco_syncer_merge_contributors_count") == 2

    def test_health_is_served_without_a_token(self, start_server):
        server = start_server(config_for(), seed=False)
        with open_channel(server.port) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "diloco.v1.Syncer"):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as refused:
                syncer_pb2_grpc.SyncerStub(channel).Status(pb.StatusRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            status = syncer_pb2_grpc.SyncerStub(channel).Status(
                pb.StatusRequest(), timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),)
            )
            assert status.num_shards == 1


def test_a_checkpoint_that_cannot_be_written_is_counted_and_tried_again(start_server, tmp_path, monkeypatch):
    """A volume the shard's user may not write (a hostPath made by root) fails each write: the shard keeps
    serving and checkpointing, counts the failure, and writes once it can."""
    written = checkpoint.save
    refusals = iter([PermissionError(13, "Permission denied")])

    def save_once_refused(path, state):
        if (refusal := next(refusals, None)) is not None:
            raise refusal
        return written(path, state)

    monkeypatch.setattr(checkpoint, "save", save_once_refused)
    server = start_server(config_for(), checkpoint_interval=0.05)
    failures = "diloco_syncer_checkpoint_failures_total"
    wait_until(lambda: server.metrics.registry.get_sample_value(failures) == 1)
    wait_until(lambda: checkpoint.checkpoint_path(tmp_path / "ckpt", 0, 1).exists())
    assert server.metrics.registry.get_sample_value(failures) == 1
    # Set once the write has returned, just after the file appears: waited for, not read at once.
    last = "diloco_syncer_last_checkpoint_timestamp_seconds"
    written_at = wait_until(lambda: server.metrics.registry.get_sample_value(last))
    assert 0 < time.time() - written_at < 60, "the dashboard's checkpoint age is measured from it"
