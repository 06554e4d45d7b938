"""`diloco run` end to end: real syncer and worker processes on loopback, real kill -9 of workers."""

import json
import math
import os
import signal
import threading
from collections import Counter

import pytest
from support import wait_until

from diloco.cli import build_parser, main
from diloco.core.config import TrainingConfig
from diloco.export.model_files import load
from diloco.local.failure_trace import FailureEvent, load_trace, save_trace
from diloco.local.run import print_sample
from diloco.progress import DoneEvent, EvalEvent, RoundEvent, StartEvent, StepEvent, read_events

pytestmark = pytest.mark.process

INITIAL_LOSS = math.log(256)  # an untrained byte-level model


def run(tmp_path, name, *extra):
    out = tmp_path / name
    args = [
        "run",
        "--islands",
        "2",
        "--steps",
        "40",
        "--inner-steps",
        "10",
        "--eval-every",
        "20",
        "--quiet",
        "--out",
        str(out),
        *extra,
    ]
    assert main(args) == 0
    return json.loads((out / "summary.json").read_text()), out


def test_a_short_run_lowers_the_loss_and_faults_do_not_derail_it(tmp_path, capsys):
    (clean,), out = run(tmp_path, "clean")
    assert clean["final_loss"] < 3.5 < INITIAL_LOSS, "40 steps of 2 islands reach well below ln(256)"
    assert clean["kills"] == 0 and clean["restarts"] == 0
    assert 0.3 < clean["goodput"] <= 1.0
    assert (out / "loss.png").stat().st_size > 0
    runs = {p.name for p in (out / "diloco" / "tensorboard").iterdir()}
    assert runs == {"island-0", "island-1", "global"}, "TensorBoard curves of each island and of the job"
    model = load(out / "diloco" / "model")  # the final global model, exported; the summary's loss is its loss
    assert model.config["preset"] == "tiny" and model.config["outer_steps"] >= 1
    print_sample(out / "diloco" / "model", None)  # what a run without --quiet ends with
    assert "the global model writes" in capsys.readouterr().out

    trace = [FailureEvent(3.0, "worker:island-0/0", 1.0), FailureEvent(6.0, "worker:island-1/0", 1.0)]
    save_trace(tmp_path / "trace.json", trace)
    (faulty,), out = run(tmp_path, "faulty", "--trace", str(tmp_path / "trace.json"))
    assert faulty["kills"] == 2 and faulty["restarts"] == 2, "both workers were killed with SIGKILL and replaced"
    assert math.isfinite(faulty["final_loss"])
    assert faulty["final_loss"] < clean["final_loss"] + 0.5, "kills cost some steps, not the run"
    assert load_trace(out / "trace.json") == trace, "the trace the run replayed is kept beside its results"
    printed = capsys.readouterr().out
    assert "diloco allocated time not in the model: first start 0." in printed, "the run says where goodput went"


def pid_at_step(out, island, at_step, rank=0):
    """The process of `rank` of `island` once it has trained `at_step` steps, else None."""
    hits = [
        e
        for e in read_events(out / "progress")
        if isinstance(e, StepEvent) and e.source.slot == (island, rank) and e.step >= at_step
    ]
    return hits[0].source.pid if hits else None


def run_killing(tmp_path, name, mode, island, at_step, *extra, rank=0):
    """A run in which `rank` of `island` gets kill -9 once it has trained `at_step` steps (a real SIGKILL,
    aimed by progress rather than by the clock, so it lands mid-training however loaded the machine is); the
    launcher sees it die and restarts the island. Returns the summary, the run folder and the killed pid."""
    out = tmp_path / name
    killed = {}

    def killer():
        pid = wait_until(lambda: pid_at_step(out / mode, island, at_step, rank), timeout=240, interval=0.2)
        os.kill(pid, signal.SIGKILL)
        killed["pid"] = pid

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    summary, _ = run(tmp_path, name, "--mode", mode, *extra)
    thread.join(1)
    assert "pid" in killed, f"{island} never reached step {at_step}"
    return summary, out, killed["pid"]


def island_events(out, island, kind):
    return [e for e in read_events(out / "progress") if isinstance(e, kind) and e.source.island == island]


def step_rate(out, island):
    """Steps per second of an island's rank 0 over its training, from its progress events."""
    steps = island_events(out, island, StepEvent)
    return (len(steps) - 1) / (steps[-1].t - steps[0].t)


def test_a_restarted_island_rejoins_with_the_current_fragments(tmp_path):
    """island-1 is killed at step 15 of 40: its replacement's first pull returns the global versions of
    that moment (at least those island-0 had already mixed in), not the initial ones, and it trains on from
    the trained model rather than from scratch (with the optimizer state it checkpointed every 5 steps: a
    cold Adam's first steps alone lift the loss by a few tenths, see the warm-restart test below)."""
    (summary,), out, pid = run_killing(
        tmp_path, "rejoin", "diloco", "island-1", 15, "--eval-every", "5", "--checkpoint-every", "5"
    )
    out = out / "diloco"
    restarted = [e for e in island_events(out, "island-1", StartEvent) if e.source.pid != pid]
    assert len(restarted) == 1 and summary["restarts"] == 1
    # Killed after its step 15, so its replacement's start is restarting time, not first start, however loaded
    # the machine (a kill by the clock may land before a loaded worker's first step, which is first start).
    assert summary["losses"]["restarting"] > 0, "the replacement started after the kill"
    rejoined = restarted[0]
    adopted = {}
    for e in island_events(out, "island-0", RoundEvent):
        if e.t < rejoined.t and e.version is not None:
            adopted[e.fragment] = max(adopted.get(e.fragment, 0), e.version)
    assert adopted and all(v > 0 for v in adopted.values()), "island-0 had mixed merged fragments by then"
    assert all(rejoined.versions[p] >= v for p, v in adopted.items()), (rejoined.versions, adopted)
    first_eval = next(e for e in island_events(out, "island-1", EvalEvent) if e.source.pid == rejoined.source.pid)
    assert first_eval.loss < 4.0 < INITIAL_LOSS, "the replacement trains on from the global model"
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < 3.5


def test_a_killed_island_resumes_at_the_jobs_step_with_warm_optimizer_state(tmp_path):
    """Three islands of 50 steps, H=10, checkpoints every 10 steps; island-1 and island-2 get kill -9 at
    step 30, island-2's checkpoint deleted with it (a cold start, for comparison). Both replacements resume
    at the job's step as the shards count it, not at 0, so the run trains about 3 x 50 steps' tokens, not
    the 2 x 30 more of islands that start over; island-1 restores its AdamW moments, island-2 cannot, and
    island-1's first steps stay near island-0's loss at the same steps. (How far fresh moments throw island-2
    off is within the noise of five steps of this tiny model, so it is not compared.)"""
    steps, inner_steps, kill_at = 50, 10, 30
    out = tmp_path / "warm" / "diloco"
    killed = {}

    def killer():
        for island in ("island-1", "island-2"):
            pid = wait_until(lambda: pid_at_step(out, island, kill_at), timeout=240, interval=0.2)
            os.kill(pid, signal.SIGKILL)
            if island == "island-2":
                (out / "checkpoints" / "workers" / f"{island}-rank0.safetensors").unlink()
            killed[island] = pid

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    (summary,), _ = run(
        tmp_path, "warm", "--islands", "3", "--steps", str(steps), "--inner-steps", str(inner_steps),
        "--checkpoint-every", "10", "--eval-every", "1000",
    )  # fmt: skip
    thread.join(1)
    assert len(killed) == 2 and summary["restarts"] == 2

    def replacement(island):
        (start,) = [e for e in island_events(out, island, StartEvent) if e.source.pid != killed[island]]
        return start

    for island in killed:
        island_0 = [e.step for e in island_events(out, "island-0", StepEvent) if e.t <= replacement(island).t]
        assert kill_at - inner_steps <= replacement(island).step <= island_0[-1], "where the job is, not step 0"
    # A kill lands a step or more after the step it was aimed at (the killer polls the progress files, and
    # island-2's waits for island-1's); at most H before the step it landed at is trained again.
    landed = {
        island: max(e.step for e in island_events(out, island, StepEvent) if e.source.pid == pid)
        for island, pid in killed.items()
    }
    retrained = sum(step - (kill_at - inner_steps) for step in landed.values())
    tokens_per_step = 16 * 128  # batch 16 of the tiny preset's 128-token context
    assert summary["tokens_trained"] <= (3 * steps + retrained) * tokens_per_step, "at most H lost per kill"
    done = {e.source.island: e.step for e in read_events(out / "progress") if isinstance(e, DoneEvent)}
    assert done == {f"island-{i}": steps for i in range(3)}

    def first_steps_above_island_0(island, count=5):
        """Mean loss of the replacement's first steps less island-0's at the same step numbers."""
        first = [e for e in island_events(out, island, StepEvent) if e.source.pid != killed[island]][:count]
        beside = {e.step: e.loss for e in island_events(out, "island-0", StepEvent)}
        return sum(e.loss - beside[e.step] for e in first) / count

    assert replacement("island-1").warm and not replacement("island-2").warm, "island-2 lost its checkpoint"
    warm = first_steps_above_island_0("island-1")
    assert warm < 0.2, f"the warm replacement's first steps are {warm:.3f} above island-0's"


def test_an_island_of_two_ranks_re_forms_when_one_of_them_dies(tmp_path):
    """`--ranks-per-island 2`: each island is one process whose two local ranks train (as a pod with two
    accelerators does); kill -9 of island-1's rank 1 takes its process and rank 0 down, and both restart
    together, while island-0 trains on untouched."""
    (summary,), out, pid = run_killing(tmp_path, "ranks", "diloco", "island-1", 15, "--ranks-per-island", "2", rank=1)
    events = read_events(out / "diloco" / "progress")
    starts = Counter(e.source.slot for e in events if isinstance(e, StartEvent))
    assert starts == {("island-0", 0): 1, ("island-0", 1): 1, ("island-1", 0): 2, ("island-1", 1): 2}
    assert summary["restarts"] == 1, "one island's process restarted, with both its ranks"
    killed = [e.source.pid for e in events if isinstance(e, StartEvent) and e.source.slot == ("island-1", 1)]
    assert killed[0] == pid != killed[1], "the rank killed was replaced by a new process"
    done = {e.source.slot: e for e in events if isinstance(e, DoneEvent)}
    assert {slot: e.step for slot, e in done.items()} == {slot: 40 for slot in starts}
    assert all(done[island, 1].learner.syncs_pushed == 0 for island in ("island-0", "island-1"))
    assert all(done[island, 0].learner.syncs_merged > 0 for island in ("island-0", "island-1"))
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < 3.5


def blocked_share(out, island):
    """The share of an island's rank-0 step time spent blocked on its syncs, from its progress events."""
    steps = island_events(out, island, StepEvent)
    return sum(e.sync_seconds for e in steps) / sum(e.seconds for e in steps)


def test_a_slow_island_does_not_slow_the_others(tmp_path):
    """island-1 four times slower (older hardware): island-0 never waits for it (a barrier would block it for
    three quarters of its time), and the shards merge its deltas without waiting for island-1's; speed-aware
    (the default), island-1 runs fewer inner steps per round than island-0. Measured within the one run: a
    step rate against another run's would measure the machine's load between the two."""
    (slow,), slow_out = run(tmp_path, "slow", "--slowdown", "1,4")
    out = slow_out / "diloco"
    assert blocked_share(out, "island-0") < 0.1, blocked_share(out, "island-0")
    assert step_rate(out, "island-0") > 2 * step_rate(out, "island-1"), "island-1 really was slower"
    assert slow["islands_per_merge"] < 2, "some merges went ahead without the slow island"
    assert slow["round_steps"]["island-1"] < slow["round_steps"]["island-0"], slow["round_steps"]
    assert math.isfinite(slow["final_loss"]) and slow["final_loss"] < 3.5


def test_an_emulated_device_gives_every_step_its_islands_factor_times_the_reference(tmp_path):
    """With a reference step time, a slow island's steps last its factor times that, whatever the islands
    beside it compute (`diloco.worker.slowdown`); a step whose compute outlasts it is flagged as an overrun.
    With --equal-time the island three times faster takes three times the steps, in the same time."""
    emulated = ["--steps", "10", "--slowdown", "1,3", "--reference-step-seconds", "0.2", "--equal-time"]
    run(tmp_path, "emulated", *emulated)
    for island, count, least in (("island-0", 30, 0.2), ("island-1", 10, 0.6)):
        steps = island_events(tmp_path / "emulated" / "diloco", island, StepEvent)
        assert len(steps) == count and all(e.seconds >= least - 1e-3 for e in steps), [e.seconds for e in steps]
        assert all(e.compute_seconds > least for e in steps if e.overran)


def test_a_reference_step_time_must_be_positive(tmp_path, capsys):
    assert main(["run", "--reference-step-seconds", "-1", "--out", str(tmp_path)]) == 2
    assert "--reference-step-seconds must be positive" in capsys.readouterr().err


def test_sync_diloco_is_a_barrier_across_all_islands(tmp_path):
    """The synchronous baseline: every merge waits for every island alive (K = M), so a fast island trains
    at the slow one's pace; killed with kill -9 mid-training, the slow island's replacement resumes the
    job's fragment schedule at the last merged due step, so the barrier goes on instead of deadlocking."""
    (summary,), out, pid = run_killing(
        tmp_path, "barrier", "sync-diloco", "island-1", 12, "--slowdown", "1,4", "--timeout", "240"
    )
    out = out / "sync-diloco"
    assert not summary["timed_out"] and summary["restarts"] == 1
    assert summary["merges"] > 0 and summary["islands_per_merge"] == 2, "every merge took in both islands"
    assert step_rate(out, "island-0") < 2 * step_rate(out, "island-1"), "island-0 was held to island-1's pace"
    (rejoined,) = [e for e in island_events(out, "island-1", StartEvent) if e.source.pid != pid]
    assert rejoined.step >= 10 and rejoined.step % 5 == 0, "resumed at a due step of the job (H=10, P=2)"
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < 3.5


def test_the_data_parallel_baseline_s_final_model_is_evaluated_once_by_rank_0(tmp_path):
    """Its ranks hold the same model; the others end with their last step rather than repeat the evaluation."""
    (summary,), out = run(tmp_path, "ddp", "--mode", "ddp", "--steps", "10")
    done = {e.source.rank: e for e in read_events(out / "ddp" / "progress") if isinstance(e, DoneEvent)}
    assert math.isfinite(done[0].loss) and summary["final_loss"] == done[0].loss < INITIAL_LOSS
    assert math.isnan(done[1].loss), "no evaluation was asked of rank 1 (eval every 20 steps, 10 trained)"


def test_the_merge_policy_defaults_are_a_jobs_own():
    """A local run merges as a DiLoCoJob with the same knobs unset would; only the schedule is scaled down."""
    args, job = build_parser().parse_args(["run"]), TrainingConfig()
    assert (args.encoding, args.quorum, args.grace_seconds, args.speed_aware) == (
        job.encoding.value,
        job.quorum,
        job.grace_seconds,
        job.speed_aware,
    )
