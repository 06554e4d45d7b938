"""The job's five status conditions, set from its phase on every pass: exactly one holds for each phase but
Pending (none), and a condition's lastTransitionTime moves only when it starts or stops holding. Every
condition carries a message naming its cause; one that does not hold names the phase."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from diloco.api.conditions import ConditionType, Message, Reason
from diloco.api.job import Condition, Phase


@dataclass(frozen=True)
class ConditionState:
    """What one condition says on this pass."""

    type: str
    holds: bool
    reason: str
    message: str = ""


def condition_states(
    phase: Phase,
    detail: str,
    degraded_reason: str = Reason.PARTIALLY_READY,
    unanswered: str = "",
    outcome: str = "",
) -> tuple[ConditionState, ...]:
    """Each condition for `phase`; `detail` names what is not ready, `unanswered` the shards whose Status call
    failed (also in a Running job's Ready message), `outcome` why a finished job finished. A condition that
    does not hold gives the phase as its reason and its message."""
    running, degraded = phase is Phase.RUNNING, phase is Phase.DEGRADED
    suspended, succeeded, failed = phase is Phase.SUSPENDED, phase is Phase.SUCCEEDED, phase is Phase.FAILED
    otherwise = f"phase {phase.value}"
    finished = outcome or f"the job {phase.value.lower()}"
    return (
        ConditionState(
            ConditionType.READY,
            running,
            phase.value,
            (f"{Message.ALL_READY}; {unanswered}" if unanswered else Message.ALL_READY)
            if running
            else detail or otherwise,
        ),
        ConditionState(
            ConditionType.DEGRADED,
            degraded,
            degraded_reason if degraded else phase.value,
            (detail or otherwise) if degraded else otherwise,
        ),
        ConditionState(
            ConditionType.SUSPENDED,
            suspended,
            Reason.SUSPENDED if suspended else Reason.NOT_SUSPENDED,
            Message.SUSPENDED if suspended else otherwise,
        ),
        ConditionState(
            ConditionType.COMPLETE,
            succeeded,
            Reason.STOP_CONDITION_REACHED if succeeded else phase.value,
            finished if succeeded else otherwise,
        ),
        ConditionState(
            ConditionType.FAILED,
            failed,
            Reason.RESTART_BUDGET_EXHAUSTED if failed else phase.value,
            finished if failed else otherwise,
        ),
    )


def set_condition(
    conditions: Sequence[Condition],
    kind: str,
    true: bool,
    reason: str,
    message: str,
    now: datetime.datetime,
    generation: int | None,
) -> list[Condition]:
    """`conditions` with `kind` set; its lastTransitionTime moves only when its status changes."""
    status: Literal["True", "False"] = "True" if true else "False"
    old = next((c for c in conditions if c.type == kind), None)
    since = old.last_transition_time if old is not None and old.status == status else now
    new = Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )
    return [new if c.type == kind else c for c in conditions] if old else [*conditions, new]


def update_conditions(
    conditions: Sequence[Condition],
    phase: Phase,
    detail: str,
    now: datetime.datetime,
    generation: int | None,
    degraded_reason: str = Reason.PARTIALLY_READY,
    unanswered: str = "",
    outcome: str = "",
) -> list[Condition]:
    """`conditions` with every condition set for `phase` (see `condition_states`)."""
    updated = list(conditions)
    for state in condition_states(phase, detail, degraded_reason, unanswered, outcome):
        updated = set_condition(updated, state.type, state.holds, state.reason, state.message, now, generation)
    return updated
