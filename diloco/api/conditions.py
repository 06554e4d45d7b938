"""The words of a DiLoCoJob's status: its condition types, the reasons the conditions and the job's Events
give, and the fixed messages, named once so the operator, its tests and anyone reading a job's status agree.

Each value is part of the API: users, their tooling (`kubectl wait --for=condition=Complete`) and the
end-to-end tests match these strings, so a value never changes. A condition that does not hold gives the
job's phase (`Phase`) as its reason; the reasons below are those that say more.
"""

from __future__ import annotations

from typing import Final


class ConditionType:
    """The conditions every job carries: one per outcome a user waits for, and one that records a loss."""

    READY: Final = "Ready"
    """Every syncer shard is ready and every island trains: its pods are ready and its pushes are merged."""
    DEGRADED: Final = "Degraded"
    """Training goes on without some island pods or a syncer shard."""
    SUSPENDED: Final = "Suspended"
    """spec.suspend is true: the islands are scaled to zero."""
    COMPLETE: Final = "Complete"
    """The stop condition was reached: the job succeeded."""
    FAILED: Final = "Failed"
    """An island exceeded the restart budget: the job failed."""
    SYNCER_STATE_LOST: Final = "SyncerStateLost"
    """A syncer shard came back without the state it had (a new lineage, or a fragment's version went back): it
    stays true for the rest of the job's life, as a record; the outer steps and tokens lost keep counting toward
    the stop condition."""

    ALL: Final = (READY, DEGRADED, SUSPENDED, COMPLETE, FAILED, SYNCER_STATE_LOST)


class Reason:
    """CamelCase reasons of the conditions and of the Events that announce the job's status changes."""

    RUNNING: Final = "Running"
    """Event: the job went to phase Running."""
    DEGRADED: Final = "Degraded"
    """Event: the job went to phase Degraded."""
    PARTIALLY_READY: Final = "PartiallyReady"
    """Condition Degraded: some island pods or syncer shards are not ready."""
    UNSCHEDULABLE: Final = "Unschedulable"
    """An island's reason, the conditions' and an Event's: the scheduler cannot place an island pod (its message
    says why)."""
    PUSHES_REFUSED: Final = "PushesRefused"
    """An island's reason, the conditions' and an Event's: the syncer shards refuse the island's token."""
    NOT_SYNCING: Final = "NotSyncing"
    """An island's reason, the conditions' and an Event's: no merge came back to a ready island within the bound
    its H and step time give."""
    SYNCER_STATE_LOST: Final = "SyncerStateLost"
    """An island's reason (it has not synced since a shard lost its state), and the Event of the loss."""
    VERSION_REGRESSED: Final = "VersionRegressed"
    """Condition SyncerStateLost: a fragment's state went back (to version 0 of a new lineage, or to an older
    version)."""
    STATE_KEPT: Final = "StateKept"
    """Condition SyncerStateLost: no shard has lost its state."""
    SYNCER_REFUSED: Final = "SyncerRefused"
    """Condition Degraded: a syncer shard refuses the job's token (its message names the shard and error)."""
    SUSPENDED: Final = "Suspended"
    """Condition Suspended and its Event: spec.suspend became true."""
    NOT_SUSPENDED: Final = "NotSuspended"
    """Condition Suspended: spec.suspend is false."""
    RESUMED: Final = "Resumed"
    """Event: spec.suspend became false."""
    STOP_CONDITION_REACHED: Final = "StopConditionReached"
    """Condition Complete and its Event: every fragment reached spec.stopCondition."""
    RESTART_BUDGET_EXHAUSTED: Final = "RestartBudgetExhausted"
    """Condition Failed and its Event: an island exceeded spec.failurePolicy.restartBudget."""
    TTL_EXPIRED: Final = "TTLExpired"
    """Event: spec.ttlSecondsAfterFinished passed since the job finished; it is being deleted."""
    ISLAND_PREEMPTED: Final = "IslandPreempted"
    """Event: island pods were preempted or lost with their node; the island re-forms, uncharged."""
    ISLAND_FAILED: Final = "IslandFailed"
    """Event: island pods failed; charged to the restart budget, the island re-forms after the backoff."""
    ISLAND_UPDATING: Final = "IslandUpdating"
    """Event: the island's pod template changed; the island re-forms to pick it up."""
    ISLAND_REFORMED: Final = "IslandReformed"
    """Event: the re-formed island's pods are started again."""
    ISLAND_UPDATED: Final = "IslandUpdated"
    """Event: an island re-formed on a new pod template is ready and synced again; the roll moves on."""
    NAME_CONFLICT: Final = "NameConflict"
    """Event: a child's name is held by an object another owner controls; the operator leaves it alone."""
    RECONCILE_FAILED: Final = "ReconcileFailed"
    """Event: a reconcile pass raised (its message names the error); kopf runs it again after a backoff."""
    TOKEN_ROTATING: Final = "TokenRotating"
    """Event: a token rotation took a step (the shards accept the new token; the islands roll onto it)."""
    TOKEN_ROTATED: Final = "TokenRotated"
    """Event: every island holds the new token, and the shards no longer accept the old one."""


ISLAND_REASONS: Final = (Reason.UNSCHEDULABLE, Reason.PUSHES_REFUSED, Reason.NOT_SYNCING, Reason.SYNCER_STATE_LOST)
"""The reasons an island does not train (status.islands[].reason), most telling first."""


class Message:
    """The messages that carry no figures (the others are written where their figures are known)."""

    ALL_READY: Final = "every island and syncer shard is ready"
    SUSPENDED: Final = "spec.suspend is true: islands scaled to zero"
    RESUMED: Final = "spec.suspend is false: islands scaled up"
    STATE_KEPT: Final = "no syncer shard has lost its state"
