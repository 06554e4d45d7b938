"""Real syncer shards on loopback: in this process (fast, inspectable) or as `diloco-syncer` processes that
tests can kill with real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support import TEST_PKI, tls_env
from syncer_harness import (  # noqa: F401  (re-exported: the helpers used to live here)
    SHAPES,
    TOKEN,
    fragment_values,
    free_port,
    make_client,
)

from diloco.core.config import TrainingConfig
from diloco.core.fragments import owned_fragments
from diloco.syncer.server import SyncerServer


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., SyncerServer]]:
    """Starts in-process shards (seeded with SHAPES unless seed=False); all are stopped after the test."""
    servers: list[SyncerServer] = []

    def start(config: TrainingConfig, *, seed: bool = True, **kwargs) -> SyncerServer:
        kwargs.setdefault("checkpoint_dir", tmp_path / "ckpt")
        kwargs.setdefault("shard_index", 0)
        kwargs.setdefault("num_shards", 1)
        kwargs.setdefault("security", TEST_PKI.server)
        server = SyncerServer(config, token=TOKEN, **kwargs)
        server.start()
        servers.append(server)
        if seed:
            with make_client(server.port, "seeder") as client:
                for p in owned_fragments(kwargs["shard_index"], kwargs["num_shards"], config.fragments):
                    client.seed(p, fragment_values())
        return server

    yield start
    for server in servers:
        server.stop(grace=0)


@dataclass
class SyncerProcess:
    """A `diloco-syncer` subprocess on a fixed port, restartable over the same checkpoint folder."""

    config_file: Path
    checkpoint_dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            **tls_env(self.checkpoint_dir.parent / "tls", server=True),
            "DILOCO_TOKEN": TOKEN,
            "DILOCO_LOG_LEVEL": "WARNING",
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "diloco.syncer.main",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--config",
                str(self.config_file),
                "--checkpoint-dir",
                str(self.checkpoint_dir),
                "--checkpoint-interval",
                "0.2",
                "--metrics-port",
                "0",
            ],
            env=env,
        )
        with make_client(self.port) as client:
            if not client.wait_ready(30):
                raise RuntimeError("syncer process did not become ready")

    def signal(self, sig: int) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGKILL)


@pytest.fixture
def syncer_process(tmp_path: Path) -> Iterator[Callable[[TrainingConfig], SyncerProcess]]:
    made: list[SyncerProcess] = []

    def make(config: TrainingConfig) -> SyncerProcess:
        config_file = tmp_path / "config.json"
        config_file.write_text(config.to_json())
        process = SyncerProcess(config_file, tmp_path / "ckpt")
        process.start()
        made.append(process)
        return process

    yield make
    for process in made:
        process.stop()
