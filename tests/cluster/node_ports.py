"""NodePort Services of the test cluster, served as kube-proxy's userspace mode served them: for every port
of a NodePort or LoadBalancer Service that has a node port and a ready endpoint, a relay in the node
namespace (pod_network.py) listens on the node port at every node address and connects each client to that
endpoint. Clients outside the cluster reach it at a node address on NODE_NETWORK (cluster_link.py).

The relay is diloco's delay proxy (diloco/local/delay_proxy.py): with a delay it holds every chunk that long
each way, so a cluster given one (`PodRunner.node_port_delay`) adds a WAN's round trip to every connection
that enters it through a node port, as netem would on a link (this kernel has no netem).

`routes` is pure; run as a module this is one relay: `python -m cluster.node_ports PORT HOST:PORT DELAY`.
"""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from diloco.local.delay_proxy import DelayProxy

EXPOSED_TYPES = ("NodePort", "LoadBalancer")


def routes(services: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]]) -> dict[int, tuple[str, int]]:
    """node port -> (pod IP, port) of a ready endpoint of its Service's port (the first, as the slices list
    them); node ports without a ready endpoint are left out."""
    ready: dict[tuple[str, str, str], tuple[str, int]] = {}
    for item in slices:
        meta = item["metadata"]
        service = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        endpoints = [
            e
            for e in item.get("endpoints") or ()
            if (e.get("conditions") or {}).get("ready") is not False and e.get("addresses")
        ]
        if not service or not endpoints or item.get("addressType") != "IPv4":
            continue
        for port in item.get("ports") or ():
            key = (meta["namespace"], service, port.get("name") or "")
            ready.setdefault(key, (endpoints[0]["addresses"][0], int(port["port"])))
    found: dict[int, tuple[str, int]] = {}
    for service in services:
        spec, meta = service.get("spec") or {}, service["metadata"]
        if spec.get("type") not in EXPOSED_TYPES:
            continue
        for port in spec.get("ports") or ():
            target = ready.get((meta["namespace"], meta["name"], port.get("name") or ""))
            if port.get("nodePort") and target is not None:
                found[int(port["nodePort"])] = target
    return found


def relay_command(python: str, node_port: int, upstream: tuple[str, int], delay: float) -> list[str]:
    """The relay of one node port, to run in the node namespace."""
    return [python, "-m", "cluster.node_ports", str(node_port), f"{upstream[0]}:{upstream[1]}", str(delay)]


def main(argv: Sequence[str]) -> None:
    """Serves node port argv[0] on every address of this namespace, relaying to argv[1] (HOST:PORT) with
    argv[2] seconds of delay each way, until SIGTERM."""
    host, port = argv[1].rsplit(":", 1)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", int(argv[0])))
    listener.listen(64)
    with DelayProxy({listener: (host, int(port))}, float(argv[2])):
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    main(sys.argv[1:])
