"""The operator's calls into the job itself: each syncer shard's Status RPC (per-fragment version and tokens,
live islands) and each island's rank-0 trainer metrics (training loss). Short deadlines, no retries: a
shard or trainer that does not answer now is simply reported as unreachable for this pass.

The trainer contract: rank 0 of an island serves Prometheus text on its metrics port (DILOCO_METRICS_PORT)
with a gauge `diloco_worker_loss`, the latest training loss.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client.parser import text_string_to_metric_families

from diloco.operator.job_status import FragmentReport, ShardObservation
from diloco.transport import tls
from diloco.transport.auth import bearer_metadata
from diloco.transport.tls import Security
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.v1 import syncer_pb2_grpc as pb_grpc

LOSS_METRIC = "diloco_worker_loss"
MAX_PARALLEL = 128
"""Probes in flight at once: a pass waits one timeout for up to this many unreachable islands or shards."""


MAX_ERROR_CHARS = 200
"""Of a failed call's details in the job's conditions: enough to say why, not a shard's whole reply."""


def rpc_error(error: grpc.RpcError) -> str:
    """`CODE: details` of a failed call, as the job's conditions name it."""
    code = error.code() if isinstance(error, grpc.Call) else None
    details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
    return f"{code.name if code else 'UNKNOWN'}: {details[:MAX_ERROR_CHARS]}"


def shard_status(
    shard: int, ready: bool, target: str, token: str, security: Security, timeout: float
) -> ShardObservation:
    """One shard's Status reply, or an observation without one when the call fails (a refused handshake
    included: UNAVAILABLE, as for a shard that is down)."""
    if not ready:
        return ShardObservation(shard=shard, ready=False)
    with tls.channel(target, security) as channel:
        try:
            reply = pb_grpc.SyncerStub(channel).Status(
                pb.StatusRequest(), timeout=timeout, metadata=bearer_metadata(token)
            )
        except grpc.RpcError as error:
            return ShardObservation(shard=shard, ready=True, error=rpc_error(error))
    fragments = tuple(
        FragmentReport(
            fragment=f.fragment_id,
            version=f.version.version,
            tokens=f.tokens_merged,
            last_merge_unix=f.last_merge_unix,
        )
        for f in reply.fragments
        if f.seeded
    )
    return ShardObservation(shard=shard, ready=True, fragments=fragments, live_islands=frozenset(reply.live_islands))


def shard_statuses(
    targets: Sequence[str], ready: Sequence[bool], token: str, security: Security, timeout: float
) -> list[ShardObservation]:
    """Every shard's status, polled in parallel so a pass costs one timeout however many shards there are."""
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL, len(targets)))) as pool:
        futures = [
            pool.submit(shard_status, shard, ready[shard], target, token, security, timeout)
            for shard, target in enumerate(targets)
        ]
        return [f.result() for f in futures]


def trainer_loss(url: str, timeout: float) -> float | None:
    """The `diloco_worker_loss` gauge at a Prometheus endpoint, or None when absent or unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            families = list(text_string_to_metric_families(response.read().decode()))
    except (OSError, ValueError):
        return None
    samples = [s.value for family in families if family.name == LOSS_METRIC for s in family.samples]
    return float(samples[0]) if samples else None


def trainer_losses(urls: Mapping[str, str], timeout: float) -> dict[str, float]:
    """Loss per island, from its rank-0 pod's metrics URL; islands that do not answer are left out."""
    if not urls:
        return {}
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(urls))) as pool:
        results = dict(zip(urls, pool.map(lambda url: trainer_loss(url, timeout), urls.values())))
    return {island: loss for island, loss in results.items() if loss is not None}
