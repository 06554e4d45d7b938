"""examples/custom_loop applied as it is (`kubectl apply -k`): the user's own loop, mounted from the ConfigMap
the kustomization makes and run by the trainer image's Python through spec.trainer.command, trains as two
islands: their pods become Ready once they have joined the shard and train, the job's outer step rises, and
its status shows each island's loss, read from the metrics the learner serves with no code of the loop's."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import support

pytestmark = [pytest.mark.process, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "e2e-custom-loop"
JOB = "custom-loop"
wait_until = partial(support.wait_until, timeout=180.0, interval=1.0)


def job_status(target) -> dict:
    out = target.kubectl("-n", NAMESPACE, "get", "dilocojob", JOB, "-o", "json", check=False)
    return (json.loads(out.stdout).get("status") or {}) if out.returncode == 0 else {}


def ready_islands(target) -> set[str]:
    out = target.kubectl("-n", NAMESPACE, "get", "pods", "-l", f"diloco.dev/job={JOB}", "-o", "json").stdout
    return {
        pod["metadata"]["labels"]["diloco.dev/island"]
        for pod in json.loads(out)["items"]
        if "diloco.dev/island" in pod["metadata"]["labels"]
        and any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", ()))
    }


def test_the_custom_loop_example_trains_on_the_cluster(target, operator):
    target.kubectl("create", "namespace", NAMESPACE)
    try:
        target.kubectl("-n", NAMESPACE, "apply", "-k", str(ROOT / "examples" / "custom_loop"))
        wait_until(lambda: ready_islands(target) == {"left", "right"})
        first = wait_until(lambda: (s := job_status(target)).get("outerStep", 0) > 0 and s)
        later = wait_until(lambda: (s := job_status(target))["outerStep"] > first["outerStep"] and s)
        assert later["tokens"] > first["tokens"]

        def losses():
            islands = job_status(target).get("islands", ())
            found = {i["name"]: i.get("loss") for i in islands}
            return found if len(found) == 2 and None not in found.values() else None

        found = wait_until(losses)
        assert all(0 < loss < 3 for loss in found.values()), found  # below ln(13), where a guess starts
    finally:
        target.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=180)
