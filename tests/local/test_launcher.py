"""A local job's folder and processes: what a run finds there from an earlier run, what each process is given."""

import os
import signal
import sys
import time

import pytest

from diloco import pod_env
from diloco.core.config import TrainingConfig
from diloco.local.launcher import (
    TOKEN,
    LocalJob,
    RunPlan,
    check_gpus,
    island_gpus,
    syncer_threads,
    terminate_as_exit,
)
from diloco.local.netns import HUB_ADDRESS, ISLAND_DEVICE, island_address
from diloco.local.wan import Link
from diloco.progress import ProgressWriter, Source, StartEvent
from diloco.transport import certificates


def test_a_run_starts_from_nothing_even_where_an_earlier_run_left_its_files(tmp_path):
    """Run twice into one --out, the second run must not resume the first's checkpoints nor count its events."""
    out = tmp_path / "diloco"
    stale = [
        out / "checkpoints" / "syncer" / "shard-0.pt",
        out / "progress" / "island-0-rank0.jsonl",
        out / "logs" / "worker-island-0-0.log",
    ]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("from an earlier run")
    keep = out / "notes.txt"
    keep.write_text("the user's own")

    LocalJob(RunPlan(mode="diloco", config=TrainingConfig(), out=out))

    assert not any(path.exists() for path in stale)
    assert all((out / folder).is_dir() for folder in ("progress", "logs", "checkpoints"))
    assert keep.read_text() == "the user's own", "only the folders a run writes are cleared"


def test_with_equal_time_decoupled_islands_take_steps_in_proportion_to_their_speed(tmp_path):
    """Every island then trains for the slowest island's time, as a job's islands do until it ends; the
    barrier modes hold every island to the slowest's pace, so they keep one count."""
    shape = {"config": TrainingConfig(), "out": tmp_path, "islands": 4, "steps": 36, "slowdowns": (1, 1, 2, 3)}
    plan = RunPlan(mode="diloco", equal_time=True, **shape)
    assert [plan.island_steps(i) for i in range(4)] == [108, 108, 54, 36]
    assert plan.total_steps == 306
    for mode in ("sync-diloco", "ddp"):
        assert [RunPlan(mode=mode, equal_time=True, **shape).island_steps(i) for i in range(4)] == [36] * 4
    assert RunPlan(mode="diloco", **shape).total_steps == 4 * 36, "without equal_time, --steps each"


def test_syncers_get_the_cores_the_workers_leave():
    assert syncer_threads(cpus=16, workers=4, threads_per_worker=1, shards=1) == 12, "a GPU box's spare cores"
    assert syncer_threads(cpus=16, workers=4, threads_per_worker=1, shards=3) == 4
    assert syncer_threads(cpus=2, workers=4, threads_per_worker=1, shards=1) == 1, "never fewer than one"


def test_a_syncer_process_is_told_its_thread_count(tmp_path):
    job = LocalJob(RunPlan(mode="diloco", config=TrainingConfig(), out=tmp_path, islands=1))
    expected = syncer_threads(os.cpu_count() or 1, 1, 1, 1)
    assert job.syncers[0].env["OMP_NUM_THREADS"] == str(expected)
    command = job.syncers[0].command
    assert command[command.index("--threads") + 1] == str(expected), "merges and differences run on as many"
    assert job.workers["island-0"].env["OMP_NUM_THREADS"] == "1"


def test_islands_get_gpus_of_their_own_while_there_are_enough():
    assert [island_gpus(i, 1, gpus=8) for i in range(4)] == ["0", "1", "2", "3"]
    assert [island_gpus(i, 2, gpus=8) for i in range(4)] == ["0,1", "2,3", "4,5", "6,7"]


def test_islands_share_the_gpus_in_turn_when_there_are_too_few():
    assert [island_gpus(i, 1, gpus=1) for i in range(4)] == ["0", "0", "0", "0"]
    assert [island_gpus(i, 2, gpus=3) for i in range(3)] == ["0,1", "2,0", "1,2"]
    assert island_gpus(0, 4, gpus=2) == "0,1", "a pod's ranks outnumbering its GPUs share them over gloo"


def test_a_cuda_run_that_cannot_start_is_refused_before_anything_starts():
    check_gpus("cpu", ["ddp"], workers=4, gpus=0)
    check_gpus("cuda", ["diloco", "sync-diloco"], workers=4, gpus=1)
    with pytest.raises(ValueError, match="no CUDA device"):
        check_gpus("cuda", ["diloco"], workers=1, gpus=0)
    with pytest.raises(ValueError, match="4 workers, 1 GPU"):
        check_gpus("cuda", ["diloco", "ddp"], workers=4, gpus=1)


def test_islands_behind_a_link_run_in_their_namespaces_and_reach_the_syncers_through_the_hub(tmp_path):
    plan = RunPlan(mode="diloco", config=TrainingConfig(), out=tmp_path, islands=2, link=Link(mbps=1.0, rtt_ms=50))
    job = LocalJob(plan)
    for island, worker in enumerate(job.workers.values()):
        assert worker.command[:4] == ["ip", "netns", "exec", job.network.namespace(island)]
        assert worker.env[pod_env.SYNCERS] == f"{HUB_ADDRESS}:{job.syncer_ports[0]}"
    assert HUB_ADDRESS in certificates.names_of(job.pki.server_cert.cert), "the certificate names the hub's address"


def test_a_data_parallel_world_behind_links_meets_at_island_0_over_the_links(tmp_path):
    plan = RunPlan(mode="ddp", config=TrainingConfig(), out=tmp_path, islands=2, link=Link(mbps=1.0))
    for worker in LocalJob(plan).workers.values():
        assert worker.env["MASTER_ADDR"] == island_address(0)
        assert worker.env["GLOO_SOCKET_IFNAME"] == ISLAND_DEVICE


def test_islands_without_a_link_run_on_loopback(tmp_path):
    job = LocalJob(RunPlan(mode="diloco", config=TrainingConfig(), out=tmp_path, islands=1))
    assert job.network is None
    assert job.workers["island-0"].command[0] == sys.executable


def test_links_are_shaped_once_every_island_has_started_not_before(tmp_path, monkeypatch):
    """The initial model crosses at full speed; training and its syncs cross the link."""
    job = LocalJob(RunPlan(mode="diloco", config=TrainingConfig(), out=tmp_path, islands=2, link=Link(mbps=1.0)))
    shaped = []
    monkeypatch.setattr(job.network, "shape", lambda: shaped.append(True))

    def started(island: str) -> None:
        with ProgressWriter(tmp_path / "progress" / f"{island}-rank0.jsonl", Source(island, 0, "diloco", 1)) as w:
            w.write(StartEvent, step=0, world=1)

    started("island-0")
    job._shape_once_started()
    assert shaped == []
    started("island-1")
    job._shape_once_started()
    assert shaped == [True]


def test_a_sigterm_to_the_launcher_unwinds_it_so_it_stops_what_it_started():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as leaving, terminate_as_exit():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert leaving.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_command_runs_as_each_islands_pod_through_the_pod_launcher_with_this_python_first(tmp_path):
    """The pod launcher runs it as the island's process, or as each of its local ranks; `python` in it is the
    one with diloco and torch, as in the trainer image."""
    plan = RunPlan(mode="diloco", config=TrainingConfig(), out=tmp_path, islands=2, command=("python", "train.py"))
    job = LocalJob(plan)
    for island, worker in enumerate(job.workers.values()):
        assert worker.command == [sys.executable, "-m", "diloco.worker.pod_launcher", "python", "train.py"]
        assert worker.env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
        assert worker.env[pod_env.ISLAND] == f"island-{island}"
        assert worker.env[pod_env.PROGRESS_FILE] == str(tmp_path / "progress" / f"island-{island}-rank{{rank}}.jsonl")
    assert plan.total_steps is None, "a command counts its own steps"


def test_the_built_in_trainer_reads_the_pods_variables_and_takes_only_its_own_settings_as_flags(tmp_path):
    job = LocalJob(RunPlan(mode="diloco", config=TrainingConfig(), out=tmp_path, islands=1, slowdowns=(2.0,)))
    worker = job.workers["island-0"]
    flags = {arg for arg in worker.command if arg.startswith("--")}
    assert flags == {
        "--model", "--steps", "--batch-size", "--eval-every", "--seed", "--threads", "--device", "--precision",
        "--max-data-bytes",
    }  # fmt: skip
    assert worker.env[pod_env.SLOWDOWN] == "2.0" and worker.env[pod_env.MODE] == "diloco"
    assert (tmp_path / "tls" / "token").read_text() == TOKEN
    assert worker.env[pod_env.TOKEN_FILE] == job.syncers[0].env[pod_env.TOKEN_FILE] == str(tmp_path / "tls" / "token")


def test_a_command_island_behind_a_link_runs_in_its_namespace_as_the_built_in_trainer_does(tmp_path):
    plan = RunPlan(mode="diloco", config=TrainingConfig(), out=tmp_path, islands=2, link=Link(mbps=1.0), command=("t",))
    job = LocalJob(plan)
    for island, worker in enumerate(job.workers.values()):
        assert worker.command[:4] == ["ip", "netns", "exec", job.network.namespace(island)]
        assert worker.command[4:] == [sys.executable, "-m", "diloco.worker.pod_launcher", "t"]
        assert worker.env[pod_env.SYNCERS] == f"{HUB_ADDRESS}:{job.syncer_ports[0]}"


def test_hostile_islands_take_the_last_islands_places_with_the_jobs_token_and_ca(tmp_path):
    """The honest islands share the data among themselves, as the same run without the hostile ones would."""
    plan = RunPlan(mode="diloco", config=TrainingConfig(), out=tmp_path, islands=4, steps=10, hostile_islands=1)
    job = LocalJob(plan)
    assert list(job.workers) == ["island-0", "island-1", "island-2"] and plan.total_steps == 30
    assert {w.env[pod_env.DATA_SHARDS] for w in job.workers.values()} == {"3"}
    (hostile,) = job.hostile
    assert hostile.name == "hostile:island-3"
    command = hostile.command
    assert command[1:3] == ["-m", "diloco.local.hostile"]
    assert command[command.index("--token-file") + 1] == str(tmp_path / "tls" / "token")
    assert command[command.index("--tls-ca-file") + 1] == str(tmp_path / "tls" / "ca.crt")
    assert command[command.index("--syncers") + 1] == f"127.0.0.1:{job.syncer_ports[0]}"
