"""`diloco-worker` as a process, started the way a pod starts it, for the tests of what only a process shows
(its metrics endpoint, its signals). Apart from learner_harness, which island_rank.py imports in processes of
its own without the tests' shared helpers on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from learner_harness import TOKEN
from support import tls_env

from diloco.core.config import TrainingConfig


def start_worker(
    tmp_path: Path,
    config: TrainingConfig,
    syncer: str,
    island: str,
    *flags: str,
    env: dict[str, str] | None = None,
    **popen,
) -> subprocess.Popen:
    """A `diloco-worker` process as a pod runs it, on CPU and one thread: the job's config file, token and TLS
    files, against shard `syncer`; `flags` and `env` add to that."""
    config_file = tmp_path / "config.json"
    config_file.write_text(config.to_json())
    command = [sys.executable, "-m", "diloco.worker.main", "--island", island, "--syncers", syncer]
    command += ["--config", str(config_file), "--batch-size", "4", "--threads", "1", "--device", "cpu", *flags]
    full_env = {
        **os.environ,
        **tls_env(tmp_path / "tls", server=False),
        "DILOCO_TOKEN": TOKEN,
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    return subprocess.Popen(command, env=full_env, **popen)
