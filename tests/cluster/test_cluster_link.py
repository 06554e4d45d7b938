"""The link between two test clusters' node namespaces: node addresses on NODE_NETWORK, held to the link's
rate both ways, pod traffic leaving with the node's address, and gone with either side."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import support

from cluster.cluster_link import DEVICE, FAR_ADDRESS, NEAR_ADDRESS, end_setup, join
from cluster.nodes import POD_NETWORK
from cluster.pod_network import NODE_NETWORK, namespace
from diloco.local.wan import Link, tbf


def test_each_end_has_its_node_address_the_link_s_rate_and_masquerades_its_pods_traffic_to_nodes():
    steps = end_setup(NEAR_ADDRESS, Link(mbps=20.0))
    assert f"ip address add {NEAR_ADDRESS}/{NODE_NETWORK.prefixlen} dev {DEVICE}" in steps
    assert steps[-1] == f"tc qdisc add dev {DEVICE} root {' '.join(tbf(20.0).tc_args())}"
    masquerade = next(step for step in steps if "MASQUERADE" in step)
    assert f"-s {POD_NETWORK} -d {NODE_NETWORK} -o {DEVICE}" in masquerade
    assert not [step for step in end_setup(FAR_ADDRESS, Link()) if step.startswith("tc ")], "no rate: no bucket"


def _namespace_holder() -> subprocess.Popen:
    """A process in a network namespace of its own, returned once it is there."""
    holder = subprocess.Popen(["unshare", "--net", "--", "sleep", "600"], start_new_session=True)
    support.wait_until(lambda: namespace(holder.pid, "net") not in (None, namespace("self", "net")))
    return holder


def _in(holder: subprocess.Popen, *command: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["nsenter", f"--target={holder.pid}", "--net", "--", *command],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=cwd,
    )


@pytest.fixture
def namespaces() -> Iterator[tuple[subprocess.Popen, subprocess.Popen]]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces and tc need root")
    near, far = _namespace_holder(), _namespace_holder()
    try:
        yield near, far
    finally:
        for holder in (near, far):
            holder.kill()
            holder.wait()


@pytest.mark.process
def test_joined_namespaces_reach_each_other_behind_a_bucket_and_lose_the_link_with_either(namespaces, tmp_path):
    near, far = namespaces
    join(near.pid, far.pid, Link(mbps=20.0))
    # The near node answers on its address with the address the far node's connection came from.
    serve = f"import socket; c, a = socket.create_server(('{NEAR_ADDRESS}', 5000)).accept(); c.sendall(a[0].encode())"
    server = subprocess.Popen(
        ["nsenter", f"--target={near.pid}", "--net", "--", sys.executable, "-c", serve], cwd=tmp_path
    )
    ask = f"import socket; print(socket.create_connection(('{NEAR_ADDRESS}', 5000), timeout=10).recv(64).decode())"
    answer = support.wait_until(lambda: _in(far, sys.executable, "-c", ask, cwd=tmp_path).stdout.strip(), timeout=30)
    assert answer == FAR_ADDRESS
    server.wait(30)
    assert "tbf" in _in(near, "tc", "qdisc", "show", "dev", DEVICE).stdout
    assert "tbf" in _in(far, "tc", "qdisc", "show", "dev", DEVICE).stdout
    far.kill()
    far.wait()
    # The far namespace goes with its last process, and its end of the pair takes the near end with it.
    support.wait_until(lambda: DEVICE not in _in(near, "ip", "-o", "link").stdout, timeout=30)
