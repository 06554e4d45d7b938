"""End to end, through kubectl and helm only: a small variant of deploy/examples/tiny-cpu.yaml (an on-demand
island and a spot island, few and cheap steps) trains for real, its trainers Ready once they train,
survives the loss of its spot node, a crashing trainer and a restarted operator, rolls onto a new image one
island at a time while it trains, is suspended and resumed, finishes, exports its model
to a volume of the user's, and is garbage-collected when deleted. Then a job whose island cannot join its
syncer is never Ready, and says so.

The tests up to the deletion share one job and run in file order, each a chapter of its life.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import support
import yaml

from diloco.export.model_files import load as load_export

pytestmark = [pytest.mark.process, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "e2e"
JOB = "tiny"
CHILD_KINDS = "configmap,secret,networkpolicy,persistentvolumeclaim,service,deployment,statefulset,job"
MODELS_CLAIM = "tiny-models"  # the user's volume the finished job exports its model to
wait_until = partial(support.wait_until, timeout=120.0, interval=1.0)
CHEAP = [  # the trainer's knobs (worker/main.py): tiny batches, one thread, no eval
    {"name": "DILOCO_BATCH_SIZE", "value": "4"},
    {"name": "DILOCO_THREADS", "value": "1"},
    {"name": "DILOCO_EVAL_EVERY", "value": "1000000"},
]


def job_manifest(image_tag: str) -> str:
    """deploy/examples/tiny-cpu.yaml with one on-demand and one spot island of one pod each, H=10, one shard,
    and a stop condition far away (test_the_job_finishes brings it near)."""
    job = yaml.safe_load((ROOT / "deploy" / "examples" / "tiny-cpu.yaml").read_text())
    job["metadata"] = {"name": JOB}
    spec = job["spec"]
    spec["image"] = f"diloco-trainer:{image_tag}"
    spec["imagePullPolicy"] = "IfNotPresent"
    spec["training"] |= {"innerSteps": 10, "fragments": 2, "overlapSteps": 1, "graceSeconds": 0.5}
    small = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}
    template = {"spec": {"containers": [{"name": "trainer", "env": CHEAP}]}}
    spec["islands"] = [
        {"name": "solo", "replicas": 1, "resources": small, "podTemplate": template},
        {
            "name": "spot",
            "replicas": 1,
            "spot": True,
            "nodeSelector": {"cloud.google.com/gke-spot": "true"},
            "resources": small,
            "podTemplate": template,
        },
    ]
    spec["syncer"] |= {"shards": 1, "resources": small}
    spec["failurePolicy"] = {"restartBudget": 5, "backoffSeconds": 1}
    spec["stopCondition"] = {"outerSteps": 100000}
    spec["export"] = {"claimName": MODELS_CLAIM}
    return yaml.safe_dump(job)


def models_claim() -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": MODELS_CLAIM},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "100Mi"}}},
        }
    )


def get(target, kind, name, namespace=NAMESPACE):
    result = target.kubectl("-n", namespace, "get", kind, name, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def status(target):
    return (get(target, "dilocojob", JOB) or {}).get("status") or {}


def island(target, name):
    return next((i for i in status(target).get("islands", ()) if i["name"] == name), {})


def pods(target, island_name):
    out = target.kubectl(
        "-n", NAMESPACE, "get", "pods", "-l", f"diloco.dev/job={JOB},diloco.dev/island={island_name}", "-o", "json"
    ).stdout
    return json.loads(out)["items"]


def ready(pod):
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", ())
    )


def children(target):
    out = target.kubectl("-n", NAMESPACE, "get", CHILD_KINDS, "-l", f"diloco.dev/job={JOB}", "-o", "json").stdout
    return {(o["kind"], o["metadata"]["name"]): o for o in json.loads(out)["items"]}


def progress_beyond(target, outer_step):
    """Waits until the job's outer step passes `outer_step`; returns the new one."""
    return wait_until(lambda: (step := status(target).get("outerStep", 0)) > outer_step and step, timeout=180)


@pytest.fixture(scope="module")
def job(target, operator):
    target.kubectl("create", "namespace", NAMESPACE)
    target.kubectl("-n", NAMESPACE, "apply", "-f", "-", stdin=models_claim())
    target.kubectl("-n", NAMESPACE, "apply", "-f", "-", stdin=job_manifest(target.image_tag))
    try:
        yield JOB
    finally:
        target.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=180)


def test_helm_installs_a_running_operator(target, operator):
    releases = json.loads(target.helm("list", "--namespace", operator, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("diloco", "deployed")]
    for crd in ("dilocojobs.diloco.dev", "clusterkopfpeerings.kopf.dev"):
        target.kubectl("wait", "--for=condition=established", f"crd/{crd}", "--timeout=60s")
    deployment = get(target, "deployment", "diloco", operator)
    assert deployment["status"].get("availableReplicas") == 1
    if target.runner is not None:
        pod = next(p for p in json.loads(target.kubectl("-n", operator, "get", "pods", "-o", "json").stdout)["items"])
        wait_until(lambda: target.runner.processes(operator, pod["metadata"]["name"]), timeout=30)


def test_the_job_creates_its_children_and_becomes_running(target, job):
    found = wait_until(lambda: len(c := children(target)) == 11 and c)
    assert set(found) == {
        ("ConfigMap", "tiny-config"),
        ("Secret", "diloco-tiny-token"),
        ("Secret", "diloco-tiny-tls"),
        ("NetworkPolicy", "tiny-syncers"),
        ("PersistentVolumeClaim", "tiny-syncer-0"),
        ("Service", "tiny-syncer-0"),
        ("Deployment", "tiny-syncer-0"),
        ("Service", "tiny-solo"),
        ("StatefulSet", "tiny-solo"),
        ("Service", "tiny-spot"),
        ("StatefulSet", "tiny-spot"),
    }
    uid = get(target, "dilocojob", JOB)["metadata"]["uid"]
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == uid for o in found.values())
    wait_until(lambda: status(target).get("phase") == "Running")
    assert status(target)["islandsReady"] == "2/2"
    for name in ("solo", "spot"):  # Ready by the trainers' readiness probe: they joined and train
        pod = wait_until(lambda name=name: (found := pods(target, name)) and ready(found[0]) and found[0])
        assert pod["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/readyz"
    spot_pod = pods(target, "spot")[0]
    assert spot_pod["spec"]["nodeName"].startswith("cpu-spot") or target.cluster is None


def test_training_progress_shows_in_status(target, job):
    first = wait_until(lambda: (s := status(target)).get("outerStep", 0) > 0 and s, timeout=180)
    later = wait_until(
        lambda: (s := status(target))["outerStep"] > first["outerStep"] and s["tokens"] > first["tokens"] and s,
        timeout=180,
    )
    assert all(f["version"] >= later["outerStep"] for f in later["fragments"])

    # The operator reads each island's training loss from its rank-0 pod's metrics, at the pod's IP.
    def island_losses():
        islands = status(target)["islands"]
        return [i["loss"] for i in islands] if all(i.get("loss") is not None for i in islands) else None

    losses = wait_until(island_losses)
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)


def test_losing_the_spot_node_reschedules_its_pod_while_the_other_island_trains_on(target, job):
    before = pods(target, "spot")[0]
    lost = before["spec"]["nodeName"]
    step = status(target)["outerStep"]
    target.lose_node(lost)
    try:
        # The on-demand island alone keeps the job moving while the spot island is away.
        progress_beyond(target, step)
        after = wait_until(
            lambda: (
                (p := pods(target, "spot"))
                and ready(p[0])
                and p[0]["metadata"]["uid"] != before["metadata"]["uid"]
                and p[0]
            ),
            timeout=180,
        )
        assert after["spec"]["nodeName"] != lost
        record = wait_until(lambda: (i := island(target, "spot")).get("preemptions", 0) >= 1 and i)
        assert record["restarts"] == 0, "a preemption is not charged to the restart budget"
        wait_until(lambda: island(target, "spot").get("ready") == 1 and status(target).get("phase") == "Running")
    finally:
        target.restore_node(lost)


def test_a_crashing_trainer_is_restarted_and_counted(target, job):
    assert island(target, "solo")["restarts"] == 0
    pod = pods(target, "solo")[0]
    target.crash(NAMESPACE, pod["metadata"]["name"])
    wait_until(lambda: island(target, "solo").get("restarts") == 1, timeout=180)
    wait_until(
        lambda: island(target, "solo").get("ready") == 1 and status(target).get("phase") == "Running", timeout=180
    )
    progress_beyond(target, status(target)["outerStep"])


def test_a_restarted_operator_changes_nothing(target, job, operator):
    before = {key: (o["metadata"]["uid"], o["metadata"].get("generation")) for key, o in children(target).items()}
    workers = {p["metadata"]["uid"] for name in ("solo", "spot") for p in pods(target, name)}
    target.kubectl("-n", operator, "delete", "pods", "-l", "app.kubernetes.io/name=diloco-operator", "--wait=true")
    target.kubectl("-n", operator, "rollout", "status", "deployment/diloco", "--timeout=120s")
    step = status(target)["outerStep"]
    progress_beyond(target, step)  # status is being written again, by the new operator
    after = {key: (o["metadata"]["uid"], o["metadata"].get("generation")) for key, o in children(target).items()}
    assert after == before
    assert {p["metadata"]["uid"] for name in ("solo", "spot") for p in pods(target, name)} == workers


def test_an_image_change_rolls_the_islands_one_at_a_time_while_the_job_trains(target, job):
    image = f"diloco-trainer:{target.image_tag}-rolled"
    old = {name: pods(target, name)[0]["metadata"]["uid"] for name in ("solo", "spot")}
    target.kubectl(
        "-n", NAMESPACE, "patch", "dilocojob", JOB, "--type", "merge", "-p", json.dumps({"spec": {"image": image}})
    )
    polls = []  # (islands rolling, outer step) at each look

    def rolled():
        now = status(target)
        rolling = {i["name"] for i in now["islands"] if i.get("reform") or i.get("rolledAt")}
        polls.append((rolling, now["outerStep"]))
        current = [p for name in ("solo", "spot") for p in pods(target, name)]
        on_new = len(current) == 2 and all(p["spec"]["containers"][0]["image"] == image and ready(p) for p in current)
        return on_new and not rolling and now

    wait_until(rolled, timeout=420)
    assert {name for rolling, _ in polls for name in rolling} == {"solo", "spot"}, "each island re-formed"
    assert max(len(rolling) for rolling, _ in polls) == 1, "never two islands down for the update at once"
    during = [step for rolling, step in polls if rolling]
    assert max(during) > min(during), "the outer step rose while islands rolled"
    assert all(pods(target, name)[0]["metadata"]["uid"] != old[name] for name in ("solo", "spot"))
    shard = get(target, "deployment", "tiny-syncer-0")["spec"]["template"]["spec"]["containers"][0]
    assert shard["image"] == image, "the shards run the job's image too"
    wait_until(lambda: status(target).get("phase") == "Running", timeout=180)
    progress_beyond(target, status(target)["outerStep"])


def test_a_suspended_job_stops_its_islands_cleanly_and_resumes_where_it_was(target, job, resync_seconds):
    """Suspending deletes the island pods: each trainer, on SIGTERM, pushes its last steps, says Leave and
    exits, which is no failure; the shards stay up and stop reporting the islands live at once (else for
    islandTimeoutSeconds, 60 s). Resuming brings the islands back, and the job trains on from its step."""
    before = status(target)
    restarts = {i["name"]: i["restarts"] for i in before["islands"]}
    suspend = partial(target.kubectl, "-n", NAMESPACE, "patch", "dilocojob", JOB, "--type", "merge", "-p")
    suspend(json.dumps({"spec": {"suspend": True}}))
    wait_until(
        lambda: status(target).get("phase") == "Suspended" and not pods(target, "solo") and not pods(target, "spot"),
        timeout=180,
    )
    left = {i["name"]: i.get("lastSync") for i in status(target)["islands"]}
    time.sleep(2.5 * resync_seconds)  # two reconcile passes at least, each asking the shards who is live
    suspended = status(target)
    assert {i["name"]: i.get("lastSync") for i in suspended["islands"]} == left, "the islands left the shards"
    assert {i["name"]: i["restarts"] for i in suspended["islands"]} == restarts, "a stop is not a failure"
    assert get(target, "deployment", "tiny-syncer-0")["status"].get("readyReplicas") == 1, "the shards stay"
    assert suspended["outerStep"] >= before["outerStep"] and suspended["tokens"] >= before["tokens"]

    suspend(json.dumps({"spec": {"suspend": False}}))
    wait_until(lambda: (s := status(target)).get("phase") == "Running" and s["islandsReady"] == "2/2", timeout=180)
    progress_beyond(target, suspended["outerStep"])
    assert status(target)["tokens"] > suspended["tokens"]


def test_the_job_finishes_when_its_stop_condition_is_reached(target, job):
    goal = status(target)["outerStep"] + 2
    target.kubectl(
        "-n",
        NAMESPACE,
        "patch",
        "dilocojob",
        JOB,
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"stopCondition": {"outerSteps": goal}}}),
    )
    wait_until(lambda: status(target).get("phase") == "Succeeded", timeout=180)
    final = status(target)
    assert final["outerStep"] >= goal and final["completionTime"]
    wait_until(lambda: not pods(target, "solo") and not pods(target, "spot"))
    assert get(target, "statefulset", "tiny-solo")["spec"]["replicas"] == 0


def test_the_finished_job_exports_its_model_to_the_users_volume(target, job):
    """Once the islands and then the shards have stopped, the export Job writes the model from the shards'
    final checkpoints; on the test cluster (KWOK's nodes or real ones) the volume is a host folder, read back
    here."""
    export = wait_until(
        lambda: (e := status(target).get("export") or {}).get("phase") == "Succeeded" and e, timeout=300
    )
    assert export["location"] == f"{MODELS_CLAIM}:/{JOB}"
    assert get(target, "deployment", "tiny-syncer-0")["spec"]["replicas"] == 0
    if target.cluster is None:
        return  # another cluster's volume is not a folder of this machine: the status is what can be checked
    volume = get(target, "persistentvolumeclaim", MODELS_CLAIM)["spec"]["volumeName"]
    folder = Path(get(target, "pv", volume)["spec"]["hostPath"]["path"]) / JOB
    exported = load_export(folder)
    assert exported.config["preset"] == "tiny" and exported.config["outer_steps"] >= status(target)["outerStep"]
    assert exported.config["training"]["innerSteps"] == 10
    exported.language_model()  # loads into the built-in GPT, as transformers loads it as GPT-2
    sampled = subprocess.run(
        [Path(sys.executable).parent / "diloco", "sample", folder, "--prompt", "def ", "--tokens", "40"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sampled.returncode == 0 and sampled.stdout.startswith("def ") and len(sampled.stdout) > 10, sampled


def test_deleting_the_job_collects_every_child(target, job):
    claim = get(target, "persistentvolumeclaim", "tiny-syncer-0")["spec"]["volumeName"]
    target.kubectl("-n", NAMESPACE, "delete", "dilocojob", JOB, "--wait=true", timeout=120)
    wait_until(lambda: not children(target))
    wait_until(lambda: not target.kubectl("-n", NAMESPACE, "get", "pods", "-o", "name").stdout)
    if target.runner is not None:
        assert not target.runner.processes(NAMESPACE)
    if target.cluster is not None:
        # The test cluster's provisioner deletes a released volume, as a cloud's would with reclaimPolicy Delete.
        wait_until(lambda: target.kubectl("get", "pv", claim, check=False).returncode != 0)


def test_an_island_that_cannot_join_its_syncer_is_never_ready_and_the_job_says_so(target, operator):
    """The island's trainer runs but never reaches its syncer (its pod template points it elsewhere): its
    readiness probe fails, so its pod is not Ready, and the job's Ready condition is False naming the island,
    while the syncer shard, which serves, is Ready."""
    namespace, name = "e2e-stuck", "stuck"
    job = yaml.safe_load(job_manifest(target.image_tag))
    job["metadata"] = {"name": name}
    nowhere = {"name": "DILOCO_SYNCERS", "value": f"{name}-syncer-9.{namespace}.svc:50051"}
    template = {"spec": {"containers": [{"name": "trainer", "env": [*CHEAP, nowhere]}]}}
    job["spec"]["islands"] = [{**job["spec"]["islands"][0], "name": "lost", "podTemplate": template}]
    target.kubectl("create", "namespace", namespace)
    try:
        target.kubectl("-n", namespace, "apply", "-f", "-", stdin=yaml.safe_dump(job))

        def probe_failures():
            out = target.kubectl("-n", namespace, "get", "events", "-o", "json").stdout
            return [
                e
                for e in json.loads(out)["items"]
                if e["reason"] == "Unhealthy" and e["involvedObject"]["name"] == f"{name}-lost-0"
            ]

        failed = wait_until(probe_failures)
        assert failed[0]["type"] == "Warning" and failed[0]["message"].startswith("Readiness probe failed")
        pod = get(target, "pod", f"{name}-lost-0", namespace)
        assert not ready(pod) and not pod["status"]["containerStatuses"][0]["ready"]

        def syncer_ready():
            out = target.kubectl("-n", namespace, "get", "pods", "-l", f"diloco.dev/job={name}", "-o", "json").stdout
            return any(ready(p) for p in json.loads(out)["items"] if "-syncer-" in p["metadata"]["name"])

        def ready_condition():
            found = (get(target, "dilocojob", name, namespace) or {}).get("status", {}).get("conditions", ())
            return next((c for c in found if c["type"] == "Ready" and "syncer shard 0 not" not in c["message"]), None)

        wait_until(syncer_ready)
        condition = wait_until(ready_condition)
        assert condition["status"] == "False" and "island lost: 0/1 pods ready" in condition["message"]
        assert not ready(get(target, "pod", f"{name}-lost-0", namespace))
    finally:
        target.kubectl("delete", "namespace", namespace, "--wait=true", timeout=180)
