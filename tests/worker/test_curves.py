"""TensorBoard event files from progress events: per island and for the job, as the workers report."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diloco.progress import EvalEvent, Source, StepEvent
from diloco.worker.curves import TrainingCurves


def source(island, rank=0):
    return Source(island=island, rank=rank, mode="diloco", pid=1)


def step(island, n, loss, rate=100.0, rank=0):
    return StepEvent(float(n), source(island, rank), step=n, loss=loss, tokens=8, seconds=0.1, tokens_per_second=rate)


def scalars(folder, run, tag):
    events = EventAccumulator(str(folder / run))
    events.Reload()
    return [(e.step, pytest.approx(e.value)) for e in events.Scalars(tag)]


def test_each_island_and_the_job_get_their_curves(tmp_path):
    curves = TrainingCurves(tmp_path, learning_rate=lambda step: 0.001 * (step + 1))
    curves.write([step("island-0", 1, 5.0), step("island-1", 1, 4.0, rate=50.0)])
    curves.write([step("island-0", 2, 3.0), EvalEvent(3.0, source("island-0"), step=2, loss=3.5)])
    curves.write([step("island-1", 2, 2.0, rank=1)])  # another rank of island-1: its island's rank 0 speaks
    curves.write_final(3.25)
    curves.close()
    assert scalars(tmp_path, "island-0", "loss") == [(1, 5.0), (2, 3.0)]
    assert scalars(tmp_path, "island-0", "held_out_loss") == [(2, 3.5)]
    assert scalars(tmp_path, "island-0", "learning_rate") == [(1, 0.001), (2, 0.002)]
    assert scalars(tmp_path, "island-1", "tokens_per_second") == [(1, 50.0)]
    assert scalars(tmp_path, "global", "loss") == [(1, 5.0), (2, 4.5), (3, 3.5), (3, 3.5)]
    assert scalars(tmp_path, "global", "tokens_per_second")[-1] == (3, 150.0)
    assert scalars(tmp_path, "global", "held_out_loss") == [(3, 3.5)]
    assert scalars(tmp_path, "global", "global_model_held_out_loss") == [(3, 3.25)]


def test_a_loop_of_ones_own_has_no_learning_rate_curve(tmp_path):
    curves = TrainingCurves(tmp_path, learning_rate=None)
    curves.write([step("island-0", 1, 5.0)])
    curves.close()
    events = EventAccumulator(str(tmp_path / "island-0"))
    events.Reload()
    assert "learning_rate" not in events.Tags()["scalars"]


def test_an_island_on_its_own_writes_only_its_run(tmp_path):
    curves = TrainingCurves(tmp_path, job=False)
    curves.write([step("island-0", 1, 5.0)])
    curves.close()
    assert [p.name for p in tmp_path.iterdir()] == ["island-0"]
