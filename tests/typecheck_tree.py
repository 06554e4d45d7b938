"""Lays out the package as it is installed for mypy, which reads folders: `diloco/` with the top-level folders
that pyproject's package-dir maps into it (`syncer/`, `worker/`, `operator/`), as a tree of symlinks under
build/typecheck (pyproject's `mypy_path`). The folders stay where they are; `make lint` runs this first.

    python tests/typecheck_tree.py
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"


def main() -> None:
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(TREE, ignore_errors=True)
    for package, folder in sorted(mapped.items()):
        link = TREE.joinpath(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        if package == "diloco":  # the package's own folder: each entry, so that mapped ones can sit beside them
            link.mkdir()
            for entry in sorted((ROOT / folder).iterdir()):
                if entry.name != "__pycache__":
                    (link / entry.name).symlink_to(entry)
        else:
            link.symlink_to(ROOT / folder, target_is_directory=True)


if __name__ == "__main__":
    main()
