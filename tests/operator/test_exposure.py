"""Where a job's shards are reached: the addresses its islands dial, the Service type or Gateway route that
exposes them, and the endpoints read back from what the cluster gave the Services."""

from __future__ import annotations

import pytest

from diloco.api.job import DiLoCoJobSpec
from diloco.operator import naming as n
from diloco.operator.exposure import endpoints, external_hosts, grpc_route, service_type, shard_targets

JOB = n.JobRef(name="demo", namespace="ml", uid="uid-1")


def spec(**changes) -> DiLoCoJobSpec:
    syncer = {"shards": 2, **changes.pop("syncer", {})}
    return DiLoCoJobSpec.model_validate(
        {"image": "img", "islands": [{"name": "a"}], "training": {"fragments": 2}, "syncer": syncer, **changes}
    )


def service(node_port: int | None = None, ingress: list[dict] | None = None) -> dict:
    port = {"name": "grpc", "port": 50051, **({"nodePort": node_port} if node_port else {})}
    return {"spec": {"ports": [port]}, "status": {"loadBalancer": {"ingress": ingress or []}}}


NODE_PORT = {"expose": {"type": "NodePort", "nodeAddress": "127.0.0.7"}}
ROUTE = {"expose": {"type": "GRPCRoute", "gateway": {"name": "edge"}, "domain": "ex.io", "gatewayPort": 8443}}


def test_islands_dial_the_shard_services_or_the_remote_shards_named():
    assert shard_targets(JOB, spec()) == ["demo-syncer-0.ml.svc:50051", "demo-syncer-1.ml.svc:50051"]
    remote = {"endpoints": ["far:1", "far:2"], "tokenSecret": "t", "caSecret": "c"}
    assert shard_targets(JOB, spec(remoteSyncers=remote)) == ["far:1", "far:2"]


@pytest.mark.parametrize(
    ("syncer", "kind"),
    [
        ({}, "ClusterIP"),
        (NODE_PORT, "NodePort"),
        ({"expose": {"type": "LoadBalancer"}}, "LoadBalancer"),
        (ROUTE, "ClusterIP"),
    ],
)
def test_the_service_takes_the_exposure_type_and_a_route_goes_through_a_cluster_ip(syncer, kind):
    assert service_type(spec(syncer=syncer)) == kind


def test_shards_inside_the_cluster_only_have_no_endpoints():
    assert endpoints("demo", spec(), {0: service(), 1: service()}) == []
    assert external_hosts("demo", spec(), {0: service(), 1: service()}) == []


def test_load_balancer_endpoints_appear_once_the_cloud_has_published_every_shards_address():
    lb = spec(syncer={"expose": {"type": "LoadBalancer"}})
    one = {0: service(ingress=[{"ip": "127.0.0.5"}]), 1: service()}
    assert endpoints("demo", lb, one) == [], "not every shard has an address yet"
    assert external_hosts("demo", lb, one) == ["127.0.0.5"]
    both = {**one, 1: service(ingress=[{"hostname": "lb.example.com"}])}
    assert endpoints("demo", lb, both) == ["127.0.0.5:50051", "lb.example.com:50051"]
    v6 = {0: service(ingress=[{"ip": "::1"}]), 1: service(ingress=[{"ip": "::1"}])}
    assert endpoints("demo", lb, v6) == ["[::1]:50051", "[::1]:50051"]
    assert external_hosts("demo", lb, v6) == ["::1"]


def test_node_port_endpoints_are_the_named_node_address_and_each_allocated_port():
    exposed = spec(syncer=NODE_PORT)
    assert endpoints("demo", exposed, {0: service(31000), 1: None}) == []
    assert endpoints("demo", exposed, {0: service(31000), 1: service(31001)}) == ["127.0.0.7:31000", "127.0.0.7:31001"]
    assert external_hosts("demo", exposed, {}) == ["127.0.0.7"]


def test_a_grpc_route_per_shard_attaches_to_the_users_gateway_under_the_shards_hostname():
    exposed = spec(syncer=ROUTE)
    assert endpoints("demo", exposed, {}) == ["demo-syncer-0.ex.io:8443", "demo-syncer-1.ex.io:8443"]
    assert external_hosts("demo", exposed, {}) == ["demo-syncer-0.ex.io", "demo-syncer-1.ex.io"]
    route = grpc_route(JOB, exposed, 1)
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["kind"] == "GRPCRoute"
    assert route["metadata"]["name"] == "demo-syncer-1" and route["metadata"]["labels"]["diloco.dev/shard"] == "1"
    assert route["spec"] == {
        "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge"}],
        "hostnames": ["demo-syncer-1.ex.io"],
        "rules": [{"backendRefs": [{"name": "demo-syncer-1", "port": 50051}]}],
    }
    namespaced = spec(
        syncer={"expose": {**ROUTE["expose"], "gateway": {"name": "edge", "namespace": "infra", "sectionName": "grpc"}}}
    )
    (parent,) = grpc_route(JOB, namespaced, 0)["spec"]["parentRefs"]
    assert parent["namespace"] == "infra" and parent["sectionName"] == "grpc"


def test_a_job_against_remote_shards_reports_their_endpoints():
    remote = {"endpoints": ["far:1", "far:2"], "tokenSecret": "t", "caSecret": "c"}
    assert endpoints("demo", spec(remoteSyncers=remote), {}) == ["far:1", "far:2"]
