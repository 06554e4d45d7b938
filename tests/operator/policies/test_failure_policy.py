"""spec.failurePolicy: an island whose charged failures exceed the restart budget fails the job."""

from diloco.api.job import IslandStatus
from diloco.operator.policies.failure_policy import exhausted_islands, restart_budget_exhausted

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
