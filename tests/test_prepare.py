"""tests/prepare.sh, which `make test` (and so CI) runs first: what a tier needs is prepared, or the tier says
in one line why it cannot run here."""

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


GO_PROGRAMS = ("go", "gofmt")


def without_go(folder: Path) -> str:
    """A PATH of one folder holding every program of the system's own folders except Go's, as on a machine
    without Go."""
    folder.mkdir()
    for system in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        for program in Path(system).iterdir() if Path(system).is_dir() else ():
            link = folder / program.name
            if program.name not in GO_PROGRAMS and not link.exists() and os.access(program, os.X_OK):
                link.symlink_to(program)
    return str(folder)


def test_without_go_and_cached_binaries_the_cluster_tiers_say_why_and_the_run_goes_on(tmp_path):
    path = without_go(tmp_path / "bin")
    assert shutil.which("go", path=path) is None
    env = {**os.environ, "PATH": path, "DILOCO_CLUSTER_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(["bash", "tests/prepare.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == "", "no binaries' folder: the tiers skip, pytest still runs"
    said = [line for line in result.stderr.splitlines() if line.startswith("[test] cluster and e2e")]
    needs_go = "[test] cluster and e2e tiers cannot run: tests/cluster/build.sh needs Go (https://go.dev/dl, on PATH)"
    assert said == [needs_go]
