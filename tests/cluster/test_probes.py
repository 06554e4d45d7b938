"""Readiness probes as the pod runner runs them, as a kubelet would: what a probe asks, how its results make a
container Ready (thresholds, period, initial delay, the kubelet's defaults), and the checks themselves against
real servers on loopback, through the prober's Unix socket."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.controlplane import free_port
from cluster.probes import ProbeTiming, Readiness, ask, check, listen, probe_request, serve

TRAINER = {"name": "trainer", "ports": [{"name": "metrics", "containerPort": 9100}]}


class TestReadiness:
    def test_the_kubelet_s_defaults_fill_what_a_probe_leaves_out(self):
        assert ProbeTiming.of({"httpGet": {"port": 1}}) == ProbeTiming(10.0, 1.0, 0.0, 1, 3)
        rendered = {"periodSeconds": 5, "failureThreshold": 2, "successThreshold": 2, "initialDelaySeconds": 7}
        assert ProbeTiming.of(rendered) == ProbeTiming(5.0, 1.0, 7.0, 2, 2)

    def test_not_ready_at_start_and_first_probed_after_the_initial_delay(self):
        readiness = Readiness(ProbeTiming(period=5, initial_delay=7), started=100.0)
        assert not readiness.ready
        assert not readiness.due(106.9) and readiness.due(107.0)

    def test_ready_after_the_success_threshold_in_a_row_then_probed_every_period(self):
        readiness = Readiness(ProbeTiming(period=5, success_threshold=2), started=0.0)
        assert readiness.record(True, 0.0) is False and not readiness.ready
        assert not readiness.due(4.9) and readiness.due(5.0)
        assert readiness.record(False, 5.0) is False
        assert readiness.record(True, 10.0) is False
        assert readiness.record(True, 15.0) is True and readiness.ready

    def test_unready_again_only_after_the_failure_threshold_in_a_row(self):
        readiness = Readiness(ProbeTiming(failure_threshold=3), started=0.0)
        readiness.record(True, 0.0)
        assert [readiness.record(ok, t) for t, ok in enumerate((False, False, True, False, False), 1)] == [False] * 5
        assert readiness.ready
        assert readiness.record(False, 6.0) is True and not readiness.ready


class TestRequests:
    def test_an_http_probe_goes_to_the_pod_ip_and_the_named_port(self):
        probe = {"httpGet": {"path": "/readyz", "port": "metrics"}, "timeoutSeconds": 2}
        assert probe_request(probe, "10.244.0.5", TRAINER) == {
            "kind": "httpGet",
            "scheme": "http",
            "host": "10.244.0.5",
            "port": 9100,
            "path": "/readyz",
            "headers": {},
            "timeout": 2.0,
        }

    def test_a_grpc_probe_checks_the_overall_health_by_default(self):
        request = probe_request({"grpc": {"port": 50051}}, "10.244.0.6", {"name": "syncer"})
        assert (request["kind"], request["host"], request["port"], request["service"]) == (
            "grpc",
            "10.244.0.6",
            50051,
            "",
        )

    def test_a_port_the_container_lacks_and_an_exec_probe_fail_saying_why(self):
        missing = probe_request({"tcpSocket": {"port": "nope"}}, "10.244.0.5", TRAINER)
        assert check(missing) == (False, "port 'nope' is not a port of container trainer")
        ok, detail = check(probe_request({"exec": {"command": ["true"]}}, "10.244.0.5", TRAINER))
        assert not ok and "exec probes are not run" in detail


@pytest.fixture
def prober(tmp_path) -> str:
    path = str(tmp_path / "prober.sock")
    threading.Thread(target=serve, args=(listen(path),), daemon=True).start()
    return path


@pytest.fixture
def http_server() -> Iterator[tuple[int, dict[str, int]]]:
    """Answers every GET with the status in `codes["status"]`."""
    codes = {"status": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(codes["status"])
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], codes
    server.shutdown()


@pytest.mark.process
class TestChecks:
    def test_http_succeeds_below_400_and_fails_from_400_or_when_refused(self, prober, http_server):
        port, codes = http_server
        request = probe_request({"httpGet": {"path": "/readyz", "port": port}}, "127.0.0.1", TRAINER)
        assert ask(prober, request) == (True, "HTTP probe succeeded with statuscode: 200")
        codes["status"] = 503
        assert ask(prober, request) == (False, "HTTP probe failed with statuscode: 503")
        closed = probe_request({"httpGet": {"port": free_port()}}, "127.0.0.1", TRAINER)
        ok, detail = ask(prober, closed)
        assert not ok and detail.startswith('Get "http://127.0.0.1:')

    def test_grpc_succeeds_only_while_the_health_service_says_serving(self, prober):
        servicer = health.HealthServicer()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            request = probe_request({"grpc": {"port": port}}, "127.0.0.1", {"name": "syncer"})
            servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            assert ask(prober, request)[0]
            servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert ask(prober, request) == (False, f'service "127.0.0.1:{port}" responded with "NOT_SERVING"')
        finally:
            server.stop(0)

    def test_tcp_succeeds_while_something_listens(self, prober, http_server):
        port, _ = http_server
        assert ask(prober, probe_request({"tcpSocket": {"port": port}}, "127.0.0.1", TRAINER))[0]
        assert not ask(prober, probe_request({"tcpSocket": {"port": free_port()}}, "127.0.0.1", TRAINER))[0]

    def test_a_prober_that_is_not_there_is_a_failure(self, tmp_path):
        ok, detail = ask(str(tmp_path / "none.sock"), {"kind": "tcpSocket", "timeout": 1})
        assert not ok and detail.startswith("the prober did not answer")
