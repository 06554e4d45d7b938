"""The operator's calls into the job itself: each syncer shard's Status RPC (per-fragment version and tokens,
live islands) and each island's rank-0 trainer metrics (training loss). Short deadlines, no retries: a
shard or trainer that does not answer now is simply reported as unreachable for this pass.

The trainer contract: rank 0 of an island serves Prometheus text on its metrics port (DILOCO_METRICS_PORT)
with the gauges `diloco_worker_loss` (the latest training loss), `diloco_worker_last_sync_timestamp_seconds`,
`diloco_worker_last_refusal_timestamp_seconds`, `diloco_worker_step_seconds` and `diloco_worker_round_steps`
(`diloco.worker.metrics`), which say whether the island trains (`policies.island_training`).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from diloco.operator.job_status import FragmentReport, ShardObservation
from diloco.operator.policies.island_training import TrainerReport
from diloco.transport import handshake, tls
from diloco.transport.auth import bearer_metadata
from diloco.transport.tls import Security, Tls
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.v1 import syncer_pb2_grpc as pb_grpc

LOSS_METRIC = "diloco_worker_loss"
LAST_SYNC_METRIC = "diloco_worker_last_sync_timestamp_seconds"
LAST_REFUSAL_METRIC = "diloco_worker_last_refusal_timestamp_seconds"
STEP_SECONDS_METRIC = "diloco_worker_step_seconds"
ROUND_STEPS_METRIC = "diloco_worker_round_steps"
MAX_PARALLEL = 128
"""Probes in flight at once: a pass waits one timeout for up to this many unreachable islands or shards."""


MAX_ERROR_CHARS = 200
"""Of a failed call's details in the job's conditions: enough to say why, not a shard's whole reply."""


def rpc_error(error: grpc.RpcError) -> str:
    """`CODE: details` of a failed call, as the job's conditions name it."""
    code = error.code() if isinstance(error, grpc.Call) else None
    details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
    return f"{code.name if code else 'UNKNOWN'}: {details[:MAX_ERROR_CHARS]}"


def _shard_error(error: grpc.RpcError, target: str, security: Security, timeout: float) -> str:
    """`rpc_error`, but a refused TLS handshake named with its reason (`handshake`): gRPC says only UNAVAILABLE
    "Socket closed" for it, as for a shard that is down."""
    said = rpc_error(error)
    if not (isinstance(security, Tls) and isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.UNAVAILABLE):
        return said
    finding = handshake.probe(target, security, timeout)
    if finding is None:
        return said
    return f"UNAVAILABLE: {handshake.HandshakeRefused(target, finding.reason, finding.detail)}"


def _status(stub: pb_grpc.SyncerStub, tokens: Sequence[str], timeout: float) -> pb.StatusReply:
    """The shard's Status reply to the first of `tokens` it takes; the last refusal raised."""
    for token in tokens[:-1]:
        try:
            return stub.Status(pb.StatusRequest(), timeout=timeout, metadata=bearer_metadata(token))
        except grpc.RpcError as error:
            if not (isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.UNAUTHENTICATED):
                raise
    return stub.Status(pb.StatusRequest(), timeout=timeout, metadata=bearer_metadata(tokens[-1]))


def shard_status(
    shard: int, ready: bool, target: str, tokens: Sequence[str], security: Security, timeout: float
) -> ShardObservation:
    """One shard's Status reply, or an observation without one when the call fails (a refused handshake
    included: UNAVAILABLE, as for a shard that is down, with its reason). `tokens` are tried in order while the
    shard refuses one (UNAUTHENTICATED): the one the islands present first, which every shard accepts, so that
    a rotation costs no refused call; the reply says which tokens the shard accepts (`accepts`)."""
    if not tokens:
        raise ValueError("a shard is called with at least one token")
    if not ready:
        return ShardObservation(shard=shard, ready=False)
    with tls.channel(target, security) as channel:
        try:
            reply = _status(pb_grpc.SyncerStub(channel), tokens, timeout)
        except grpc.RpcError as error:
            return ShardObservation(shard=shard, ready=True, error=_shard_error(error, target, security, timeout))
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
    return ShardObservation(
        shard=shard,
        ready=True,
        fragments=fragments,
        live_islands=frozenset(reply.live_islands),
        accepts=frozenset(reply.accepted_tokens),
        lineage=reply.lineage,
    )


def shard_statuses(
    targets: Sequence[str], ready: Sequence[bool], tokens: Sequence[str], security: Security, timeout: float
) -> list[ShardObservation]:
    """Every shard's status, polled in parallel so a pass costs one timeout however many shards there are."""
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL, len(targets)))) as pool:
        futures = [
            pool.submit(shard_status, shard, ready[shard], target, tokens, security, timeout)
            for shard, target in enumerate(targets)
        ]
        return [f.result() for f in futures]


def _samples(families: list[Metric], name: str) -> list[float]:
    return [float(s.value) for family in families for s in family.samples if s.name == name]


def trainer_report(url: str, timeout: float) -> TrainerReport | None:
    """What a rank-0 trainer serves at its Prometheus endpoint (`TrainerReport`), or None when it does not
    answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            families = list(text_string_to_metric_families(response.read().decode()))
    except (OSError, ValueError):
        return None

    def first(name: str) -> float | None:
        found = _samples(families, name)
        return found[0] if found else None

    round_steps = first(ROUND_STEPS_METRIC)
    return TrainerReport(
        loss=first(LOSS_METRIC),
        last_sync_unix=first(LAST_SYNC_METRIC) or 0.0,
        last_refusal_unix=first(LAST_REFUSAL_METRIC) or 0.0,
        step_seconds=first(STEP_SECONDS_METRIC),
        round_steps=int(round_steps) if round_steps else None,
    )


def trainer_reports(urls: Mapping[str, str], timeout: float) -> dict[str, TrainerReport]:
    """Each island's rank-0 trainer's report, from its metrics URL; islands that do not answer are left out."""
    if not urls:
        return {}
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(urls))) as pool:
        results = dict(zip(urls, pool.map(lambda url: trainer_report(url, timeout), urls.values())))
    return {island: report for island, report in results.items() if report is not None}
