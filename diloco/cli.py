"""`diloco`: the command line. Each subcommand lives in the module that owns its concern and registers
itself here through a `register(subparsers)` function, so this file stays a table of contents."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = (
    "diloco.local.run",
    "diloco.export.command",
    "diloco.worker.tokenize_shards",
    "diloco.shard_status",
    "diloco.sim.simulate",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco", description="Decoupled DiLoCo training, on one machine or on Kubernetes."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
