from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from cluster.cluster import Cluster, MissingBinaries, start_cluster
from cluster.controlplane import ControlPlane, binaries_dir, start_control_plane
from support import missing_binary, wait_until

ROOT = Path(__file__).resolve().parents[2]


def install_crds(plane: ControlPlane) -> None:
    plane.kubectl(
        "apply",
        "--server-side",
        "-f",
        str(ROOT / "deploy" / "crd.yaml"),
        "-f",
        str(ROOT / "deploy" / "peering-crds.yaml"),
    )
    # `kubectl wait` refuses a CRD that has no conditions yet, as the API server writes them only once it has
    # compiled the schema's rules: asked again until they are there.
    waited = partial(
        plane.kubectl,
        "wait",
        "--for",
        "condition=established",
        "--timeout",
        "60s",
        "crd/dilocojobs.diloco.dev",
        "crd/clusterkopfpeerings.kopf.dev",
        check=False,
    )
    wait_until(lambda: waited().returncode == 0, timeout=60.0, interval=0.5)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver with the project's CRDs installed."""
    bin_dir = binaries_dir()
    if bin_dir is None:
        missing_binary("no cached kube-apiserver/etcd/kubectl (run tests/cluster/build.sh)")
    plane = start_control_plane(bin_dir, tmp_path_factory.mktemp("control-plane"))
    try:
        install_crds(plane)
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def operator_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A whole cluster (controllers, scheduler, KWOK's default node pools) with the project's CRDs. Not the
    shared `kwok_cluster`: the e2e suite installs the chart's operator there, which would act on these
    tests' jobs too and take part in their peering."""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("operator-cluster"))
    except MissingBinaries as error:
        missing_binary(str(error))
    try:
        install_crds(cluster)
        yield cluster
    finally:
        cluster.stop()
