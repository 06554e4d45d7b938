"""An image archive stands for this checkout only if its source label matches the checkout's sources."""

import io
import json
import tarfile

from cluster.realnode import archives


def save(path, labels):
    """A `docker save` archive of one image with `labels` (its manifest and config: the layers do not matter)."""
    files = {
        "manifest.json": [{"Config": "abc.json", "RepoTags": ["diloco-trainer:dev"], "Layers": []}],
        "abc.json": {"config": {"Labels": labels}},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, content in files.items():
            data = json.dumps(content).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_an_archive_built_from_this_checkout_is_usable(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_CLUSTER_CACHE", str(tmp_path))
    digest = archives.build_context.digest(archives.ROOT, "trainer")
    save(archives.archive("trainer"), {archives.build_context.LABEL: digest})
    assert archives.unusable("trainer") is None


def test_a_missing_or_stale_archive_is_refused_with_the_command_that_rebuilds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_CLUSTER_CACHE", str(tmp_path))
    assert "no " in archives.unusable("trainer")
    for labels in ({}, {archives.build_context.LABEL: "0" * 64}):
        save(archives.archive("trainer"), labels)
        reason = archives.unusable("trainer")
        assert "other sources" in reason and reason.endswith("tests/cluster/realnode/images.sh trainer")
