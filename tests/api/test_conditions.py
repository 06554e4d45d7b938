"""The status vocabulary is part of the API: its values are pinned here, and the CRD documents the same
condition types the operator sets."""

import re

from diloco.api.conditions import ISLAND_REASONS, ConditionType, Message, Reason
from diloco.api.job import Condition, DiLoCoJobStatus, IslandReason, IslandStatus


def test_the_condition_types_are_the_six_the_crd_documents():
    assert ConditionType.ALL == ("Ready", "Degraded", "Suspended", "Complete", "Failed", "SyncerStateLost")
    for documented in (
        Condition.model_fields["type"].description,
        DiLoCoJobStatus.model_fields["conditions"].description,
    ):
        assert all(kind in documented for kind in ConditionType.ALL)


def test_reasons_keep_their_values_and_are_camel_case():
    reasons = {name: value for name, value in vars(Reason).items() if name.isupper()}
    assert reasons == {
        "RUNNING": "Running",
        "DEGRADED": "Degraded",
        "PARTIALLY_READY": "PartiallyReady",
        "SUSPENDED": "Suspended",
        "NOT_SUSPENDED": "NotSuspended",
        "RESUMED": "Resumed",
        "STOP_CONDITION_REACHED": "StopConditionReached",
        "RESTART_BUDGET_EXHAUSTED": "RestartBudgetExhausted",
        "TTL_EXPIRED": "TTLExpired",
        "ISLAND_PREEMPTED": "IslandPreempted",
        "ISLAND_FAILED": "IslandFailed",
        "ISLAND_UPDATING": "IslandUpdating",
        "ISLAND_REFORMED": "IslandReformed",
        "ISLAND_UPDATED": "IslandUpdated",
        "SYNCER_REFUSED": "SyncerRefused",
        "NAME_CONFLICT": "NameConflict",
        "RECONCILE_FAILED": "ReconcileFailed",
        "UNSCHEDULABLE": "Unschedulable",
        "PUSHES_REFUSED": "PushesRefused",
        "NOT_SYNCING": "NotSyncing",
        "SYNCER_STATE_LOST": "SyncerStateLost",
        "VERSION_REGRESSED": "VersionRegressed",
        "STATE_KEPT": "StateKept",
        "TOKEN_ROTATING": "TokenRotating",
        "TOKEN_ROTATED": "TokenRotated",
    }
    assert all(re.fullmatch(r"[A-Z][A-Za-z]*", value) for value in reasons.values())


def test_an_islands_reason_is_one_the_vocabulary_names_and_the_crd_documents():
    assert IslandReason.__args__ == ISLAND_REASONS
    assert all(reason in IslandStatus.model_fields["reason"].description for reason in ISLAND_REASONS)


def test_fixed_messages_keep_their_wording():
    assert Message.ALL_READY == "every island and syncer shard is ready"
    assert Message.SUSPENDED == "spec.suspend is true: islands scaled to zero"
    assert Message.RESUMED == "spec.suspend is false: islands scaled up"
    assert Message.STATE_KEPT == "no syncer shard has lost its state"
