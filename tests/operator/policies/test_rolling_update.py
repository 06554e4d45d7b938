import datetime

from diloco.api.job import IslandStatus, Reform
from diloco.operator.policies.rolling_update import islands_free_to_update, rejoined, rolling, shards_held_back

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
LATER = T0 + datetime.timedelta(seconds=30)


def island(name, **fields):
    return IslandStatus(name=name, desired=2, **fields)


def test_an_island_rolls_while_re_forming_for_an_update_and_until_it_rejoined():
    updating = island("a", reform=Reform(reason="Update", since=T0, hold_until=T0))
    failing = island("a", reform=Reform(reason="Failure", since=T0, hold_until=T0))
    assert rolling(updating) and not rolling(failing) and rolling(island("a", rolled_at=T0))


def test_rejoined_needs_every_pod_ready_and_a_sync_after_it_came_back():
    assert rejoined(island("a", rolled_at=T0, ready=2, last_sync=LATER))
    assert not rejoined(island("a", rolled_at=T0, ready=1, last_sync=LATER)), "a pod short"
    assert not rejoined(island("a", rolled_at=T0, ready=2, last_sync=T0)), "the sync is from before it came back"
    assert not rejoined(island("a", ready=2, last_sync=LATER)), "not rolling"


def test_outdated_islands_start_in_spec_order_within_max_unavailable():
    idle = [island("a"), island("b"), island("c")]
    assert islands_free_to_update(idle, ["b", "c"], 1) == {"b"}
    assert islands_free_to_update(idle, ["a", "b", "c"], 2) == {"a", "b"}
    busy = [island("a", rolled_at=T0), island("b"), island("c")]
    assert islands_free_to_update(busy, ["b", "c"], 1) == frozenset()
    assert islands_free_to_update(busy, ["b", "c"], 2) == {"b"}


def deployment(name, image, replicas=1, *, serving=True):
    status = {"observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas, "readyReplicas": replicas}
    return {
        "metadata": {"name": name, "generation": 1},
        "spec": {"replicas": replicas, "template": {"spec": {"containers": [{"image": image}]}}},
        "status": status if serving else {"observedGeneration": 1, "replicas": replicas},
    }


def test_one_changed_shard_goes_first_and_the_rest_wait():
    live = {f"s{i}": deployment(f"s{i}", "v1") for i in range(3)}
    desired = [deployment(f"s{i}", "v2") for i in range(3)]
    assert shards_held_back(desired, live) == {"s1", "s2"}


def test_every_changed_shard_waits_while_one_on_the_new_template_does_not_serve():
    live = {"s0": deployment("s0", "v2", serving=False), "s1": deployment("s1", "v1")}
    assert shards_held_back([deployment("s0", "v2"), deployment("s1", "v2")], live) == {"s1"}


def test_new_shards_and_shards_scaled_to_zero_never_wait():
    live = {"s0": deployment("s0", "v2", serving=False), "s1": deployment("s1", "v1")}
    desired = [deployment("s0", "v2"), deployment("s1", "v2", replicas=0), deployment("s2", "v2")]
    assert shards_held_back(desired, live) == frozenset()
