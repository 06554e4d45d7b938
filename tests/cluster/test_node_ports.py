"""Which endpoint each node port of the test cluster relays to, as kube-proxy decides it."""

from __future__ import annotations

from cluster.node_ports import relay_command, routes


def service(name, kind, ports, namespace="ns"):
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"type": kind, "ports": ports}}


def endpoint_slice(service_name, ports, endpoints, namespace="ns"):
    return {
        "metadata": {"namespace": namespace, "labels": {"kubernetes.io/service-name": service_name}},
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": endpoints,
    }


def ready(ip, is_ready=True):
    return {"addresses": [ip], "conditions": {"ready": is_ready}}


def test_each_node_port_relays_to_a_ready_endpoint_of_its_service_port():
    services = [
        service("job-syncer-0", "NodePort", [{"name": "grpc", "port": 50051, "nodePort": 31000}, {"name": "metrics"}]),
        service("job-syncer-1", "LoadBalancer", [{"name": "grpc", "port": 50051, "nodePort": 31001}]),
    ]
    slices = [
        endpoint_slice(
            "job-syncer-0", [{"name": "grpc", "port": 50051}, {"name": "metrics", "port": 9090}], [ready("10.244.0.5")]
        ),
        endpoint_slice(
            "job-syncer-1", [{"name": "grpc", "port": 50051}], [ready("10.244.1.2", False), ready("10.244.1.3")]
        ),
    ]
    assert routes(services, slices) == {31000: ("10.244.0.5", 50051), 31001: ("10.244.1.3", 50051)}


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
    assert routes(services, slices) == {}


def test_a_relay_is_the_delay_proxy_run_as_a_module():
    command = relay_command("python", 31000, ("10.244.0.5", 50051), 0.02)
    assert command == ["python", "-m", "cluster.node_ports", "31000", "10.244.0.5:50051", "0.02"]
