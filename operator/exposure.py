"""Where a job's syncer shards are reached, decided without I/O: the addresses its islands and the operator
dial (the in-cluster Service names, or the shards of another cluster's job that spec.remoteSyncers names),
the Service type and Gateway API route that expose them outside the cluster (spec.syncer.expose), and the
endpoints that exposure yields once the cluster has given it addresses, read from the live Services.

The endpoints are also the names the operator-made server certificate must carry for a remote island to
verify it (`job_tls`): a LoadBalancer's ingress IP or hostname as the cloud controller publishes it, the
NodePort's node address as the job names it, or each shard's route hostname.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco.api.job import DiLoCoJobSpec, Exposure
from diloco.operator import naming as n

GATEWAY_API = "gateway.networking.k8s.io/v1"


def shard_targets(job: n.JobRef, spec: DiLoCoJobSpec) -> list[str]:
    """host:port of every shard, in shard order, as the job's islands and the operator dial them."""
    if spec.remote_syncers is not None:
        return list(spec.remote_syncers.endpoints)
    return [n.syncer_address(job.name, job.namespace, s, spec.syncer.port) for s in range(spec.syncer.shards)]


def service_type(spec: DiLoCoJobSpec) -> str:
    """The shard Services' type: a route reaches its backend through a ClusterIP Service."""
    kind = spec.syncer.expose.type
    return Exposure.CLUSTER_IP.value if kind is Exposure.GRPC_ROUTE else kind.value


def route_hostname(job: str, spec: DiLoCoJobSpec, shard: int) -> str:
    """The hostname a shard's GRPCRoute answers for: `<job>-syncer-<n>.<domain>`."""
    return f"{n.syncer_name(job, shard)}.{spec.syncer.expose.domain}"


def grpc_route(job: n.JobRef, spec: DiLoCoJobSpec, shard: int) -> dict[str, Any]:
    """A GRPCRoute sending every call for the shard's hostname, through the user's Gateway, to its Service
    (the route carries no stamp: `children` adds it, as to every child)."""
    gateway = spec.syncer.expose.gateway
    if gateway is None:
        raise ValueError("spec.syncer.expose.gateway is not set")
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway.name}
    if gateway.namespace:
        parent["namespace"] = gateway.namespace
    if gateway.section_name:
        parent["sectionName"] = gateway.section_name
    return {
        "apiVersion": GATEWAY_API,
        "kind": "GRPCRoute",
        "metadata": {
            "name": n.syncer_name(job.name, shard),
            "namespace": job.namespace,
            "labels": n.shard_labels(job.name, shard),
            "ownerReferences": [job.owner_reference()],
        },
        "spec": {
            "parentRefs": [parent],
            "hostnames": [route_hostname(job.name, spec, shard)],
            "rules": [{"backendRefs": [{"name": n.syncer_name(job.name, shard), "port": spec.syncer.port}]}],
        },
    }


def _grpc_port(service: Mapping[str, Any]) -> Mapping[str, Any]:
    ports = (service.get("spec") or {}).get("ports") or []
    return next((p for p in ports if p.get("name") == "grpc"), {})


def _ingress_host(service: Mapping[str, Any]) -> str | None:
    """The first address the cloud controller published for a LoadBalancer Service."""
    for ingress in ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []:
        host = ingress.get("ip") or ingress.get("hostname")
        if host:
            return str(host)
    return None


def shard_host(job: str, spec: DiLoCoJobSpec, shard: int, service: Mapping[str, Any] | None) -> str | None:
    """The host (IP or name) at which the exposed shard is reached from outside; None while the cluster has
    not given it one, or when the job exposes its shards inside the cluster only."""
    expose = spec.syncer.expose
    if expose.type is Exposure.NODE_PORT:
        return expose.node_address
    if expose.type is Exposure.GRPC_ROUTE:
        return route_hostname(job, spec, shard)
    if expose.type is Exposure.LOAD_BALANCER and service is not None:
        return _ingress_host(service)
    return None


def _port(spec: DiLoCoJobSpec, service: Mapping[str, Any] | None) -> int | None:
    expose = spec.syncer.expose
    if expose.type is Exposure.GRPC_ROUTE:
        return expose.gateway_port
    if expose.type is Exposure.NODE_PORT:
        node_port = _grpc_port(service or {}).get("nodePort")
        return int(node_port) if node_port else None
    return spec.syncer.port


def external_hosts(job: str, spec: DiLoCoJobSpec, services: Mapping[int, Mapping[str, Any] | None]) -> list[str]:
    """Every host the exposed shards are reached at, each once: the names their certificate must carry."""
    hosts = (shard_host(job, spec, shard, services.get(shard)) for shard in range(spec.syncer.shards))
    return list(dict.fromkeys(h for h in hosts if h))


def endpoints(job: str, spec: DiLoCoJobSpec, services: Mapping[int, Mapping[str, Any] | None]) -> list[str]:
    """host:port of every shard from outside the cluster, in shard order, once every shard has one (a list
    to copy into another cluster's spec.remoteSyncers.endpoints as it is); empty until then, and for
    shards exposed inside the cluster only. With spec.remoteSyncers, the endpoints it names."""
    if spec.remote_syncers is not None:
        return list(spec.remote_syncers.endpoints)
    found = []
    for shard in range(spec.syncer.shards):
        host, port = shard_host(job, spec, shard, services.get(shard)), _port(spec, services.get(shard))
        if host is None or port is None:
            return []
        found.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return found
