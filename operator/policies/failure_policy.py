"""spec.failurePolicy: failures are charged to each island's restart budget, and an island that exceeds it
fails the job for good. Preemptions are never charged; a charged failure re-forms the island after
`backoffSeconds` (see `diloco.operator.island_accounting`, which tells failures from preemptions).

A multi-pod island is one torch.distributed world: when one rank dies the others fail with it. So the
failures seen in one pass are charged once, as the largest count of any one pod: a crash-looping rank still
exhausts the budget, its collateral peers add nothing, and failures that accompany a preemption are charged
as part of it (not at all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from diloco.api.job import IslandStatus


def charged_failures(failures: Mapping[int, int], preempted: bool) -> int:
    """Failures to charge for one pass, from the count per pod (see the module docstring)."""
    return 0 if preempted else max(failures.values(), default=0)


def exhausted_islands(islands: Sequence[IslandStatus], budget: int) -> list[str]:
    """Islands whose failures exceed the restart budget."""
    return [i.name for i in islands if i.restarts > budget]


def restart_budget_exhausted(
    islands: Sequence[IslandStatus], budget: int, causes: Mapping[str, str] | None = None
) -> str | None:
    """Why the job fails (a message naming the islands and, from `causes`, the failure each was charged on
    this pass), or None while every island is within the budget."""
    exhausted = exhausted_islands(islands, budget)
    if not exhausted:
        return None
    known = causes or {}
    last = "".join(f"; island {name}'s last failure: {known[name]}" for name in exhausted if name in known)
    return f"islands {exhausted} exceeded failurePolicy.restartBudget {budget}: the job failed{last}"
