"""A push across a link slower than its fixed deadline allowed, on a real shaped link (a network namespace
behind tc tbf, as `diloco run --link-mbps` makes): with the deadline of its bytes at the job's slowest rate it
completes and the shard takes it; with a deadline that ignores its bytes it times out, as every push did at a
tenth of the 2 Gbit/s equivalent in bench/wan.py. Skipped (never failed) where namespaces cannot be made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import require_network_namespaces

from diloco.core.config import TrainingConfig
from diloco.local.delay_proxy import DelayProxy
from diloco.local.netns import HUB_ADDRESS, IslandNetwork
from diloco.local.wan import Link
from diloco.syncer.server import SyncerServer
from diloco.transport.client import SyncerClient
from diloco.transport.tls import LOOPBACK_NAMES, throwaway_pki

pytestmark = pytest.mark.process

PUSH = Path(__file__).with_name("slow_push.py")
TOKEN = "test-token"
PKI = throwaway_pki((HUB_ADDRESS, *LOOPBACK_NAMES))
LINK = Link(mbps=2.0)
FLOATS = 250_000  # a 1 MB push: 4 s at 2 Mbit/s
BASE_SECONDS = 1.0  # stands in for the fixed 60 s: the push takes several times as long


@pytest.fixture(scope="module", autouse=True)
def namespaces_allowed():
    require_network_namespaces()


@pytest.fixture
def shard(tmp_path):
    """A shard on the host's loopback holding one fragment of FLOATS values, seeded at memory speed, in a job
    whose slowest rate is half the link's."""
    config = TrainingConfig(fragments=1, inner_steps=10, overlap_steps=1, min_transfer_mbps=LINK.mbps / 2)
    server = SyncerServer(config, shard_index=0, num_shards=1, token=TOKEN, security=PKI.server)
    server.start()
    with SyncerClient(f"127.0.0.1:{server.port}", TOKEN, security=PKI.client, island_id="seeder") as seeder:
        seeder.seed(0, [("w", torch.zeros(FLOATS))])
    yield server
    server.stop(grace=0)


def push_across_the_link(server: SyncerServer, min_mbps: float, tmp_path: Path) -> dict:
    """One push from an island behind LINK to `server`, with the deadline of its bytes at `min_mbps`."""
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(PKI.ca.cert)
    with IslandNetwork(1, LINK) as network:
        network.shape()
        listener = network.listen(server.port)
        with DelayProxy({listener: ("127.0.0.1", server.port)}, LINK.one_way_seconds):
            argv = [sys.executable, str(PUSH), f"{HUB_ADDRESS}:{server.port}", str(ca_file), TOKEN]
            argv += [str(BASE_SECONDS), str(min_mbps), str(FLOATS)]
            done = subprocess.run(network.command(0, argv), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_push_slower_than_the_base_deadline_completes_within_the_deadline_of_its_bytes(shard, tmp_path):
    pushed = push_across_the_link(shard, shard.config.min_transfer_mbps, tmp_path)
    assert pushed["code"] == "OK"
    assert pushed["seconds"] > BASE_SECONDS, "the link did not hold the push back"
    assert shard.metrics.registry.get_sample_value("diloco_syncer_pushes_total", {"result": "accepted"}) == 1


def test_a_push_given_only_the_base_deadline_times_out_on_the_same_link(shard, tmp_path):
    pushed = push_across_the_link(shard, 1e6, tmp_path)  # a rate no link has: the deadline is the base alone
    assert pushed["code"] == "DEADLINE_EXCEEDED"
    assert shard.metrics.registry.get_sample_value("diloco_syncer_pushes_total", {"result": "accepted"}) is None
