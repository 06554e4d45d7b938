"""The test cluster's stand-in for a kubelet and container runtime, for this project's images only: every pod
bound to a node with a container whose image is one of IMAGES (by repository name, any registry or tag) has
that container's command and args run as a local process from this checkout's virtualenv, as the image
would run them. What the pod spec says is honoured (podspec.py): the environment (env, ConfigMap and Secret
references, downward API, envFrom), ConfigMap, Secret, emptyDir and PersistentVolumeClaim volumes (files
under the runner's directory, container paths rewritten to them; a ConfigMap's or Secret's files are updated
in place while the container runs, every VOLUME_REFRESH seconds, as a kubelet does), the pod's hostname and an
/etc/hosts in which the job's Service names and the pods of headless Services resolve to their pod IPs. Each pod has a
network namespace of its own with its pod IP on `eth0` (pod_network.py), where other pods' IPs are reachable
and the API server is the `kubernetes` Service's ClusterIP; each process runs there, in mount and UTS
namespaces of its own for its hostname and /etc/hosts (`unshare`). NodePort and LoadBalancer Services are
served there by a relay per node port and per ingress IP and port (node_ports.py, which also gives each
LoadBalancer its ingress IP), delayed by `node_port_delay` each way.

A pod being deleted has its processes sent SIGTERM, and SIGKILL (to the whole process group) once it is gone
or its grace period (at most MAX_GRACE seconds) has passed; the runner's finalizer keeps the pod, Terminating,
until then, as a kubelet does (KWOK alone removes a deleted pod at once). A process that exits is reported
as the kubelet does (container not ready, then restarted after a back-off with restartCount incremented and
lastState holding the exit code, 128+N for a signal), so the operator's failure accounting sees it. A runner
started on the data of one that was killed with its cluster (isolated.py's restart) finds pods Running on its
nodes whose processes died with it: as a kubelet after a reboot, it reports each container lost (LOST) and
restarts it, its restartCount carried on. A
container with a readinessProbe is not ready from the moment its pod is bound (KWOK leaves it so on a cluster
started for a runner: cluster.start_cluster's `pod_runner`) and becomes ready, and unready again, as its
probe's results say (probes.py); each failed probe is an `Unhealthy` Warning Event on the pod, aggregated as
the kubelet's are; the pod is Ready while all its containers are. A probed container the runner does not run
is reported ready at once.

No device plugin runs here and no container sees a GPU (CUDA_VISIBLE_DEVICES is empty): a pod asking for
accelerators (nvidia.com/gpu ...) runs on CPU, where the built-in worker starts one gloo rank per
accelerator, as it would one nccl rank per GPU. A pod asking for more than MAX_ACCELERATORS is left to KWOK
alone (scheduled, Running and Ready, no process): each accelerator would be a training process on this
machine's few cores.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from cluster.controlplane import group_alive, stop_group
from cluster.node_ports import EVERY_ADDRESS, Address, ingress_ips, listeners, relay_command
from cluster.pod_network import KUBERNETES_SERVICE, PodNetwork, http_get
from cluster.podspec import (
    Data,
    Lookup,
    Unresolvable,
    accelerators,
    container_command,
    own_names,
    projected_files,
    render_hosts,
    resolve_env,
    rewrite_paths,
    secret_data,
    service_names,
)
from cluster.probes import ProbeTiming, Readiness, ask, probe_request

log = logging.getLogger("tests.cluster.pod_runner")

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {
    "diloco-trainer": ROOT / "deploy" / "Dockerfile.trainer",
    "diloco-operator": ROOT / "deploy" / "Dockerfile.operator",
}
"""Repository name -> Dockerfile of the images this project builds (the examples' spec.image, the chart's
image.repository); the Dockerfile's ENTRYPOINT and CMD stand in for the image's."""
MAX_GRACE = 10.0
MAX_ACCELERATORS = 2
VOLUME_REFRESH = 2.0
"""Seconds between two updates of a running container's ConfigMap and Secret files (a kubelet's take a minute
or so: its sync period and cache)."""
FINALIZER = "test.diloco.dev/pod-runner"
"""Held on every pod the runner has started a process for, and released once a deleted pod's processes have
exited, so that the pod outlives its processes' SIGTERM handling as it does under a kubelet."""
LOST = {
    "exitCode": 137,
    "reason": "ContainerStatusUnknown",
    "message": "The container could not be located when the pod was deleted.  The container used to be Running",
}
"""How a kubelet reports (in lastState) a container it finds gone from the runtime while it was running, as
after its node rebooted, in the kubelet's own words; it raises the container's restartCount."""
RUN_DIRS = ("/run/", "/var/run/")
"""Mounts under /run are bind-mounted at their real path over a private /run (the service-account token at
/var/run/secrets/kubernetes.io/serviceaccount, read from there by every Kubernetes client); every other
mount path is rewritten to the volume's local directory in the container's env, command and args."""


def dockerfile_exec(dockerfile: Path) -> tuple[list[str], list[str]]:
    """The (ENTRYPOINT, CMD) of a Dockerfile's last stage, each in its JSON (exec) form."""
    found: dict[str, list[str]] = {"ENTRYPOINT": [], "CMD": []}
    for line in dockerfile.read_text().splitlines():
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            found = {"ENTRYPOINT": [], "CMD": []}
        elif word.upper() in found:
            found[word.upper()] = json.loads(rest)
    return found["ENTRYPOINT"], found["CMD"]


def image_name(image: str) -> str:
    """`registry.example.com/team/diloco-trainer:1.0@sha256:..` -> `diloco-trainer`."""
    return image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]


def in_pod(
    network: PodNetwork, uid: str, command: Sequence[str], hosts: Path, hostname: str, run_mounts: Mapping[str, str]
) -> list[str]:
    """`command` wrapped to run in the network namespace of pod `uid` with `hosts` as its /etc/hosts,
    `hostname` as its host name and `run_mounts` (path under /run -> local directory) bind-mounted over a
    private /run, in mount and UTS namespaces of its own."""
    steps = [f"mount --bind {shlex.quote(str(hosts))} /etc/hosts"]
    steps.append(f"hostname {shlex.quote(hostname)}")
    if run_mounts:
        steps.append("mount -t tmpfs tmpfs /run")
        for target, source in run_mounts.items():
            steps += [f"mkdir -p {shlex.quote(target)}", f"mount --bind {shlex.quote(source)} {shlex.quote(target)}"]
    script = " && ".join([*steps, 'exec "$@"'])
    return network.enter_pod(
        uid, ["unshare", "--mount", "--uts", "--propagation", "private", "--", "/bin/sh", "-c", script, "pod", *command]
    )


def write_in_place(path: Path, text: str) -> None:
    """Rewrites a file keeping its inode, so bind mounts of it see the new content."""
    if path.exists() and path.read_text() == text:
        return
    with open(path, "a+") as f:
        f.seek(0)
        f.truncate()
        f.write(text)


def _environment(environ: bytes) -> dict[str, str]:
    """/proc/<pid>/environ as a mapping."""
    pairs = (item.decode(errors="replace").partition("=") for item in environ.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Container:
    """One container of one pod: its current process, and its restarts so far."""

    namespace: str
    pod: str
    uid: str
    name: str
    directory: Path
    process: subprocess.Popen | None = None
    started_at: str = ""
    restarts: int = 0
    last_exit: dict[str, Any] | None = None
    restart_at: float = 0.0
    terminating_since: float | None = None
    config_error: str | None = None
    finished: bool = False
    readiness: Readiness | None = None
    probing: Future[tuple[bool, str]] | None = None
    unhealthy: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Event name and count of each distinct failed-probe message posted for this container."""
    refresh_at: float = 0.0
    """When its ConfigMap and Secret files are next brought up to date."""

    @property
    def log_path(self) -> Path:
        return self.directory / f"{self.name}.log"


@dataclass
class PodRunner:
    """Runs in a thread: `start`, then `stop` (which kills every process it started)."""

    api: client.ApiClient
    workdir: Path
    images: Mapping[str, Path] = field(default_factory=lambda: dict(IMAGES))
    bin_dir: Path = field(default_factory=lambda: Path(sys.executable).parent)
    interval: float = 0.5
    backoff: tuple[float, float] = (1.0, 10.0)
    node_port_delay: float = 0.0
    """Seconds each node port's (and load balancer's) relay holds every chunk each way: a WAN's half round trip
    for clients that reach the cluster through them (cluster_link.py); relays started after a change use it."""
    containers: dict[tuple[str, str], Container] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.discovery = client.DiscoveryV1Api(self.api)
        self.network = PodNetwork(self.workdir / "network", self.api.configuration.host)
        self.prober_socket = self.workdir / "network" / "prober.sock"
        self._prober: subprocess.Popen | None = None
        self._node_ports: dict[Address, tuple[Address, subprocess.Popen]] = {}
        self._probes = ThreadPoolExecutor(max_workers=8, thread_name_prefix="probe")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pod-runner", daemon=True)

    # --- the public face -------------------------------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.network.start()
        self.prober_socket.unlink(missing_ok=True)  # a killed runner's, in a workdir started again
        self._prober = subprocess.Popen(
            self.network.enter([sys.executable, "-m", "cluster.probes", str(self.prober_socket)]),
            env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not self.prober_socket.exists():
            if time.monotonic() > deadline or self._prober.poll() is not None:
                raise RuntimeError("the prober did not start in the node namespace")
            time.sleep(0.1)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        with self._lock:
            for container in self.containers.values():
                self._kill(container)
        self._probes.shutdown(wait=True, cancel_futures=True)
        self._serve_node_ports({})
        if self._prober is not None:
            stop_group(self._prober, grace=5)
        self.network.stop()

    def processes(self, namespace: str, pod: str | None = None) -> list[subprocess.Popen]:
        """The live processes of a pod's containers (of every pod in `namespace` when `pod` is None)."""
        with self._lock:
            return [
                c.process
                for c in self.containers.values()
                if c.namespace == namespace and pod in (None, c.pod) and c.process and c.process.poll() is None
            ]

    def members(self, namespace: str, pod: str) -> dict[int, dict[str, str]]:
        """Every live process in a pod's containers, theirs and those they started (a launcher's ranks run in
        sessions of their own), with its environment: pid -> environment."""
        parents: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                # After the command's name in parentheses: state, parent, ...
                state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue  # it ended while we looked
            if state != "Z":
                parents[int(entry.name)] = int(parent)
        tree = {p.pid for p in self.processes(namespace, pod)}
        while grown := {pid for pid, parent in parents.items() if parent in tree} - tree:
            tree |= grown
        found = {}
        for pid in tree:
            try:
                found[pid] = _environment(Path(f"/proc/{pid}/environ").read_bytes())
            except OSError:
                continue
        return found

    def get(self, url: str) -> str:
        """The body of an HTTP GET of `url` from the pod network's node namespace, where pod IPs are reachable."""
        return http_get(self.network.enter([]), url)

    def kill(self, namespace: str, pod: str, sig: int = signal.SIGKILL) -> int:
        """Sends `sig` to the process groups of a pod's containers, as an OOM kill or a crash would end them;
        returns how many were signalled."""
        signalled = 0
        for process in self.processes(namespace, pod):
            os.killpg(process.pid, sig)
            signalled += 1
        return signalled

    def logs(self, namespace: str, pod: str) -> str:
        """Everything the pod's containers wrote (every incarnation), for failure messages."""
        with self._lock:
            paths = [c.log_path for c in self.containers.values() if (c.namespace, c.pod) == (namespace, pod)]
        return "".join(p.read_text(errors="replace") for p in paths if p.exists())

    def leftovers(self) -> list[int]:
        """Process groups started here that still have a live member (empty after `stop`)."""
        with self._lock:
            pods = [c.process.pid for c in self.containers.values() if c.process and group_alive(c.process.pid)]
            relays = [p.pid for _, p in self._node_ports.values() if group_alive(p.pid)]
        prober = [self._prober.pid] if self._prober is not None and group_alive(self._prober.pid) else []
        return pods + relays + prober + self.network.leftovers()

    # --- the loop -------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with self._lock:
                    self.pass_once()
            except (ApiException, OSError) as error:
                log.warning("pod runner pass failed: %s", error)

    def _list(self, call: Any) -> list[dict[str, Any]]:
        return json.loads(call(_preload_content=False).data)["items"]

    def runnable(self, pod: Mapping[str, Any]) -> bool:
        spec, status = pod["spec"], pod.get("status") or {}
        return bool(
            spec.get("nodeName")
            and status.get("podIP")
            and status.get("phase") == "Running"
            and any(image_name(c["image"]) in self.images for c in spec["containers"])
            and accelerators(pod) <= MAX_ACCELERATORS
        )

    def pass_once(self) -> None:
        """One look at every pod: processes of pods gone are killed first and their network namespaces taken
        away once none is left (their addresses freed for their successors), then every runnable pod gets its
        namespace and its containers converge to running."""
        every_pod = self._list(self.core.list_pod_for_all_namespaces)
        pods = [p for p in every_pod if self.runnable(p)]
        slices = self._list(self.discovery.list_endpoint_slice_for_all_namespaces)
        entries = service_names(slices)
        services = self._list(self.core.list_service_for_all_namespaces)
        self._assign_ingress(services)
        self._serve_node_ports(listeners(services, slices))
        live = {(p["metadata"]["uid"], c["name"]) for p in pods for c in p["spec"]["containers"]}
        for key, container in list(self.containers.items()):
            if key not in live:
                self._kill(container)
                if not (container.process and group_alive(container.process.pid)):
                    del self.containers[key]
        in_use = {uid for uid, _ in self.containers} | {uid for uid, _ in live}
        for uid in set(self.network.pods) - in_use:
            self.network.remove_pod(uid)
        for pod in pods:
            meta = pod["metadata"]
            directory = self.workdir / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
            directory.mkdir(parents=True, exist_ok=True)
            own = (pod["status"]["podIP"], own_names(pod))
            write_in_place(directory / "hosts", render_hosts(entries, own, meta["namespace"]))
            if not meta.get("deletionTimestamp"):
                self.network.add_pod(meta["uid"], pod["status"]["podIP"])
            for spec in pod["spec"]["containers"]:
                if image_name(spec["image"]) not in self.images:
                    continue
                container = self.containers.get((meta["uid"], spec["name"]))
                if container is None:
                    container = Container(meta["namespace"], meta["name"], meta["uid"], spec["name"], directory)
                    self.containers[(meta["uid"], spec["name"])] = container
                    if FINALIZER in (meta.get("finalizers") or ()) and not meta.get("deletionTimestamp"):
                        self._lost(container, pod)
                if meta.get("deletionTimestamp"):
                    self._terminate(container, pod)
                else:
                    self._converge(container, pod, spec)
        for pod in every_pod:
            meta = pod["metadata"]
            self._report_unprobed(pod)
            if meta.get("deletionTimestamp") and FINALIZER in (meta.get("finalizers") or ()):
                if not any(
                    c.uid == meta["uid"] and c.process and c.process.poll() is None for c in self.containers.values()
                ):
                    self._release(pod)

    def _report_unprobed(self, pod: Mapping[str, Any]) -> None:
        """Reports ready the probed containers this runner does not run (a pod left to KWOK alone, a foreign
        image), which KWOK started not ready (cluster.kwok_stages): no process of theirs answers a probe, so
        they are taken as up, as KWOK takes every container it alone runs."""
        meta, status = pod["metadata"], pod.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("phase") != "Running":
            return
        runs = self.runnable(pod)
        ready = {s["name"]: s.get("ready") for s in status.get("containerStatuses") or ()}
        updates = {
            spec["name"]: {"ready": True}
            for spec in pod["spec"]["containers"]
            if ready.get(spec["name"]) is False and not (runs and image_name(spec["image"]) in self.images)
        }
        if updates:
            self._patch_statuses(pod, updates)

    def _assign_ingress(self, services: list[dict[str, Any]]) -> None:
        """Publishes an ingress IP for each LoadBalancer Service without one, as a cloud controller does (its
        relay listens there from the next pass on)."""
        for (namespace, name), ip in ingress_ips(services).items():
            body = {"status": {"loadBalancer": {"ingress": [{"ip": ip}]}}}
            self.core.patch_namespaced_service_status(name, namespace, body)
            log.info("load balancer %s/%s at %s", namespace, name, ip)

    def _serve_node_ports(self, wanted: Mapping[Address, Address]) -> None:
        """Converges the relays to `wanted` (listening address -> endpoint): a relay whose endpoint moved, or
        that exited, is replaced."""
        for listen, (upstream, relay) in list(self._node_ports.items()):
            if wanted.get(listen) != upstream or relay.poll() is not None:
                stop_group(relay, grace=1)
                del self._node_ports[listen]
        for listen, upstream in wanted.items():
            if listen not in self._node_ports:
                if listen[0] != EVERY_ADDRESS:
                    self.network.add_address(listen[0])
                command = relay_command(sys.executable, listen, upstream, self.node_port_delay)
                relay = subprocess.Popen(
                    self.network.enter(command),
                    env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
                    cwd=self.workdir,
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                )
                self._node_ports[listen] = (upstream, relay)
                log.info("%s:%d -> %s:%d", *listen, *upstream)

    def _hold(self, pod: Mapping[str, Any]) -> None:
        """Adds the runner's finalizer (a strategic merge adds to the list)."""
        if FINALIZER not in (pod["metadata"].get("finalizers") or ()):
            meta = pod["metadata"]
            self.core.patch_namespaced_pod(meta["name"], meta["namespace"], {"metadata": {"finalizers": [FINALIZER]}})

    def _release(self, pod: Mapping[str, Any]) -> None:
        """Removes the runner's finalizer: the pod may go."""
        meta = pod["metadata"]
        rest = [f for f in meta["finalizers"] if f != FINALIZER]
        try:
            self.core.patch_namespaced_pod(
                meta["name"], meta["namespace"], [{"op": "replace", "path": "/metadata/finalizers", "value": rest}]
            )
        except ApiException as error:
            if error.status != 404:
                raise

    # --- one container ----------------------------------------------------------------------------------

    def _converge(self, container: Container, pod: dict[str, Any], spec: Mapping[str, Any]) -> None:
        process = container.process
        if process is not None and process.poll() is None:
            self._probe(container, pod, spec)
            self._refresh_volumes(container, pod, spec)
            return
        if process is not None and container.last_exit is None:
            self._exited(container, pod, process.returncode)
            return
        if container.finished or time.monotonic() < container.restart_at:
            return
        try:
            command, env, cwd = self._prepare(container, pod, spec)
        except Unresolvable as error:
            if container.config_error != str(error):
                container.config_error = str(error)
                self._patch(
                    pod,
                    container,
                    {"waiting": {"reason": "CreateContainerConfigError", "message": str(error)}},
                    ready=False,
                )
            return
        container.config_error = None
        restarting = container.last_exit is not None
        if restarting:
            container.restarts += 1
        self._hold(pod)
        with open(container.log_path, "ab") as out:
            container.process = subprocess.Popen(
                command,
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        container.started_at = _now()
        probe = spec.get("readinessProbe")
        container.readiness = Readiness(ProbeTiming.of(probe), time.monotonic()) if probe else None
        container.probing = None
        log.info("started %s/%s %s", container.namespace, container.pod, container.name)
        if restarting or probe:
            # A first start has the status KWOK gave the pod: running, and ready unless probed (on a cluster
            # started for a runner; ready all the same on another). A probed container is ready once its probe says so.
            self._patch(pod, container, {"running": {"startedAt": container.started_at}}, ready=not probe)
            container.last_exit = None

    def _probe(self, container: Container, pod: dict[str, Any], spec: Mapping[str, Any]) -> None:
        """Takes the result of the container's readiness probe when it is in, starts the next when due."""
        readiness = container.readiness
        if readiness is None:
            return
        if container.probing is not None:
            if not container.probing.done():
                return
            ok, detail = container.probing.result()
            container.probing = None
            if readiness.record(ok, time.monotonic()):
                running = {"running": {"startedAt": container.started_at}}
                self._patch(pod, container, running, ready=readiness.ready)
            if not ok:
                self._unhealthy(pod, container, f"Readiness probe failed: {detail}")
        elif readiness.due(time.monotonic()):
            request = probe_request(spec["readinessProbe"], pod["status"]["podIP"], spec)
            container.probing = self._probes.submit(ask, str(self.prober_socket), request)

    def _unhealthy(self, pod: Mapping[str, Any], container: Container, message: str) -> None:
        """The kubelet's Warning Event for a failed probe: one per container and message, its count raised.
        Best effort, as the kubelet's: a refused post (a namespace being deleted) is logged and dropped."""
        try:
            self._post_unhealthy(pod, container, message)
        except ApiException as error:
            log.warning("%s/%s: event not posted: %s", container.namespace, container.pod, error.reason)

    def _post_unhealthy(self, pod: Mapping[str, Any], container: Container, message: str) -> None:
        namespace, now = container.namespace, _now()
        name, count = container.unhealthy.get(message, ("", 0))
        if count:
            body: dict[str, Any] = {"count": count + 1, "lastTimestamp": now}
            self.core.patch_namespaced_event(name, namespace, body)
        else:
            digest = hashlib.sha256(f"{container.uid}\0{container.name}\0{message}".encode()).hexdigest()[:16]
            name = f"{container.pod}.{digest}"
            body = {
                "metadata": {"name": name, "namespace": namespace},
                "involvedObject": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": container.pod,
                    "namespace": namespace,
                    "uid": container.uid,
                    "fieldPath": f"spec.containers{{{container.name}}}",
                },
                "type": "Warning",
                "reason": "Unhealthy",
                "message": message,
                "count": 1,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "source": {"component": "kubelet", "host": pod["spec"].get("nodeName", "")},
                "reportingComponent": "kubelet",
            }
            self.core.create_namespaced_event(namespace, body)
        container.unhealthy[message] = (name, count + 1)

    def _lost(self, container: Container, pod: dict[str, Any]) -> None:
        """A container of a pod that holds FINALIZER, which only a runner that started its process adds, but
        with no process here: it died with the runner before this one, as containers die with their node.
        Taken as a kubelet takes a container it finds gone from the runtime while it was running: terminated
        as LOST says, restarted at once with its restart count carried on from the pod's status."""
        statuses = (pod.get("status") or {}).get("containerStatuses") or ()
        status = next((s for s in statuses if s["name"] == container.name), {})
        container.restarts = status.get("restartCount", 0)
        log.info("%s/%s %s died with the node", container.namespace, container.pod, container.name)
        self._ended(container, pod, dict(LOST), hold=0.0)

    def _exited(self, container: Container, pod: dict[str, Any], code: int) -> None:
        exit_code = code if code >= 0 else 128 - code
        termination = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": container.started_at,
            "finishedAt": _now(),
        }
        base, cap = self.backoff
        self._ended(container, pod, termination, hold=min(cap, base * 2**container.restarts))

    def _ended(self, container: Container, pod: dict[str, Any], termination: dict[str, Any], hold: float) -> None:
        """Reports the container's end (`termination`, its lastState from now on) and restarts it after `hold`
        seconds, or ends the pod, as its restartPolicy says."""
        container.last_exit = termination
        container.readiness = None
        exit_code = termination["exitCode"]
        log.info("%s/%s %s exited with %d", container.namespace, container.pod, container.name, exit_code)
        policy = pod["spec"].get("restartPolicy", "Always")
        if policy == "Never" or (policy == "OnFailure" and exit_code == 0):
            container.finished = True
            self._patch(
                pod,
                container,
                {"terminated": container.last_exit},
                ready=False,
                phase="Succeeded" if exit_code == 0 else "Failed",
            )
            return
        container.restart_at = time.monotonic() + hold
        waiting = "CrashLoopBackOff" if hold else "ContainerCreating"
        self._patch(pod, container, {"waiting": {"reason": waiting}}, ready=False)

    def _lookup(self, namespace: str) -> Lookup:
        """What a pod of `namespace` reads of its ConfigMaps and Secrets."""

        def lookup(kind: str, name: str) -> Data | None:
            try:
                if kind == "ConfigMap":
                    return dict(self.core.read_namespaced_config_map(name, namespace).data or {})
                return secret_data(
                    self.api.sanitize_for_serialization(self.core.read_namespaced_secret(name, namespace))
                )
            except ApiException as error:
                if error.status == 404:
                    return None
                raise

        return lookup

    def _refresh_volumes(self, container: Container, pod: Mapping[str, Any], spec: Mapping[str, Any]) -> None:
        """Brings the running container's ConfigMap and Secret files up to date, each file replaced whole (a
        reader sees the old contents or the new, as behind a kubelet's symlink swap); a ConfigMap or Secret
        that is gone leaves its files as they were."""
        if time.monotonic() < container.refresh_at:
            return
        container.refresh_at = time.monotonic() + VOLUME_REFRESH
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or ()}
        lookup = self._lookup(pod["metadata"]["namespace"])
        for mount in spec.get("volumeMounts") or ():
            volume = volumes.get(mount["name"]) or {}
            if not ("configMap" in volume or "secret" in volume):
                continue
            try:
                files = projected_files(volume, pod, lookup, lambda source: "")
            except Unresolvable:
                continue
            directory = container.directory / "volumes" / volume["name"]
            for path, content in (files or {}).items():
                data = content.encode() if isinstance(content, str) else content
                target = directory / path
                if target.exists() and target.read_bytes() == data:
                    continue
                staged = target.with_name(f".{target.name}.new")
                staged.write_bytes(data)
                os.replace(staged, target)

    def _prepare(
        self, container: Container, pod: Mapping[str, Any], spec: Mapping[str, Any]
    ) -> tuple[list[str], dict[str, str], Path]:
        """Command (wrapped by in_pod), environment and working directory of the next incarnation;
        volumes materialized."""
        lookup = self._lookup(pod["metadata"]["namespace"])

        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or ()}
        mounts: dict[str, str] = {}
        run_mounts: dict[str, str] = {}
        for mount in spec.get("volumeMounts") or ():
            if mount.get("subPath") or mount.get("subPathExpr"):
                raise Unresolvable(f"volume mount {mount['name']}: subPath is not supported by the pod runner")
            local = str(self._volume(container, pod, volumes[mount["name"]], lookup))
            path = mount["mountPath"]
            if path.startswith(RUN_DIRS):
                run_mounts["/run/" + path.split("/run/", 1)[1]] = local
            else:
                mounts[path] = local
        env = resolve_env(pod, spec, lookup)
        env = {name: rewrite_paths(value, mounts) for name, value in env.items()}
        command = container_command(spec, *dockerfile_exec(self.images[image_name(spec["image"])]))
        command = [rewrite_paths(part, mounts) for part in command]
        if not command:
            raise Unresolvable("neither the container nor the image's Dockerfile says what to run")
        base = {
            "PATH": f"{self.bin_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(container.directory),
            "HOSTNAME": pod["metadata"]["name"],
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": "",
            # What every pod gets for the `kubernetes` Service (pod_network.py relays it to the API server).
            "KUBERNETES_SERVICE_HOST": KUBERNETES_SERVICE[0],
            "KUBERNETES_SERVICE_PORT": str(KUBERNETES_SERVICE[1]),
        }
        if "/tmp" in mounts:
            base["TMPDIR"] = mounts["/tmp"]
        hosts, hostname = container.directory / "hosts", pod["metadata"]["name"]
        wrapped = in_pod(self.network, container.uid, command, hosts, hostname, run_mounts)
        return wrapped, base | env, container.directory

    def _token(self, pod: Mapping[str, Any], source: Mapping[str, Any]) -> str:
        """A token of the pod's service account bound to the pod, as the kubelet requests it."""
        meta = pod["metadata"]
        spec: dict[str, Any] = {
            "expirationSeconds": int(source.get("expirationSeconds", 3600)),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
        }
        if source.get("audience"):
            spec["audiences"] = [source["audience"]]
        reply = self.core.create_namespaced_service_account_token(
            pod["spec"].get("serviceAccountName") or "default", meta["namespace"], {"spec": spec}
        )
        return reply.status.token

    def _volume(self, container: Container, pod: Mapping[str, Any], volume: Mapping[str, Any], lookup: Any) -> Path:
        """The local directory that stands for `volume` (ConfigMap, Secret and projected files written anew at
        every start)."""
        files = projected_files(volume, pod, lookup, lambda source: self._token(pod, source))
        if files is not None:
            directory = container.directory / "volumes" / volume["name"]
            shutil.rmtree(directory, ignore_errors=True)
            for path, content in files.items():
                (directory / path).parent.mkdir(parents=True, exist_ok=True)
                (directory / path).write_bytes(content.encode() if isinstance(content, str) else content)
            return directory
        if "emptyDir" in volume:
            directory = container.directory / "volumes" / volume["name"]
            directory.mkdir(parents=True, exist_ok=True)
            return directory
        if "persistentVolumeClaim" in volume:
            claim = self.core.read_namespaced_persistent_volume_claim(
                volume["persistentVolumeClaim"]["claimName"], container.namespace
            )
            if not claim.spec.volume_name:
                raise Unresolvable(f"claim {claim.metadata.name} is not bound")
            host_path = self.core.read_persistent_volume(claim.spec.volume_name).spec.host_path
            if host_path is None:
                raise Unresolvable(f"volume {claim.spec.volume_name} is not a hostPath volume")
            Path(host_path.path).mkdir(parents=True, exist_ok=True)
            return Path(host_path.path)
        raise Unresolvable(f"volume {volume['name']}: {sorted(set(volume) - {'name'})} is not supported")

    def _terminate(self, container: Container, pod: Mapping[str, Any]) -> None:
        process = container.process
        if process is None or process.poll() is not None:
            return
        if container.terminating_since is None:
            container.terminating_since = time.monotonic()
            os.killpg(process.pid, signal.SIGTERM)
        grace = min(MAX_GRACE, float(pod["spec"].get("terminationGracePeriodSeconds", 30)))
        if time.monotonic() - container.terminating_since > grace:
            self._kill(container)

    def _kill(self, container: Container) -> None:
        process = container.process
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            log.warning("%s/%s did not die on SIGKILL", container.namespace, container.pod)

    def _patch(
        self, pod: Mapping[str, Any], container: Container, state: dict[str, Any], ready: bool, phase: str | None = None
    ) -> None:
        """The kubelet's status update for `container` (other containers' statuses kept as they are); the pod is
        Ready while every container is."""
        update: dict[str, Any] = {
            "ready": ready,
            "started": "running" in state,
            "restartCount": container.restarts,
            "state": state,
        }
        if container.last_exit is not None:
            update["lastState"] = {"terminated": container.last_exit}
        self._patch_statuses(pod, {container.name: update}, phase)

    def _patch_statuses(
        self, pod: Mapping[str, Any], updates: Mapping[str, dict[str, Any]], phase: str | None = None
    ) -> None:
        """The status update of some of the pod's containers (by name), the others' kept as they are."""
        now = _now()
        current = {s["name"]: s for s in (pod.get("status") or {}).get("containerStatuses") or ()}
        statuses = []
        for spec in pod["spec"]["containers"]:
            status = dict(current.get(spec["name"]) or {"name": spec["name"], "image": spec["image"], "imageID": ""})
            statuses.append(status | updates.get(spec["name"], {}))
        flag = "True" if all(status.get("ready") for status in statuses) else "False"
        body: dict[str, Any] = {
            "status": {
                "containerStatuses": statuses,
                "conditions": [
                    {"type": kind, "status": flag, "lastTransitionTime": now} for kind in ("Ready", "ContainersReady")
                ],
            }
        }
        if phase:
            body["status"]["phase"] = phase
        try:
            self.core.patch_namespaced_pod_status(pod["metadata"]["name"], pod["metadata"]["namespace"], body)
        except ApiException as error:
            if error.status != 404:
                raise
