"""An image archive stands for this checkout only if its source label matches the checkout's sources."""

import io
import json
import tarfile

import pytest

from cluster.realnode import archives

IMAGES = pytest.mark.parametrize("image", archives.build_context.IMAGES)


def save(path, image, labels):
    """A `docker save` archive of `diloco-<image>:dev` with `labels` and the images' user (its manifest and
    config: the layers do not matter)."""
    files = {
        "manifest.json": [{"Config": "abc.json", "RepoTags": [f"diloco-{image}:dev"], "Layers": []}],
        "abc.json": {"config": {"User": "10001:10001", "Labels": labels}},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, content in files.items():
            data = json.dumps(content).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@IMAGES
def test_an_archive_built_from_this_checkout_is_usable(tmp_path, monkeypatch, image):
    monkeypatch.setenv("DILOCO_CLUSTER_CACHE", str(tmp_path))
    digest = archives.build_context.digest(archives.ROOT, image)
    save(archives.archive(image), image, {archives.build_context.LABEL: digest})
    assert archives.unusable(image) is None
    assert archives.config(archives.archive(image))["User"] == "10001:10001"


@IMAGES
def test_a_missing_or_stale_archive_is_refused_with_the_command_that_rebuilds_it(tmp_path, monkeypatch, image):
    monkeypatch.setenv("DILOCO_CLUSTER_CACHE", str(tmp_path))
    assert "no " in archives.unusable(image)
    for labels in ({}, {archives.build_context.LABEL: "0" * 64}):
        save(archives.archive(image), image, labels)
        reason = archives.unusable(image)
        assert "other sources" in reason and reason.endswith(f"tests/cluster/realnode/images.sh {image}")
