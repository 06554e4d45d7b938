"""Regenerates the Python stubs for protos/ into the transport layer (diloco/transport/v1/).

The stubs are committed so an install needs no protoc; tests/transport/test_protos.py fails when they are stale.
Usage: python protos/generate.py [--check]
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTOS = Path(__file__).resolve().parent
REPO = PROTOS.parent
VIRTUAL = Path("diloco/transport")
GENERATED = ("syncer_pb2.py", "syncer_pb2.pyi", "syncer_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc on every .proto under protos/, writing the package tree below out_dir."""
    # protos/diloco/v1/x.proto is compiled as diloco/transport/v1/x.proto (protoc's virtual include path), so the
    # stubs land in, and import each other from, the transport layer while the proto package stays diloco.v1.
    sources = sorted(str(VIRTUAL / p.relative_to(PROTOS / "diloco")) for p in PROTOS.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{VIRTUAL}={PROTOS / 'diloco'}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            *sources,
        ]
    )
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    return [out_dir / VIRTUAL / "v1" / name for name in GENERATED]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for fresh in generate(Path(tmp)):
            committed = REPO / VIRTUAL / "v1" / fresh.name
            if args.check:
                if not committed.exists() or not filecmp.cmp(fresh, committed, shallow=False):
                    stale.append(committed.relative_to(REPO))
            else:
                shutil.copyfile(fresh, committed)
        if stale:
            print("stale generated stubs (run: python protos/generate.py):", *stale, sep="\n  ")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
