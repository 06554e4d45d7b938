"""Readiness probes as the kubelet runs them, for the pod runner: what a probe asks (`probe_request`, pure), how
its results make a container Ready (`Readiness`, pure: periodSeconds, initialDelaySeconds, successThreshold,
failureThreshold, with the kubelet's defaults), and the check itself (`check`).

Pod IPs are reachable only inside the pod network (pod_network.py), so the checks run in its node namespace,
as a kubelet's run on its node, in one prober process the pod runner starts (`python -m cluster.probes
UNIX_PATH`); the runner hands it each probe over a Unix socket, which crosses network namespaces (`ask`).
httpGet, tcpSocket and grpc probes are run (the operator renders httpGet for trainers and grpc for syncers);
an exec probe fails, saying the pod runner does not run it. Startup and liveness probes are not run.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ASK_SLACK_SECONDS = 5.0
"""How much longer than a probe's own timeout the runner waits for the prober's answer."""


@dataclass(frozen=True)
class ProbeTiming:
    """A probe's timing and thresholds, with the kubelet's defaults for the fields a probe leaves out."""

    period: float = 10.0
    timeout: float = 1.0
    initial_delay: float = 0.0
    success_threshold: int = 1
    failure_threshold: int = 3

    @classmethod
    def of(cls, probe: Mapping[str, Any]) -> ProbeTiming:
        return cls(
            period=float(probe.get("periodSeconds", cls.period)),
            timeout=float(probe.get("timeoutSeconds", cls.timeout)),
            initial_delay=float(probe.get("initialDelaySeconds", cls.initial_delay)),
            success_threshold=int(probe.get("successThreshold", cls.success_threshold)),
            failure_threshold=int(probe.get("failureThreshold", cls.failure_threshold)),
        )


@dataclass
class Readiness:
    """The readiness of one container incarnation: not ready when it starts; ready after `success_threshold`
    successes in a row, not ready again after `failure_threshold` failures in a row; probed first
    `initial_delay` after it started, then every `period` after each result."""

    timing: ProbeTiming
    started: float
    ready: bool = False
    successes: int = 0
    failures: int = 0
    next_at: float = field(init=False)

    def __post_init__(self) -> None:
        self.next_at = self.started + self.timing.initial_delay

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> bool:
        """Takes one probe's result; True when the container's readiness changed."""
        self.next_at = now + self.timing.period
        was = self.ready
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.timing.success_threshold:
                self.ready = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= self.timing.failure_threshold:
                self.ready = False
        return self.ready != was


def _port(value: int | str, container: Mapping[str, Any]) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for port in container.get("ports") or ():
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"port {value!r} is not a port of container {container['name']}")


def probe_request(probe: Mapping[str, Any], pod_ip: str, container: Mapping[str, Any]) -> dict[str, Any]:
    """What the prober is to check for `probe` of `container` in a pod at `pod_ip` (JSON-able); a probe
    naming a port the container does not have fails, saying so."""
    try:
        return _request(probe, pod_ip, container)
    except ValueError as error:
        return {"kind": "invalid", "detail": str(error)}


def _request(probe: Mapping[str, Any], pod_ip: str, container: Mapping[str, Any]) -> dict[str, Any]:
    timeout = ProbeTiming.of(probe).timeout
    if "httpGet" in probe:
        get = probe["httpGet"]
        return {
            "kind": "httpGet",
            "scheme": str(get.get("scheme", "HTTP")).lower(),
            "host": get.get("host") or pod_ip,
            "port": _port(get["port"], container),
            "path": get.get("path") or "/",
            "headers": {h["name"]: h["value"] for h in get.get("httpHeaders") or ()},
            "timeout": timeout,
        }
    if "tcpSocket" in probe:
        tcp = probe["tcpSocket"]
        return {
            "kind": "tcpSocket",
            "host": tcp.get("host") or pod_ip,
            "port": _port(tcp["port"], container),
            "timeout": timeout,
        }
    if "grpc" in probe:
        rpc = probe["grpc"]
        return {
            "kind": "grpc",
            "host": pod_ip,
            "port": int(rpc["port"]),
            "service": rpc.get("service") or "",
            "timeout": timeout,
        }
    return {"kind": "exec" if "exec" in probe else "unknown", "timeout": timeout}


def _http(request: Mapping[str, Any]) -> tuple[bool, str]:
    url = f"{request['scheme']}://{request['host']}:{request['port']}{request['path']}"
    get = urllib.request.Request(url, headers=dict(request["headers"]))
    context = ssl._create_unverified_context() if request["scheme"] == "https" else None  # as the kubelet: no checks
    try:
        with urllib.request.urlopen(get, timeout=request["timeout"], context=context) as reply:
            return True, f"HTTP probe succeeded with statuscode: {reply.status}"
    except urllib.error.HTTPError as error:
        return False, f"HTTP probe failed with statuscode: {error.code}"
    except (urllib.error.URLError, OSError) as error:
        return False, f'Get "{url}": {getattr(error, "reason", error)}'


def _grpc(request: Mapping[str, Any]) -> tuple[bool, str]:
    target = f"{request['host']}:{request['port']}"
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=request["service"]), timeout=request["timeout"]
            )
        except grpc.RpcError as error:
            return False, f'failed to check service "{target}": {error.code().name}'
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f'service "{target}" responded with "{status}"'


def check(request: Mapping[str, Any]) -> tuple[bool, str]:
    """Runs one probe from where pod IPs are reachable: whether it succeeded, and what the kubelet would say."""
    kind = request["kind"]
    if kind == "httpGet":
        return _http(request)
    if kind == "grpc":
        return _grpc(request)
    if kind == "tcpSocket":
        try:
            socket.create_connection((request["host"], request["port"]), timeout=request["timeout"]).close()
        except OSError as error:
            return False, f"dial tcp {request['host']}:{request['port']}: {error}"
        return True, "TCP probe succeeded"
    if kind == "invalid":
        return False, request["detail"]
    return False, f"{kind} probes are not run by the test cluster's pod runner"


def ask(path: str, request: Mapping[str, Any]) -> tuple[bool, str]:
    """`check(request)` by the prober listening on the Unix socket `path`."""
    try:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(float(request.get("timeout", 0.0)) + ASK_SLACK_SECONDS)
            conn.connect(path)
            with conn.makefile("rwb") as stream:
                stream.write(json.dumps(request).encode() + b"\n")
                stream.flush()
                answer = json.loads(stream.readline())
    except (OSError, ValueError) as error:
        return False, f"the prober did not answer: {error}"
    return bool(answer["ok"]), str(answer["detail"])


def _answer(conn: socket.socket) -> None:
    with conn, conn.makefile("rwb") as stream:
        ok, detail = check(json.loads(stream.readline()))
        stream.write(json.dumps({"ok": ok, "detail": detail}).encode() + b"\n")


def listen(path: str) -> socket.socket:
    """A Unix socket listening at `path`; it appears there only once it accepts, so a caller that sees the
    path can connect at once."""
    pending = f"{path}.binding"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(pending)
    listener.listen(64)
    os.rename(pending, path)
    return listener


def serve(listener: socket.socket) -> None:
    """The prober: answers each connection on `listener` with `check` of the request it sends."""
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_answer, args=(conn,), daemon=True).start()


def main(argv: Sequence[str]) -> None:
    serve(listen(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
