"""spec.export: a job that succeeded exports its model once its shards have stopped; status.export says where
and how far it got, from the export Job as observed."""

import pytest
from status_builders import at

from diloco.api.job import DiLoCoJobSpec, ExportPhase, ExportStatus, Phase
from diloco.operator.policies.model_export import WAITING_FOR_SHARDS, export_due, export_status


def spec(export=None) -> DiLoCoJobSpec:
    data = {"image": "img", "islands": [{"name": "a"}], "training": {"fragments": 2}}
    if export is not None:
        data["export"] = export
    return DiLoCoJobSpec.model_validate(data)


WITH_EXPORT = spec({"claimName": "models", "path": "runs/tiny"})


def test_the_export_runs_once_the_job_succeeded_and_its_shards_have_stopped():
    assert export_due(WITH_EXPORT, Phase.SUCCEEDED, shards_stopped=True, started=False)
    assert not export_due(WITH_EXPORT, Phase.SUCCEEDED, shards_stopped=False, started=False)
    assert export_due(WITH_EXPORT, Phase.SUCCEEDED, shards_stopped=False, started=True)  # once started, kept
    assert not export_due(WITH_EXPORT, Phase.FAILED, shards_stopped=True, started=False)
    assert not export_due(WITH_EXPORT, Phase.RUNNING, shards_stopped=True, started=False)
    assert not export_due(spec(), Phase.SUCCEEDED, shards_stopped=True, started=True)


def test_the_location_defaults_to_a_folder_named_after_the_job():
    status = export_status(spec({"claimName": "models"}), "tiny", Phase.SUCCEEDED, None, None, at(0))
    assert status == ExportStatus(phase=ExportPhase.PENDING, location="models:/tiny", message=WAITING_FOR_SHARDS)


@pytest.mark.parametrize(
    ("observed", "phase"),
    [
        ({}, ExportPhase.RUNNING),
        ({"status": {"active": 1}}, ExportPhase.RUNNING),
        ({"status": {"succeeded": 1}}, ExportPhase.SUCCEEDED),
        (
            {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}},
            ExportPhase.FAILED,
        ),
    ],
)
def test_the_phase_is_the_export_jobs(observed, phase):
    status = export_status(WITH_EXPORT, "tiny", Phase.SUCCEEDED, observed, None, at(5))
    assert status.phase is phase and status.location == "models:/runs/tiny"
    assert (status.completion_time is not None) == (phase is ExportPhase.SUCCEEDED)
    assert (status.message or "").startswith("BackoffLimitExceeded") == (phase is ExportPhase.FAILED)


def test_a_finished_export_keeps_its_outcome_and_nothing_is_said_before_success():
    done = export_status(WITH_EXPORT, "tiny", Phase.SUCCEEDED, {"status": {"succeeded": 1}}, None, at(5))
    assert export_status(WITH_EXPORT, "tiny", Phase.SUCCEEDED, None, done, at(60)) == done
    assert export_status(WITH_EXPORT, "tiny", Phase.RUNNING, None, None, at(0)) is None
    assert export_status(spec(), "tiny", Phase.SUCCEEDED, None, None, at(0)) is None
