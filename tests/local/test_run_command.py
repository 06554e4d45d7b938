"""`diloco run -- COMMAND`: a loop of one's own (examples/custom_loop/train.py, through `Learner.from_env`) as
every island's worker, on loopback with real shards, a real kill -9, the run's summary, plot and export."""

import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
from support import wait_until

from diloco.cli import main
from diloco.export.model_files import load
from diloco.progress import DoneEvent, StartEvent, StepEvent, read_events

pytestmark = pytest.mark.process

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_loop" / "train.py"
STEPS, INNER_STEPS, KILL_AT = 60, 10, 30


def pid_at_step(progress: Path, island: str, at_step: int) -> int | None:
    """The process of `island` once it has trained `at_step` steps, else None."""
    hits = [
        e for e in read_events(progress) if isinstance(e, StepEvent) and e.source.island == island and e.step >= at_step
    ]
    return hits[0].source.pid if hits else None


def test_the_custom_loop_example_trains_as_four_islands_resumes_a_killed_one_warm_and_is_exported(tmp_path, capsys):
    """Four islands of the example, checkpointing every 10 steps; island-1 gets kill -9 past step 30 and
    the run starts it again: it resumes warm at the job's step, every island trains its 60 steps, the shards'
    model is exported, and the summary shows the loss the loop reports falling."""
    out = tmp_path / "run"
    progress = out / "diloco" / "progress"
    killed = {}

    def killer() -> None:
        pid = wait_until(lambda: pid_at_step(progress, "island-1", KILL_AT), timeout=300, interval=0.2)
        os.kill(pid, signal.SIGKILL)
        killed["pid"] = pid

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    command = [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--log-every", str(STEPS)]
    args = ["run", "--islands", "4", "--inner-steps", str(INNER_STEPS), "--checkpoint-every", "10"]
    assert main([*args, "--quiet", "--out", str(out), "--", *command]) == 0
    thread.join(1)
    assert "pid" in killed, "island-1 never reached the step it was to be killed at"
    (summary,) = json.loads((out / "summary.json").read_text())
    events = read_events(progress)

    done = {e.source.island: e.step for e in events if isinstance(e, DoneEvent)}
    assert done == {f"island-{i}": STEPS for i in range(4)}, "every island trained to its end"
    assert summary["restarts"] == 1 and not summary["timed_out"]

    (again,) = [
        e
        for e in events
        if isinstance(e, StartEvent) and e.source.island == "island-1" and e.source.pid != killed["pid"]
    ]
    lost_at = max(e.step for e in events if isinstance(e, StepEvent) and e.source.pid == killed["pid"])
    others = [e.step for e in events if isinstance(e, StepEvent) and e.source.island != "island-1" and e.t <= again.t]
    assert again.warm, "the optimizer state came back from the island's checkpoint"
    assert lost_at - INNER_STEPS <= again.step <= max(others), "at the job's step, not at 0"

    model = load(out / "diloco" / "model")
    assert model.config["preset"] is None and model.config["outer_steps"] >= 1, "the shards' model, the loop's own"
    assert {"embed.weight", "head.weight"} <= set(model.tensors)

    assert summary["train_loss_end"] < 0.8 * summary["train_loss_start"], summary
    assert summary["goodput"] > 0 and summary["merges"] > 0
    printed = capsys.readouterr().out
    assert "training loss the islands reported" in printed
    assert (out / "loss.png").stat().st_size > 0


def test_a_command_that_cannot_start_ends_the_run_naming_its_log_rather_than_restarting_forever(tmp_path, capsys):
    failing = [sys.executable, "-c", "import sys; sys.exit(3)"]
    assert main(["run", "--islands", "1", "--quiet", "--out", str(tmp_path), "--", *failing]) == 1
    said = capsys.readouterr().err
    assert "island-0 exited 3 times (last with 3) before it ever trained; see" in said, said
    assert str(tmp_path / "diloco" / "logs" / "worker-island-0.log") in said
