"""The environment of an island's process, named once: what the operator renders into an island's pods
(`diloco.operator.children`), what `diloco run` gives each island's process on one machine
(`diloco.local.launcher`), and what `Learner.from_env` and `diloco-worker` read. Both starters build it from
`IslandPod`, so a loop that trains under `diloco run` finds on a cluster the same variables, meaning the same.

Three kinds of variable beyond those of `IslandPod`: each pod's own (`NODE_RANK`, `RANK`, `DILOCO_POD_NAME`:
the kubelet fills them from the pod's ordinal and name, `diloco run` from the island), the built-in
trainer's settings (none for a command of one's own), and a local run's instruments (`RUN_INSTRUMENTS`),
which no pod gets: where a loop writes its progress events, the baseline it runs as, emulated slower hardware.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

JOB = "DILOCO_JOB"
ISLAND = "DILOCO_ISLAND"
SYNCERS = "DILOCO_SYNCERS"
CONFIG_FILE = "DILOCO_CONFIG_FILE"
TOKEN_FILE = "DILOCO_TOKEN_FILE"
METRICS_PORT = "DILOCO_METRICS_PORT"
ACCELERATORS_PER_POD = "DILOCO_ACCELERATORS_PER_POD"
TERMINATION_GRACE_SECONDS = "DILOCO_TERMINATION_GRACE_SECONDS"
CHECKPOINT_DIR = "DILOCO_CHECKPOINT_DIR"
CHECKPOINT_EVERY = "DILOCO_CHECKPOINT_EVERY"
THREADS = "OMP_NUM_THREADS"
WORLD_SIZE = "WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"

NODE_RANK = "NODE_RANK"
RANK = "RANK"
POD_NAME = "DILOCO_POD_NAME"

TLS_CA_FILE = "DILOCO_TLS_CA_FILE"
TLS_CERT_FILE = "DILOCO_TLS_CERT_FILE"
TLS_KEY_FILE = "DILOCO_TLS_KEY_FILE"
TLS_MUTUAL = "DILOCO_TLS_MUTUAL"
INSECURE_PLAINTEXT = "DILOCO_INSECURE_PLAINTEXT"

MODEL = "DILOCO_MODEL"
INIT_FROM = "DILOCO_INIT_FROM"
TOKENIZER = "DILOCO_TOKENIZER"
DATA = "DILOCO_DATA"
DATA_SHARD = "DILOCO_DATA_SHARD"
DATA_SHARDS = "DILOCO_DATA_SHARDS"
TEXT_FIELD = "DILOCO_TEXT_FIELD"
PRECISION = "DILOCO_PRECISION"
ACTIVATION_CHECKPOINTING = "DILOCO_ACTIVATION_CHECKPOINTING"

METRICS_HOST = "DILOCO_METRICS_HOST"
PROGRESS_FILE = "DILOCO_PROGRESS_FILE"
MODE = "DILOCO_MODE"
SLOWDOWN = "DILOCO_SLOWDOWN"
JITTER = "DILOCO_JITTER"
REFERENCE_STEP_SECONDS = "DILOCO_REFERENCE_STEP_SECONDS"
RUN_INSTRUMENTS = frozenset({PROGRESS_FILE, MODE, SLOWDOWN, JITTER, REFERENCE_STEP_SECONDS})
"""What a local run adds for its own accounting and emulation (`diloco.worker.loop_instruments`); a progress
file's `{rank}` becomes the rank in the island."""
LOCAL_RUN = RUN_INSTRUMENTS | {METRICS_HOST}
"""Every variable a local run gives an island's process beyond a pod's: its instruments, and the metrics
served on loopback alone."""

DEFAULT_GRACE_SECONDS = 30
"""Seconds an island's process has from SIGTERM to SIGKILL unless its pod template says otherwise."""


@dataclass(frozen=True)
class IslandPod:
    """What every process of an island is told, as values: its job and island, the syncer shards (in index
    order), the files holding the training config and the job's token, its metrics port (local rank r serves
    on it + r), its pod's accelerators (one process each), the seconds it has after SIGTERM, its island's
    checkpoint folder, and torch.distributed's rendezvous for the island's world of `world_size` ranks."""

    job: str
    island: str
    syncers: Sequence[str]
    config_file: str
    token_file: str
    metrics_port: int
    accelerators_per_pod: int
    grace_seconds: int
    checkpoint_dir: str
    world_size: int
    master_addr: str
    master_port: int
    checkpoint_every: int | None = None  # None: the learner's default
    threads: int | None = None  # math-library threads per rank; None: the library's own choice
    trainer: Mapping[str, str] = field(default_factory=dict)  # the built-in trainer's settings (MODEL, DATA, ...)

    def variables(self) -> dict[str, str]:
        """Every variable with a literal value, in the order the operator renders them."""
        values = {
            CONFIG_FILE: self.config_file,
            TOKEN_FILE: self.token_file,
            JOB: self.job,
            ISLAND: self.island,
            SYNCERS: ",".join(self.syncers),
            METRICS_PORT: str(self.metrics_port),
            ACCELERATORS_PER_POD: str(self.accelerators_per_pod),
            TERMINATION_GRACE_SECONDS: str(self.grace_seconds),
            CHECKPOINT_DIR: self.checkpoint_dir,
        }
        if self.checkpoint_every is not None:
            values[CHECKPOINT_EVERY] = str(self.checkpoint_every)
        values |= self.trainer
        if self.threads is not None:
            values[THREADS] = str(self.threads)
        return values | {
            WORLD_SIZE: str(self.world_size),
            MASTER_ADDR: self.master_addr,
            MASTER_PORT: str(self.master_port),
        }

    @property
    def ordinal_variables(self) -> tuple[str, ...]:
        """The variables that hold the pod's ordinal: NODE_RANK, and RANK too when the pod runs one process
        (a pod of N ranks has no one rank: its launcher numbers them)."""
        return (NODE_RANK, RANK) if self.accelerators_per_pod <= 1 else (NODE_RANK,)

    def own(self, ordinal: int, pod_name: str) -> dict[str, str]:
        """Each pod's own variables, for a starter that knows them as values (the operator has the kubelet
        fill them from the pod)."""
        return {name: str(ordinal) for name in self.ordinal_variables} | {POD_NAME: pod_name}


def tls_variables(
    *,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    mutual: bool = False,
    insecure_plaintext: bool = False,
) -> dict[str, str]:
    """How a process secures its channels (`diloco.settings.load_security` reads them): in plaintext when
    asked by name, else the CA that verifies the peer and, for a shard or mutual TLS, its own certificate."""
    if insecure_plaintext:
        return {INSECURE_PLAINTEXT: "1"}
    values = {TLS_CA_FILE: ca_file} if ca_file else {}
    if cert_file and key_file:
        values |= {TLS_CERT_FILE: cert_file, TLS_KEY_FILE: key_file}
    if mutual:
        values[TLS_MUTUAL] = "1"
    return values
