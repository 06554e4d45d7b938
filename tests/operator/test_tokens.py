"""A job's bearer token is a function of the operator's key, the job's identity and its rotation: deleting the
job's Secret cannot lose it, and only a deliberate rotation (or another job) changes it."""

from diloco.operator import naming as n
from diloco.operator.tokens import fingerprint, job_token, rotation_of

KEY = bytes(range(32))
JOB = n.JobRef(name="demo", namespace="ml", uid="uid-1")


def test_the_same_job_always_gets_the_same_token():
    assert job_token(KEY, JOB, "") == job_token(KEY, n.JobRef("demo", "ml", "uid-1"), "")
    assert len(job_token(KEY, JOB, "")) >= 43


def test_rotation_another_job_or_another_key_each_give_another_token():
    tokens = {
        job_token(KEY, JOB, ""),
        job_token(KEY, JOB, "2026-01-01"),
        job_token(KEY, n.JobRef("demo", "ml", "uid-2"), ""),
        job_token(KEY, n.JobRef("demo", "other", "uid-1"), ""),
        job_token(bytes(32), JOB, ""),
    }
    assert len(tokens) == 5


def test_the_rotation_is_read_from_the_jobs_annotation():
    assert rotation_of({}) == "" and rotation_of({"annotations": {"diloco.dev/rotate-token": "r2"}}) == "r2"


def test_the_fingerprint_names_a_token_without_revealing_it():
    token = job_token(KEY, JOB, "")
    assert fingerprint(token) == fingerprint(token) != fingerprint(job_token(KEY, JOB, "r"))
    assert fingerprint(token) not in token and len(fingerprint(token)) == 16
