"""A WAN link between two test clusters on this machine, as between two datacenters: a veth pair joins their
node namespaces (pod_network.py), each end at a node address of NODE_NETWORK, with a token bucket (`tc` tbf,
diloco.local.wan) holding each direction to the link's rate. Each node namespace forwards its pods' traffic
to NODE_NETWORK onto the link with the node's address (masquerade, as a cloud's NAT does for pod egress: both
clusters hand out pod IPs from the same POD_NETWORK). The round trip is added where a connection enters a
cluster through a node port (`PodRunner.node_port_delay`, node_ports.py): this kernel has no netem.

    join(near_pid, far_pid, Link(mbps=50, rtt_ms=40))   # pids of the node namespaces' holders

Nothing is made outside the two node namespaces, and the link goes with either of them (a cluster stopped
whole takes its end, and so the pair, away). Needs root, as the pod network does when a pod runner runs.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from cluster.nodes import POD_NETWORK
from cluster.pod_network import NODE_NETWORK
from diloco.local.wan import Link, tbf

NEAR_ADDRESS, FAR_ADDRESS = (str(NODE_NETWORK[1]), str(NODE_NETWORK[2]))
"""The node addresses of the two clusters on the link: where each reaches the other's node ports."""
DEVICE = "wan0"


def end_setup(address: str, link: Link) -> list[str]:
    """In one node namespace, once its end of the pair (DEVICE) is there: its address, the link's rate on
    what leaves through it, forwarding, and the masquerade of its pods' traffic to the other node (added once:
    a cluster joined again, after the other was re-created, keeps its rule)."""
    masquerade = f"POSTROUTING -s {POD_NETWORK} -d {NODE_NETWORK} -o {DEVICE} -j MASQUERADE"
    steps = [
        f"ip address add {address}/{NODE_NETWORK.prefixlen} dev {DEVICE}",
        f"ip link set {DEVICE} up",
        "sysctl -qw net.ipv4.ip_forward=1",
        f"(iptables -t nat -C {masquerade} 2>/dev/null || iptables -t nat -A {masquerade})",
    ]
    if link.mbps is not None:
        steps.append(f"tc qdisc add dev {DEVICE} root {' '.join(tbf(link.mbps).tc_args())}")
    return steps


def _in_namespace(pid: int, script: Sequence[str]) -> None:
    command = ["nsenter", f"--target={pid}", "--net", "--", "sh", "-c", " && ".join(script)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise OSError(f"the link in the namespace of {pid}: {result.stderr.strip()[-400:]}")


def join(near: int, far: int, link: Link) -> None:
    """Joins the node namespaces held by processes `near` (at NEAR_ADDRESS) and `far` (at FAR_ADDRESS)."""
    _in_namespace(near, [f"ip link add {DEVICE} type veth peer name {DEVICE} netns {far}"])
    _in_namespace(near, end_setup(NEAR_ADDRESS, link))
    _in_namespace(far, end_setup(FAR_ADDRESS, link))
