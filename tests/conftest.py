"""Fixtures every tier may use. `kwok_cluster`: one real cluster (tests/cluster/cluster.py) per session,
started on first use, so tiers that do not ask for it never pay for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster.cluster import Cluster, MissingBinaries, start_cluster
from support import missing_binary


@pytest.fixture(scope="session")
def kwok_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK with the default node pools."""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("cluster"))
    except MissingBinaries as error:
        missing_binary(str(error))
    try:
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.leftovers(), f"cluster processes left running: {cluster.leftovers()}"
