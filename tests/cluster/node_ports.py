"""NodePort and LoadBalancer Services of the test cluster, served as kube-proxy's userspace mode served them:
for every port of such a Service that has a ready endpoint, a relay in the node namespace (pod_network.py)
listens on the node port at every node address, and for a LoadBalancer also on the port at its ingress IP,
and connects each client to that endpoint. A LoadBalancer Service gets its ingress IP from
LOAD_BALANCER_POOL, as a cloud controller (or MetalLB) gives one, added to the node namespace. Clients
outside the cluster reach them on NODE_NETWORK (cluster_link.py).

The relay is diloco's delay proxy (diloco/local/delay_proxy.py): with a delay it holds every chunk that long
each way, so a cluster given one (`PodRunner.node_port_delay`) adds a WAN's round trip to every connection
that enters it through a node port, as netem would on a link (this kernel has no netem).

`listeners` and `ingress_ips` are pure; run as a module this is one relay:
`python -m cluster.node_ports ADDRESS:PORT HOST:PORT DELAY`.
"""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cluster.pod_network import NODE_NETWORK
from diloco.local.delay_proxy import DelayProxy

EXPOSED_TYPES = ("NodePort", "LoadBalancer")
EVERY_ADDRESS = "0.0.0.0"
LOAD_BALANCER_POOL = list(NODE_NETWORK.subnets(new_prefix=NODE_NETWORK.prefixlen + 1))[1]
"""The upper half of NODE_NETWORK: LoadBalancer ingress IPs (the lower half holds the node addresses)."""
Address = tuple[str, int]


def _ingress_ip(service: Mapping[str, Any]) -> str | None:
    ingress = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or [{}]
    return ingress[0].get("ip")


def ingress_ips(services: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], str]:
    """(namespace, name) -> a free address of LOAD_BALANCER_POOL for each LoadBalancer Service without an
    ingress IP yet, as a cloud controller hands them out."""
    services = list(services)
    taken = {_ingress_ip(s) for s in services}
    free = (str(ip) for ip in LOAD_BALANCER_POOL.hosts() if str(ip) not in taken)
    return {
        (s["metadata"]["namespace"], s["metadata"]["name"]): next(free)
        for s in services
        if (s.get("spec") or {}).get("type") == "LoadBalancer" and not _ingress_ip(s)
    }


def listeners(services: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]]) -> dict[Address, Address]:
    """(address, port) to listen at -> (pod IP, port) of a ready endpoint of the Service's port (the first, as
    the slices list them): every node port at every address, and a LoadBalancer's ports at its ingress IP.
    Ports without a ready endpoint are left out."""
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
    found: dict[Address, Address] = {}
    for service in services:
        spec, meta = service.get("spec") or {}, service["metadata"]
        if spec.get("type") not in EXPOSED_TYPES:
            continue
        ingress = _ingress_ip(service) if spec["type"] == "LoadBalancer" else None
        for port in spec.get("ports") or ():
            target = ready.get((meta["namespace"], meta["name"], port.get("name") or ""))
            if target is None:
                continue
            if port.get("nodePort"):
                found[(EVERY_ADDRESS, int(port["nodePort"]))] = target
            if ingress:
                found[(ingress, int(port["port"]))] = target
    return found


def _address(text: str) -> Address:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def relay_command(python: str, listen: Address, upstream: Address, delay: float) -> list[str]:
    """The relay of one listening address, to run in the node namespace."""
    return [python, "-m", "cluster.node_ports", *(f"{h}:{p}" for h, p in (listen, upstream)), str(delay)]


def main(argv: Sequence[str]) -> None:
    """Listens at argv[0] (ADDRESS:PORT), relaying to argv[1] (HOST:PORT) with argv[2] seconds of delay each
    way, until SIGTERM."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(_address(argv[0]))
    listener.listen(64)
    with DelayProxy({listener: _address(argv[1])}, float(argv[2])):
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    main(sys.argv[1:])
