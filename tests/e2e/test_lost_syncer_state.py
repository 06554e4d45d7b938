"""A shard that loses its state is loud, and the job does not count again from zero. Deleting a shard's claim and
then its pod, as a careless cleanup would, gives the shard an empty volume: it starts again from what the island
seeds it with, its fragments' versions back at 0. The job says so (a Warning Event, condition SyncerStateLost),
carries the outer steps it had reached, and trains on."""

from __future__ import annotations

import json

import pytest
import support
import yaml
from test_diloco_job import job_manifest

# Its waits add up past the suite's 5 minutes when the machine is busy; each names what it waited for.
pytestmark = [pytest.mark.process, pytest.mark.e2e, pytest.mark.timeout(1200)]

NAMESPACE = "e2e-lost"
JOB = "lost"
CLAIM = f"{JOB}-syncer-0"


def manifest(image_tag: str) -> str:
    """test_diloco_job's job with its on-demand island alone and no export."""
    job = yaml.safe_load(job_manifest(image_tag))
    job["metadata"] = {"name": JOB}
    job["spec"]["islands"] = job["spec"]["islands"][:1]
    del job["spec"]["export"]
    return yaml.safe_dump(job)


def wait_until(target, what, condition, timeout=240.0):
    """`support.wait_until`, failing with what the namespace shows: a busy CI machine's slow step is then named."""
    try:
        return support.wait_until(condition, timeout=timeout, interval=1.0)
    except pytest.fail.Exception:
        shown = [
            target.kubectl("-n", NAMESPACE, *args, check=False).stdout
            for args in (
                ("get", "pods,pvc", "-o", "wide"),
                ("get", "events", "--sort-by=.lastTimestamp"),
                ("get", "dilocojob", JOB, "-o", "jsonpath={.status.conditions}"),
            )
        ]
        pytest.fail(f"{what}: not within {timeout} s; the namespace shows:\n" + "\n".join(shown))


def get(target, kind, name):
    result = target.kubectl("-n", NAMESPACE, "get", kind, name, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def status(target):
    return (get(target, "dilocojob", JOB) or {}).get("status") or {}


def condition(target, kind):
    return next((c for c in status(target).get("conditions", ()) if c["type"] == kind), {})


def test_a_shard_whose_volume_is_lost_is_loud_and_the_job_goes_on_from_where_it_was(target, operator):
    target.kubectl("create", "namespace", NAMESPACE)
    try:
        target.kubectl("-n", NAMESPACE, "apply", "-f", "-", stdin=manifest(target.image_tag))
        before = wait_until(target, "4 outer steps", lambda: (s := status(target)).get("outerStep", 0) >= 4 and s)
        assert condition(target, "SyncerStateLost")["status"] == "False"
        claim = get(target, "pvc", CLAIM)["metadata"]["uid"]
        shard = json.loads(
            target.kubectl(
                "-n", NAMESPACE, "get", "pods", "-l", f"diloco.dev/job={JOB},diloco.dev/shard=0", "-o", "json"
            ).stdout
        )["items"][0]["metadata"]["name"]

        target.kubectl("-n", NAMESPACE, "delete", "pvc", CLAIM, "--wait=false")
        target.kubectl("-n", NAMESPACE, "delete", "pod", shard, "--wait=false")

        # The old pod's grace period, the claim made anew, the new pod scheduled and the shard seeded again.
        lost = wait_until(
            target,
            "SyncerStateLost true",
            lambda: (c := condition(target, "SyncerStateLost")).get("status") == "True" and c,
            timeout=480.0,
        )
        assert lost["reason"] == "VersionRegressed" and "syncer shard 0 came back without its state" in lost["message"]
        listing = json.loads(target.kubectl("-n", NAMESPACE, "get", "events", "-o", "json").stdout)["items"]
        warned = [e for e in listing if e["reason"] == "SyncerStateLost"]
        assert {e["type"] for e in warned} == {"Warning"}
        # One Event for the shard, naming its fragments; the island that has not synced since says so in another.
        assert any("fragments" in e["message"] for e in warned), [e["message"] for e in warned]
        now = status(target)
        # What the shard counted before is carried, however far its new state had got when the operator looked.
        assert now["carriedOuterSteps"] > 0 and now["outerStep"] >= before["outerStep"], "not counted from zero"
        assert get(target, "pvc", CLAIM)["metadata"]["uid"] != claim, "an empty claim was made in its place"
        wait_until(target, "training on", lambda: status(target)["outerStep"] > now["outerStep"])
        assert condition(target, "SyncerStateLost")["status"] == "True", "it stays a record"
    finally:
        target.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=180)
