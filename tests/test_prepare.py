"""tests/prepare.sh, which `make test` (and so CI) runs first: what a tier needs is prepared, or the tier says
in one line why it cannot run here."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_without_go_and_cached_binaries_the_cluster_tiers_say_why_and_the_run_goes_on(tmp_path):
    system = os.pathsep.join(["/usr/sbin", "/usr/bin", "/sbin", "/bin"])  # the system's tools, not Go's
    if shutil.which("go", path=system):
        pytest.skip("Go is on the system path here: prepare.sh would build the binaries")
    env = {**os.environ, "PATH": system, "DILOCO_CLUSTER_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(["bash", "tests/prepare.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == "", "no binaries' folder: the tiers skip, pytest still runs"
    said = [line for line in result.stderr.splitlines() if line.startswith("[test] cluster and e2e")]
    needs_go = "[test] cluster and e2e tiers cannot run: tests/cluster/build.sh needs Go (https://go.dev/dl, on PATH)"
    assert said == [needs_go]
