"""An island pod deleted mid-run (a node drained, a spot VM reclaimed: the pod is gone, not its container
restarted) comes back warm when its island keeps its checkpoints on a volume (spec.islands[].checkpoint):
the replacement mounts the same claim, finds the optimizer state there, and resumes at the step its
predecessor had reached rather than at 0. The claim goes with the job."""

from __future__ import annotations

import json
import re
from functools import partial

import pytest
import support
import yaml
from test_diloco_job import job_manifest, ready

pytestmark = [pytest.mark.process, pytest.mark.e2e]

NAMESPACE = "e2e-warm"
JOB = "warm"
POD = f"{JOB}-solo-0"
CLAIM = f"checkpoints-{POD}"  # the StatefulSet's claim template "checkpoints", for pod 0
wait_until = partial(support.wait_until, timeout=180.0, interval=1.0)


def manifest(image_tag: str) -> str:
    """test_diloco_job's job with its on-demand island alone, keeping its checkpoints on a volume, and no
    export (its claim is not in this namespace)."""
    job = yaml.safe_load(job_manifest(image_tag))
    job["metadata"] = {"name": JOB}
    spec = job["spec"]
    spec["islands"] = [{**spec["islands"][0], "checkpoint": {"size": "100Mi", "checkpointEvery": 5}}]
    del spec["export"]
    return yaml.safe_dump(job)


def island_pod(target) -> dict | None:
    result = target.kubectl("-n", NAMESPACE, "get", "pod", POD, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def trained_step(target) -> int:
    """The step the island's trainer has reached (its diloco_worker_step gauge); 0 while it does not answer."""
    try:
        metrics = target.get(island_pod(target), 9090, "/metrics")
    except OSError:
        return 0
    return int(float(re.search(r"^diloco_worker_step\{[^}]*\} (\S+)$", metrics, re.MULTILINE).group(1)))


def resumed(target) -> dict | None:
    """The trainer's last "island resumes" log record (its replacement's, once there is one)."""
    if target.runner is not None:
        logs = target.runner.logs(NAMESPACE, POD)
    else:
        logs = target.kubectl("-n", NAMESPACE, "logs", POD, check=False).stdout
    records = [json.loads(line) for line in logs.splitlines() if '"island resumes"' in line]
    return records[-1] if records else None


def test_a_deleted_island_pod_resumes_warm_from_its_volume(target, operator):
    target.kubectl("create", "namespace", NAMESPACE)
    try:
        target.kubectl("-n", NAMESPACE, "apply", "-f", "-", stdin=manifest(target.image_tag))
        first = wait_until(lambda: (pod := island_pod(target)) and ready(pod) and pod)
        claims = [
            v["persistentVolumeClaim"]["claimName"] for v in first["spec"]["volumes"] if v["name"] == "checkpoints"
        ]
        assert claims == [CLAIM], "the checkpoints are on the island's claim, not an emptyDir"
        before = wait_until(lambda: (step := trained_step(target)) >= 10 and step)

        uid = island_pod(target)["metadata"]["uid"]
        target.kubectl("-n", NAMESPACE, "delete", "pod", POD, "--wait=false")
        wait_until(lambda: (pod := island_pod(target)) and pod["metadata"]["uid"] != uid and ready(pod))
        record = wait_until(lambda: (r := resumed(target)) and r["step"] > 0 and r)
        assert record["warm"] is True, record
        assert record["step"] >= before, "where its predecessor had got to, not step 0"

        target.kubectl("-n", NAMESPACE, "delete", "dilocojob", JOB, "--wait=true", timeout=120)
        wait_until(lambda: target.kubectl("-n", NAMESPACE, "get", "pvc", CLAIM, check=False).returncode != 0)
    finally:
        target.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=180)
