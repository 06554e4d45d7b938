"""spec.failurePolicy: failures are charged to each island's restart budget, and an island that exceeds it
fails the job for good. Preemptions are never charged (see `diloco.operator.island_accounting`)."""

from __future__ import annotations

from collections.abc import Sequence

from diloco.api.job import IslandStatus


def exhausted_islands(islands: Sequence[IslandStatus], budget: int) -> list[str]:
    """Islands whose failures exceed the restart budget."""
    return [i.name for i in islands if i.restarts > budget]


def restart_budget_exhausted(islands: Sequence[IslandStatus], budget: int) -> str | None:
    """Why the job fails (a message), or None while every island is within the budget."""
    exhausted = exhausted_islands(islands, budget)
    if not exhausted:
        return None
    return f"islands {exhausted} exceeded failurePolicy.restartBudget {budget}: the job failed"
