"""spec.ttlSecondsAfterFinished: a finished job is deleted once its TTL has passed since it finished."""

from status_builders import at

from diloco.api.job import DiLoCoJobStatus, Phase
from diloco.operator.policies.ttl_after_finished import deletion_due, ttl_expires_at


def test_ttl_after_finishing():
    running = DiLoCoJobStatus(phase=Phase.RUNNING)
    assert ttl_expires_at(running, 60) is None
    done = DiLoCoJobStatus(phase=Phase.SUCCEEDED, completion_time=at(0))
    assert ttl_expires_at(done, None) is None and ttl_expires_at(done, 60) == at(60)


def test_the_deletion_is_due_at_expiry_and_announced():
    failed = DiLoCoJobStatus(phase=Phase.FAILED, completion_time=at(0))
    assert deletion_due(failed, 60, at(59)) is None
    assert deletion_due(failed, None, at(600)) is None
    assert deletion_due(DiLoCoJobStatus(phase=Phase.RUNNING), 60, at(600)) is None
    event = deletion_due(failed, 60, at(60))
    assert (event.type, event.reason) == ("Normal", "TTLExpired")
    assert event.message == "deleting the job ttlSecondsAfterFinished=60s after it failed"
