"""Where a pod's local ranks sit in their island's world, and which device and backend each one gets."""

import pytest

from diloco.worker.pod_ranks import LOOPBACK, Placement, PodShape, local_position, metrics_port, place


def test_the_island_world_is_every_local_rank_of_every_pod_ranked_from_the_ordinal():
    shape = PodShape.from_env({"DILOCO_ACCELERATORS_PER_POD": "8", "WORLD_SIZE": "24", "NODE_RANK": "2"})
    assert shape == PodShape(pods=3, ranks_per_pod=8, node_rank=2)
    assert shape.world_size == 24 and shape.launches_ranks
    assert [shape.global_rank(r) for r in range(8)] == list(range(16, 24))
    ranks = [PodShape(3, 8, pod).global_rank(r) for pod in range(3) for r in range(8)]
    assert ranks == list(range(24)), "every rank of the island exactly once"


def test_a_pod_without_accelerators_or_with_one_runs_one_process():
    assert PodShape.from_env({}) == PodShape(pods=1, ranks_per_pod=1, node_rank=0)
    for count in ("0", "1"):
        shape = PodShape.from_env({"DILOCO_ACCELERATORS_PER_POD": count, "WORLD_SIZE": "3", "NODE_RANK": "1"})
        assert shape == PodShape(pods=3, ranks_per_pod=1, node_rank=1) and not shape.launches_ranks
        assert shape.global_rank(0) == 1


@pytest.mark.parametrize(
    "env, message",
    [
        ({"DILOCO_ACCELERATORS_PER_POD": "4", "WORLD_SIZE": "6"}, "not a whole number of pods"),
        ({"DILOCO_ACCELERATORS_PER_POD": "2", "WORLD_SIZE": "4", "NODE_RANK": "2"}, "outside the island's 2 pods"),
    ],
)
def test_an_inconsistent_environment_is_refused(env, message):
    with pytest.raises(ValueError, match=message):
        PodShape.from_env(env)


def test_a_local_rank_outside_the_pod_has_no_global_rank():
    with pytest.raises(ValueError, match="outside the pod's 2 ranks"):
        PodShape(1, 2, 0).global_rank(2)


def test_ranks_of_a_one_pod_island_meet_on_loopback_others_at_the_first_pod():
    assert PodShape(1, 2, 0).rendezvous_host("job-island-0.job-island.ns.svc") == LOOPBACK
    assert PodShape(2, 2, 1).rendezvous_host("job-island-0.job-island.ns.svc") == "job-island-0.job-island.ns.svc"


def test_each_local_rank_serves_metrics_on_its_own_port():
    assert [metrics_port(9100, r) for r in range(3)] == [9100, 9101, 9102]
    assert metrics_port(0, 1) == 0, "no port: no metrics"


def test_the_local_position_comes_from_the_launcher():
    assert local_position({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}) == (3, 8)
    assert local_position({}) == (0, 1)


def test_each_local_rank_drives_its_own_gpu_with_nccl():
    assert [place("cuda", r, 4, 4) for r in range(4)] == [Placement(f"cuda:{r}", "nccl") for r in range(4)]
    assert place("cuda", 0, 1, 8) == Placement("cuda:0", "nccl")


def test_ranks_sharing_a_gpu_use_gloo_since_nccl_refuses_two_ranks_on_one_device():
    assert [place("cuda", r, 4, 2) for r in range(4)] == [
        Placement("cuda:0", "gloo"),
        Placement("cuda:1", "gloo"),
        Placement("cuda:0", "gloo"),
        Placement("cuda:1", "gloo"),
    ]
    assert place("cuda:1", 1, 2, 8) == Placement("cuda:1", "gloo"), "one named device for every local rank"
    assert place("cuda:1", 0, 1, 8) == Placement("cuda:1", "nccl")


def test_cpu_ranks_use_gloo_and_cuda_without_a_gpu_is_refused():
    assert place("cpu", 1, 2, 0) == Placement("cpu", "gloo")
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        place("cuda", 0, 2, 0)
