"""A job's shards exposed as LoadBalancer: the test cluster gives each Service an ingress IP as a cloud
controller does, the job's status lists it as the shard's endpoint, and a client outside the pod network
(the node namespace) reaches the shard there over TLS verified against the job's CA, with the job's token:
the certificate the operator re-issued once the address appeared names it."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import support
from cluster.node_ports import LOAD_BALANCER_POOL
from test_two_clusters import JOB, SMALL, job_manifest, secret_value, status

pytestmark = [pytest.mark.process, pytest.mark.e2e]

NAMESPACE = "exposed"
wait_until = partial(support.wait_until, timeout=180.0, interval=1.0)


@pytest.fixture
def exposed_job(target, operator):
    if target.runner is None:
        pytest.skip("the KWOK test cluster's load balancers")
    target.kubectl("create", "namespace", NAMESPACE)
    syncer = {"shards": 1, "resources": SMALL, "expose": {"type": "LoadBalancer"}}
    manifest = job_manifest(target.image_tag, "solo", syncer)
    target.kubectl("-n", NAMESPACE, "apply", "-f", "-", stdin=manifest)
    try:
        yield JOB
    finally:
        target.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=180)


def test_a_shard_behind_a_load_balancer_is_reached_at_its_address_over_tls(target, exposed_job, tmp_path):
    endpoints = wait_until(lambda: status(target, NAMESPACE).get("syncer", {}).get("endpoints"))
    host, port = endpoints[0].rsplit(":", 1)
    assert ipaddress.ip_address(host) in LOAD_BALANCER_POOL and port == "50051"
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text(secret_value(target, f"diloco-{JOB}-token", "token", NAMESPACE))
    ca.write_text(secret_value(target, f"diloco-{JOB}-tls", "ca.crt", NAMESPACE))
    diloco = str(Path(sys.executable).parent / "diloco")
    ask = [diloco, "status", endpoints[0], "--token-file", str(token), "--tls-ca-file", str(ca)]

    def answer() -> str:
        command = target.runner.network.enter(ask)
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        return result.stdout if result.returncode == 0 else ""

    assert wait_until(answer).startswith("shard 0 of 1")
