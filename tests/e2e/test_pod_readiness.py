"""On the test cluster a pod is Ready when a kubelet would say so: a container with a readinessProbe is not
ready from the moment its pod is bound until its probe passes, so `helm install --wait`, a Deployment's
availability or a wait for Ready never takes a pod whose process has not answered for one that is up. A
probed container the pod runner does not run (no process to probe) is reported ready at once."""

from __future__ import annotations

from functools import partial

import pytest
import support
import yaml
from kubernetes import client, watch
from kubernetes import config as kube_config

pytestmark = [pytest.mark.process, pytest.mark.e2e]

NAMESPACE = "e2e-readiness"
PAUSE = "registry.k8s.io/pause:3.10"
wait_until = partial(support.wait_until, timeout=60.0, interval=0.5)
PROBE_PERIODS = 5  # seconds the silent pod is watched: five of its probe's periods


def probed_pod(name: str, image: str, command: list[str] | None = None) -> str:
    """A pod whose container's readiness probe asks a port nothing listens on."""
    container = {
        "name": "main",
        "image": image,
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8080}, "periodSeconds": 1},
    }
    if command:
        container["command"] = command
    return yaml.safe_dump(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {"containers": [container]}}
    )


def condition(pod: client.V1Pod, kind: str) -> str | None:
    return next((c.status for c in pod.status.conditions or () if c.type == kind), None)


@pytest.fixture
def namespace(target):
    if target.runner is None:
        pytest.skip("readiness as the pod runner reports it: the KWOK test cluster only")
    target.kubectl("create", "namespace", NAMESPACE)
    try:
        yield NAMESPACE
    finally:
        target.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=180)


def test_a_probed_container_is_not_ready_before_its_probe_passes(target, namespace):
    core = client.CoreV1Api(kube_config.new_client_from_config(str(target.kubeconfig)))
    since = core.list_namespaced_pod(namespace).metadata.resource_version
    image = f"diloco-trainer:{target.image_tag}"
    target.kubectl("-n", namespace, "apply", "-f", "-", stdin=probed_pod("silent", image, ["sleep", "600"]))
    wait_until(lambda: target.runner.processes(namespace, "silent"))
    # Every state the pod has been in, from its creation until a few probe periods after its process started.
    states = [
        event["object"]
        for event in watch.Watch().stream(
            core.list_namespaced_pod, namespace, resource_version=since, timeout_seconds=PROBE_PERIODS
        )
    ]
    last = states[-1]
    assert last.status.phase == "Running" and last.status.pod_ip
    assert [s.ready for s in last.status.container_statuses] == [False]
    assert "True" not in [condition(pod, "Ready") for pod in states], "Ready before its probe passed"


def test_a_probed_container_the_runner_does_not_run_is_ready(target, namespace):
    target.kubectl("-n", namespace, "apply", "-f", "-", stdin=probed_pod("paused", PAUSE))
    core = client.CoreV1Api(kube_config.new_client_from_config(str(target.kubeconfig)))
    pod = wait_until(
        lambda: (p := core.read_namespaced_pod("paused", namespace)) and condition(p, "Ready") == "True" and p
    )
    assert [s.ready for s in pod.status.container_statuses] == [True]
    assert not target.runner.processes(namespace, "paused")
