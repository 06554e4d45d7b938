"""A token rotation of a training job of three islands, through kubectl: every push is accepted all along (the
shard's count of calls it refused for their token does not move, and the shard is never restarted, so that count
covers the whole rotation), the islands roll onto the new token one at a time, and the outer step rises
throughout. One island also mounts a binary Secret of the user's (a keystore), which its pod gets as the bytes it
holds."""

from __future__ import annotations

import base64
import json
import re
from functools import partial

import pytest
import support
import yaml
from test_diloco_job import CHEAP, ready

from diloco.operator.tokens import JobTokens, fingerprint

# Its waits add up past the suite's 5 minutes when the machine is busy; each names what it waited for.
pytestmark = [pytest.mark.process, pytest.mark.e2e, pytest.mark.timeout(1200)]

NAMESPACE = "e2e-rotate"
JOB = "rotate"
ISLANDS = ("a", "b", "c")
KEYSTORE = bytes(range(256)) * 4  # no text: every byte value, as a DER key or a keystore holds them
wait_until = partial(support.wait_until, timeout=180.0, interval=1.0)


def manifest(image_tag: str) -> str:
    """Three one-pod CPU islands of the tiny preset, one shard; island c mounts the keystore."""
    small = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}
    trainer = {"name": "trainer", "env": CHEAP}
    keystore = {
        "spec": {
            "containers": [{**trainer, "volumeMounts": [{"name": "keystore", "mountPath": "/etc/keystore"}]}],
            "volumes": [{"name": "keystore", "secret": {"secretName": "keystore"}}],
        }
    }
    islands = [
        {
            "name": name,
            "resources": small,
            "podTemplate": keystore if name == "c" else {"spec": {"containers": [trainer]}},
        }
        for name in ISLANDS
    ]
    spec = {
        "image": f"diloco-trainer:{image_tag}",
        "imagePullPolicy": "IfNotPresent",
        "trainer": {"model": "tiny", "data": "stdlib"},
        "training": {"innerSteps": 10, "fragments": 2, "overlapSteps": 1, "graceSeconds": 0.5, "encoding": "int4"},
        "islands": islands,
        "syncer": {"shards": 1, "resources": small},
        "failurePolicy": {"restartBudget": 5, "backoffSeconds": 1},
        "updateStrategy": {"maxUnavailable": 1},
    }
    return yaml.safe_dump(
        {"apiVersion": "diloco.dev/v1alpha1", "kind": "DiLoCoJob", "metadata": {"name": JOB}, "spec": spec}
    )


def get(target, kind, name):
    result = target.kubectl("-n", NAMESPACE, "get", kind, name, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def status(target):
    return (get(target, "dilocojob", JOB) or {}).get("status") or {}


def pods(target, selector):
    out = target.kubectl("-n", NAMESPACE, "get", "pods", "-l", selector, "-o", "json").stdout
    return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]


def island_pods(target):
    return pods(target, f"diloco.dev/job={JOB},app.kubernetes.io/component=island")


def shard_pod(target):
    (pod,) = pods(target, f"diloco.dev/job={JOB},diloco.dev/shard=0")
    return pod


def refused_calls(target, pod) -> float:
    """The shard's count of calls it refused for their token (0 while it has refused none)."""
    metrics = target.get(pod, 9090, "/metrics")
    found = re.search(r'^diloco_syncer_rejected_pushes_total\{reason="unauthenticated"\} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


def tokens(target) -> JobTokens:
    tokens = JobTokens.from_secret(get(target, "secret", f"diloco-{JOB}-token"))
    assert tokens is not None
    return tokens


def events(target, reason):
    listing = json.loads(target.kubectl("-n", NAMESPACE, "get", "events", "-o", "json").stdout)["items"]
    return [e for e in listing if e["reason"] == reason]


@pytest.fixture(scope="module")
def job(target, operator):
    target.kubectl("create", "namespace", NAMESPACE)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "keystore"},
        "data": {"keystore.p12": base64.b64encode(KEYSTORE).decode()},
    }
    target.kubectl("-n", NAMESPACE, "apply", "-f", "-", stdin=yaml.safe_dump(secret))
    target.kubectl("-n", NAMESPACE, "apply", "-f", "-", stdin=manifest(target.image_tag))
    try:
        wait_until(lambda: (s := status(target)).get("phase") == "Running" and s.get("outerStep", 0) > 0, timeout=300)
        yield JOB
    finally:
        target.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=180)


def test_an_island_mounting_a_binary_secret_trains_with_its_bytes(target, job):
    (pod,) = pods(target, f"diloco.dev/job={JOB},diloco.dev/island=c")
    assert ready(pod), "the runner started it: a Secret that is no text did not stop it"
    if target.runner is not None:
        meta = pod["metadata"]
        folder = target.runner.workdir / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / "volumes" / "keystore"
        assert (folder / "keystore.p12").read_bytes() == KEYSTORE


def test_a_token_rotation_refuses_no_push_and_training_goes_on_throughout(target, job):
    old = tokens(target)
    assert old == JobTokens.only(old.presented)
    shard = shard_pod(target)
    refused_before = refused_calls(target, shard)
    first = {p["metadata"]["labels"]["diloco.dev/island"]: p["metadata"]["uid"] for p in island_pods(target)}
    assert set(first) == set(ISLANDS)

    target.kubectl("-n", NAMESPACE, "annotate", "dj", JOB, "diloco.dev/rotate-token=1", "--overwrite")
    polls = []  # (accepted tokens, islands on the new token, islands rolling, outer step) at each look

    def rotated():
        now, held = tokens(target), island_pods(target)
        moved = [p for p in held if ready(p) and p["metadata"]["uid"] not in first.values()]
        new = {p["metadata"]["labels"]["diloco.dev/island"] for p in moved}
        rolling = {i["name"] for i in status(target)["islands"] if i.get("reform") or i.get("rolledAt")}
        polls.append((len(now.accepted), new, rolling, status(target)["outerStep"]))
        assert shard_pod(target)["metadata"]["uid"] == shard["metadata"]["uid"], "the shard was never restarted"
        return now.presented != old.presented and now.accepted == (now.presented,) and new == set(ISLANDS) and now

    done = wait_until(rotated, timeout=600)
    assert refused_calls(target, shard) == refused_before, "no call of the job was refused for its token"
    for pod in island_pods(target):
        assert pod["metadata"]["annotations"]["diloco.dev/token-hash"] == fingerprint(done.presented)
    steps = [step for *_, step in polls]
    assert steps == sorted(steps), "the outer step never went back"
    during = [step for accepted, _, rolling, step in polls if accepted == 2 and rolling]
    assert during and max(during) > min(during), "the outer step rose while the islands rolled"
    assert max(len(rolling) for *_, rolling, _ in polls) == 1, "one island at a time (maxUnavailable 1)"
    assert [e["reason"] for e in events(target, "TokenRotated")] == ["TokenRotated"]
    after = status(target)["outerStep"]
    wait_until(lambda: status(target)["outerStep"] > after)
    assert refused_calls(target, shard) == refused_before
    assert status(target)["phase"] == "Running"
