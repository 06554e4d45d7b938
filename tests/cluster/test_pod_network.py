"""The pod network gives each pod a namespace of its own with its IP on `eth0`, as a bridge CNI plugin does:
pods reach each other and are reached from the node namespace (probes), each binds the same port at its own
address, and what a pod or a run leaves behind, even a run that crashed, goes."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import support

from cluster.controlplane import SERVICE_CIDR
from cluster.nodes import POD_NETWORK, pod_cidr
from cluster.pod_network import (
    GATEWAY,
    HOLDER_PREFIX,
    NODE_NETWORK,
    Holder,
    PodNetwork,
    attach,
    holder_command,
    pod_setup,
    process_start,
    remove_stale,
    veth_names,
)

TESTS = Path(__file__).resolve().parents[1]


class TestNames:
    def test_a_holder_s_name_says_who_owns_it_and_reads_back(self):
        holder = Holder(4242, 123456, "0b8e6c2a-5d1f-4c3e-9a7b-1f2e3d4c5b6a")
        assert holder.name.startswith(HOLDER_PREFIX + ":")
        assert Holder.parse(holder.name) == holder
        assert holder_command(holder)[-1] == holder.name

    @pytest.mark.parametrize(
        "argv0", ["sleep", "/usr/bin/python3", f"{HOLDER_PREFIX}:x:1:node", f"{HOLDER_PREFIX}:1:2:"]
    )
    def test_other_processes_are_no_holders(self, argv0):
        assert Holder.parse(argv0) is None

    def test_a_holder_is_stale_once_its_owner_is_gone_or_its_pid_is_another_s(self):
        holder = Holder(4242, 123456, "node")
        assert not holder.stale(123456)
        assert holder.stale(None)
        assert holder.stale(999999)

    def test_veth_names_are_per_pod_and_fit_linux_s_limit(self):
        ends = [veth_names(f"uid-{i}") for i in range(100)]
        assert all(len(name) <= 15 for pair in ends for name in pair)
        assert len({name for pair in ends for name in pair}) == 200
        assert veth_names("uid-1") == ends[1]

    def test_the_gateway_is_no_pod_s_ip(self):
        assert ipaddress.ip_address(GATEWAY) not in POD_NETWORK
        assert ipaddress.ip_address("10.244.0.1") in ipaddress.ip_network(pod_cidr(0)), "KWOK hands out .1"

    def test_a_pod_s_eth0_carries_its_ip_on_the_pod_network_and_service_and_node_ips_route_by_the_gateway(self):
        _, pod_end = veth_names("uid-1")
        steps = pod_setup("uid-1", "10.244.1.1")
        assert f"ip link set {pod_end} name eth0" in steps
        assert f"ip address add 10.244.1.1/{POD_NETWORK.prefixlen} dev eth0" in steps
        assert steps[-2:] == [
            f"ip route add {SERVICE_CIDR} via {GATEWAY} dev eth0",
            f"ip route add {NODE_NETWORK} via {GATEWAY} dev eth0",
        ]
        assert not [step for step in steps if "default" in step], "nothing outside the cluster is routed"
        assert f"ip link set {pod_end} netns 77" in attach("uid-1", 77)


def _in(network: PodNetwork, command: list[str], uid: str | None = None) -> subprocess.CompletedProcess:
    wrapped = network.enter_pod(uid, command) if uid else network.enter(command)
    return subprocess.run(wrapped, capture_output=True, text=True, timeout=30)


def _python(network: PodNetwork, code: str, uid: str | None = None) -> subprocess.CompletedProcess:
    return _in(network, [sys.executable, "-c", code], uid)


def _server(network: PodNetwork, uid: str, ip: str, port: int) -> subprocess.Popen:
    """A TCP server in pod `uid` at `ip`:`port` answering every connection with the pod's UID."""
    code = (
        "import socket, sys\n"
        "s = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
        "while True:\n"
        "    c, _ = s.accept(); c.sendall(sys.argv[3].encode()); c.close()\n"
    )
    return subprocess.Popen(
        network.enter_pod(uid, [sys.executable, "-c", code, ip, str(port), uid]), start_new_session=True
    )


def _fetch(network: PodNetwork, ip: str, port: int, uid: str | None = None) -> str:
    code = f"import socket; print(socket.create_connection(('{ip}', {port}), timeout=2).recv(100).decode())"
    return support.wait_until(lambda: (r := _python(network, code, uid)).returncode == 0 and r.stdout.strip())


def _links(network: PodNetwork) -> str:
    return _in(network, ["ip", "-o", "link"]).stdout


@pytest.fixture
def network(tmp_path: Path) -> Iterator[PodNetwork]:
    network = PodNetwork(tmp_path / "network", "https://127.0.0.1:1")
    network.start()
    yield network
    network.stop()
    assert not network.leftovers()


@pytest.mark.process
def test_each_pod_has_its_ip_on_eth0_and_pods_reach_each_other_and_are_reached_from_the_node(network):
    pods = {"pod-a": "10.244.0.1", "pod-b": "10.244.1.1"}
    for uid, ip in pods.items():
        network.add_pod(uid, ip)
    servers = [_server(network, uid, "0.0.0.0", 8080) for uid in pods]  # the same port in both: no clash
    try:
        for uid, ip in pods.items():
            shown = _in(network, ["ip", "-o", "-4", "address", "show", "dev", "eth0"], uid).stdout
            assert f"inet {ip}/{POD_NETWORK.prefixlen}" in shown
        assert _fetch(network, "10.244.1.1", 8080, uid="pod-a") == "pod-b"
        assert _fetch(network, "10.244.0.1", 8080, uid="pod-b") == "pod-a"
        assert _fetch(network, "10.244.0.1", 8080) == "pod-a", "the node namespace (probes) reaches a pod"
        # The `kubernetes` Service's ClusterIP answers from a pod (its relay lives in the node namespace).
        relay = _python(network, "import socket; socket.create_connection(('10.96.0.1', 443), timeout=2)", "pod-a")
        assert relay.returncode == 0, relay.stderr
        # Nothing outside the cluster is routed: the machine's DNS server, say, fails at once, not after a timeout.
        outside = "import socket; socket.create_connection(('192.0.2.1', 53), timeout=30)"
        assert "Network is unreachable" in _python(network, outside, "pod-a").stderr
    finally:
        for server in servers:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.process
def test_every_pod_added_in_a_row_gets_its_eth0_in_its_own_namespace_never_the_nodes(network):
    """A pod's holder enters the node namespace, then unshares its own: a veth moved into it before that
    landed in the node namespace, and the pod had no route to anything (a restarted operator's "Network is
    unreachable", seen in the e2e tier)."""
    pods = {f"pod-{i}": f"10.244.0.{i + 1}" for i in range(12)}
    for uid, ip in pods.items():
        network.add_pod(uid, ip)
    for uid, ip in pods.items():
        assert f"inet {ip}/" in _in(network, ["ip", "-o", "-4", "address", "show", "dev", "eth0"], uid).stdout
    assert "eth0" not in _links(network)


@pytest.mark.process
def test_a_removed_pod_leaves_neither_veth_nor_namespace(network):
    network.add_pod("pod-a", "10.244.0.1")
    holder = network.pods["pod-a"].holder
    node_end, _ = veth_names("pod-a")
    assert node_end in _links(network)
    network.remove_pod("pod-a")
    assert holder.poll() is not None
    assert node_end not in _links(network)
    network.add_pod("pod-c", "10.244.0.1")  # its successor takes its IP
    assert "10.244.0.1" in _in(network, ["ip", "-o", "address"], "pod-c").stdout


@pytest.mark.process
def test_the_network_of_a_run_that_crashed_is_removed_when_the_next_starts(tmp_path):
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from cluster.pod_network import PodNetwork\n"
        "network = PodNetwork(Path(sys.argv[1]), 'https://127.0.0.1:1')\n"
        "network.start(); network.add_pod('pod-a', '10.244.0.1')\n"
        "print(network.pods['pod-a'].holder.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    crashing = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "network")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        start_new_session=True,
    )
    assert crashing.stdout is not None
    holder = int(crashing.stdout.readline())
    os.killpg(crashing.pid, signal.SIGKILL)  # the runner dies; its holders, in sessions of their own, do not
    crashing.wait()
    assert process_start(holder) is not None
    assert remove_stale() >= 3  # the node's and the pod's holders, and the relay
    deadline = time.monotonic() + 10
    while process_start(holder) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_start(holder) is None or Path(f"/proc/{holder}/stat").read_text().split()[2] == "Z"


@pytest.mark.process
def test_a_network_held_in_another_pid_namespace_is_left_to_its_own(tmp_path):
    """A cluster run whole in a PID namespace (cluster/isolated.py) names its holders' owner by a pid only that
    namespace knows: from outside it looks stale, and must not be taken for a crashed run's."""
    if os.geteuid() != 0:
        pytest.skip("a PID namespace needs root")
    holder = Holder(1, 1, "node")  # pid 1 of its namespace; out here some other process, or none
    isolated = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--net", "--", *holder_command(holder)],
        start_new_session=True,
    )
    try:
        inside = int(support.wait_until(lambda: _children(isolated.pid)))
        support.wait_until(lambda: Holder.parse(Path(f"/proc/{inside}/cmdline").read_bytes().split(b"\0")[0].decode()))
        remove_stale()
        with pytest.raises(subprocess.TimeoutExpired):  # its namespace's init, had it been killed, would end it
            isolated.wait(2)
    finally:
        os.killpg(isolated.pid, signal.SIGKILL)
        isolated.wait()


def _children(pid: int) -> str:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split(" ")[0]
