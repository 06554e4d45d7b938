"""End to end, one pod with two accelerators: an island of `acceleratorsPerPod: 2` on the GPU node pool runs
two ranks in its one pod (on the test cluster, CPU processes with gloo, as its nodes' GPUs are KWOK's), both
training and rank 0 alone pushing; a real SIGKILL of one rank's process takes the pod's process down, the
island re-forms and trains again, while the job's other island trains on.

The tests share one job and run in file order. They need the pod runner (to see a pod's processes and reach
its metrics in the pod network) and a GPU node pool."""

from __future__ import annotations

import json
import os
import re
import signal
from functools import partial
from pathlib import Path

import pytest
import support
import yaml
from test_diloco_job import CHEAP

pytestmark = [pytest.mark.process, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "e2e-ranks"
JOB = "ranks"
GPU_POOL = {"cloud.google.com/gke-accelerator": "nvidia-a100-80gb"}
wait_until = partial(support.wait_until, timeout=180.0, interval=1.0)


def job_manifest(image_tag: str) -> str:
    """deploy/examples/tiny-cpu.yaml with a one-pod island of two accelerators on the A100 pool beside a
    one-pod CPU island; K=1, so either island's pushes merge without the other's."""
    job = yaml.safe_load((ROOT / "deploy" / "examples" / "tiny-cpu.yaml").read_text())
    job["metadata"] = {"name": JOB}
    spec = job["spec"]
    spec["image"] = f"diloco-trainer:{image_tag}"
    spec["imagePullPolicy"] = "IfNotPresent"
    spec["training"] |= {"innerSteps": 10, "fragments": 2, "overlapSteps": 1, "graceSeconds": 0.5, "quorum": 1}
    small = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}
    template = {"spec": {"containers": [{"name": "trainer", "env": CHEAP}]}}
    spec["islands"] = [
        {
            "name": "gpu",
            "replicas": 1,
            "acceleratorsPerPod": 2,
            "nodeSelector": GPU_POOL,
            "resources": small,
            "podTemplate": template,
        },
        {"name": "cpu", "replicas": 1, "resources": small, "podTemplate": template},
    ]
    spec["syncer"] |= {"shards": 1, "resources": small}
    spec["failurePolicy"] = {"restartBudget": 5, "backoffSeconds": 1}
    spec["stopCondition"] = {"outerSteps": 100000}
    return yaml.safe_dump(job)


def status(target):
    result = target.kubectl("-n", NAMESPACE, "get", "dilocojob", JOB, "-o", "json", check=False)
    return (json.loads(result.stdout).get("status") or {}) if result.returncode == 0 else {}


def island(target, name):
    return next((i for i in status(target).get("islands", ()) if i["name"] == name), {})


def the_pod(target, island_name):
    """The island's one pod, once it is Running with an IP and not being deleted (else None)."""
    out = target.kubectl(
        "-n", NAMESPACE, "get", "pods", "-l", f"diloco.dev/job={JOB},diloco.dev/island={island_name}", "-o", "json"
    ).stdout
    pods = [
        p for p in json.loads(out)["items"] if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
    ]
    return pods[0] if len(pods) == 1 else None


def restarts(pod):
    return sum(s.get("restartCount", 0) for s in pod["status"].get("containerStatuses") or ())


def metric(target, pod, local_rank, name, **labels):
    """A sample of local rank `local_rank`'s metrics (served on the pod's metrics port + local rank), or None
    while it does not answer or has no such sample."""
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    try:
        text = target.get(pod, int(env["DILOCO_METRICS_PORT"]) + local_rank, "/metrics")
    except OSError:
        return None
    for line in text.splitlines():
        found = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if found and all(f'{key}="{value}"' in found.group(1) for key, value in labels.items()):
            return float(found.group(2))
    return None


def local_ranks(target, pod):
    """LOCAL_RANK -> pid of each of the pod's rank processes."""
    members = target.runner.members(NAMESPACE, pod["metadata"]["name"])
    return {int(env["LOCAL_RANK"]): pid for pid, env in members.items() if "LOCAL_RANK" in env}


@pytest.fixture(scope="module")
def job(target, operator):
    if target.runner is None:
        pytest.skip("needs the test cluster's pod runner, to see a pod's processes and reach its metrics")
    nodes = json.loads(target.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    if not any(GPU_POOL.items() <= n["metadata"]["labels"].items() for n in nodes):
        pytest.skip("this cluster has no A100 node pool (the KWOK test cluster has one)")
    target.kubectl("create", "namespace", NAMESPACE)
    target.kubectl("-n", NAMESPACE, "apply", "-f", "-", stdin=job_manifest(target.image_tag))
    try:
        yield JOB
    finally:
        target.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=180)


def test_a_pod_with_two_accelerators_trains_as_two_ranks_and_rank_0_pushes(target, job):
    pod = wait_until(lambda: the_pod(target, "gpu"))
    assert pod["spec"]["nodeName"].startswith("a100-")
    ranks = wait_until(lambda: len(r := local_ranks(target, pod)) == 2 and r)
    assert sorted(ranks) == [0, 1] and len(set(ranks.values())) == 2, "one process per local rank"
    for rank in (0, 1):
        wait_until(lambda rank=rank: (metric(target, pod, rank, "diloco_worker_step", rank=str(rank)) or 0) > 0)
    wait_until(lambda: (metric(target, pod, 0, "diloco_worker_pushes_total", rank="0") or 0) > 0)
    assert metric(target, pod, 1, "diloco_worker_pushes_total", rank="1") == 0, "only rank 0 talks to the syncers"
    wait_until(lambda: status(target).get("phase") == "Running" and status(target)["islandsReady"] == "2/2")


def test_killing_one_rank_re_forms_its_island_while_the_other_island_trains_on(target, job):
    pod, cpu_pod = wait_until(lambda: the_pod(target, "gpu")), wait_until(lambda: the_pod(target, "cpu"))
    before = wait_until(lambda: len(r := local_ranks(target, pod)) == 2 and r)
    cpu_process = set(target.runner.members(NAMESPACE, cpu_pod["metadata"]["name"]))
    merged = partial(metric, target, cpu_pod, 0, "diloco_worker_syncs_total", outcome="merged")
    cpu_merges = wait_until(merged)

    os.kill(before[1], signal.SIGKILL)

    # The CPU island trains on: its merges keep rising, in the very process it had.
    wait_until(lambda: (merged() or 0) > cpu_merges)
    # The GPU island's pod lost its process, rank 0 included: a failure, and the island re-forms as for a
    # dead pod, with both ranks new processes.
    wait_until(lambda: island(target, "gpu").get("restarts") == 1)

    def re_formed():
        found = the_pod(target, "gpu")
        ranks = local_ranks(target, found) if found else {}
        return len(ranks) == 2 and not set(ranks.values()) & set(before.values()) and found

    again = wait_until(re_formed)
    for rank in (0, 1):
        wait_until(lambda rank=rank: (metric(target, again, rank, "diloco_worker_step", rank=str(rank)) or 0) > 0)
    step = status(target)["outerStep"]
    wait_until(lambda: status(target)["outerStep"] > step and status(target)["islandsReady"] == "2/2")

    assert set(target.runner.members(NAMESPACE, cpu_pod["metadata"]["name"])) == cpu_process
    assert island(target, "cpu").get("restarts") == 0 and restarts(the_pod(target, "cpu")) == 0
