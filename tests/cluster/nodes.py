"""Fake nodes as clouds label and taint them, rendered as Node manifests for KWOK to keep alive. Pure: no I/O.

The default pools are a GKE-shaped cluster (the examples in deploy/examples assume GKE labels): on-demand
CPU nodes, spot CPU nodes, spot H100 and on-demand A100 GPU nodes. Spot nodes carry the label and the
NoSchedule taint GKE puts on them (`cloud.google.com/gke-spot`), GPU nodes the labels of GKE and of NVIDIA's
GPU feature discovery, the `nvidia.com/gpu` extended resource and the `nvidia.com/gpu=present:NoSchedule`
taint (pods that request GPUs get the toleration from the ExtendedResourceToleration admission plugin).

Every node gets its own pod CIDR out of POD_NETWORK; KWOK hands out pod IPs from it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
"""KWOK is started to manage only nodes annotated so (`--manage-nodes-with-annotation-selector`)."""
POD_NETWORK = ipaddress.ip_network("10.244.0.0/16")
NODE_PREFIX = 24
"""Each node's pod CIDR is a /24 of POD_NETWORK."""
SPOT_TAINT = {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
POOL_LABEL = "cloud.google.com/gke-nodepool"


@dataclass(frozen=True)
class Pool:
    """A node pool: `count` identical nodes named `<name>-<index>`."""

    name: str
    count: int
    machine_type: str
    capacity: Mapping[str, str]
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: Sequence[Mapping[str, str]] = ()
    zone: str = "us-central1-a"


def _gpu_labels(accelerator: str, product: str, count: int) -> dict[str, str]:
    return {
        "cloud.google.com/gke-accelerator": accelerator,
        "cloud.google.com/gke-accelerator-count": str(count),
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.count": str(count),
    }


SPOT_LABELS = {"cloud.google.com/gke-spot": "true", "cloud.google.com/gke-provisioning": "spot"}

DEFAULT_POOLS: tuple[Pool, ...] = (
    Pool("cpu", 2, "n2-standard-32", {"cpu": "32", "memory": "128Gi", "pods": "110"}),
    Pool(
        "cpu-spot",
        2,
        "n2-standard-16",
        {"cpu": "16", "memory": "64Gi", "pods": "110"},
        labels=SPOT_LABELS,
        taints=(SPOT_TAINT,),
        zone="us-central1-b",
    ),
    Pool(
        "h100-spot",
        2,
        "a3-highgpu-8g",
        {"cpu": "208", "memory": "1872Gi", "pods": "110", "nvidia.com/gpu": "8"},
        labels={**SPOT_LABELS, **_gpu_labels("nvidia-h100-80gb", "NVIDIA-H100-80GB-HBM3", 8)},
        taints=(SPOT_TAINT, GPU_TAINT),
        zone="us-central1-c",
    ),
    Pool(
        "a100",
        4,
        "a2-ultragpu-8g",
        {"cpu": "96", "memory": "1360Gi", "pods": "110", "nvidia.com/gpu": "8"},
        labels=_gpu_labels("nvidia-a100-80gb", "NVIDIA-A100-SXM4-80GB", 8),
        taints=(GPU_TAINT,),
    ),
)


def pod_cidr(index: int) -> str:
    """The pod CIDR of the `index`-th node created in the cluster."""
    return str(list(POD_NETWORK.subnets(new_prefix=NODE_PREFIX))[index])


def cidr_index(cidr: str) -> int:
    """The index `pod_cidr` made `cidr` for: its place among POD_NETWORK's node CIDRs."""
    first = ipaddress.ip_network(cidr).network_address
    return (int(first) - int(POD_NETWORK.network_address)) >> (POD_NETWORK.max_prefixlen - NODE_PREFIX)


def pool_labels(pool: Pool) -> dict[str, str]:
    """The labels a cloud puts on every node of `pool` (a kubelet's own ones aside: hostname, OS, arch)."""
    return {
        "node.kubernetes.io/instance-type": pool.machine_type,
        "topology.kubernetes.io/region": pool.zone.rsplit("-", 1)[0],
        "topology.kubernetes.io/zone": pool.zone,
        POOL_LABEL: pool.name,
        **pool.labels,
    }


def node_manifest(pool: Pool, index: int, cidr: str) -> dict[str, Any]:
    """The Node `<pool>-<index>`, status included: KWOK keeps it Ready and heartbeating, never changes it."""
    name = f"{pool.name}-{index}"
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        **pool_labels(pool),
        "type": "kwok",
    }
    capacity = dict(pool.capacity)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr], "taints": [dict(t) for t in pool.taints]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }
