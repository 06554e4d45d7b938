"""Small pods for the real node's tests, from Debian's static busybox packed as an image by ociimage.py: a web
server that can also fetch a URL once, or keep trying to open a TCP connection and say how the last try went."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import yaml

from cluster.cluster import Cluster

HERE = Path(__file__).resolve().parent
IMAGE = "diloco.local/busybox:test"
USER = 65532


def image(folder: Path) -> Path:
    """The busybox image as an OCI archive in `folder`, for start_real_nodes' `images`."""
    archive = folder / "busybox.tar"
    subprocess.run(
        ["python3", str(HERE / "ociimage.py"), IMAGE, str(archive), "--add", "/bin/busybox:/bin/busybox"],
        check=True,
    )
    return archive


def web_pod(
    name: str,
    fetch: str = "",
    probe: str = "",
    labels: dict[str, str] | None = None,
    port: int = 8080,
    node: str = "",
) -> str:
    """A pod serving /srv over HTTP on `port`, with `uid` (its user id) and, given `fetch` (a URL), what that
    URL answered. Given `probe` (`HOST PORT`), it tries every second to open a TCP connection there and keeps
    in `probe` how the last try went (`last_probe`). Ready once `uid` is served. On `node`, when given (bound
    there, whatever its taints). It says on stdout what it serves."""
    script = ["id -u > /srv/uid", f'echo "serving /srv on port {port} as uid $(id -u)"']
    if fetch:
        script.append(f"until wget -q -O /srv/fetched {fetch}; do sleep 1; done")
    if probe:
        # nc runs `true` once connected; it gives up after 2 s without an answer.
        outcome = f"if nc -w 2 {probe} -e true; then echo $n reached; else echo $n blocked; fi"
        record = "mv /srv/probe.new /srv/probe"  # whole: the test never reads half a line
        script.append("echo 0 untried > /srv/probe")  # there from the first request the pod is Ready for
        script.append(f"n=0; while true; do n=$((n + 1)); {outcome} > /srv/probe.new; {record}; sleep 1; done &")
    script.append(f"exec httpd -f -p {port} -h /srv")
    container = {
        "name": "web",
        "image": IMAGE,
        "imagePullPolicy": "Never",
        "command": ["/bin/busybox", "sh", "-c", "\n".join(script)],
        "env": [{"name": "PATH", "value": "/bin"}],
        "readinessProbe": {"httpGet": {"path": "/uid", "port": port}, "periodSeconds": 1},
        "livenessProbe": {"tcpSocket": {"port": port}, "initialDelaySeconds": 30},
        "resources": {"limits": {"memory": "32Mi", "cpu": "100m"}},
        "volumeMounts": [{"name": "srv", "mountPath": "/srv"}],
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": USER, "fsGroup": USER},
            "containers": [container],
            "volumes": [{"name": "srv", "emptyDir": {}}],
            **({"nodeName": node} if node else {}),
        },
    }
    return yaml.safe_dump(pod)


def running(cluster: Cluster, namespace: str, manifest: str) -> dict:
    """Applies `manifest` (one pod), waits until it is Ready and returns it."""
    name = yaml.safe_load(manifest)["metadata"]["name"]
    cluster.kubectl("-n", namespace, "apply", "-f", "-", stdin=manifest)
    cluster.kubectl("-n", namespace, "wait", "--for=condition=Ready", f"pod/{name}", "--timeout=120s", timeout=150)
    return json.loads(cluster.kubectl("-n", namespace, "get", "pod", name, "-o", "json").stdout)


def served(pod: dict, path: str) -> str:
    """What the web pod `pod` serves at `path` (fetched from the host)."""
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/{path}", timeout=10) as reply:
        return reply.read().decode().strip()


def last_probe(pod: dict) -> tuple[int, str]:
    """The number of the probing pod's last try, and whether it `reached` its target or was `blocked` (0 and
    `untried` before the first)."""
    tried, outcome = served(pod, "probe").split()
    return int(tried), outcome
