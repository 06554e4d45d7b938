"""The shard's merge decisions, driven with explicit times: quorum, grace, staleness, idempotency, resume."""

import grpc
import pytest
import torch

from diloco.core.config import TrainingConfig
from diloco.core.encoding import Encoded, Encoding, decoded, encode, validated
from diloco.core.grace import ADAPTIVE_MAX_SECONDS, FLOOR_SECONDS, MARGIN, SLACK_FRACTION
from diloco.core.island_id import ISLAND_ID_MAX_CHARS
from diloco.core.merge import MAX_TOKEN_RATIO
from diloco.syncer.shard import MAX_KNOWN_ISLANDS, MAX_PENDING_BYTES, PushKey, Refused, ShardState, TensorSpec
from diloco.transport.codes import status_code
from diloco.transport.v1 import syncer_pb2 as pb

SPECS = (TensorSpec("w", (2,), pb.FLOAT32), TensorSpec("b", (1,), pb.FLOAT32))
INCARNATION = 7


def make_shard(max_pending_bytes: int = MAX_PENDING_BYTES, **overrides) -> ShardState:
    config = TrainingConfig(fragments=2, inner_steps=10, overlap_steps=1, **overrides)
    shard = ShardState(
        config, shard_index=0, num_shards=1, incarnation=INCARNATION, max_pending_bytes=max_pending_bytes
    )
    for p in (0, 1):
        shard.seed(p, SPECS, [torch.zeros(2), torch.zeros(1)])
    return shard


def push(shard, island, now, *, fragment=0, base=None, seq=0, delta=1.0, tokens=100, specs=SPECS, last=False):
    base = shard.fragments[fragment].version if base is None else base
    key = PushKey(island, INCARNATION, base, seq)
    deltas = [torch.full((2,), delta), torch.full((1,), delta)]
    return shard.submit(key, fragment, specs, deltas, tokens, 10, now, last=last)


def outer_lr_first_step(delta: float, config: TrainingConfig) -> float:
    """θ after one Nesterov step from 0 with zero momentum: −lr·(g + μ·g)."""
    return -config.outer.lr * (delta + config.outer.momentum * delta)


class TestSeed:
    def test_first_seed_wins(self):
        shard = make_shard()
        assert shard.seed(0, SPECS, [torch.ones(2), torch.ones(1)]) is False
        assert torch.equal(shard.fragments[0].values[0], torch.zeros(2))

    def test_push_to_unseeded_fragment_is_a_failed_precondition(self):
        shard = ShardState(TrainingConfig(fragments=1, inner_steps=10, overlap_steps=1), 0, 1, INCARNATION)
        with pytest.raises(Refused) as refused:
            shard.check_push(PushKey("a", INCARNATION, 0, 0), 0, SPECS, 100, 10)
        assert status_code(refused.value.kind) == grpc.StatusCode.FAILED_PRECONDITION

    def test_unknown_fragment_is_invalid(self):
        shard = ShardState(TrainingConfig(fragments=4, inner_steps=8, overlap_steps=1), 1, 2, INCARNATION)
        assert sorted(shard.fragments) == [1, 3]
        with pytest.raises(Refused) as refused:
            shard.fragment(2)
        assert status_code(refused.value.kind) == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.reason == "unknown_fragment"


class TestQuorumAndGrace:
    def test_merge_waits_for_quorum(self):
        shard = make_shard(quorum=2, grace_seconds=5.0, island_timeout_seconds=1000.0)
        for island in "abc":
            shard.join(island, 0.0)
        push(shard, "a", 1.0)
        assert shard.poll(1.0) == []
        assert shard.poll(100.0) == [], "one push never reaches a quorum of two, however long we wait"

    def test_quorum_then_grace_window_bounds_the_wait(self):
        shard = make_shard(quorum=2, grace_seconds=5.0)
        for island in "abc":
            shard.join(island, 0.0)
        push(shard, "a", 1.0)
        push(shard, "b", 2.0)
        assert shard.poll(2.0) == [], "c is live and may still report within the grace window"
        assert shard.next_deadline() == pytest.approx(7.0)
        assert shard.poll(6.9) == []
        assert shard.poll(7.0) == [0], "the slow island c does not block the merge past the grace window"

    def test_merge_is_immediate_when_every_live_island_reported(self):
        shard = make_shard(quorum=1, grace_seconds=60.0)
        for island in "ab":
            shard.join(island, 0.0)
        push(shard, "a", 1.0)
        push(shard, "b", 1.0)
        assert shard.poll(1.0) == [0]

    def test_quorum_is_capped_by_live_islands(self):
        shard = make_shard(quorum=3, grace_seconds=0.0, island_timeout_seconds=10.0)
        for island in "abc":
            shard.join(island, 0.0)
        push(shard, "a", 20.0)
        assert shard.effective_quorum(20.0) == 1, "b and c have not been heard from for 20 s"
        assert shard.poll(20.0) == [0]

    def test_an_island_that_left_holds_nothing_back(self):
        shard = make_shard(quorum=3, grace_seconds=60.0, island_timeout_seconds=1000.0)
        for island in "abc":
            shard.join(island, 0.0)
        shard.leave("c")
        push(shard, "a", 1.0)
        push(shard, "b", 1.0)
        assert shard.live_islands(1.0) == ["a", "b"] and shard.effective_quorum(1.0) == 2
        assert shard.poll(1.0) == [0], "everyone still live reported: no grace window for the island that left"

    def test_islands_that_finished_count_for_the_rounds_of_an_island_timeout(self):
        # The slowest island's last rounds come after the others finished and left: each of its merges is its
        # share of a round, as it would be beside islands gone silent, not a whole round of its own.
        shard = make_shard(quorum=1, island_timeout_seconds=60.0)
        for island in "abcd":
            shard.join(island, 0.0)
            push(shard, island, 0.0)
        shard.merge(0, 0.0)
        for island in "abc":
            shard.leave(island)
        frag = shard.fragments[0]
        for seq in range(1, 6):  # the round they left in, then the next
            push(shard, "d", float(seq), seq=seq)
            assert shard.live_islands(float(seq)) == ["d"], "they hold no merge back"
            assert shard.merge_share(frag, 1, float(seq)) == 0.25
            shard.merge(0, float(seq))
        push(shard, "d", 61.0, seq=6)
        assert shard.merge_share(frag, 1, 61.0) == 1.0, "an island timeout after they were last heard of"

    def test_an_island_that_left_is_live_again_only_when_it_joins(self):
        shard = make_shard(quorum=1, island_timeout_seconds=1000.0)
        shard.join("a", 0.0)
        shard.leave("a")
        push(shard, "a", 1.0)  # a retry that landed after the leave still counts as a contribution
        assert shard.live_islands(1.0) == [] and shard.left.keys() == {"a"}
        shard.join("a", 2.0)
        assert shard.live_islands(2.0) == ["a"] and not shard.left

    def test_once_every_island_has_left_nothing_is_awaited(self):
        shard = make_shard(quorum=2, grace_seconds=60.0, island_timeout_seconds=1000.0)
        for island in "ab":
            shard.join(island, 0.0)
            push(shard, island, 1.0)
            shard.leave(island)
        assert shard.poll(1.0) == [0], "the last pushes of a finished job merge at once, ready to export"

    def test_no_live_island_is_not_everyone_reporting(self):
        shard = make_shard(quorum=1, grace_seconds=5.0, island_timeout_seconds=10.0)
        push(shard, "a", 0.0)
        assert shard.poll(100.0) == [], "a timed out: nobody is live, so the grace window still runs"
        assert shard.poll(105.0) == [0]


ARRIVALS = {"a": 0.0, "b": 0.5, "c": 0.5, "d": 2.0}
"""Seconds after a that each island pushes in TestAdaptiveGrace's rounds."""


class TestAdaptiveGrace:
    """Islands b and c arrive 0.5 s after a, d 2 s after: the window learns 2 s, not the 30 s configured."""

    def learned_shard(self, rounds: int = 3) -> tuple[ShardState, float]:
        shard = make_shard(quorum=1, grace_seconds=30.0, island_timeout_seconds=1000.0)
        for island in ARRIVALS:
            shard.join(island, 0.0)
        start = 0.0
        for _ in range(rounds):
            self.round(shard, start, ARRIVALS)
            start += 10.0
        return shard, start

    @staticmethod
    def round(shard: ShardState, start: float, arrivals: dict[str, float]) -> list[int]:
        """Pushes of fragment 0 at `start` + each island's lateness; merges as soon as one is due."""
        for island, late in sorted(arrivals.items(), key=lambda item: item[1]):
            push(shard, island, start + late)
            due = shard.poll(start + late)
            if due:
                shard.merge(0, start + late)
                return due
        return []

    def test_the_window_is_sized_from_the_lateness_seen(self):
        shard, _ = self.learned_shard()
        assert shard.grace_seconds() == pytest.approx(MARGIN * 2.0)

    def test_a_late_island_is_held_and_merged(self):
        shard, start = self.learned_shard()
        assert self.round(shard, start, {"a": 0.0, "b": 0.5, "c": 0.5}) == []
        assert shard.poll(start + 2.9) == [], "d is late, not dead: within the window it learned"
        push(shard, "d", start + 2.9)
        assert shard.poll(start + 2.9) == [0]
        assert shard.merge(0, start + 2.9).contributors == ("a", "b", "c", "d")
        assert shard.lateness[-1] == pytest.approx(2.9)

    def test_an_island_that_left_is_not_waited_for(self):
        shard, start = self.learned_shard()
        shard.leave("d")
        assert self.round(shard, start, {"a": 0.0, "b": 0.5, "c": 0.5}) == [0]

    def test_an_island_whose_lease_expired_is_not_waited_for(self):
        shard, start = self.learned_shard()
        start += 1000.0
        assert self.round(shard, start, {"a": 0.0, "b": 0.5, "c": 0.5}) == [0], "d was last seen 1000 s ago"

    def test_a_silent_live_island_holds_a_merge_only_for_the_learned_window(self):
        shard, start = self.learned_shard()
        self.round(shard, start, {"a": 0.0, "b": 0.5, "c": 0.5})
        assert shard.next_deadline() == pytest.approx(start + MARGIN * 2.0)
        assert shard.poll(start + MARGIN * 2.0) == [0], "not the 30 s configured"

    def test_an_island_that_missed_a_merge_is_counted_late_for_it(self):
        shard, start = self.learned_shard()
        self.round(shard, start, {"a": 0.0, "b": 0.5, "c": 0.5})
        shard.merge(0, start + 3.0)
        push(shard, "d", start + 6.0, base=shard.fragments[0].version - 1)
        assert shard.lateness[-1] == 6.0, "the window that cut it off learns how late it was"

    def test_before_it_has_seen_enough_the_shard_waits_the_configured_window(self):
        shard = make_shard(quorum=1, grace_seconds=30.0, island_timeout_seconds=1000.0)
        assert shard.grace_seconds() == 30.0

    def test_unset_the_window_for_pushes_that_say_no_slack_is_at_most_two_seconds(self):
        assert make_shard(quorum=1).grace_seconds() == ADAPTIVE_MAX_SECONDS == 2.0


class TestMergeWindow:
    """Once its quorum is in, a merge waits for every live island up to its window, and never past the slack
    of the islands already in it (`diloco.core.grace`)."""

    def test_a_merge_waits_the_window_for_every_live_island(self):
        shard = make_shard(quorum=1, grace_seconds=2.0, island_timeout_seconds=1000.0)
        for island in "ab":
            shard.join(island, 0.0)
        push(shard, "a", 0.0)
        assert shard.poll(0.0) == [] and shard.poll(1.9) == [], "b is live and may come"
        assert shard.poll(2.0) == [0]

    def test_a_merge_goes_ahead_once_every_live_island_has_pushed(self):
        shard = make_shard(quorum=1, grace_seconds=2.0)
        for island in "ab":
            shard.join(island, 0.0)
        push(shard, "a", 0.0)
        push(shard, "b", 0.5)
        assert shard.poll(0.5) == [0]

    def test_a_merge_closes_within_the_slack_of_the_islands_in_it(self):
        shard = make_shard(quorum=1, grace_seconds=2.0)
        for island in "ab":
            shard.join(island, 0.0)
        key = PushKey("a", INCARNATION, 0, 0)
        shard.submit(key, 0, SPECS, [torch.zeros(2), torch.zeros(1)], 100, 10, 10.0, slack_seconds=0.5)
        assert shard.poll(10.0) == [] and shard.poll(10.3) == []
        assert shard.closes(shard.fragments[0]) == pytest.approx(10.0 + SLACK_FRACTION * 0.5)
        assert shard.poll(10.0 + SLACK_FRACTION * 0.5) == [0], "a mixes in at 10.5: b is not waited for longer"

    def test_a_late_island_is_waited_for_past_the_lateness_seen_within_the_slack(self):
        shard = make_shard(quorum=1, island_timeout_seconds=1000.0)
        for island in "ab":
            shard.join(island, 0.0)
        shard.lateness.extend([0.1] * 8)  # the islands have come together so far
        assert shard.grace_seconds() == pytest.approx(FLOOR_SECONDS), "the window for pushes that say no slack"
        key = PushKey("a", INCARNATION, 0, 0)
        shard.submit(key, 0, SPECS, [torch.zeros(2), torch.zeros(1)], 100, 10, 10.0, slack_seconds=8.0)
        assert shard.poll(10.0) == [] and shard.poll(13.0) == [], "b, 3 s late, costs a nothing: it is waited for"
        assert shard.closes(shard.fragments[0]) == pytest.approx(10.0 + SLACK_FRACTION * 8.0), "past 2 s"
        assert shard.poll(10.0 + SLACK_FRACTION * 8.0) == [0]

    @pytest.mark.parametrize("grace", [0.0, 3.0])
    def test_a_grace_the_job_sets_caps_the_wait_whatever_the_slack(self, grace):
        shard = make_shard(quorum=1, grace_seconds=grace, island_timeout_seconds=1000.0)
        for island in "ab":
            shard.join(island, 0.0)
        key = PushKey("a", INCARNATION, 0, 0)
        shard.submit(key, 0, SPECS, [torch.zeros(2), torch.zeros(1)], 100, 10, 10.0, slack_seconds=8.0)
        if grace:
            assert shard.poll(10.0) == [] and shard.closes(shard.fragments[0]) == pytest.approx(10.0 + grace)
        assert shard.poll(10.0 + grace) == [0], "b is not waited for past graceSeconds"

    @pytest.mark.parametrize("slack", [float("nan"), float("inf"), -0.1])
    def test_a_slack_that_is_not_a_finite_duration_is_refused(self, slack):
        shard = make_shard()
        with pytest.raises(Refused) as refused:
            shard.check_push(PushKey("a", INCARNATION, 0, 0), 0, SPECS, 100, 10, slack)
        assert status_code(refused.value.kind) == grpc.StatusCode.INVALID_ARGUMENT and refused.value.reason == "slack"
        assert shard.fragments[0].pending == {}


class TestCadence:
    def test_the_cadence_is_the_fastest_live_island_s_seconds_per_step(self):
        shard = make_shard(island_timeout_seconds=100.0)
        for island, seconds in (("a", 0.3), ("b", 0.1)):
            shard.join(island, 0.0)
            key = PushKey(island, INCARNATION, 0, 0)
            shard.submit(key, 0, SPECS, [torch.zeros(2), torch.zeros(1)], 100, 10, 1.0, step_seconds=seconds)
        assert shard.cadence_step_seconds(1.0) == 0.1
        shard.leave("b")
        assert shard.cadence_step_seconds(1.0) == 0.3, "an island that left sets no cadence"
        assert shard.cadence_step_seconds(500.0) == 0.0, "nor one whose lease expired"


class TestMerge:
    def test_single_contribution_takes_one_nesterov_step(self):
        shard = make_shard()
        push(shard, "a", 0.0, delta=1.0)
        record = shard.merge(0, 0.0)
        expected = outer_lr_first_step(1.0, shard.config)
        assert record.version == 1 and record.contributors == ("a",)
        assert torch.allclose(shard.fragments[0].values[0], torch.full((2,), expected))
        assert shard.fragments[0].pending == {}

    def test_contributions_are_weighted_by_tokens(self):
        shard = make_shard()
        for island in "ab":  # two contributions at quorum 1: the islands joined
            shard.join(island, 0.0)
        push(shard, "a", 0.0, delta=1.0, tokens=100)
        push(shard, "b", 0.0, delta=5.0, tokens=300)
        shard.merge(0, 0.0)
        mean = (1.0 * 100 + 5.0 * 300) / 400
        assert torch.allclose(shard.fragments[0].values[1], torch.full((1,), outer_lr_first_step(mean, shard.config)))

    def test_merge_leaves_other_fragments_alone(self):
        shard = make_shard()
        push(shard, "a", 0.0)
        shard.merge(0, 0.0)
        assert shard.fragments[1].version == 0
        assert torch.equal(shard.fragments[1].values[0], torch.zeros(2))


class TestStalenessAndIdempotency:
    def test_duplicate_push_counts_once(self):
        shard = make_shard(quorum=2, grace_seconds=60.0)
        first = push(shard, "a", 0.0, seq=3)
        again = push(shard, "a", 0.1, seq=3, delta=99.0)
        assert not first.duplicate and again.duplicate
        assert torch.equal(shard.fragments[0].pending["a"].delta[0], torch.ones(2))

    def test_retry_after_merge_is_a_duplicate(self):
        shard = make_shard()
        push(shard, "a", 0.0, seq=1)
        shard.merge(0, 0.0)
        assert push(shard, "a", 1.0, base=0, seq=1).duplicate
        assert shard.fragments[0].pending == {}

    def test_newer_push_replaces_pending_and_late_retry_does_not(self):
        shard = make_shard(quorum=2, grace_seconds=60.0)
        push(shard, "a", 0.0, seq=1, delta=1.0)
        push(shard, "a", 0.1, seq=2, delta=2.0)
        assert push(shard, "a", 0.2, seq=1, delta=1.0).duplicate, "a late retry of a superseded push"
        assert torch.equal(shard.fragments[0].pending["a"].delta[0], torch.full((2,), 2.0))

    def test_stale_beyond_bound_is_refused_and_changes_nothing(self):
        shard = make_shard(max_staleness=1)
        for _ in range(3):
            push(shard, "a", 0.0)
            shard.merge(0, 0.0)
        before = shard.fragments[0].values[0].clone()
        with pytest.raises(Refused) as refused:
            push(shard, "b", 1.0, base=1)
        assert (
            status_code(refused.value.kind) == grpc.StatusCode.FAILED_PRECONDITION and refused.value.reason == "stale"
        )
        assert shard.fragments[0].pending == {}
        assert torch.equal(shard.fragments[0].values[0], before)

    def test_staleness_within_bound_is_reported_and_down_weighted(self):
        shard = make_shard(max_staleness=2, staleness_decay=0.5)
        shard.join("a", 0.0)
        push(shard, "a", 0.0)
        shard.merge(0, 0.0)
        for island in "bc":
            shard.join(island, 1.0)
        result = push(shard, "b", 1.0, base=0, delta=4.0, tokens=100)
        push(shard, "c", 1.0, base=1, delta=1.0, tokens=100)
        assert result.staleness == 1
        shard.merge(0, 1.0)
        assert shard.fragments[0].max_staleness_seen == 1
        lr = shard.config.outer.lr
        after_first = outer_lr_first_step(1.0, shard.config)
        grad = (4.0 * 100 * 0.5 + 1.0 * 100) / (100 * 0.5 + 100)
        # The first merge, a's alone before b and c joined, was a whole round (momentum 1.0 after it). This one
        # opens the next, of a, b and c, and takes 2/3 of its gradient; the look-ahead waits for the round's end.
        share = 2 / 3
        expected = after_first - lr * share * grad
        assert torch.allclose(shard.fragments[0].values[0], torch.full((2,), expected))

    def test_base_ahead_or_from_another_incarnation_asks_for_a_pull(self):
        shard = make_shard()
        with pytest.raises(Refused) as ahead:
            push(shard, "a", 0.0, base=5)
        other = PushKey("a", INCARNATION + 1, 0, 0)
        with pytest.raises(Refused) as foreign:
            shard.submit(other, 0, SPECS, [torch.zeros(2), torch.zeros(1)], 1, 1, 0.0)
        assert (ahead.value.reason, foreign.value.reason) == ("ahead", "incarnation")
        assert status_code(ahead.value.kind) == status_code(foreign.value.kind) == grpc.StatusCode.FAILED_PRECONDITION

    @pytest.mark.parametrize(
        "specs, reason",
        [
            ((TensorSpec("w", (3,), pb.FLOAT32), SPECS[1]), "shape"),
            ((SPECS[0],), "shape"),
            ((TensorSpec("w", (2,), pb.BFLOAT16), SPECS[1]), "dtype"),
        ],
    )
    def test_wrong_layout_is_invalid(self, specs, reason):
        shard = make_shard()
        with pytest.raises(Refused) as refused:
            shard.check_push(PushKey("a", INCARNATION, 0, 0), 0, specs, 100, 10)
        assert status_code(refused.value.kind) == grpc.StatusCode.INVALID_ARGUMENT and refused.value.reason == reason


class TestPendingRoom:
    """Islands that never joined hold at most max(joined islands, quorum) pending deltas of a fragment."""

    def test_a_stranger_beyond_the_room_is_refused_and_changes_nothing(self):
        shard = make_shard(quorum=2, grace_seconds=60.0)
        shard.join("a", 0.0)
        push(shard, "x", 0.0)
        push(shard, "y", 0.0)
        with pytest.raises(Refused) as refused:
            push(shard, "z", 0.0)
        assert status_code(refused.value.kind) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert sorted(shard.fragments[0].pending) == ["x", "y"]
        assert shard.islands == {"a": 0.0}

    def test_joined_islands_and_replacements_always_have_room(self):
        shard = make_shard(quorum=1, grace_seconds=60.0)
        push(shard, "x", 0.0)
        push(shard, "x", 0.0, seq=1, delta=2.0)  # a newer push replaces x's own
        shard.join("a", 0.0)
        shard.join("b", 0.0)
        push(shard, "a", 0.0)
        push(shard, "b", 0.0)
        assert sorted(shard.fragments[0].pending) == ["a", "b", "x"]
        assert torch.equal(shard.fragments[0].pending["x"].delta[0], torch.full((2,), 2.0))


class TestPendingBytes:
    """The pending deltas of all the shard's fragments together take at most `max_pending_bytes`."""

    FRAGMENT_BYTES = 3 * 4  # SPECS: three float32 values

    def bounded_shard(self, deltas: int) -> ShardState:
        shard = make_shard(deltas * self.FRAGMENT_BYTES, quorum=3, grace_seconds=60.0)
        for island in "abc":
            shard.join(island, 0.0)
        return shard

    def test_a_push_beyond_the_bound_is_refused_from_its_header_and_changes_nothing(self):
        shard = self.bounded_shard(deltas=2)
        push(shard, "a", 0.0, fragment=0)
        push(shard, "b", 0.0, fragment=1)
        assert shard.pending_bytes() == shard.max_pending_bytes
        with pytest.raises(Refused) as refused:
            shard.check_push(PushKey("c", INCARNATION, 0, 0), 0, SPECS, 100, 10)
        assert status_code(refused.value.kind) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.reason == "pending_bytes"
        with pytest.raises(Refused):
            push(shard, "c", 0.0, fragment=0)
        assert (sorted(shard.fragments[0].pending), sorted(shard.fragments[1].pending)) == (["a"], ["b"])
        assert shard.islands == {"a": 0.0, "b": 0.0, "c": 0.0}

    def test_a_newer_push_replacing_the_island_s_own_takes_no_more(self):
        shard = self.bounded_shard(deltas=1)
        push(shard, "a", 0.0)
        push(shard, "a", 0.0, seq=1, delta=2.0)
        assert torch.equal(shard.fragments[0].pending["a"].delta[0], torch.full((2,), 2.0))
        assert shard.pending_bytes() == self.FRAGMENT_BYTES

    def test_a_merge_frees_its_bytes_for_the_next_push(self):
        shard = self.bounded_shard(deltas=1)
        push(shard, "a", 0.0)
        with pytest.raises(Refused):
            push(shard, "b", 0.0)
        shard.merge(0, 0.0)
        push(shard, "b", 0.0)
        assert sorted(shard.fragments[0].pending) == ["b"]

    def test_a_resumed_shard_holds_the_bound_it_is_given(self):
        shard = self.bounded_shard(deltas=1)
        push(shard, "a", 0.0)
        saved = shard.to_state_dict(clean=True)
        resumed = ShardState.from_state_dict(shard.config, 0, 1, saved, INCARNATION, self.FRAGMENT_BYTES)
        with pytest.raises(Refused):
            push(resumed, "b", 0.0)


class TestCheckpointState:
    def test_clean_resume_keeps_incarnation_pending_and_keys(self):
        shard = make_shard(quorum=2, grace_seconds=60.0)
        push(shard, "a", 0.0, seq=1)
        shard.merge(0, 0.0)
        push(shard, "b", 1.0, seq=2)
        resumed = ShardState.from_state_dict(shard.config, 0, 1, shard.to_state_dict(clean=True), 99)
        assert resumed.incarnation == INCARNATION
        assert resumed.fragments[0].version == 1
        assert "b" in resumed.fragments[0].pending
        assert push(resumed, "a", 2.0, base=0, seq=1).duplicate

    def test_resume_remembers_when_islands_were_heard_from(self):
        shard = make_shard(quorum=2, grace_seconds=60.0, island_timeout_seconds=1000.0)
        shard.join("a", 0.0)
        push(shard, "a", 0.0)
        shard.join("b", 0.0)
        for clean in (True, False):
            resumed = ShardState.from_state_dict(shard.config, 0, 1, shard.to_state_dict(clean=clean), 99)
            assert resumed.live_islands(1.0) == ["a", "b"]
            assert resumed.effective_quorum(1.0) == 2, "the quorum cap does not fall to one after a restart"

    def test_resume_remembers_which_islands_left(self):
        shard = make_shard()
        shard.join("a", 0.0)
        shard.leave("a")
        resumed = ShardState.from_state_dict(shard.config, 0, 1, shard.to_state_dict(clean=True), 99)
        assert resumed.left.keys() == {"a"} and resumed.live_islands(1.0) == []

    def test_unclean_resume_takes_a_new_incarnation_and_drops_pending(self):
        shard = make_shard()
        push(shard, "a", 0.0)
        shard.merge(0, 0.0)
        push(shard, "b", 1.0)
        resumed = ShardState.from_state_dict(shard.config, 0, 1, shard.to_state_dict(clean=False), 99)
        assert resumed.incarnation == 99
        assert resumed.fragments[0].pending == {}
        assert torch.equal(resumed.fragments[0].values[0], shard.fragments[0].values[0])
        assert resumed.fragments[0].version == 1

    def test_a_resumed_shard_keeps_the_lineage_of_its_state_and_an_old_checkpoint_has_none(self):
        shard = ShardState(make_shard().config, 0, 1, INCARNATION, lineage=7)
        for clean in (True, False):
            assert ShardState.from_state_dict(shard.config, 0, 1, shard.to_state_dict(clean=clean), 99).lineage == 7
        old = {k: v for k, v in shard.to_state_dict(clean=True).items() if k != "lineage"}
        assert ShardState.from_state_dict(shard.config, 0, 1, old, 99).lineage == 0, "not known"

    def test_resume_refuses_a_checkpoint_of_another_layout(self):
        shard = make_shard()
        with pytest.raises(ValueError, match="shard 0 of 1"):
            ShardState.from_state_dict(shard.config, 0, 2, shard.to_state_dict(clean=True), 1)


class TestIslandsOutOfPhase:
    """Islands that drift out of phase (restarts, mixed speeds) with K = 1 are merged one at a time. Each
    island here runs H SGD steps on a noisy quadratic, pushes its delta, and mixes the merged values in with
    α = 0.5, like a learner; only the phase of the islands' schedules differs between the two runs."""

    @staticmethod
    def train(out_of_phase: bool, islands: int = 4, rounds: int = 60, h: int = 10) -> tuple[float, float]:
        """The quadratic's loss at the global values before and after training."""
        torch.manual_seed(0)
        curvature, optimum = torch.linspace(0.2, 2.0, 32), torch.randn(32)
        spec = (TensorSpec("w", (32,), pb.FLOAT32),)
        config = TrainingConfig(
            fragments=1,
            inner_steps=h,
            overlap_steps=0,
            quorum=1,
            grace_seconds=0.0,
            mix_alpha=0.5,
            max_staleness=2 * islands,
        )
        shard = ShardState(config, shard_index=0, num_shards=1, incarnation=INCARNATION)
        shard.seed(0, spec, [torch.zeros(32)])
        local = [torch.zeros(32) for _ in range(islands)]
        base = [(torch.zeros(32), 0) for _ in range(islands)]
        for i in range(islands):
            shard.join(f"island-{i}", 0.0)
        for step in range(1, rounds * h + 1):
            due = [i for i in range(islands) if (step + (i * h // islands if out_of_phase else 0)) % h == 0]
            for i in range(islands):
                local[i] -= 0.05 * (curvature * (local[i] - optimum) + 0.3 * torch.randn(32))
            for i in due:
                key = PushKey(f"island-{i}", INCARNATION, base[i][1], step)
                shard.submit(key, 0, spec, [base[i][0] - local[i]], 100, h, float(step))
            for p in shard.poll(float(step)):
                shard.merge(p, float(step))
            fragment = shard.fragments[0]
            for i in due:
                local[i] = torch.lerp(fragment.values[0], local[i], 0.5)
                base[i] = (fragment.values[0].clone(), fragment.version)

        def loss(values: torch.Tensor) -> float:
            return 0.5 * float((curvature * (values - optimum) ** 2).sum())

        return loss(torch.zeros(32)), loss(shard.fragments[0].values[0])

    def test_one_at_a_time_merges_converge_like_merges_of_everyone(self):
        (start, in_phase), (_, out_of_phase) = self.train(False), self.train(True)
        assert in_phase < start / 100
        assert out_of_phase < start / 100, (out_of_phase, in_phase, start)

    def test_a_merge_is_the_share_of_the_live_islands_it_holds(self):
        shard = make_shard(quorum=1, grace_seconds=0.0)
        for island in "abcd":
            shard.join(island, 0.0)
        frag = shard.fragments[0]
        assert shard.merge_share(frag, 1, 1.0) == 0.25
        assert shard.merge_share(frag, 4, 1.0) == 1.0
        later = 1.0 + shard.config.island_timeout_seconds + 1
        assert shard.merge_share(frag, 1, later) == 1.0, "dead islands count not"

    def test_a_round_is_never_more_islands_than_the_job_declares(self):
        shard = ShardState(make_shard().config, 0, 1, incarnation=1, declared_islands=4)
        for island in [*"abc", *(f"invented-{i}" for i in range(1000))]:
            shard.join(island, 0.0)
        frag = shard.fragments[0]
        assert shard.merge_share(frag, 3, 1.0) == 3 / 4, "a thousand invented ids make a merge of 3 no smaller"
        assert shard.merge_share(frag, 1, 1.0) == 1 / 4
        resumed = ShardState.from_state_dict(
            shard.config, 0, 1, shard.to_state_dict(clean=True), new_incarnation=2, declared_islands=4
        )
        assert resumed.merge_share(resumed.fragments[0], 3, 1.0) == 3 / 4, "and after a restart"


class TestRoundsOfShares:
    """However a round's pushes are grouped in time, the fragment moves as one merge of all of them would:
    against a shard that merges every round's deltas together (the synchronous reference)."""

    ISLANDS = "abcd"

    def run(self, groups_per_round: list[list[str]], leave_after: dict[str, int] | None = None) -> ShardState:
        """Rounds of one delta per island, each island's delta the same on both shards; `groups_per_round`
        says which islands each merge of a round holds, `leave_after` the merge after which an island leaves."""
        shard = make_shard(quorum=1, grace_seconds=0.0, island_timeout_seconds=1e9)
        for island in self.ISLANDS:
            shard.join(island, 0.0)
        gen = torch.Generator().manual_seed(3)
        merges = 0
        for r, groups in enumerate(groups_per_round):
            deltas = {i: float(torch.randn(1, generator=gen)) for i in self.ISLANDS}
            for group in groups:
                for island in group:
                    push(shard, island, float(r), seq=r, delta=deltas[island])
                shard.merge(0, float(r))
                merges += 1
                for island, after in (leave_after or {}).items():
                    if after == merges:
                        shard.leave(island)
        return shard

    def assert_same(self, shard: ShardState, reference: ShardState) -> None:
        frag, want = shard.fragments[0], reference.fragments[0]
        for got, expected in zip([*frag.values, *frag.momentum], [*want.values, *want.momentum]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

    def test_islands_merged_one_at_a_time_move_the_fragment_as_merges_of_all(self):
        rounds = 5
        together = self.run([[self.ISLANDS]] * rounds)
        apart = self.run([[*self.ISLANDS]] * rounds)
        paired = self.run([["ab", "cd"], ["a", "bcd"], ["abc", "d"], ["d", "c", "ba"], ["abcd"]])
        assert together.fragments[0].version == rounds and apart.fragments[0].version == 4 * rounds
        self.assert_same(apart, together)
        self.assert_same(paired, together)
        assert apart.fragments[0].round_progress == 0.0

    def test_islands_that_finish_one_after_another_do_not_enlarge_the_last_merges(self):
        # The last round: each island's last push merged alone, and the island leaves after it, as at the end
        # of a job. Those merges are still quarters of the round that they end.
        last = {island: 4 + n for n, island in enumerate(self.ISLANDS, start=1)}
        finishing = self.run([[self.ISLANDS]] * 4 + [[*self.ISLANDS]], leave_after=last)
        together = self.run([[self.ISLANDS]] * 5)
        self.assert_same(finishing, together)
        assert finishing.fragments[0].round_left == {"d"}, "a, b and c counted for the round that ended; d left after"

    def test_momentum_follows_the_share_of_the_last_round_that_was_fresh(self):
        shard = make_shard(quorum=1, grace_seconds=0.0, island_timeout_seconds=1e9)
        for island in "ab":
            shard.join(island, 0.0)
        frag = shard.fragments[0]
        push(shard, "a", 0.0)
        push(shard, "b", 0.0)
        shard.merge(0, 0.0)
        assert frag.freshness == 1.0, "both deltas were computed against the version they went into"
        push(shard, "a", 1.0, base=0, seq=1)  # both a round stale: computed against version 0, merged into 1
        shard.merge(0, 1.0)
        push(shard, "b", 1.0, base=0, seq=1)
        shard.merge(0, 1.0)
        assert frag.freshness == 0.0
        before, momentum = [v.clone() for v in frag.values], [m.clone() for m in frag.momentum]
        push(shard, "a", 2.0, seq=2, delta=1.0)  # fresh, but the round it opens carries no momentum
        shard.merge(0, 2.0)
        lr = shard.config.outer.lr
        torch.testing.assert_close(frag.momentum[0], torch.full((2,), 0.5))
        torch.testing.assert_close(frag.values[0], before[0] - lr * 0.5 * 1.0)
        assert momentum[0].abs().sum() > 0, "there was momentum to carry"

    def test_a_round_opens_when_its_first_merge_got_its_pushes(self):
        shard = make_shard(quorum=1, grace_seconds=60.0)
        for island in "abcd":
            shard.join(island, 0.0)
        for island, at in (("a", 10.0), ("b", 10.2), ("c", 11.0)):
            push(shard, island, at)
        shard.merge(0, 11.0)
        assert shard.fragments[0].round_opened == 10.2, "the median of the pushes of the merge that opened it"
        push(shard, "d", 11.5, base=0)  # d missed that merge: its merge ends the round, and opens none
        shard.merge(0, 11.5)
        assert shard.fragments[0].round_opened == 10.2
        for island, at in (("a", 20.0), ("b", 20.4)):
            push(shard, island, at, seq=1)
        shard.merge(0, 20.4)
        assert shard.fragments[0].round_opened == pytest.approx(20.2), "the next round"

    def test_a_round_in_progress_survives_a_restart(self):
        shard = make_shard(quorum=1, grace_seconds=0.0)
        for island in "abcd":
            shard.join(island, 0.0)
        push(shard, "a", 0.0)
        shard.merge(0, 0.0)
        shard.leave("b")
        saved = shard.to_state_dict(clean=True)
        resumed = ShardState.from_state_dict(shard.config, 0, 1, saved, new_incarnation=INCARNATION + 1)
        assert resumed.fragments[0].round_progress == shard.fragments[0].round_progress == 0.25
        assert resumed.fragments[0].round_left == {"b"}


class TestLastPushes:
    """An island's last pushes (the end of its run) land the fragment on the mean of the islands' models: no
    outer learning rate or momentum past it, for rounds that will not come."""

    def trained(self):
        shard = make_shard()
        for island in "abcd":
            shard.join(island, 0.0)
        for island in "abcd":
            push(shard, island, 0.0, delta=1.0)
        shard.merge(0, 0.0)  # one whole round: momentum 1.0
        return shard

    def test_every_islands_last_push_in_one_merge_lands_on_the_mean_of_their_models(self):
        shard = self.trained()
        frag = shard.fragments[0]
        before, momentum = frag.values[0].clone(), [m.clone() for m in frag.momentum]
        for island, delta in zip("abcd", (0.2, 0.4, 0.6, 0.8)):
            push(shard, island, 1.0, delta=delta, last=True)
        record = shard.merge(0, 1.0)
        assert record.landed == 4 and frag.version == 2
        assert torch.allclose(frag.values[0], before - 0.5)  # the models before − δ, averaged
        assert all(torch.equal(a, b) for a, b in zip(frag.momentum, momentum))
        assert frag.round_progress == 0.0

    def test_last_pushes_land_as_their_share_and_the_others_step_in_the_same_merge(self):
        shard = self.trained()
        frag = shard.fragments[0]
        before = frag.values[0].clone()
        push(shard, "a", 1.0, delta=0.4)  # still training: a quarter of the next round, no look-ahead yet
        push(shard, "b", 1.0, delta=0.8, last=True)
        record = shard.merge(0, 1.0)
        assert record.landed == 1 and record.contributors == ("a", "b")
        lr = shard.config.outer.lr
        assert torch.allclose(frag.values[0], before - lr * 0.25 * 0.4 - 0.25 * 0.8)
        assert frag.round_progress == pytest.approx(0.25)

    def test_a_clean_checkpoint_keeps_a_pending_push_last(self):
        shard = self.trained()
        push(shard, "a", 1.0, delta=0.4, last=True)
        resumed = ShardState.from_state_dict(shard.config, 0, 1, shard.to_state_dict(clean=True), INCARNATION)
        assert resumed.fragments[0].pending["a"].last

    def test_a_round_from_an_older_checkpoint_format_resumes_as_a_round_opening(self):
        shard = self.trained()
        push(shard, "a", 1.0, delta=0.4)
        shard.merge(0, 1.0)
        saved = shard.to_state_dict(clean=True) | {"format": 2}  # its round's look-ahead was taken at the opening
        assert saved["fragments"][0]["round_progress"] == pytest.approx(0.25)
        resumed = ShardState.from_state_dict(shard.config, 0, 1, saved, INCARNATION)
        assert resumed.fragments[0].round_progress == 0.0


class TestMergeBounds:
    """What one island can claim and send: tokens are bounded at admission and in the merge, and a merge that
    would make the fragment non-finite is refused with everything as it was."""

    def test_tokens_no_inner_steps_could_produce_are_refused_and_change_nothing(self):
        shard = make_shard()
        key = PushKey("a", INCARNATION, 0, 0)
        delta = [torch.ones(2), torch.ones(1)]
        for tokens, inner_steps in ((2**64 - 1, 10), (1, 0)):
            with pytest.raises(Refused) as refused:
                shard.check_push(key, 0, SPECS, tokens, inner_steps)
            assert status_code(refused.value.kind) == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.reason == "tokens" and f"{tokens} tokens" in refused.value.message
            with pytest.raises(Refused):
                shard.submit(key, 0, SPECS, delta, tokens, inner_steps, 0.0)
        assert shard.fragments[0].pending == {} and shard.islands == {}

    def test_one_claim_weighs_at_most_max_token_ratio_times_another(self):
        shard = make_shard(quorum=2, grace_seconds=60.0)
        push(shard, "a", 0.0, delta=1.0, tokens=100)
        key = PushKey("b", INCARNATION, 0, 0)
        huge = 10 * 2**32  # as many tokens as 10 inner steps may claim
        shard.submit(key, 0, SPECS, [torch.full((2,), 5.0), torch.full((1,), 5.0)], huge, 10, 0.0)
        record = shard.merge(0, 0.0)
        ratio = MAX_TOKEN_RATIO
        mean = (1.0 * 100 + 5.0 * 100 * ratio) / (100 + 100 * ratio)
        assert torch.allclose(shard.fragments[0].values[1], torch.full((1,), outer_lr_first_step(mean, shard.config)))
        assert record.tokens == 100 + huge and shard.fragments[0].tokens_merged == 100 + huge, "counts what was claimed"

    @pytest.mark.parametrize("radial", [False, True])
    def test_a_merge_that_would_not_be_finite_is_refused_and_changes_nothing(self, radial):
        shard = make_shard(quorum=2, grace_seconds=60.0, radial_directional=radial)
        push(shard, "a", 0.0, delta=1.0)
        shard.merge(0, 0.0)
        frag = shard.fragments[0]
        before = ([v.clone() for v in frag.values], [m.clone() for m in frag.momentum], frag.version)
        counters = (frag.last_merge_unix, frag.last_contributors, frag.tokens_merged, set(frag.merged_keys))
        # Finite, as is their mean: the outer step overflows. Three of them, so their median is the clip's reference
        # (each island's own past norms are not its peers').
        for island in "abc":
            shard.join(island, 1.0)
            push(shard, island, 1.0, seq=1, delta=3e38)
        record = shard.merge(0, 2.0)
        assert record.dropped == "non_finite" and record.contributors == ("a", "b", "c")
        assert record.version == before[2]
        assert all(torch.equal(v, w) for v, w in zip(frag.values, before[0]))
        assert all(not m.any() for m in frag.momentum), "momentum restarts: it carried the overflow"
        assert frag.version == before[2]
        assert (frag.last_merge_unix, frag.last_contributors, frag.tokens_merged, frag.merged_keys) == counters
        assert frag.pending == {} and shard.rejected_pushes == 3, "the contributions are dropped and counted"

    def test_a_push_is_left_out_by_the_norm_taken_when_it_arrived(self):
        # The server takes each delta's norm on the push's own thread, before the shard's lock; the merge, under
        # the lock, makes no pass over the deltas to measure them again.
        shard = make_shard(quorum=4, grace_seconds=60.0)
        for island in "abc":
            push(shard, island, 0.0, delta=1.0)
        delta = [torch.full((2,), 1.0), torch.full((1,), 1.0)]
        d = PushKey("d", INCARNATION, 0, 0)
        shard.submit(d, 0, SPECS, delta, 100, 10, 0.0, norm=1e30)
        assert shard.fragments[0].pending["a"].norm == pytest.approx(3**0.5), "taken by submit when not given"
        record = shard.merge(0, 0.0)
        assert record.outliers == (d,) and record.contributors == ("a", "b", "c"), "d is measured as its push said"

    def test_a_huge_delta_is_left_out_whatever_it_claims_and_the_others_merge_as_they_would_alone(self):
        alone, with_huge = make_shard(quorum=4, grace_seconds=60.0), make_shard(quorum=4, grace_seconds=60.0)
        for shard in (alone, with_huge):
            for island in "abc":
                shard.join(island, 0.0)
                push(shard, island, 0.0, delta=0.5, tokens=100)
        with_huge.join("h", 0.0)
        push(with_huge, "h", 0.0, delta=1e38, tokens=10 * 2**32)  # as many tokens as 10 inner steps may claim
        record = with_huge.merge(0, 0.0)
        alone.merge(0, 0.0)
        assert record.outliers == (PushKey("h", INCARNATION, 0, 0),) and record.dropped is None
        for got, want in zip(with_huge.fragments[0].values, alone.fragments[0].values):
            assert torch.equal(got, want), "the merge of a, b and c is the whole round: h contributed nothing"
        assert with_huge.rejected_pushes == 1 and "h" not in with_huge.fragments[0].delta_norms, "it left no vote"
        assert with_huge.members(0.0) == {"a", "b", "c"}

    def test_a_merge_of_nothing_but_outliers_is_not_taken(self):
        shard = make_shard(quorum=1, grace_seconds=0.0)
        for island in "abc":
            shard.join(island, 0.0)
            push(shard, island, 0.0, delta=0.5)
        shard.merge(0, 0.0)
        frag = shard.fragments[0]
        before = ([v.clone() for v in frag.values], [m.clone() for m in frag.momentum], frag.version)
        shard.join("h", 1.0)
        push(shard, "h", 1.0, seq=1, base=1, delta=1e38)
        record = shard.merge(0, 1.0)
        assert record.dropped == "outliers" and record.pushes == () and len(record.outliers) == 1
        assert frag.version == before[2] and frag.pending == {} and frag.quorum_since is None
        assert all(torch.equal(v, w) for v, w in zip(frag.values, before[0]))
        assert all(torch.equal(m, w) for m, w in zip(frag.momentum, before[1])), "its momentum goes on"

    def test_islands_go_on_after_a_refused_merge(self):
        shard = make_shard(quorum=2, grace_seconds=60.0)
        push(shard, "a", 0.0, delta=3e38)
        push(shard, "b", 0.0, delta=3e38)
        assert shard.merge(0, 0.0).dropped == "non_finite"
        push(shard, "a", 1.0, seq=1, delta=1.0)
        push(shard, "b", 1.0, seq=1, delta=1.0)
        record = shard.merge(0, 1.0)
        assert record.dropped is None and record.version == 1
        assert torch.allclose(shard.fragments[0].values[0], torch.full((2,), outer_lr_first_step(1.0, shard.config)))


class TestIslandIds:
    """Only an island that joined counts as live or may leave, and a refused call changes nothing."""

    def test_calls_of_an_island_that_never_joined_make_nothing_live(self):
        shard = make_shard(quorum=2, grace_seconds=5.0)
        shard.join("a", 0.0)
        shard.touch("stranger", 1.0)
        push(shard, "stranger", 1.0)  # a valid push still counts as a contribution
        assert shard.live_islands(1.0) == ["a"]
        assert shard.merge_share(shard.fragments[0], 1, 1.0) == 1 / 1, "the stranger dilutes no merge"

    def test_only_an_island_that_joined_can_leave_and_a_retried_leave_is_answered(self):
        shard = make_shard()
        shard.join("a", 0.0)
        before = shard.to_state_dict(clean=True)
        with pytest.raises(Refused) as refused:
            shard.leave("stranger")
        assert status_code(refused.value.kind) == grpc.StatusCode.FAILED_PRECONDITION
        assert shard.to_state_dict(clean=True)["left"] == before["left"] == {}
        shard.leave("a")
        shard.leave("a")
        assert shard.left.keys() == {"a"} and shard.live_islands(1.0) == []

    @pytest.mark.parametrize("island", ["a" * (ISLAND_ID_MAX_CHARS + 1), "a b", "a/b", "é", "-a"])
    def test_an_id_outside_the_rule_is_refused_by_every_call_and_changes_nothing(self, island):
        shard = make_shard()
        shard.join("a", 0.0)
        push(shard, "a", 0.0)
        before = (dict(shard.islands), dict(shard.left), dict(shard.fragments[0].pending))
        calls = {
            "join": lambda: shard.join(island, 1.0),
            "leave": lambda: shard.leave(island),
            "push header": lambda: shard.check_push(PushKey(island, INCARNATION, 0, 1), 0, SPECS, 100, 10),
            "push": lambda: push(shard, island, 1.0, seq=1),
        }
        for name, call in calls.items():
            with pytest.raises(Refused) as refused:
                call()
            assert status_code(refused.value.kind) == grpc.StatusCode.INVALID_ARGUMENT, name
            assert (shard.islands, shard.left, shard.fragments[0].pending) == before, name

    def test_a_shard_remembers_a_bounded_number_of_islands(self):
        shard = make_shard()
        for i in range(MAX_KNOWN_ISLANDS - 1):
            shard.join(f"island-{i}", 0.0)
        shard.join("last", 0.0)
        shard.leave("last")
        with pytest.raises(Refused) as refused:
            shard.join("one-too-many", 1.0)
        assert status_code(refused.value.kind) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "one-too-many" not in shard.islands
        shard.join("last", 2.0)  # an island it knows may always join again
        shard.join("island-0", 2.0)
        assert len(shard.islands) == MAX_KNOWN_ISLANDS


class TestMergeAtSize:
    """A shard keeps pushes as they came over the wire and merges them in one pass, in place when it can prove
    the step finite, on copies otherwise."""

    @staticmethod
    def encoded(values: list[torch.Tensor], encoding: Encoding = Encoding.INT4) -> list[Encoded]:
        return [validated(encode(v, encoding, 4, 1), v.shape, encoding, 4, 1) for v in values]

    @pytest.mark.parametrize("encoding", [Encoding.INT4, Encoding.SPARSE, Encoding.FP32])
    def test_encoded_pushes_merge_as_their_decoded_values_would(self, encoding):
        gen = torch.Generator().manual_seed(5)
        pushes = {island: [torch.randn(2, generator=gen), torch.randn(1, generator=gen)] for island in "ab"}
        shards = {"encoded": make_shard(quorum=2, grace_seconds=60.0), "decoded": make_shard(quorum=2)}
        for form, shard in shards.items():
            for island, values in pushes.items():
                sent = self.encoded(values, encoding)
                delta = sent if form == "encoded" else [decoded(e) for e in sent]
                shard.submit(PushKey(island, INCARNATION, 0, 0), 0, SPECS, delta, 100, 10, 0.0)
            if form == "encoded":
                assert all(isinstance(d, Encoded) for d in shard.fragments[0].pending["a"].delta), "kept encoded"
            shard.merge(0, 0.0)
        got, want = shards["encoded"].fragments[0], shards["decoded"].fragments[0]
        for a, b in zip([*got.values, *got.momentum], [*want.values, *want.momentum]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    def test_a_merge_at_ordinary_magnitudes_steps_in_place(self):
        shard = make_shard()
        frag = shard.fragments[0]
        storage = [t.data_ptr() for t in [*frag.values, *frag.momentum]]
        push(shard, "a", 0.0, delta=1.0)
        shard.merge(0, 0.0)
        assert [t.data_ptr() for t in [*frag.values, *frag.momentum]] == storage, "no copy of the fragment"
        expected = outer_lr_first_step(1.0, shard.config)
        assert torch.allclose(frag.values[0], torch.full((2,), expected))
        assert frag.magnitudes == pytest.approx((abs(expected), 1.0)), "the pass measured what it left"

    def test_a_merge_that_cannot_be_proven_finite_but_is_steps_on_copies_and_is_applied(self):
        shard = make_shard()
        frag = shard.fragments[0]
        frag.values = [torch.full((2,), 2e38), torch.zeros(1)]
        frag.magnitudes = None  # measured at the next merge
        storage = frag.values[0].data_ptr()
        push(shard, "a", 0.0, delta=-1.0)
        record = shard.merge(0, 0.0)
        assert record.dropped is None and frag.version == 1
        assert frag.values[0].data_ptr() != storage, "stepped on a copy"
        assert torch.equal(frag.values[0], torch.full((2,), 2e38)), "a step of 1.33 is lost in 2e38's rounding"
        assert frag.values[1].item() == pytest.approx(-outer_lr_first_step(1.0, shard.config))

    def test_a_clean_resume_keeps_encoded_pending_pushes_as_their_values(self):
        shard = make_shard(quorum=2, grace_seconds=60.0)
        sent = self.encoded([torch.tensor([0.5, -0.25]), torch.tensor([1.0])])
        shard.submit(PushKey("a", INCARNATION, 0, 0), 0, SPECS, sent, 100, 10, 0.0)
        resumed = ShardState.from_state_dict(shard.config, 0, 1, shard.to_state_dict(clean=True), INCARNATION)
        kept = resumed.fragments[0].pending["a"].delta
        assert all(torch.equal(k, decoded(e)) for k, e in zip(kept, sent))

    def test_pending_pushes_count_as_the_bytes_they_are_held_in(self):
        """Pushes kept as sent take what they were sent in, so a bound that holds two float32 deltas holds
        several int4 ones; a header declaring more than the room left is refused before its data is read."""
        int4 = self.encoded([torch.ones(2), torch.ones(1)])
        held = sum(e.nbytes for e in int4)  # a scale and a byte per tensor: 10 bytes against 12 in float32
        shard = make_shard(max_pending_bytes=3 * held, quorum=4, grace_seconds=60.0)
        for island in "abcd":
            shard.join(island, 0.0)
        for island in "abc":
            shard.submit(PushKey(island, INCARNATION, 0, 0), 0, SPECS, int4, 100, 10, 0.0)
        assert shard.pending_bytes() == 3 * held
        with pytest.raises(Refused, match="pending deltas take"):
            shard.check_push(PushKey("d", INCARNATION, 0, 0), 0, SPECS, 100, 10, nbytes=held)
        shard.merge(0, 0.0)
        assert shard.check_push(PushKey("d", INCARNATION, 0, 0), 0, SPECS, 100, 10, nbytes=held) is None
