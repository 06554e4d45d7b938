"""Writes a one-layer OCI image archive from local files, for `ctr images import`: how the real node gets its
pause and test images where no registry can be reached and no image builder is installed.

    python3 tests/cluster/realnode/ociimage.py NAME OUT.tar --add SRC:DEST ... [--user UID] [--entrypoint ARG ...]

The layer is an uncompressed tar with fixed times and owners, so the same files always make the same image
digest. Directories on the way to each DEST are created (mode 0755); a SRC directory is added recursively.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tarfile
from pathlib import Path

LAYER = "application/vnd.oci.image.layer.v1.tar"
CONFIG = "application/vnd.oci.image.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def layer(files: list[tuple[Path, str]]) -> bytes:
    """The layer tar: each (source, destination) pair, with its parent directories."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        made: set[str] = set()
        for source, dest in files:
            parts = Path(dest.strip("/")).parts
            for depth in range(1, len(parts)):
                parent = "/".join(parts[:depth])
                if parent not in made:
                    made.add(parent)
                    info = tarfile.TarInfo(parent)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(_normalized(info))
            tar.add(source, arcname="/".join(parts), filter=_normalized)
    return buffer.getvalue()


def image_archive(name: str, files: list[tuple[Path, str]], user: str, entrypoint: list[str]) -> bytes:
    """An OCI image layout as a tar (index.json naming the image `name`, the blobs by digest)."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes, media_type: str) -> dict[str, object]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    tar = layer(files)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"User": user, "Entrypoint": entrypoint, "Env": ["PATH=/bin:/usr/bin"]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar).hexdigest()]},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": blob(json.dumps(config).encode(), CONFIG),
        "layers": [blob(tar, LAYER)],
    }
    descriptor = blob(json.dumps(manifest).encode(), MANIFEST)
    # containerd names the imported image after io.containerd.image.name; the OCI ref name is the tag alone.
    descriptor["annotations"] = {
        "io.containerd.image.name": name,
        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1],
    }
    index = {"schemaVersion": 2, "mediaType": INDEX, "manifests": [descriptor]}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        entries = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": json.dumps(index).encode()}
        entries.update({f"blobs/sha256/{digest.split(':')[1]}": data for digest, data in blobs.items()})
        for path, data in entries.items():
            info = _normalized(tarfile.TarInfo(path))
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name")
    parser.add_argument("out", type=Path)
    parser.add_argument("--add", action="append", default=[], metavar="SRC:DEST")
    parser.add_argument("--user", default="0")
    parser.add_argument("--entrypoint", nargs="*", default=[])
    args = parser.parse_args()
    files = [(Path(src), dest) for src, dest in (pair.split(":", 1) for pair in args.add)]
    args.out.write_bytes(image_archive(args.name, files, args.user, args.entrypoint))


if __name__ == "__main__":
    main()
