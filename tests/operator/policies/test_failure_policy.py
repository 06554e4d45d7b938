"""spec.failurePolicy: the failures of one pass are charged once, and an island whose charged failures exceed
the restart budget fails the job."""

from diloco.api.job import IslandStatus
from diloco.operator.policies.failure_policy import charged_failures, exhausted_islands, restart_budget_exhausted

ISLANDS = [IslandStatus(name="a", restarts=2), IslandStatus(name="b", restarts=3), IslandStatus(name="c")]


def test_an_island_exhausts_the_budget_only_by_exceeding_it():
    assert exhausted_islands(ISLANDS, 2) == ["b"]
    assert exhausted_islands(ISLANDS, 1) == ["a", "b"]
    assert exhausted_islands(ISLANDS, 3) == []


def test_the_job_fails_naming_the_islands_and_the_budget():
    assert restart_budget_exhausted(ISLANDS, 3) is None
    assert restart_budget_exhausted(ISLANDS, 1) == (
        "islands ['a', 'b'] exceeded failurePolicy.restartBudget 1: the job failed"
    )


def test_one_pass_charges_the_largest_count_of_any_pod_and_nothing_beside_a_preemption():
    assert charged_failures({0: 1, 1: 1}, preempted=False) == 1
    assert charged_failures({0: 3, 1: 1}, preempted=False) == 3
    assert charged_failures({}, preempted=False) == 0
    assert charged_failures({0: 2}, preempted=True) == 0
