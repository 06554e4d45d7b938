"""The project's images as images.sh saves them for the real node (`docker save` archives in the cluster cache),
and whether each was built from this checkout: images.sh builds them with deploy/images/build.sh, which labels
each with the digest of its sources (deploy/images/context.py). An archive from other sources would run other
code than the operator under test (an older trainer refuses the fields a newer operator sends)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("context", ROOT / "deploy" / "images" / "context.py")
build_context = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_context)


def archive(image: str, tag: str = "dev") -> Path:
    """Where images.sh saves `diloco-<image>:<tag>`."""
    cache = Path(os.environ.get("DILOCO_CLUSTER_CACHE", os.path.expanduser("~/.cache/diloco-cluster")))
    return cache / "images" / f"diloco-{image}-{tag}.tar"


def config(saved: Path) -> dict:
    """The run settings (User, Entrypoint, Labels...) of the one image in a `docker save` archive (its manifest
    names the image's config)."""
    with tarfile.open(saved) as tar:
        (manifest,) = json.load(tar.extractfile("manifest.json"))
        return json.load(tar.extractfile(manifest["Config"]))["config"]


def labels(saved: Path) -> dict[str, str]:
    """The labels of the one image in a `docker save` archive."""
    return config(saved).get("Labels") or {}


def unusable(image: str) -> str | None:
    """Why `diloco-<image>:dev`'s archive cannot stand for this checkout (missing, or built from other
    sources), with the command that makes it; None when it can."""
    saved, rebuild = archive(image), f"run tests/cluster/realnode/images.sh {image}"
    if not saved.exists():
        return f"no {saved}: {rebuild}"
    built_from = labels(saved).get(build_context.LABEL)
    if built_from != build_context.digest(ROOT, image):
        return f"{saved} was built from other sources than this checkout ({built_from=}): {rebuild}"
    return None


if __name__ == "__main__":
    # `archives.py IMAGE...`: those of the images whose archive cannot stand for this checkout (images.sh builds
    # only them).
    print(*(image for image in sys.argv[1:] if unusable(image)))
