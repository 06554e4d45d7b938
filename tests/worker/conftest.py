"""Real syncer shards on loopback in this process, and small islands that train against them."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from learner_harness import FAST_BACKOFF, TOKEN, SingleIsland
from support import TEST_PKI
from torch import nn

from diloco.core.config import TrainingConfig
from diloco.syncer.server import SyncerServer
from diloco.transport.client import SyncerClient
from diloco.worker.learner import Learner


@pytest.fixture(autouse=True)
def own_sigterm():
    """`Learner.from_env` takes SIGTERM, as a pod's process should; the test process gets its own back."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine, two threads contending with other work are an
    order of magnitude slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Shards:
    """In-process shards of one job; a shard can be stopped and started again on the same port."""

    def __init__(self, config: TrainingConfig, count: int, checkpoint_dir: Path | None) -> None:
        self.config = config
        self.count = count
        self.checkpoint_dir = checkpoint_dir
        self.servers: dict[int, SyncerServer] = {}
        self.ports: dict[int, int] = {}
        for index in range(count):
            self.start(index)

    @property
    def targets(self) -> list[str]:
        return [f"127.0.0.1:{self.ports[index]}" for index in range(self.count)]

    def start(self, index: int, port: int = 0) -> None:
        server = SyncerServer(
            self.config,
            shard_index=index,
            num_shards=self.count,
            token=TOKEN,
            security=TEST_PKI.server,
            port=port,
            checkpoint_dir=self.checkpoint_dir,
        )
        server.start()
        self.servers[index] = server
        self.ports[index] = server.port

    def stop(self, index: int) -> None:
        self.servers[index].stop(grace=0)

    def client(self, index: int) -> SyncerClient:
        return SyncerClient(
            self.targets[index], TOKEN, security=TEST_PKI.client, island_id="observer", backoff=FAST_BACKOFF
        )

    def status(self, index: int) -> dict[int, tuple[bool, int, int]]:
        """Per owned fragment: (seeded, version, tokens merged)."""
        with self.client(index) as client:
            reply = client.status()
        return {f.fragment_id: (f.seeded, f.version.version, f.tokens_merged) for f in reply.fragments}

    def live_islands(self, index: int) -> list[str]:
        with self.client(index) as client:
            return list(client.status().live_islands)


@pytest.fixture
def start_shards(tmp_path: Path) -> Iterator[Callable[..., Shards]]:
    made: list[Shards] = []

    def start(config: TrainingConfig, count: int = 1, checkpoints: bool = True) -> Shards:
        shards = Shards(config, count, tmp_path / "ckpt" if checkpoints else None)
        made.append(shards)
        return shards

    yield start
    for shards in made:
        for server in shards.servers.values():
            server.stop(grace=0)


@pytest.fixture
def island(start_shards: Callable[..., Shards]) -> Iterator[Callable[..., SingleIsland]]:
    """Makes islands against some `Shards` (started, unless start=False); all are closed after the test."""
    made: list[SingleIsland] = []

    def make(
        shards: Shards,
        seed: int,
        name: str,
        start: bool = True,
        syncers: list[str] | None = None,
        token: str = TOKEN,
        **options: object,
    ) -> SingleIsland:
        options = {"backoff": FAST_BACKOFF, "retry_for": 20.0, "sync_timeout": 10.0, "close_timeout": 2.0, **options}

        def learner_for(model: nn.Module, optimizer: torch.optim.Optimizer) -> Learner:
            return Learner(
                model,
                optimizer,
                shards.config,
                syncers=syncers or shards.targets,
                token=token,
                security=TEST_PKI.client,
                island_id=name,
                **options,
            )

        made_island = SingleIsland(learner_for, seed)
        made.append(made_island)
        if start:
            made_island.learner.start()
        return made_island

    yield make
    for made_island in made:
        made_island.learner.close()
