from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
from apiserver_harness import ControlPlane, binaries_dir, start

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver with the project's CRDs installed. A developer without the binaries skips these
    tests; CI, which builds them first (.ci/run), fails instead, so the cluster tier can never vanish."""
    bin_dir = binaries_dir()
    if bin_dir is None:
        message = "no cached kube-apiserver/etcd/kubectl (run tests/cluster/build.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    plane = start(bin_dir, tmp_path_factory.mktemp("control-plane"))
    try:
        plane.kubectl("apply", "--server-side", "-f", str(ROOT / "deploy" / "crd.yaml"),
                      "-f", str(ROOT / "deploy" / "peering-crds.yaml"))
        plane.kubectl("wait", "--for", "condition=established", "--timeout", "60s",
                      "crd/dilocojobs.diloco.dev", "crd/clusterkopfpeerings.kopf.dev")
        yield plane
    finally:
        plane.stop()
