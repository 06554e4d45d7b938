"""Prints the label that names the sources an image is built from, `dev.diloco.source=DIGEST`: a digest of the
image's Dockerfile and every file of the build context that .dockerignore admits, wheels/ aside (build.sh
fills it from pyproject.toml's pins, which the digest covers). build.sh labels each image with it, so that
whoever runs an image can tell whether it was built from the checkout at hand.

    python context.py {operator|trainer} [ROOT]
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import sys
from pathlib import Path

LABEL = "dev.diloco.source"
"""The image label that holds the digest."""
IMAGES = ("operator", "trainer")
NOT_SOURCES = ("wheels",)
"""Context folders that are not the image's sources: the dependencies they hold come from pyproject.toml."""


def ignore_rules(root: Path) -> list[str]:
    """The rules of `root`/.dockerignore, in order."""
    lines = (root / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def admitted(path: str, rules: list[str]) -> bool:
    """Whether .dockerignore `rules` send `path` (relative, with /) to the builder (the last matching rule
    wins)."""
    keep = True
    for rule in rules:
        pattern = rule.removeprefix("!").rstrip("/")
        if pattern == "**" or fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            keep = rule.startswith("!")
    return keep


def context_files(root: Path) -> list[str]:
    """The files of the build context rooted at `root`, relative and sorted, wheels/ aside: walked from each
    path that a `!` rule brings back, skipping what a later rule leaves out."""
    rules = ignore_rules(root)
    starts = {rule.removeprefix("!").rstrip("/") for rule in rules if rule.startswith("!")}
    found: set[str] = set()
    for start in sorted(starts - set(NOT_SOURCES)):
        if (root / start).is_file():
            found.add(start)
        for directory, subdirectories, files in os.walk(root / start):
            relative = Path(directory).relative_to(root).as_posix()
            subdirectories[:] = [d for d in subdirectories if admitted(f"{relative}/{d}", rules)]
            found.update(f"{relative}/{f}" for f in files if admitted(f"{relative}/{f}", rules))
    return sorted(found)


def digest(root: Path, image: str) -> str:
    """sha256 over `image`'s Dockerfile and every context file's path and content."""
    hashed = hashlib.sha256()
    for path in [f"deploy/Dockerfile.{image}", *context_files(root)]:
        content = (root / path).read_bytes()
        hashed.update(f"{path}\0{len(content)}\0".encode())
        hashed.update(content)
    return hashed.hexdigest()


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] not in IMAGES:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[1]) if len(argv) == 2 else Path(__file__).resolve().parents[2]
    print(f"{LABEL}={digest(root, argv[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
