"""What a learner writes for `diloco run` about a loop of one's own (`LoopInstruments`): read from the
variables a local run sets, and turned into the progress events the runner counts, from the learner's
public state alone (a stand-in learner here: the events are the unit under test)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from diloco import pod_env
from diloco.progress import DoneEvent, PushEvent, RoundEvent, StartEvent, StepEvent, read_events
from diloco.worker.learner import PushReport, RoundReport
from diloco.worker.loop_instruments import LoopInstruments
from diloco.worker.stats import LearnerStats, Version
from diloco.worker.sync import RoundOutcome


@dataclass
class StandIn:
    """A learner as the instruments see it: its island, step, stats and the loss the loop reported."""

    stats: LearnerStats = field(default_factory=LearnerStats)
    island_id: str = "island-2"
    island: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(rank=1, size=2))
    resume_step: int = 30
    resumed_warm: bool = True
    inner_step: int = 30
    loss: float = math.nan

    def step(self, tokens: int, blocked: float, loss: float) -> None:
        """What the learner's hook has done by the time the instruments hear of a step."""
        self.inner_step += 1
        self.stats.inner_steps += 1
        self.stats.tokens += tokens
        self.stats.blocked_seconds += blocked
        self.loss = loss


def test_nothing_is_instrumented_in_a_pod_which_gets_none_of_the_variables():
    assert LoopInstruments.from_env({pod_env.ISLAND: "a", pod_env.SYNCERS: "h:1"}) is None


def test_the_variables_of_a_local_run_say_where_to_write_and_how_slow_to_be(tmp_path):
    env = {
        pod_env.PROGRESS_FILE: str(tmp_path / "island-0-rank{rank}.jsonl"),
        pod_env.MODE: "sync-diloco",
        pod_env.SLOWDOWN: "3",
        pod_env.JITTER: "0.25",
    }
    instruments = LoopInstruments.from_env(env)
    assert instruments.synchronous and instruments.slowdown == 3 and instruments.jitter == 0.25
    assert instruments.reference_step_seconds is None
    with pytest.raises(ValueError, match="slowdown"):
        LoopInstruments.from_env({**env, pod_env.SLOWDOWN: "0.5"})


def test_a_loops_start_steps_rounds_pushes_and_end_become_the_runners_progress_events(tmp_path):
    instruments = LoopInstruments(str(tmp_path / "progress" / "rank{rank}.jsonl"))
    learner = StandIn()
    learner.stats.versions = {1: Version(0, 7), 0: Version(0, 5)}
    learner.stats.tokens, learner.stats.blocked_seconds = 4096, 2.0  # what the run before this process did
    instruments.started(learner)
    learner.step(tokens=1024, blocked=0.0, loss=2.5)
    instruments.stepped(learner)
    instruments.push(PushReport(fragment=0, began_at_step=31, incarnation=1, base_version=5, sequence=9))
    learner.step(tokens=1024, blocked=0.125, loss=2.25)
    instruments.stepped(learner)
    instruments.round(RoundReport(fragment=0, began_at_step=31, outcome=RoundOutcome.MERGED, version=6))
    instruments.done(learner)
    instruments.done(learner)  # flushed again: the end is written once
    instruments.close()

    start, first, push, second, merged, done = read_events(tmp_path / "progress")
    assert (tmp_path / "progress" / "rank1.jsonl").exists(), "the rank in the island names the file"
    assert start.source.island == "island-2" and start.source.rank == 1 and start.source.mode == "diloco"
    assert isinstance(start, StartEvent) and (start.step, start.world, start.warm) == (30, 2, True)
    assert start.versions == (5, 7), "fragment 0 first"
    assert isinstance(first, StepEvent) and isinstance(second, StepEvent)
    assert (first.step, first.loss, first.tokens, first.sync_seconds) == (31, 2.5, 1024, 0), "this process's own"
    assert (second.step, second.loss, second.tokens, second.sync_seconds) == (32, 2.25, 1024, 0.125)
    assert not second.overran, "no emulated device to overrun"
    assert isinstance(push, PushEvent) and (push.fragment, push.began_at, push.base_version, push.sequence) == (
        0,
        31,
        5,
        9,
    )
    assert isinstance(merged, RoundEvent) and merged.merged and merged.version == 6
    assert isinstance(done, DoneEvent) and done.step == 32 and math.isnan(done.loss), "no held-out loss of the loop's"
    assert done.learner.tokens == 4096 + 2048 and done.learner.inner_steps == 2


def test_a_slowed_loop_sleeps_through_each_step_as_the_built_in_trainer_does(tmp_path):
    """With a reference step time every step lasts the slowdown times it, whatever the loop computed."""
    instruments = LoopInstruments(str(tmp_path / "rank{rank}.jsonl"), slowdown=2.0, reference_step_seconds=0.05)
    learner = StandIn()
    instruments.started(learner)
    for _ in range(2):
        learner.step(tokens=1, blocked=0.0, loss=1.0)
        instruments.stepped(learner)
    instruments.close()
    steps = [e for e in read_events(tmp_path) if isinstance(e, StepEvent)]
    assert len(steps) == 2 and all(e.seconds >= 0.1 for e in steps), [e.seconds for e in steps]
