"""A DiLoCo job on one machine: syncer shards and island workers as processes on loopback, supervised the
way Kubernetes would (a dead worker or shard is replaced), with failures injected from a trace.

Each island is one pod: one `diloco-worker` process, or a command of one's own (`diloco run -- COMMAND`), which
with more than one rank per island starts them as its local ranks (diloco.worker.pod_launcher), as a pod with
that many accelerators does. Every island's process gets the environment the operator gives an island's pod
(`diloco.pod_env.IslandPod`: shards, token and config files, TLS, checkpoint folder, metrics port, grace
period, rendezvous), plus the run's instruments (`diloco.pod_env.LOCAL_RUN`: where to write progress events,
the mode, the emulated slowness), through which the built-in trainer and a loop's `Learner.from_env` alike
report what they do. Islands re-form when one of their ranks dies (the pod's process and every rank in it
stop, and all restart together), and other islands never notice. The data-parallel baseline has one world,
the islands its nodes: any death stops every worker, and all restart from the last checkpoint, as a
non-elastic job does.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from diloco import pod_env
from diloco.core.config import Mode, TrainingConfig
from diloco.lifetime import launcher_env
from diloco.local.delay_proxy import DelayProxy
from diloco.local.failure_trace import FailureEvent, syncer_target, worker_island
from diloco.local.netns import HUB_ADDRESS, ISLAND_DEVICE, IslandNetwork, island_address
from diloco.local.wan import Link
from diloco.operator import naming
from diloco.progress import StartEvent, read_events
from diloco.settings import DEFAULT_CORPUS_BYTES
from diloco.transport.tls import LOOPBACK_NAMES, throwaway_pki
from diloco.worker.pod_launcher import LAUNCHER_MODULE

log = logging.getLogger("diloco.local.launcher")

TOKEN = "local-run"
JOB = "local-run"
GRACE_SECONDS = pod_env.DEFAULT_GRACE_SECONDS
"""What each island's process is told it has after SIGTERM, and what the launcher gives it before SIGKILL."""
RESTART_DELAY_SECONDS = 1.0
FAILURES_BEFORE_TRAINING = 3
"""Times an island's process may fail before it has ever trained before the run gives up: a loop that cannot
start (a typo, a missing file) would otherwise be restarted until the run's timeout."""
POLL_SECONDS = 0.1
SCRAPE_JOB = "run"
"""The job a run's processes are named after in its Prometheus targets (`prometheus-targets.json`)."""
SYNCER_START_SECONDS = 180.0  # importing torch and grpc takes minutes on a saturated machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free on loopback: a pod's local rank r serves metrics on the
    pod's port + r."""
    while True:
        first = free_port()
        try:
            for port in range(first + 1, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first


def _write_secrets(folder: Path, files: dict[str, bytes]) -> dict[str, Path]:
    """The run's token, certificates and keys as files its processes read, readable by this user alone."""
    paths = {}
    for name, pem in files.items():
        paths[name] = folder / name
        with os.fdopen(os.open(paths[name], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
            handle.write(pem)
    return paths


@dataclass(frozen=True)
class RunPlan:
    mode: str
    config: TrainingConfig
    out: Path
    islands: int = 4
    ranks_per_island: int = 1
    shards: int = 1
    steps: int = 300
    batch_size: int = 16
    model: str = "tiny"  # a preset, or a transformers configuration (diloco.worker.language_model.ModelSpec)
    tokenizer: str | None = None
    init_from: str | None = None
    data: str | None = None
    seed: int = 0
    eval_every: int = 50
    checkpoint_every: int = 50
    command: tuple[str, ...] = ()  # every island's worker: a loop of one's own; empty: the built-in trainer
    slowdowns: tuple[float, ...] = ()
    jitters: tuple[float, ...] = ()  # per island: each step a random 0 to 2 x this share longer
    reference_step_seconds: float | None = None  # the emulated device's step, which slowdowns multiply
    equal_time: bool = False  # decoupled islands take steps in proportion to their speed: see island_steps
    trace: tuple[FailureEvent, ...] = ()
    threads: int = 1
    timeout: float = 3600.0
    device: str = "cpu"  # every worker's: islands share an accelerator as processes
    gpus: int = 0  # CUDA devices visible to the run, which the islands divide among themselves
    max_data_bytes: int = DEFAULT_CORPUS_BYTES  # of the corpus, the same for the workers and the global evaluation
    precision: str = "auto"
    link: Link = field(
        default_factory=Link
    )  # between each island and the syncers (and the other islands); unshaped: loopback
    hostile_islands: int = 0  # the last this many islands are misbehaving clients (diloco.local.hostile)

    def island_name(self, index: int) -> str:
        return f"island-{index}"

    @property
    def honest(self) -> range:
        """The islands that train: all but the last `hostile_islands`, which misbehave instead."""
        return range(self.islands - self.hostile_islands)

    @property
    def hostile(self) -> range:
        return range(self.islands - self.hostile_islands, self.islands)

    def slowdown(self, index: int) -> float:
        return self.slowdowns[index] if index < len(self.slowdowns) else 1.0

    def jitter(self, index: int) -> float:
        return self.jitters[index] if index < len(self.jitters) else 0.0

    @property
    def built_in(self) -> bool:
        """Whether the islands run the built-in trainer, whose steps, model and evaluations the run knows."""
        return not self.command

    def island_steps(self, index: int) -> int:
        """The island's inner steps: `steps`, or with `equal_time` in decoupled DiLoCo, `steps` times how
        many times faster than the slowest island it is, so that every island trains for the slowest's time,
        as a job's islands train until the job ends. The synchronous baselines keep `steps` on every island:
        their barrier holds each island to the slowest's pace whatever its count."""
        if not self.equal_time or self.mode != Mode.DILOCO.value:
            return self.steps
        slowest = max(self.slowdown(i) for i in self.honest)
        return round(self.steps * slowest / self.slowdown(index))

    @property
    def total_steps(self) -> int | None:
        """Inner steps of every rank of every island together (None: a command's own, unknown)."""
        if not self.built_in:
            return None
        return self.ranks_per_island * sum(self.island_steps(i) for i in self.honest)


def island_gpus(island: int, ranks_per_island: int, gpus: int) -> str:
    """CUDA_VISIBLE_DEVICES of an island's pod process: a GPU of its own for each of its ranks while there are
    enough for every rank of every island, else the machine's GPUs in turn (several islands then share one,
    as processes; a pod whose ranks outnumber its GPUs runs them over gloo: `diloco.worker.pod_ranks.place`)."""
    first = island * ranks_per_island
    return ",".join(dict.fromkeys(str((first + k) % gpus) for k in range(ranks_per_island)))


def check_gpus(device: str, modes: Sequence[str], workers: int, gpus: int) -> None:
    """Refuses a run that cannot start: CUDA asked for and none visible, or data-parallel across more ranks
    than GPUs (NCCL refuses two ranks of one world on one GPU)."""
    if not device.startswith("cuda"):
        return
    if gpus < 1:
        raise ValueError(f"--device {device}: no CUDA device is visible")
    if Mode.DDP in modes and workers > gpus:
        raise ValueError(
            f"ddp runs one rank per GPU (NCCL refuses two on one GPU): {workers} workers, {gpus} GPU(s); run the "
            "DiLoCo modes alone, and ddp with --islands 1 at the islands' global batch, as bench/training.py does"
        )


def syncer_threads(cpus: int, workers: int, threads_per_worker: int, shards: int) -> int:
    """Math-library threads for each syncer shard: the cores the workers leave, shared by the shards. A shard
    decodes, merges and re-encodes whole fragments on the CPU, which at accelerator model sizes (62 M
    parameters a fragment) is what every round waits for; pinned to one thread, it held back a GPU run."""
    return max(1, (cpus - workers * threads_per_worker) // shards)


@contextmanager
def terminate_as_exit() -> Iterator[None]:
    """A SIGTERM to the launcher raises SystemExit, so that its `finally`s stop the job's processes (each in a
    session of its own, which the signal does not reach) and delete the islands' namespaces, as Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class _Proc:
    name: str
    command: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restart_at: float | None = None
    done: bool = False
    starts: int = 0
    failures: int = 0  # exits with an error that no injected failure caused

    def start(self, log_dir: Path) -> None:
        """In a session of its own, killed as a group, as a container is killed whole (its local ranks, in
        sessions of their own, die with it: diloco.worker.pod_launcher.follow_launcher)."""
        log_file = open(self.log_path(log_dir), "ab")
        self.proc = subprocess.Popen(
            self.command, env=self.env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        log_file.close()
        self.restart_at = None
        self.starts += 1

    def log_path(self, log_dir: Path) -> Path:
        return log_dir / f"{self.name.replace(':', '-').replace('/', '-')}.log"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class IslandCannotStart(RuntimeError):
    """An island's process kept failing before it ever trained; the message names its log."""


@dataclass
class JobResult:
    started_at: float
    finished_at: float
    syncer_bytes: float = 0.0
    merges: float = 0.0  # merges applied by the syncers, all fragments
    merged_contributions: float = 0.0  # island contributions those merges took in (summed over merges)
    global_eval_loss: float | None = None
    model_dir: Path | None = None  # the syncers' final global model, exported (diloco export's format)
    export_error: str | None = None  # why there is none, for a command
    kills: int = 0
    timed_out: bool = False
    worker_starts: dict[str, int] = field(default_factory=dict)  # per island's process
    rejected: dict[str, float] = field(default_factory=dict)  # calls the syncers refused, by reason
    outliers: float = 0.0  # contributions the syncers left out of merges (diloco.core.robust)
    hostile: dict[str, dict] = field(default_factory=dict)  # per misbehaving island: what its calls came back with


# The syncer counters a run sums over its shards, as regular expressions over their Prometheus text.
_SYNCER_COUNTERS = {
    "bytes": r"^diloco_syncer_(?:received|sent)_bytes_total ([0-9.e+]+)$",
    "merges": r"^diloco_syncer_merge_contributors_count ([0-9.e+]+)$",
    "contributions": r"^diloco_syncer_merge_contributors_sum ([0-9.e+]+)$",
    "outliers": r"^diloco_syncer_outlier_contributions_total ([0-9.e+]+)$",
}
_REJECTED = r'^diloco_syncer_rejected_pushes_total\{reason="([a-z_]+)"\} ([0-9.e+]+)$'


class _CounterTracker:
    """Sums a Prometheus counter across restarts of the process exposing it (a restart resets it)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._last = 0.0

    def observe(self, value: float) -> None:
        self.total += value - self._last if value >= self._last else value
        self._last = value


class LocalJob:
    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        self.out = plan.out
        for folder in ("progress", "merges", "logs", "checkpoints", "tls"):
            # A run starts from nothing: a previous run's checkpoints would be resumed and its events counted.
            shutil.rmtree(self.out / folder, ignore_errors=True)
            (self.out / folder).mkdir(parents=True)
        self.config_file = self.out / "config.json"
        self.config_file.write_text(plan.config.to_json())
        # Islands behind links run in namespaces of their own and reach the syncers through the hub.
        self.network = IslandNetwork(plan.islands, plan.link) if plan.link.shaped else None
        # A CA for this run alone, so the shards and islands speak TLS exactly as they do on a cluster.
        self.pki = throwaway_pki(LOOPBACK_NAMES + ((HUB_ADDRESS,) if self.network else ()))
        self.secrets = _write_secrets(
            self.out / "tls",
            {
                "ca.crt": self.pki.ca.cert,
                "tls.crt": self.pki.server_cert.cert,
                "tls.key": self.pki.server_cert.key,
                "token": TOKEN.encode(),
            },
        )
        self.syncer_ports = [free_port() for _ in range(plan.shards)]
        self.metrics_ports = [free_port() for _ in range(plan.shards)]
        self.island_ports = [free_port() for _ in range(plan.islands)]
        self.island_metrics_ports = [free_ports(plan.ranks_per_island) for _ in range(plan.islands)]
        self._write_scrape_targets()
        self.syncers = [] if plan.mode == Mode.DDP else [self._syncer(i) for i in range(plan.shards)]
        self.workers = {plan.island_name(i): self._worker(i) for i in plan.honest}
        self.hostile = [] if plan.mode == Mode.DDP else [self._hostile(i) for i in plan.hostile]
        self._counters = {(shard, name): _CounterTracker() for shard in range(plan.shards) for name in _SYNCER_COUNTERS}
        self._rejected: dict[tuple[int, str], _CounterTracker] = {}

    def _base_env(self, threads: int | None = None) -> dict[str, str]:
        """Every process's environment; `threads` for its math libraries, a worker's by default."""
        threads = str(threads or self.plan.threads)
        return {
            **os.environ,
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            "DILOCO_LOG_LEVEL": os.environ.get("DILOCO_LOG_LEVEL", "WARNING"),  # the run's own: quiet unless asked
            "PYTHONUNBUFFERED": "1",
            **launcher_env(),
        }

    def island_pod(self, island: int) -> pod_env.IslandPod:
        """What the island's process is told, as the operator tells an island's pod. In data-parallel every
        island is one pod (node) of one world, which meets at island 0."""
        p = self.plan
        ddp = p.mode == Mode.DDP
        return pod_env.IslandPod(
            job=JOB,
            island=p.island_name(island),
            syncers=[f"{HUB_ADDRESS if self.network else '127.0.0.1'}:{port}" for port in self.syncer_ports],
            config_file=str(self.config_file),
            token_file=str(self.secrets["token"]),
            metrics_port=self.island_metrics_ports[island],
            accelerators_per_pod=p.ranks_per_island,
            grace_seconds=GRACE_SECONDS,
            checkpoint_dir=str(self.out / "checkpoints" / "workers"),
            checkpoint_every=p.checkpoint_every,
            threads=p.threads,
            world_size=(p.islands if ddp else 1) * p.ranks_per_island,
            master_addr=island_address(0) if self.network and ddp else "127.0.0.1",
            master_port=self.island_ports[0] if ddp else self.island_ports[island],
            # Each island reads its own share of the training set, as the operator tells its pods; data-parallel's
            # one world reads one.
            trainer={pod_env.DATA_SHARD: str(island), pod_env.DATA_SHARDS: str(len(p.honest))}
            if p.built_in and not ddp
            else {},
        )

    def island_env(self, island: int) -> dict[str, str]:
        """The island's variables as an island pod of the operator's gets them: its `island_pod`, the pod's
        own (ordinal 0 of its island, or its node rank in data-parallel) and the CA that verifies the shards."""
        pod = self.island_pod(island)
        ordinal = island if self.plan.mode == Mode.DDP else 0
        own = pod.own(ordinal, f"{self.plan.island_name(island)}-{ordinal}")
        return pod.variables() | own | pod_env.tls_variables(ca_file=str(self.secrets["ca.crt"]))

    def run_env(self, island: int) -> dict[str, str]:
        """What this run gives the island's process beyond a pod's (`diloco.pod_env.LOCAL_RUN`)."""
        p = self.plan
        name = p.island_name(island)
        env = {
            pod_env.PROGRESS_FILE: str(self.out / "progress" / f"{name}-rank{{rank}}.jsonl"),
            pod_env.MODE: p.mode,
            pod_env.SLOWDOWN: str(p.slowdown(island)),
            pod_env.JITTER: str(p.jitter(island)),
            pod_env.METRICS_HOST: "127.0.0.1",
        }
        if p.reference_step_seconds:
            env[pod_env.REFERENCE_STEP_SECONDS] = str(p.reference_step_seconds)
        return env

    def _syncer(self, shard: int) -> _Proc:
        command = [
            sys.executable,
            "-m",
            "diloco.syncer.main",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.syncer_ports[shard]),
            "--shard-index",
            str(shard),
            "--num-shards",
            str(self.plan.shards),
            "--islands",
            str(self.plan.islands),
            "--config",
            str(self.config_file),
            "--checkpoint-dir",
            str(self.out / "checkpoints" / "syncer"),
            "--checkpoint-interval",
            "2",
            "--metrics-port",
            str(self.metrics_ports[shard]),
            "--progress-file",
            str(self.out / "merges" / f"shard-{shard}.jsonl"),
        ]
        p = self.plan
        threads = syncer_threads(os.cpu_count() or 1, p.islands * p.ranks_per_island, p.threads, p.shards)
        command += ["--threads", str(threads)]
        env = {
            **self._base_env(threads),
            pod_env.TOKEN_FILE: str(self.secrets["token"]),
            **pod_env.tls_variables(
                ca_file=str(self.secrets["ca.crt"]),
                cert_file=str(self.secrets["tls.crt"]),
                key_file=str(self.secrets["tls.key"]),
            ),
        }
        return _Proc(syncer_target(shard), command, env)

    def _worker(self, island: int) -> _Proc:
        """The island's pod: its process, and its ranks as that process's local ranks, with the environment
        the operator gives a pod (`island_env`) and this run's instruments (`run_env`)."""
        p = self.plan
        env = {**self._base_env(), **self.island_env(island), **self.run_env(island)}
        if self.network and p.mode == Mode.DDP:
            # One world across the islands' links: it all-reduces over each island's own end of its link,
            # however long a collective takes to cross it.
            env |= {"GLOO_SOCKET_IFNAME": ISLAND_DEVICE, "DILOCO_DIST_TIMEOUT": str(p.timeout)}
        if p.device.startswith("cuda") and p.gpus:
            env["CUDA_VISIBLE_DEVICES"] = island_gpus(island, p.ranks_per_island, p.gpus)
        if p.built_in:
            command = self._built_in_command(island)
        else:
            # This run's Python first on PATH, as in the trainer image: `python` is the one with diloco and torch.
            env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])
            command = [sys.executable, "-m", LAUNCHER_MODULE, *p.command]
        if self.network:
            command = self.network.command(island, command)
        return _Proc(f"worker:{p.island_name(island)}", command, env)

    def _hostile(self, island: int) -> _Proc:
        """A misbehaving client in the island's place: the job's token, CA and shards, as its pod would have."""
        name = self.plan.island_name(island)
        (self.out / "hostile").mkdir(exist_ok=True)
        pod = self.island_pod(island)
        command = [
            sys.executable,
            "-m",
            "diloco.local.hostile",
            "--syncers",
            ",".join(pod.syncers),
            "--token-file",
            str(self.secrets["token"]),
            "--tls-ca-file",
            str(self.secrets["ca.crt"]),
            "--config",
            str(self.config_file),
            "--name",
            name,
            "--report",
            str(self.hostile_report(name)),
        ]
        if self.network:
            command = self.network.command(island, command)
        return _Proc(f"hostile:{name}", command, self._base_env())

    def hostile_report(self, name: str) -> Path:
        return self.out / "hostile" / f"{name}.json"

    def _built_in_command(self, island: int) -> list[str]:
        """`diloco-worker` with the built-in trainer's own settings; the rest it reads from the environment."""
        p = self.plan
        command = [
            sys.executable,
            "-m",
            "diloco.worker.main",
            "--model",
            p.model,
            "--steps",
            str(p.island_steps(island)),
            "--batch-size",
            str(p.batch_size),
            "--eval-every",
            str(p.eval_every),
            "--seed",
            str(p.seed),
            "--threads",
            str(p.threads),
            "--device",
            p.device,
            "--precision",
            p.precision,
            "--max-data-bytes",
            str(p.max_data_bytes),
        ]
        for flag, value in (("--data", p.data), ("--tokenizer", p.tokenizer), ("--init-from", p.init_from)):
            if value:
                command += [flag, value]
        return command

    def _fails_with(self, island: str) -> list[_Proc]:
        """The processes that fail together with a rank of `island`: its pod, or everyone in data-parallel."""
        return list(self.workers.values()) if self.plan.mode == Mode.DDP else [self.workers[island]]

    def _fail(self, target: str, downtime: float, now: float) -> None:
        """A trace's kill -9 of a worker rank or a syncer shard."""
        victims = [s for s in self.syncers if s.name == target] or self._fails_with(worker_island(target))
        self._take_down(victims, downtime, now)

    def _take_down(self, victims: list[_Proc], downtime: float, now: float) -> None:
        for proc in victims:
            if proc.done:
                continue
            proc.kill()
            proc.restart_at = now + downtime

    def _write_scrape_targets(self) -> None:
        """`prometheus-targets.json`: every metrics port of the run in Prometheus's file_sd format, each labelled
        with the `pod` the process would be in were the run a job named SCRAPE_JOB (the operator's names: a
        shard's Deployment's, an island's one pod, which holds all its ranks), so that a Prometheus on this
        machine can scrape the run as the chart's dashboard expects. A shard's gRPC address is its
        `__meta_diloco_address` (a meta label: dropped from its series, as Prometheus drops them)."""
        shards = range(self.plan.shards if self.plan.mode != Mode.DDP else 0)
        groups = [
            {
                "targets": [f"127.0.0.1:{self.metrics_ports[shard]}"],
                "labels": {
                    "pod": naming.syncer_name(SCRAPE_JOB, shard),
                    "component": "syncer",
                    "__meta_diloco_address": f"127.0.0.1:{self.syncer_ports[shard]}",
                },
            }
            for shard in shards
        ] + [
            {
                "targets": [f"127.0.0.1:{first + rank}"],
                "labels": {
                    "pod": f"{naming.island_name(SCRAPE_JOB, self.plan.island_name(island))}-0",
                    "component": "worker",
                },
            }
            for island, first in enumerate(self.island_metrics_ports)
            for rank in range(self.plan.ranks_per_island)
        ]
        (self.out / "prometheus-targets.json").write_text(json.dumps(groups, indent=2) + "\n")

    def _scrape_syncers(self) -> None:
        for shard, port in enumerate(self.metrics_ports[: len(self.syncers)]):
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                continue
            for name, pattern in _SYNCER_COUNTERS.items():
                total = sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))
                self._counters[shard, name].observe(total)
            for m in re.finditer(_REJECTED, text, re.M):
                self._rejected.setdefault((shard, m.group(1)), _CounterTracker()).observe(float(m.group(2)))

    def _shape_once_started(self) -> None:
        """Shapes the links once every island has begun training: the initial model (seeded in float32, then
        pulled) crosses at full speed, as it would for a job resumed from checkpoints held in every region,
        and every training step and sync after it crosses the link."""
        if self.network is None or self.network.shaped:
            return
        started = {e.source.island for e in read_events(self.out / "progress") if isinstance(e, StartEvent)}
        if started >= set(self.workers):
            self.network.shape()
            log.info("links shaped", extra={"link": self.plan.link.describe()})

    def _counter(self, name: str) -> float:
        return sum(tracker.total for (_, counter), tracker in self._counters.items() if counter == name)

    @contextmanager
    def _links(self) -> Iterator[None]:
        """The islands' namespaces and links, and a delay proxy in the hub for each shard, for as long as the
        job runs; deleted after its processes stop."""
        if self.network is None:
            yield
            return
        with self.network:
            listeners = {
                self.network.listen(port): ("127.0.0.1", port) for port in self.syncer_ports[: len(self.syncers)]
            }
            with DelayProxy(listeners, self.plan.link.one_way_seconds):
                yield

    def run(self, on_tick: Callable[[], None] = lambda: None) -> JobResult:
        """Runs the job to completion (or the plan's timeout), replaying the failure trace."""
        with terminate_as_exit(), self._links():
            return self._run(on_tick)

    def _run(self, on_tick: Callable[[], None]) -> JobResult:
        from diloco.transport.client import SyncerClient

        logs = self.out / "logs"
        for syncer in self.syncers:
            syncer.start(logs)
        try:
            for port in self.syncer_ports[: len(self.syncers)]:
                with SyncerClient(f"127.0.0.1:{port}", TOKEN, security=self.pki.client) as client:
                    if not client.wait_ready(SYNCER_START_SECONDS):
                        raise RuntimeError(f"syncer on port {port} did not start; see {logs}")
        except BaseException:
            for syncer in self.syncers:  # not left running behind a job that never started
                syncer.kill()
            raise
        started = time.time()
        for worker in [*self.workers.values(), *self.hostile]:
            worker.start(logs)
        trace = sorted(self.plan.trace)
        result = JobResult(started_at=started, finished_at=started)
        next_scrape = 0.0
        try:
            while not all(w.done for w in self.workers.values()):
                now = time.time()
                if now - started > self.plan.timeout:
                    result.timed_out = True
                    break
                while trace and trace[0].at <= now - started:
                    event = trace.pop(0)
                    self._fail(event.target, event.downtime, now)
                    result.kills += 1
                self._supervise(now, logs)
                if now >= next_scrape:
                    self._scrape_syncers()
                    self._shape_once_started()
                    next_scrape = now + 1.0
                on_tick()
                time.sleep(POLL_SECONDS)
            result.finished_at = time.time()
            self._scrape_syncers()
            if self.syncers and not result.timed_out:  # a job that ran out of time has no final model
                if self.plan.built_in:  # a command's model and data are its own to evaluate
                    result.model_dir = self._export_global()
                    result.global_eval_loss = self._evaluate(result.model_dir)
                else:
                    try:
                        result.model_dir = self._export_global()
                    except ValueError as error:  # the shards hold nothing: the command never trained
                        result.export_error = str(error)
        finally:
            for proc in [*self.workers.values(), *self.hostile, *self.syncers]:
                if proc.alive:
                    proc.proc.send_signal(signal.SIGTERM)
            for proc in [*self.workers.values(), *self.hostile, *self.syncers]:
                if proc.proc is not None:
                    try:
                        proc.proc.wait(GRACE_SECONDS)
                    except subprocess.TimeoutExpired:
                        proc.kill()
        result.syncer_bytes = self._counter("bytes")
        result.merges = self._counter("merges")
        result.merged_contributions = self._counter("contributions")
        result.worker_starts = {name: w.starts for name, w in self.workers.items()}
        result.outliers = self._counter("outliers")
        for (_, reason), tracker in self._rejected.items():
            result.rejected[reason] = result.rejected.get(reason, 0.0) + tracker.total
        for proc in self.hostile:
            report = self.hostile_report(proc.name.removeprefix("hostile:"))
            result.hostile[proc.name] = json.loads(report.read_text()) if report.exists() else {"starts": proc.starts}
        return result

    def _supervise(self, now: float, logs: Path) -> None:
        for proc in [*self.syncers, *self.hostile]:
            if proc.restart_at is not None and now >= proc.restart_at:
                proc.start(logs)
            elif proc.restart_at is None and not proc.alive:
                proc.restart_at = now + RESTART_DELAY_SECONDS
        for name, proc in self.workers.items():
            if proc.done:
                continue
            if proc.restart_at is not None:
                if now >= proc.restart_at:
                    proc.start(logs)
                continue
            code = proc.proc.poll() if proc.proc is not None else None
            if code == 0:
                proc.done = True
            elif code is not None:
                log.info("worker exited; its island re-forms", extra={"island": name, "code": code})
                self._check_started(name, proc, code, logs)
                self._take_down(self._fails_with(name), RESTART_DELAY_SECONDS, now)

    def _check_started(self, island: str, proc: _Proc, code: int, logs: Path) -> None:
        """Gives up on an island whose process has failed `FAILURES_BEFORE_TRAINING` times and never began
        training (no start event of the island's): it will not start by being restarted."""
        proc.failures += 1
        if proc.failures < FAILURES_BEFORE_TRAINING:
            return
        events = read_events(self.out / "progress")
        if not any(isinstance(e, StartEvent) and e.source.island == island for e in events):
            raise IslandCannotStart(
                f"{island} exited {proc.failures} times (last with {code}) before it ever trained; see "
                f"{proc.log_path(logs)}"
            )

    def _export_global(self) -> Path:
        """The syncers' global model written to `<out>/model`, as `diloco export` writes it (Hugging Face's
        layout, with its tokenizer)."""
        from diloco.export import assemble, model_files

        folder = self.plan.out / "model"
        targets = [f"127.0.0.1:{port}" for port in self.syncer_ports]
        model = assemble.from_shards(targets, TOKEN, security=self.pki.client)
        if self.plan.built_in:
            model_files.save(folder, model, self.plan.model, self.plan.config, tokenizer=self.plan.tokenizer)
        else:  # a command's model is its own: no preset or tokenizer of the run's describes it
            model_files.save(folder, model, None, self.plan.config)
        return folder

    def _evaluate(self, model_dir: Path) -> float:
        """The held-out loss of an exported model as the trainer measures it, on the windows every worker
        evaluates."""
        from diloco.export import model_files

        p = self.plan
        return model_files.evaluate_export(model_dir, p.data, p.max_data_bytes, p.batch_size, tokenizer=p.tokenizer)
