"""Helpers every test tier shares (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest

from diloco.local.netns import WanUnavailable, check_available
from diloco.transport.tls import Pki, throwaway_pki

TEST_PKI: Pki = throwaway_pki()
"""The tests' CA, a syncer certificate for loopback and a client certificate: every shard in the tests serves
TLS with `TEST_PKI.server` and every client trusts it with `TEST_PKI.client`, as on a cluster."""


def wait_until(condition: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> object:
    """Polls `condition` until it returns something truthy (returned), failing the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s: {getattr(condition, '__name__', condition)}")
        time.sleep(interval)


def tls_env(folder: Path, pki: Pki = TEST_PKI, *, server: bool) -> dict[str, str]:
    """The DILOCO_TLS_* variables of a syncer (`server`) or an island process, with `pki`'s PEM files
    written under `folder` as the operator's mounted Secrets would be."""
    folder.mkdir(parents=True, exist_ok=True)
    issued = pki.server_cert if server else pki.client_cert
    for name, pem in (("ca.crt", pki.ca.cert), ("tls.crt", issued.cert), ("tls.key", issued.key)):
        (folder / name).write_bytes(pem)
    env = {"DILOCO_TLS_CA_FILE": str(folder / "ca.crt")}
    if server or pki.mutual:
        env |= {"DILOCO_TLS_CERT_FILE": str(folder / "tls.crt"), "DILOCO_TLS_KEY_FILE": str(folder / "tls.key")}
    if pki.mutual:
        env["DILOCO_TLS_MUTUAL"] = "1"
    return env


def require_network_namespaces() -> None:
    """Skips (never fails) the calling test where network namespaces and tc cannot be made (not root, say)."""
    try:
        check_available()
    except WanUnavailable as error:
        pytest.skip(f"no network namespaces here: {error}")


def missing_binary(message: str) -> NoReturn:
    """A developer without the cluster binaries skips; CI, which builds them first (.ci/run), fails, so a
    tier can never vanish silently."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def largest_status() -> dict[str, object]:
    """The largest status a job can have within the CRD's bounds, as the operator writes it (camelCase JSON):
    MAX_ISLANDS islands of ISLAND_NAME_MAX characters re-forming, MAX_JOB_PODS pod records with the longest
    node names and largest counts, as many remote islands of the longest island ids, MAX_SHARDS endpoints of
    the longest form, MAX_FRAGMENTS fragments and every condition with the longest message; each island with the
    longest reason and message it may give, and every count carried."""
    from diloco.api.conditions import ISLAND_REASONS, ConditionType
    from diloco.api.job import (
        ENDPOINT_MAX,
        ISLAND_NAME_MAX,
        MAX_CONDITION_MESSAGE,
        MAX_ISLAND_MESSAGE,
        MAX_ISLANDS,
        MAX_JOB_PODS,
        MAX_SHARDS,
        Condition,
        DiLoCoJobStatus,
        FragmentProgress,
        IslandStatus,
        Phase,
        PodRecord,
        Reform,
        RemoteIsland,
        ShardLineage,
        SyncerStatus,
    )
    from diloco.core.config import MAX_FRAGMENTS
    from diloco.core.island_id import ISLAND_ID_MAX_CHARS

    t = datetime.datetime(2026, 11, 24, 23, 59, 59, 999999, tzinfo=datetime.UTC)
    big = 2**63 - 1
    pods_per_island = MAX_JOB_PODS // MAX_ISLANDS
    islands = [
        IslandStatus(
            name=f"i{n:0{ISLAND_NAME_MAX - 1}d}",
            desired=MAX_JOB_PODS,
            ready=MAX_JOB_PODS,
            restarts=big,
            preemptions=big,
            last_sync=t,
            loss=1.2345678901234567,
            reform=Reform(reason="Preemption", since=t, hold_until=t),
            reason=max(ISLAND_REASONS, key=len),
            message="m" * MAX_ISLAND_MESSAGE,
            pods=[
                PodRecord(
                    ordinal=MAX_JOB_PODS - 1,
                    uid="0" * 36,
                    restarts=big,
                    node="n" * 253,
                    disrupted=True,
                    failed=True,
                    owner="0" * 36,
                )
                for _ in range(pods_per_island)
            ],
        )
        for n in range(MAX_ISLANDS)
    ]
    status = DiLoCoJobStatus(
        phase=Phase.DEGRADED,
        observed_generation=big,
        conditions=[
            Condition(
                type=kind,
                status="True",
                reason="RestartBudgetExhausted",
                message="m" * MAX_CONDITION_MESSAGE,
                last_transition_time=t,
                observed_generation=big,
            )
            for kind in ConditionType.ALL
        ],
        islands_ready=f"{MAX_ISLANDS}/{MAX_ISLANDS}",
        islands=islands,
        remote_islands=[
            RemoteIsland(name=f"r{n:0{ISLAND_ID_MAX_CHARS - 1}d}", last_sync=t) for n in range(MAX_ISLANDS)
        ],
        syncer=SyncerStatus(
            shards=MAX_SHARDS,
            ready=MAX_SHARDS,
            reachable=MAX_SHARDS,
            last_state_loss=t,
            lineages=[
                ShardLineage(shard=63, lineage="f" * 16, carried_outer_steps=big, carried_tokens=big)
                for _ in range(MAX_SHARDS)
            ],
            endpoints=["e" * ENDPOINT_MAX] * MAX_SHARDS,
        ),
        fragments=[
            FragmentProgress(fragment=MAX_FRAGMENTS - 1, shard=63, version=big, tokens=big, last_merge=t)
            for _ in range(MAX_FRAGMENTS)
        ],
        outer_step=big,
        tokens=big,
        carried_outer_steps=big,
        carried_tokens=big,
        loss=1.2345678901234567,
        goodput=0.9876543210987654,
        ready_pod_seconds=1.2345678901234567e15,
        desired_pod_seconds=1.2345678901234567e15,
        last_observed=t,
        start_time=t,
        completion_time=t,
    )
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)
