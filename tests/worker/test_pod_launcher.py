"""A pod of two local ranks: `diloco-worker` with DILOCO_ACCELERATORS_PER_POD=2 starts two training
processes against a real shard on loopback, and a rank that dies, or a SIGTERM or SIGKILL to the pod's
process, ends them all. On CPU (gloo), and in the gpu tier on CUDA (nccl with a GPU per rank; on one GPU,
the two ranks share it over gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from learner_harness import TOKEN, make_config
from support import tls_env, wait_until

from diloco.core.config import TrainingConfig
from diloco.local.launcher import free_port
from diloco.progress import DoneEvent, StartEvent, StepEvent, read_events

pytestmark = pytest.mark.process

CONFIG = make_config()  # H=4, P=2: a fragment falls due every other step
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def start_pod(
    tmp_path: Path, syncer: str, steps: int, metrics_port: int = 0, device: str = "cpu", config: TrainingConfig = CONFIG
) -> subprocess.Popen:
    """The pod's main process, as the operator configures a one-pod island of two accelerators."""
    (tmp_path / "config.json").write_text(config.to_json())
    env = {
        **os.environ,
        "DILOCO_ACCELERATORS_PER_POD": "2",
        "WORLD_SIZE": "2",
        "NODE_RANK": "0",
        "MASTER_ADDR": "pod-0.island.invalid",  # a one-pod island meets on loopback, whatever this says
        "MASTER_PORT": str(free_port()),
        "DILOCO_TOKEN": TOKEN,
        "OMP_NUM_THREADS": "1",
        **tls_env(tmp_path / "tls", server=False),
    }
    command = [
        sys.executable,
        "-m",
        "diloco.worker.main",
        "--island",
        "pod-island",
        "--syncers",
        syncer,
        "--config",
        str(tmp_path / "config.json"),
        "--steps",
        str(steps),
        "--batch-size",
        "2",
        "--eval-every",
        "1000000",
        "--threads",
        "1",
        "--device",
        device,
        "--progress-file",
        str(tmp_path / "progress" / "rank{rank}.jsonl"),
        "--metrics-port",
        str(metrics_port),
        "--metrics-host",
        "127.0.0.1",
    ]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stepping_ranks(tmp_path: Path) -> dict[int, int]:
    """Rank in the island -> pid of the process stepping as it."""
    events = read_events(tmp_path / "progress") if (tmp_path / "progress").exists() else []
    return {e.source.rank: e.source.pid for e in events if isinstance(e, StepEvent)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def finish(pod: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = pod.communicate(timeout=timeout)
    finally:
        pod.kill()
    return pod.returncode, out


@pytest.mark.parametrize("device", DEVICES)
def test_a_pod_of_two_accelerators_trains_as_two_ranks_of_one_island(start_shards, tmp_path, device):
    shards = start_shards(CONFIG)
    code, out = finish(start_pod(tmp_path, shards.targets[0], steps=8, device=device), timeout=240)
    assert code == 0, out

    events = read_events(tmp_path / "progress")
    starts = {e.source.rank: e for e in events if isinstance(e, StartEvent)}
    assert sorted(starts) == [0, 1] and all(e.world == 2 for e in starts.values())
    assert starts[0].source.pid != starts[1].source.pid, "one process per local rank"
    done = {e.source.rank: e for e in events if isinstance(e, DoneEvent)}
    assert {rank: e.step for rank, e in done.items()} == {0: 8, 1: 8}
    assert done[0].learner.syncs_pushed > 0 and done[0].learner.syncs_merged > 0
    assert done[1].learner.syncs_pushed == 0, "only the island's rank 0 talks to the syncers"
    assert done[0].learner.syncs_merged == done[1].learner.syncs_merged
    assert all(version >= 1 for _seeded, version, _tokens in shards.status(0).values())


@pytest.mark.parametrize("device", DEVICES)
def test_a_local_rank_that_dies_takes_the_pod_down(start_shards, tmp_path, device):
    shards = start_shards(CONFIG)
    base = free_port()
    pod = start_pod(tmp_path, shards.targets[0], steps=1_000_000, metrics_port=base, device=device)
    try:
        ranks = wait_until(lambda: len(r := stepping_ranks(tmp_path)) == 2 and r, timeout=240, interval=0.5)
        for rank in (0, 1):  # local rank r serves its own metrics on the pod's port + r
            text = urllib.request.urlopen(f"http://127.0.0.1:{base + rank}/metrics", timeout=5).read().decode()
            assert f'rank="{rank}"' in text
        os.kill(ranks[1], signal.SIGKILL)
        code, out = finish(pod)
    finally:
        pod.kill()
    assert code == 128 + signal.SIGKILL, out
    assert not alive(ranks[0]), "the launcher stopped the surviving rank"


def test_sigterm_to_the_pods_process_reaches_every_local_rank_and_the_pod_exits_0(start_shards, tmp_path):
    shards = start_shards(CONFIG)
    pod = start_pod(tmp_path, shards.targets[0], steps=1_000_000)
    try:
        ranks = wait_until(lambda: len(r := stepping_ranks(tmp_path)) == 2 and r, timeout=240, interval=0.5)
        pod.send_signal(signal.SIGTERM)
        code, out = finish(pod)
    finally:
        pod.kill()
    assert code == 0, out
    assert not any(alive(pid) for pid in ranks.values())


def test_no_rank_outlives_the_pods_process_killed_with_sigkill(start_shards, tmp_path):
    """The agent starts each rank in a session of its own: a SIGKILL of the pod's process, which it cannot
    pass on, must still end them (as a container runtime would by killing the whole container)."""
    shards = start_shards(CONFIG)
    pod = start_pod(tmp_path, shards.targets[0], steps=1_000_000)
    try:
        ranks = wait_until(lambda: len(r := stepping_ranks(tmp_path)) == 2 and r, timeout=240, interval=0.5)
        pod.kill()
        pod.wait(30)
        wait_until(lambda: not any(alive(pid) for pid in ranks.values()), timeout=30, interval=0.2)
    finally:
        pod.kill()


RANK_SCRIPT = """
import json, os, sys, time
values = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DILOCO_ISLAND")}
with open(os.path.join(sys.argv[1], f"rank{values['RANK']}.json"), "w") as out:
    json.dump({**values, "pid": os.getpid()}, out)
while values["RANK"] == "1":  # once rank 0 has written too, after argv[2] seconds
    if os.path.exists(os.path.join(sys.argv[1], "rank0.json")):
        time.sleep(float(sys.argv[2])); sys.exit(3)
    time.sleep(0.05)
time.sleep(3600)
"""


def start_command_pod(tmp_path: Path, ranks: int, rank_1_lives: float) -> subprocess.Popen:
    """`python -m diloco.worker.pod_launcher COMMAND` as the operator configures a one-pod island of `ranks`
    accelerators; the command writes what it was given, and its rank 1 exits 3 after `rank_1_lives` s."""
    env = {
        **os.environ,
        "DILOCO_ACCELERATORS_PER_POD": str(ranks),
        "WORLD_SIZE": str(ranks),
        "NODE_RANK": "0",
        "MASTER_ADDR": "pod-0.island.invalid",
        "MASTER_PORT": str(free_port()),
        "DILOCO_ISLAND": "own-loop",
        **({"RANK": "0"} if ranks == 1 else {}),
    }
    command = ["python", "-c", RANK_SCRIPT, str(tmp_path), str(rank_1_lives)]
    return subprocess.Popen(
        [sys.executable, "-m", "diloco.worker.pod_launcher", "--", *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def given(tmp_path: Path, rank: int) -> dict | None:
    path = tmp_path / f"rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() and path.read_text().endswith("}") else None


def test_a_command_of_ones_own_runs_as_every_local_rank_and_a_failed_rank_takes_the_pod_down(tmp_path):
    pod = start_command_pod(tmp_path, ranks=2, rank_1_lives=1.0)
    try:
        ranks = wait_until(lambda: (r := [given(tmp_path, k) for k in (0, 1)]) and all(r) and r, timeout=120)
        code, out = finish(pod)
    finally:
        pod.kill()
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) for r in ranks] == [("0", "0", "2"), ("1", "1", "2")]
    assert all(r["DILOCO_ISLAND"] == "own-loop" for r in ranks), "the pod's environment reaches every rank"
    assert code == 3, out
    assert not alive(ranks[0]["pid"]), "the launcher stopped the surviving rank"


def test_no_rank_of_a_command_outlives_the_pods_process_killed_with_sigkill(tmp_path):
    pod = start_command_pod(tmp_path, ranks=2, rank_1_lives=3600)
    try:
        ranks = wait_until(lambda: (r := [given(tmp_path, k) for k in (0, 1)]) and all(r) and r, timeout=120)
        pod.kill()
        pod.wait(30)
        wait_until(lambda: not any(alive(r["pid"]) for r in ranks), timeout=30, interval=0.2)
    finally:
        pod.kill()


def test_a_pod_of_one_process_becomes_the_command(tmp_path):
    pod = start_command_pod(tmp_path, ranks=1, rank_1_lives=0)
    try:
        ran = wait_until(lambda: given(tmp_path, 0), timeout=60)
    finally:
        pod.kill()
        pod.wait(30)
    assert ran["pid"] == pod.pid, "the launcher execs the command in a pod of one process: no agent between"
