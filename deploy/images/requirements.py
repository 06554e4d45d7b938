"""Prints the requirements an image installs, read from pyproject.toml, so that each image runs exactly the
versions the tests ran. The Dockerfiles run it inside the build; wheels.sh runs it to download them.

    python requirements.py {operator|trainer|build} [PYPROJECT]

operator: only what the operator imports (no torch, numpy or matplotlib: a small image that starts fast);
trainer: every runtime dependency; build: what building the diloco wheel itself needs.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

OPERATOR = (
    "kopf",
    "kubernetes",
    "pydantic",
    "grpcio",
    "protobuf",
    "prometheus-client",
    "python-json-logger",
    "pyyaml",
    "cryptography",
)
IMAGES = ("operator", "trainer", "build")


def name_of(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement (`PyYAML==6.0` -> `pyyaml`)."""
    return re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


def requirements(pyproject: Mapping[str, Any], image: str) -> list[str]:
    """The requirement lines for `image`; refuses an unpinned runtime dependency or an operator one missing."""
    if image == "build":
        return list(pyproject["build-system"]["requires"])
    dependencies = list(pyproject["project"]["dependencies"])
    unpinned = [r for r in dependencies if "==" not in r]
    if unpinned:
        raise ValueError(f"pyproject.toml must pin every runtime dependency exactly (==): {', '.join(unpinned)}")
    if image == "trainer":
        return dependencies
    if image == "operator":
        by_name = {name_of(r): r for r in dependencies}
        missing = [name for name in OPERATOR if name not in by_name]
        if missing:
            raise ValueError(f"the operator image needs {', '.join(missing)}, which pyproject.toml does not pin")
        return [by_name[name] for name in OPERATOR]
    raise ValueError(f"unknown image {image!r}: one of {', '.join(IMAGES)}")


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] not in IMAGES:
        print(__doc__, file=sys.stderr)
        return 2
    pyproject = tomllib.loads(Path(argv[1] if len(argv) == 2 else "pyproject.toml").read_text())
    try:
        print("\n".join(requirements(pyproject, argv[0])))
    except ValueError as error:
        print(f"requirements.py: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
