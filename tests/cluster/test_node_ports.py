"""Which endpoint each node port and load balancer of the test cluster relays to, as kube-proxy decides it,
and the ingress IPs load balancers get, as a cloud controller hands them out."""

from __future__ import annotations

from cluster.node_ports import EVERY_ADDRESS, LOAD_BALANCER_POOL, ingress_ips, listeners, relay_command
from cluster.pod_network import NODE_NETWORK


def service(name, kind, ports, namespace="ns", ingress=None):
    found = {"metadata": {"name": name, "namespace": namespace}, "spec": {"type": kind, "ports": ports}}
    if ingress:
        found["status"] = {"loadBalancer": {"ingress": [{"ip": ingress}]}}
    return found


def endpoint_slice(service_name, ports, endpoints, namespace="ns"):
    return {
        "metadata": {"namespace": namespace, "labels": {"kubernetes.io/service-name": service_name}},
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": endpoints,
    }


def ready(ip, is_ready=True):
    return {"addresses": [ip], "conditions": {"ready": is_ready}}


def test_each_node_port_and_load_balancer_relays_to_a_ready_endpoint_of_its_service_port():
    services = [
        service("job-syncer-0", "NodePort", [{"name": "grpc", "port": 50051, "nodePort": 31000}, {"name": "metrics"}]),
        service(
            "job-syncer-1", "LoadBalancer", [{"name": "grpc", "port": 50051, "nodePort": 31001}], ingress="10.79.0.129"
        ),
    ]
    slices = [
        endpoint_slice(
            "job-syncer-0", [{"name": "grpc", "port": 50051}, {"name": "metrics", "port": 9090}], [ready("10.244.0.5")]
        ),
        endpoint_slice(
            "job-syncer-1", [{"name": "grpc", "port": 50051}], [ready("10.244.1.2", False), ready("10.244.1.3")]
        ),
    ]
    assert listeners(services, slices) == {
        (EVERY_ADDRESS, 31000): ("10.244.0.5", 50051),
        (EVERY_ADDRESS, 31001): ("10.244.1.3", 50051),
        ("10.79.0.129", 50051): ("10.244.1.3", 50051),
    }


def test_cluster_ip_services_and_services_without_a_ready_endpoint_have_no_node_port():
    services = [
        service("inside", "ClusterIP", [{"name": "grpc", "port": 50051}]),
        service("starting", "NodePort", [{"name": "grpc", "port": 50051, "nodePort": 31002}]),
        service("elsewhere", "NodePort", [{"name": "grpc", "port": 50051, "nodePort": 31003}], namespace="other"),
    ]
    slices = [
        endpoint_slice("inside", [{"name": "grpc", "port": 50051}], [ready("10.244.0.9")]),
        endpoint_slice("starting", [{"name": "grpc", "port": 50051}], [ready("10.244.0.7", False)]),
        endpoint_slice("elsewhere", [{"name": "grpc", "port": 50051}], [ready("10.244.0.8")]),
    ]
    assert listeners(services, slices) == {}


def test_load_balancers_without_an_address_get_free_ones_of_the_pool_on_the_node_network():
    assert LOAD_BALANCER_POOL.subnet_of(NODE_NETWORK)
    first, second, third = (str(ip) for ip in list(LOAD_BALANCER_POOL.hosts())[:3])
    services = [
        service("given", "LoadBalancer", [], ingress=first),
        service("new", "LoadBalancer", []),
        service("node-port", "NodePort", []),
        service("other-new", "LoadBalancer", [], namespace="other"),
    ]
    assert ingress_ips(services) == {("ns", "new"): second, ("other", "other-new"): third}


def test_a_relay_is_the_delay_proxy_run_as_a_module():
    command = relay_command("python", (EVERY_ADDRESS, 31000), ("10.244.0.5", 50051), 0.02)
    assert command == ["python", "-m", "cluster.node_ports", "0.0.0.0:31000", "10.244.0.5:50051", "0.02"]
