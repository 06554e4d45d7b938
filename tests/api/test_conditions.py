"""The status vocabulary is part of the API: its values are pinned here, and the CRD documents the same
condition types the operator sets."""

import re

from diloco.api.conditions import ConditionType, Message, Reason
from diloco.api.job import Condition, DiLoCoJobStatus


def test_the_condition_types_are_the_five_the_crd_documents():
    assert ConditionType.ALL == ("Ready", "Degraded", "Suspended", "Complete", "Failed")
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
    }
    assert all(re.fullmatch(r"[A-Z][A-Za-z]*", value) for value in reasons.values())


def test_fixed_messages_keep_their_wording():
    assert Message.ALL_READY == "every island and syncer shard is ready"
    assert Message.SUSPENDED == "spec.suspend is true: islands scaled to zero"
    assert Message.RESUMED == "spec.suspend is false: islands scaled up"
