"""A process of the job dies with the launcher that started it, even when the launcher is killed with -9 and
the process sits in a session of its own; a process no launcher of ours started is left alone."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import wait_until

from diloco.lifetime import LAUNCHER_PID, follow_launcher, launcher_env

pytestmark = pytest.mark.process

CHILD = "import time; from diloco.lifetime import follow_launcher; follow_launcher(); time.sleep(60)"
LAUNCHER = """
import os, subprocess, sys, time
from diloco.lifetime import launcher_env
env = {**os.environ, **launcher_env()}
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


def test_a_child_in_its_own_session_dies_with_its_launcher_killed_by_sigkill():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILD], stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    assert alive(child)
    launcher.kill()
    launcher.wait()
    wait_until(lambda: not alive(child), timeout=10)


def test_a_process_no_launcher_started_is_left_alone(monkeypatch):
    monkeypatch.delenv(LAUNCHER_PID, raising=False)
    follow_launcher()  # a pod's first process: nothing to follow, and it lives on
    assert launcher_env() == {LAUNCHER_PID: str(os.getpid())}


def test_diloco_run_killed_with_sigkill_leaves_no_syncer_or_worker_behind(tmp_path):
    out = tmp_path / "killed-run"
    run = subprocess.Popen(
        [Path(sys.executable).parent / "diloco", "run", "--islands", "2", "--steps", "100000", "--quiet", "--out", out],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: any((out / "diloco" / "progress").glob("*.jsonl")), timeout=120, interval=0.5)
        children = wait_until(lambda: processes_mentioning(str(out)), timeout=30)
        run.send_signal(signal.SIGKILL)
        run.wait()
        wait_until(lambda: not processes_mentioning(str(out)), timeout=20, interval=0.2)
    finally:
        run.kill()
        for pid in processes_mentioning(str(out)):
            os.kill(pid, signal.SIGKILL)
    assert children, "the run had started its syncer and workers"
