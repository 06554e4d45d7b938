"""Ready means the islands train: an island whose pods are all Ready yet whose token the shards refuse, that has
not synced since a shard lost its state, or that brought no merge back within the bound its H and step time
give, does not train, and says why; an island the scheduler cannot place says what the scheduler says."""

import datetime

from status_builders import at, pod

from diloco.api.job import IslandStatus, Reform
from diloco.core.config import TrainingConfig
from diloco.operator.policies.island_training import MIN_SYNC_BOUND, TrainerReport, not_training, sync_bound

CONFIG = TrainingConfig(inner_steps=100, fragments=4, overlap_steps=1, grace_seconds=5)
WHOLE = IslandStatus(name="a", desired=2, ready=2)
PODS = [pod(0, ready_since=at(0)), pod(1, ready_since=at(5))]


def unix(seconds: float) -> float:
    return at(seconds).timestamp()


def test_a_whole_island_that_syncs_within_its_bound_trains():
    report = TrainerReport(last_sync_unix=unix(100), step_seconds=1.0, round_steps=100)
    assert not_training(WHOLE, PODS, report, CONFIG, None, at(400)) is None


def test_the_bound_is_rounds_of_the_islands_inner_steps_at_its_step_time_and_never_short():
    slow = TrainerReport(step_seconds=2.0, round_steps=50)
    assert sync_bound(CONFIG, slow) == datetime.timedelta(seconds=3 * 50 * 2.0 + 5)
    assert sync_bound(CONFIG, TrainerReport(step_seconds=2.0)) == datetime.timedelta(seconds=3 * 100 * 2.0 + 5)
    assert sync_bound(CONFIG, TrainerReport(step_seconds=0.01, round_steps=10)) == MIN_SYNC_BOUND
    assert sync_bound(CONFIG, None) == MIN_SYNC_BOUND


def test_no_merge_within_the_bound_is_not_syncing_counted_from_the_last_sync_or_the_island_becoming_ready():
    report = TrainerReport(last_sync_unix=unix(100), step_seconds=1.0, round_steps=100)  # bound 305 s
    found = not_training(WHOLE, PODS, report, CONFIG, None, at(406))
    assert found is not None and found.reason == "NotSyncing"
    assert found.message == "no merge for 306s (bound 305s)"
    never = TrainerReport(step_seconds=1.0, round_steps=100)
    assert not_training(WHOLE, PODS, never, CONFIG, None, at(310)) is None, "ready since 5 s: 305 s of bound left"
    assert not_training(WHOLE, PODS, never, CONFIG, None, at(311)).reason == "NotSyncing"


def test_without_a_trainer_report_the_shards_last_report_of_the_island_counts():
    live = WHOLE.model_copy(update={"last_sync": at(200)})
    assert not_training(live, PODS, None, CONFIG, None, at(200) + MIN_SYNC_BOUND) is None
    assert not_training(live, PODS, None, CONFIG, None, at(201) + MIN_SYNC_BOUND).reason == "NotSyncing"


def test_a_refusal_after_the_last_sync_is_pushes_refused_ready_pods_or_not():
    refused = TrainerReport(last_sync_unix=unix(100), last_refusal_unix=unix(120), step_seconds=1.0)
    found = not_training(WHOLE, PODS, refused, CONFIG, None, at(130))
    assert found is not None and found.reason == "PushesRefused"
    assert "UNAUTHENTICATED" in found.message and "12:02:00Z" in found.message
    joining = IslandStatus(name="a", desired=2, ready=0)
    never_joined = TrainerReport(last_refusal_unix=unix(120))
    assert not_training(joining, [pod(0, ready=False)], never_joined, CONFIG, None, at(130)).reason == "PushesRefused"
    recovered = TrainerReport(last_sync_unix=unix(125), last_refusal_unix=unix(120), step_seconds=1.0)
    assert not_training(WHOLE, PODS, recovered, CONFIG, None, at(130)) is None


def test_no_merge_since_a_shard_lost_its_state_is_syncer_state_lost():
    report = TrainerReport(last_sync_unix=unix(100), step_seconds=1.0)
    found = not_training(WHOLE, PODS, report, CONFIG, at(110), at(120))
    assert found is not None and found.reason == "SyncerStateLost" and "12:01:50Z" in found.message
    assert not_training(WHOLE, PODS, report, CONFIG, at(90), at(120)) is None, "synced since the loss"


def test_an_unschedulable_pod_says_what_the_scheduler_says_before_anything_else():
    message = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    pods = [pod(0, ready=False, unschedulable=message)]
    found = not_training(IslandStatus(name="a", desired=1), pods, None, CONFIG, at(0), at(500))
    assert found is not None and (found.reason, found.message) == ("Unschedulable", f"pod job-a-0: {message}")


def test_an_island_short_of_pods_or_re_forming_is_left_to_its_pod_counts():
    short = IslandStatus(name="a", desired=2, ready=1)
    assert not_training(short, PODS[:1], TrainerReport(step_seconds=1.0), CONFIG, None, at(10_000)) is None
    reforming = WHOLE.model_copy(update={"reform": Reform(reason="Update", since=at(0), hold_until=at(0))})
    assert not_training(reforming, PODS, None, CONFIG, None, at(10_000)) is None
