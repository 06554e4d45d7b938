"""Fixtures every tier may use. `kwok_cluster`: one real cluster (tests/cluster/cluster.py) per session,
started on first use, so tiers that do not ask for it never pay for it."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
from cluster.cluster import Cluster, MissingBinaries, start_cluster
from hypothesis import settings
from support import missing_binary

# Nothing may come from the Hugging Face Hub: models are built from configurations, tokenizers read from files.
# Processes the tests start inherit it.
os.environ["HF_HUB_OFFLINE"] = "1"

# Hypothesis's CI profile replays the same examples on every run; ours draws new ones each run, from the seed
# the header prints, so CI keeps searching and whatever it finds replays.
settings.register_profile("diloco-ci", parent=settings.get_profile("ci"), derandomize=False)
if settings.get_current_profile_name() == "ci":
    settings.load_profile("diloco-ci")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """The fuzz tier's seed, chosen once per run unless given, so that whatever it finds replays."""
    if config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(random.SystemRandom().randrange(2**32))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The gpu tier runs where CUDA is and is skipped, never failed, elsewhere (CI has no GPU)."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu tier: no CUDA device on this machine")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.option.hypothesis_seed
    return f"fuzz tier: hypothesis seed {seed} (replay a failure with: pytest --hypothesis-seed={seed})"


@pytest.fixture(scope="session")
def kwok_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK with the default node pools,
    started for the e2e suite's pod runner (a probed container is ready when the runner's probe says so)."""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("cluster"), pod_runner=True)
    except MissingBinaries as error:
        missing_binary(str(error))
    try:
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.leftovers(), f"cluster processes left running: {cluster.leftovers()}"
