"""The committed gRPC stubs are what protos/generate.py makes from protos/: never stale, never hand-edited."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh():
    result = subprocess.run(
        [sys.executable, str(REPO / "protos" / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
