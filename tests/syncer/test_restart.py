"""Real `diloco-syncer` processes killed and restarted over their checkpoint folder: kill -9 mid-run with
islands pushing, a graceful SIGTERM, and a checkpoint write cut short."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from syncer_harness import (
    SHAPES,
    ReferenceFragment,
    config_for,
    make_client,
    random_values,
    wait_until,
)

from diloco.core.encoding import Encoding
from diloco.syncer import checkpoint
from diloco.transport.v1 import syncer_pb2 as pb

pytestmark = pytest.mark.process


def checkpoint_file(process) -> Path:
    return checkpoint.checkpoint_path(process.checkpoint_dir, 0, 1)


def saved_versions(process) -> dict[int, int]:
    saved = checkpoint.load(checkpoint_file(process))
    return {} if saved is None else {p: f["version"] for p, f in saved["fragments"].items()}


def status_by_fragment(client) -> dict[int, pb.FragmentStatus]:
    return {f.fragment_id: f for f in client.status().fragments}


def same_values(a: list[tuple[str, torch.Tensor]], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for (_, x), y in zip(a, b))


class Worker(threading.Thread):
    """An island as the worker behaves: pull, push a small delta against what it holds, pull what merged;
    on FAILED_PRECONDITION (a restarted shard's new incarnation, staleness) it pulls afresh and rebases. The
    client retries UNAVAILABLE by itself. Runs while `running` is set, waits while it is clear (checking it
    again between a pull and the push built on it) and stops when `stop` is set, or after `max_steps`."""

    def __init__(
        self, port: int, index: int, running: threading.Event, stop: threading.Event, max_steps: int = 2000
    ) -> None:
        super().__init__(name=f"worker-{index}", daemon=True)
        self.port, self.index, self.running, self.stop, self.max_steps = port, index, running, stop, max_steps
        self.seen: list[tuple[int, int, int, str]] = []  # (fragment, incarnation, version, how)
        self.refusals = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._work()
        except BaseException as error:  # reported by the test
            self.error = error

    def _work(self) -> None:
        generator = torch.Generator().manual_seed(self.index)
        with make_client(self.port, f"island-{self.index}", retry_for=60.0, timeout=10.0) as client:
            client.join(2)
            held: dict[int, pb.FragmentVersion | None] = {0: None, 1: None}
            sequence = 0
            for step in range(self.max_steps):
                if self.stop.is_set():
                    return
                if not self.running.wait(0.05):
                    continue
                p = step % 2
                if held[p] is None:
                    version, values = client.pull(p)
                    self._saw(p, version, "pull", values)
                    held[p] = version
                    if not self.running.is_set():
                        continue
                delta = [(n, torch.randn(s, generator=generator) * 0.01) for n, s in SHAPES.items()]
                try:
                    reply = client.push(
                        p,
                        base=held[p],
                        tokens=100 + self.index,
                        inner_steps=10,
                        sequence=sequence,
                        delta=delta,
                        encoding=Encoding.INT8,
                        block_size=32,
                    )
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    self.refusals += 1
                    held[p] = None
                    continue
                sequence += 1
                self._saw(p, reply.current, "duplicate" if reply.duplicate else "accepted")
                newer = client.pull(p, have=held[p])
                if newer is not None:
                    self._saw(p, newer[0], "pull", newer[1])
                    held[p] = newer[0]
                self.stop.wait(0.01)

    def _saw(self, p: int, version: pb.FragmentVersion, how: str, values=None) -> None:
        if values is not None:
            assert all(torch.isfinite(t).all() for _, t in values), f"non-finite values in fragment {p}"
        self.seen.append((p, version.incarnation, version.version, how))


def test_kill_9_mid_run_resumes_from_the_checkpoint(syncer_process):
    config = config_for(quorum=2, grace_seconds=0.2, max_staleness=8)
    process = syncer_process(config)
    with make_client(process.port) as seeder:
        for p in (0, 1):
            assert seeder.seed(p, random_values(p)).accepted
        lineage = seeder.status().lineage
    assert lineage != 0, "a shard that starts without a checkpoint draws its state's id"

    running, stop = threading.Event(), threading.Event()
    running.set()
    workers = [Worker(process.port, i, running, stop) for i in range(3)]
    for worker in workers:
        worker.start()
    try:
        wait_until(lambda: (v := saved_versions(process)) and min(v.values()) >= 2, timeout=60, interval=0.1)
        assert process.signal(signal.SIGKILL) == -signal.SIGKILL
        running.clear()  # workers finish what they are doing (retrying against the dead shard), then wait

        saved = checkpoint.load(checkpoint_file(process))
        assert saved["clean"] is False
        old_incarnation = saved["incarnation"]
        ckpt = {p: (f["version"], f["values"]) for p, f in saved["fragments"].items()}
        for version, values in ckpt.values():
            assert version >= 2 and all(torch.isfinite(t).all() for t in values)

        process.start()  # same port, same folder
        with make_client(process.port) as observer:
            status = status_by_fragment(observer)
            for p, (version, values) in ckpt.items():
                assert status[p].version.incarnation != old_incarnation, "an unclean stop takes a new incarnation"
                assert (status[p].version.version, status[p].pending) == (version, 0)
                pulled_version, pulled = observer.pull(p)
                assert pulled_version.version == version
                assert same_values(pulled, values), f"fragment {p} differs from its checkpoint"
            new_incarnation = status[0].version.incarnation
            assert observer.status().lineage == lineage, "the state it resumed is the one it had"

            running.set()  # the workers go on by themselves: re-pull, rebase, push

            def everyone_pushed_again() -> bool:
                return all(
                    (p, new_incarnation, "accepted") in {(q, inc, how) for q, inc, _, how in list(worker.seen)}
                    for worker in workers
                    for p in (0, 1)
                )

            wait_until(everyone_pushed_again, timeout=60, interval=0.1)
            wait_until(
                lambda: all(s.version.version >= ckpt[p][0] + 2 for p, s in status_by_fragment(observer).items()),
                timeout=60,
                interval=0.1,
            )
            assert {f"island-{i}" for i in range(3)} <= set(observer.status().live_islands)
    finally:
        stop.set()
        running.set()
        for worker in workers:
            worker.join(timeout=60)
    assert not any(worker.is_alive() for worker in workers)
    for worker in workers:
        assert worker.error is None, f"{worker.name}: {worker.error!r}"

    for worker in workers:
        for p in (0, 1):
            for incarnation in (old_incarnation, new_incarnation):
                seen = [v for q, inc, v, _ in worker.seen if q == p and inc == incarnation]
                assert seen == sorted(seen), f"{worker.name} saw fragment {p} go backwards: {seen}"
            assert {inc for q, inc, _, _ in worker.seen if q == p} <= {old_incarnation, new_incarnation}
            after = [(v, how) for q, inc, v, how in worker.seen if q == p and inc == new_incarnation]
            assert after and min(v for v, _ in after) >= ckpt[p][0], "versions continue from the checkpoint"
            assert any(how == "accepted" for _, how in after), f"{worker.name} pushed {p} again after the restart"
            before = [v for q, inc, v, _ in worker.seen if q == p and inc == old_incarnation]
            assert before, f"{worker.name} worked on fragment {p} before the kill"
        assert any(how == "accepted" for _, inc, _, how in worker.seen if inc == old_incarnation)


class Islands:
    """Islands a, b, c as clients of one shard process, with fragment 0 merged twice (every island reporting
    each round) and a hand-written reference of what fragment 0 must hold."""

    def __init__(self, process, config) -> None:
        seeds = {p: random_values(p) for p in (0, 1)}
        self.clients = {name: make_client(process.port, name, retry_for=30.0) for name in "abc"}
        with make_client(process.port) as seeder:
            for p, values in seeds.items():
                assert seeder.seed(p, values).accepted
        self.join()
        self.incarnation = self.clients["a"].pull(0)[0].incarnation
        self.reference = ReferenceFragment(config, seeds[0])
        self.first_round: list = []
        for r in range(2):
            contributions = [(random_values(10 * r + i, 0.1), 100 + 10 * i) for i in range(3)]
            for name, (delta, tokens) in zip("abc", contributions):
                self.push(name, 0, r, r, delta, tokens)
            self.first_round = self.first_round or contributions
            wait_until(lambda: status_by_fragment(self.clients["a"])[0].version.version == r + 1)
            self.reference.merge(contributions)

    def join(self) -> None:
        for client in self.clients.values():  # after a restart, the old channels reconnect by themselves
            client.join(2)

    def push(self, name, p, version, sequence, delta, tokens) -> pb.PushReply:
        return self.clients[name].push(
            p,
            base=pb.FragmentVersion(incarnation=self.incarnation, version=version),
            tokens=tokens,
            inner_steps=10,
            sequence=sequence,
            delta=delta,
            encoding=Encoding.FP32,
            block_size=0,
        )

    def state(self, client=None) -> dict:
        return {
            p: (
                f.seeded,
                f.version.incarnation,
                f.version.version,
                f.pending,
                f.last_contributors,
                f.last_merge_unix,
                f.max_staleness_seen,
                f.tokens_merged,
            )
            for p, f in status_by_fragment(client or self.clients["a"]).items()
        }

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


@pytest.fixture
def islands_of():
    made = []

    def make(process, config) -> Islands:
        made.append(Islands(process, config))
        return made[-1]

    yield make
    for islands in made:
        islands.close()


def stop_cleanly_and_check_the_checkpoint(process, incarnation: int, pulled: dict) -> None:
    assert process.signal(signal.SIGTERM) == 0, "a graceful stop exits 0"
    saved = checkpoint.load(checkpoint_file(process))
    assert saved["clean"] is True and saved["incarnation"] == incarnation
    for p, (version, values) in pulled.items():
        assert saved["fragments"][p]["version"] == version.version
        assert same_values(values, saved["fragments"][p]["values"])


def test_sigterm_writes_a_clean_checkpoint_and_a_restart_loses_nothing(syncer_process, islands_of):
    config = config_for(quorum=2, grace_seconds=30.0, max_staleness=4)
    process = syncer_process(config)
    islands = islands_of(process, config)
    before = islands.state()
    pulled = {p: islands.clients["a"].pull(p) for p in (0, 1)}
    islands.reference.assert_matches(pulled[0][1])

    stop_cleanly_and_check_the_checkpoint(process, islands.incarnation, pulled)
    process.start()
    with make_client(process.port) as observer:
        assert islands.state(observer) == before, "same incarnation, versions and counters"
        for p, (version, values) in pulled.items():
            assert observer.pull(p, have=version) is None, "an island holding the current version pulls nothing"
            again = observer.pull(p)
            assert again[0] == version and same_values(again[1], [t for _, t in values])

    islands.join()
    delta, tokens = islands.first_round[0]
    assert islands.push("a", 0, 1, 1, delta, tokens).duplicate, "the keys of merged pushes survived"
    # The next merge continues from the restored values and momentum.
    contributions = [(random_values(70 + i, 0.1), 20 + i) for i in range(3)]
    for name, (delta, tokens) in zip("abc", contributions):
        assert not islands.push(name, 0, 2, 5, delta, tokens).duplicate
    wait_until(lambda: status_by_fragment(islands.clients["a"])[0].version.version == 3)
    islands.reference.merge(contributions)
    islands.reference.assert_matches(islands.clients["a"].pull(0)[1])
    assert status_by_fragment(islands.clients["a"])[0].version.incarnation == islands.incarnation


def test_pending_pushes_survive_a_clean_restart_and_still_wait_for_the_quorum(syncer_process, islands_of):
    config = config_for(quorum=2, grace_seconds=30.0, max_staleness=4)
    process = syncer_process(config)
    islands = islands_of(process, config)
    pending_a = (random_values(50, 0.1), 70)
    islands.push("a", 0, 2, 10, *pending_a)
    islands.push("b", 1, 0, 0, random_values(51, 0.1), 30)
    before = islands.state()
    assert {p: s[3] for p, s in before.items()} == {0: 1, 1: 1}
    pulled = {p: islands.clients["a"].pull(p) for p in (0, 1)}

    stop_cleanly_and_check_the_checkpoint(process, islands.incarnation, pulled)
    process.start()
    with make_client(process.port) as observer:
        wait_until(lambda: islands.state(observer))
        time.sleep(0.6)  # more than the merge thread's poll: a merge due now would have happened
        assert islands.state(observer) == before, "one pending push each, below the quorum of two: no merge"

    islands.join()
    assert islands.push("a", 0, 2, 10, *pending_a).duplicate, "the pending push survived: its retry is a duplicate"
    contributions = [pending_a, (random_values(60, 0.1), 40), (random_values(61, 0.1), 90)]
    islands.push("b", 0, 2, 10, *contributions[1])
    islands.push("c", 0, 2, 10, *contributions[2])
    wait_until(lambda: status_by_fragment(islands.clients["a"])[0].version.version == 3)
    merged = status_by_fragment(islands.clients["a"])[0]
    assert (merged.version.incarnation, merged.last_contributors, merged.pending) == (islands.incarnation, 3, 0)
    islands.reference.merge(contributions)
    islands.reference.assert_matches(islands.clients["a"].pull(0)[1])


def test_an_interrupted_checkpoint_write_does_not_stop_a_restart(syncer_process):
    config = config_for(quorum=1, grace_seconds=0.0)
    process = syncer_process(config)
    with make_client(process.port, "a", retry_for=30.0) as client:
        for p in (0, 1):
            assert client.seed(p, random_values(p)).accepted
        client.join(2)
        base = client.pull(0)[0]
        client.push(
            0,
            base=base,
            tokens=10,
            inner_steps=10,
            sequence=0,
            delta=random_values(5, 0.1),
            encoding=Encoding.FP32,
            block_size=0,
        )
        wait_until(lambda: saved_versions(process).get(0) == 1, timeout=30, interval=0.1)
        assert process.signal(signal.SIGKILL) == -signal.SIGKILL

        path = checkpoint_file(process)
        saved = checkpoint.load(path)
        whole = path.read_bytes()
        # What a writer killed mid-write leaves beside the checkpoint: temporary files, torn or empty.
        (path.parent / f".{path.name}.k7x2_q9").write_bytes(whole[: len(whole) // 2])
        (path.parent / f".{path.name}.00000000").write_bytes(b"")

        process.start()
        status = status_by_fragment(client)
        assert status[0].version.version == 1 and status[0].version.incarnation != saved["incarnation"]
        version, values = client.pull(0)
        assert version.version == 1 and same_values(values, saved["fragments"][0]["values"])

        client.push(
            0,
            base=version,
            tokens=10,
            inner_steps=10,
            sequence=1,
            delta=random_values(6, 0.1),
            encoding=Encoding.FP32,
            block_size=0,
        )
        wait_until(lambda: saved_versions(process).get(0) == 2, timeout=30, interval=0.1)
        assert checkpoint.load(path)["incarnation"] == version.incarnation, "checkpoints are written again"
        assert os.path.getsize(path) > 0


def test_a_shard_that_comes_back_without_its_checkpoint_names_a_new_state(syncer_process):
    process = syncer_process(config_for(quorum=1))
    with make_client(process.port) as client:
        assert client.seed(0, random_values(0)).accepted
        lineage = client.status().lineage
    assert process.signal(signal.SIGTERM) == 0
    checkpoint_file(process).unlink()  # the volume lost, as when its claim is deleted and made anew
    process.start()
    with make_client(process.port) as client:
        reply = client.status()
    assert reply.lineage not in (0, lineage), "whoever watches the shard tells a new state from a resumed one"
    assert not any(f.seeded for f in reply.fragments)
