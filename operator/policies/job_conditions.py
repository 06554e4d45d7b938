"""The job's status conditions, set on every pass. Five follow its phase: exactly one holds for each phase but
Pending (none). The sixth, SyncerStateLost, records that a shard lost its state, and once true stays so.
A condition's lastTransitionTime moves only when it starts or stops holding. Every condition carries a message
naming its cause; one that does not hold names the phase, and Ready, while it does not hold, gives why as its
reason where the job knows (an island that does not train, a shard that refuses the operator's token)."""

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
    """Each phase condition for `phase`; `detail` names what is not ready, `unanswered` the shards whose Status
    call failed (also in a Running job's Ready message), `outcome` why a finished job finished. A condition that
    does not hold gives the phase as its reason and its message, but Ready, which gives `degraded_reason` when it
    says more than PartiallyReady."""
    running, degraded = phase is Phase.RUNNING, phase is Phase.DEGRADED
    specific = degraded_reason != Reason.PARTIALLY_READY and not phase.finished and phase is not Phase.SUSPENDED
    suspended, succeeded, failed = phase is Phase.SUSPENDED, phase is Phase.SUCCEEDED, phase is Phase.FAILED
    otherwise = f"phase {phase.value}"
    finished = outcome or f"the job {phase.value.lower()}"
    return (
        ConditionState(
            ConditionType.READY,
            running,
            degraded_reason if specific and not running else phase.value,
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


def state_lost_condition(conditions: Sequence[Condition], lost: str | None) -> ConditionState:
    """SyncerStateLost: true with `lost` (what a shard lost on this pass, in words) and for good once it was,
    with the message of the last loss; false before."""
    before = next((c for c in conditions if c.type == ConditionType.SYNCER_STATE_LOST), None)
    if lost is not None:
        return ConditionState(ConditionType.SYNCER_STATE_LOST, True, Reason.VERSION_REGRESSED, lost)
    if before is not None and before.status == "True":
        return ConditionState(ConditionType.SYNCER_STATE_LOST, True, before.reason, before.message)
    return ConditionState(ConditionType.SYNCER_STATE_LOST, False, Reason.STATE_KEPT, Message.STATE_KEPT)


def update_conditions(
    conditions: Sequence[Condition],
    phase: Phase,
    detail: str,
    now: datetime.datetime,
    generation: int | None,
    degraded_reason: str = Reason.PARTIALLY_READY,
    unanswered: str = "",
    outcome: str = "",
    state_lost: str | None = None,
) -> list[Condition]:
    """`conditions` with every condition set for `phase` (see `condition_states`) and SyncerStateLost
    (`state_lost`: what a shard lost on this pass, see `state_lost_condition`)."""
    updated = list(conditions)
    states = (
        *condition_states(phase, detail, degraded_reason, unanswered, outcome),
        state_lost_condition(conditions, state_lost),
    )
    for state in states:
        updated = set_condition(updated, state.type, state.holds, state.reason, state.message, now, generation)
    return updated
