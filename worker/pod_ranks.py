"""Where each process of a pod sits in its island's torch.distributed world, and which device it drives.

A pod asks for N accelerators (`acceleratorsPerPod`, DILOCO_ACCELERATORS_PER_POD) and runs one training
process per accelerator, its local ranks, as torchrun's local ranks are. The island's world is every local
rank of every pod: pod `node_rank` (the StatefulSet ordinal) of `pods` holds the global ranks
node_rank * N ... node_rank * N + N - 1, and the world has pods * N ranks. With N <= 1 the pod runs one
process, whose rank is the ordinal. Pure: the caller reads the environment and the visible devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from diloco import pod_env

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class PodShape:
    """One pod of an island: `ranks_per_pod` local ranks, on the pod at `node_rank` of `pods`."""

    pods: int
    ranks_per_pod: int
    node_rank: int

    def __post_init__(self) -> None:
        if self.pods < 1 or self.ranks_per_pod < 1:
            raise ValueError(f"an island has at least one pod of one rank, got {self.pods} x {self.ranks_per_pod}")
        if not 0 <= self.node_rank < self.pods:
            raise ValueError(f"pod index {self.node_rank} is outside the island's {self.pods} pods")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PodShape:
        """From what the operator injects: DILOCO_ACCELERATORS_PER_POD (N; 0 or unset: one process),
        WORLD_SIZE (every rank of the island: pods x N) and NODE_RANK (the pod's ordinal)."""
        ranks = max(1, int(env.get(pod_env.ACCELERATORS_PER_POD) or 1))
        world = int(env.get(pod_env.WORLD_SIZE) or ranks)
        if world % ranks:
            raise ValueError(f"{pod_env.WORLD_SIZE}={world} is not a whole number of pods of {ranks} ranks")
        return cls(pods=world // ranks, ranks_per_pod=ranks, node_rank=int(env.get(pod_env.NODE_RANK) or 0))

    @property
    def world_size(self) -> int:
        return self.pods * self.ranks_per_pod

    @property
    def launches_ranks(self) -> bool:
        """Whether the pod's process starts and supervises local ranks rather than training itself."""
        return self.ranks_per_pod > 1

    def global_rank(self, local_rank: int) -> int:
        if not 0 <= local_rank < self.ranks_per_pod:
            raise ValueError(f"local rank {local_rank} is outside the pod's {self.ranks_per_pod} ranks")
        return self.node_rank * self.ranks_per_pod + local_rank

    def rendezvous_host(self, master_addr: str) -> str:
        """Where the ranks meet: loopback when the island is this one pod (every peer is here, and the pod's
        own address need not be on any interface), else the island's first pod."""
        return LOOPBACK if self.pods == 1 else master_addr


def local_position(env: Mapping[str, str]) -> tuple[int, int]:
    """(local rank, local world size) as a launcher sets them (LOCAL_RANK, LOCAL_WORLD_SIZE); (0, 1) for a
    process that no launcher started."""
    return int(env.get("LOCAL_RANK") or 0), int(env.get("LOCAL_WORLD_SIZE") or 1)


def metrics_port(base: int, local_rank: int) -> int:
    """Local rank r of a pod serves its metrics on `base` + r (0: none), so a pod's ranks never share a port;
    local rank 0, on `base` itself, answers the pod's readiness probe."""
    return base + local_rank if base else 0


@dataclass(frozen=True)
class Placement:
    """The device a rank trains on and the torch.distributed backend of its island."""

    device: str
    backend: str


def place(requested: str, local_rank: int, local_world_size: int, cuda_devices: int) -> Placement:
    """Local rank r on `cuda` drives cuda:r (a device with an index is taken as given, by every local rank).
    nccl refuses two ranks on one device: when the pod runs more ranks than it sees GPUs, they share them
    round-robin and the island uses gloo instead, as it does on CPU."""
    if not requested.startswith("cuda"):
        return Placement(requested, "gloo")
    if cuda_devices < 1:
        raise ValueError(f"device {requested!r} asked for, but no CUDA device is visible")
    if ":" in requested:
        return Placement(requested, "nccl" if local_world_size == 1 else "gloo")
    own_device = local_world_size <= cuda_devices
    return Placement(f"cuda:{local_rank % cuda_devices}", "nccl" if own_device else "gloo")
