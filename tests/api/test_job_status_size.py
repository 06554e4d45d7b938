"""A job's status stays within its byte budget at the largest job the CRD admits, and a job beyond those bounds
is refused: the status is rewritten on every pass, so one that outgrows the API server's object size limit
would stop the operator from ever recording that job again."""

from __future__ import annotations

import json

import pytest
from support import largest_status

from diloco.api.job import MAX_CONDITION_MESSAGE, MAX_JOB_PODS, STATUS_BYTES_BUDGET, Condition, DiLoCoJobSpec
from diloco.core.config import MAX_FRAGMENTS, TrainingConfig


def spec(**changes: object) -> dict[str, object]:
    return {"image": "diloco-trainer:dev", "islands": [{"name": "a"}], **changes}


def test_the_largest_status_fits_its_budget():
    size = len(json.dumps(largest_status(), separators=(",", ":")))
    assert size <= STATUS_BYTES_BUDGET, f"{size} bytes"


def test_islands_may_add_up_to_the_job_pod_bound_and_no_further():
    halves = [{"name": "a", "replicas": MAX_JOB_PODS // 2}, {"name": "b", "replicas": MAX_JOB_PODS // 2}]
    assert sum(i.replicas for i in DiLoCoJobSpec.model_validate(spec(islands=halves)).islands) == MAX_JOB_PODS
    halves[1]["replicas"] += 1
    with pytest.raises(ValueError, match=rf"spec.islands\[\].replicas must add up to at most {MAX_JOB_PODS} pods"):
        DiLoCoJobSpec.model_validate(spec(islands=halves))


def test_fragments_are_bounded():
    assert TrainingConfig(fragments=MAX_FRAGMENTS, inner_steps=MAX_FRAGMENTS * 2, overlap_steps=1).fragments
    with pytest.raises(ValueError, match="fragments"):
        TrainingConfig(fragments=MAX_FRAGMENTS + 1, inner_steps=MAX_FRAGMENTS * 4, overlap_steps=1)


def test_a_condition_message_is_cut_to_its_bound_and_says_so():
    condition = Condition(
        type="Failed", status="True", reason="R", message="x" * 5000, last_transition_time="2026-11-24T00:00:00Z"
    )
    assert len(condition.message) == MAX_CONDITION_MESSAGE and condition.message.endswith("…")
