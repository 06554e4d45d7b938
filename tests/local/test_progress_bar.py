"""What `diloco run`'s progress bar shows beside its step count, from the workers' progress files."""

from diloco.local.run import ProgressReader
from diloco.progress import EvalEvent, ProgressWriter, Source, StepEvent
from diloco.worker.curves import TrainingCurves


def writer(folder, island):
    return ProgressWriter(folder / f"{island}-rank0.jsonl", Source(island, 0, "diloco", 1), clock=lambda: 1.0)


def test_nothing_before_the_first_step_then_the_training_loss_until_the_first_evaluation(tmp_path):
    progress = tmp_path / "progress"
    progress.mkdir()
    reader = ProgressReader(progress, TrainingCurves(tmp_path / "tensorboard"))
    assert reader.poll() == 0 and reader.postfix == {}, "no loss=nan while the workers start"
    island = writer(progress, "island-0")
    island.write(StepEvent, step=1, loss=5.25, tokens=8, seconds=0.1)
    assert reader.poll() == 1 and reader.postfix == {"loss": "5.250"}
    island.write(EvalEvent, step=1, loss=4.5)
    island.write(StepEvent, step=2, loss=4.0, tokens=8, seconds=0.1)
    assert reader.poll() == 2 and reader.postfix == {"loss": "4.500"}, "the held-out loss once there is one"
    island.close()
    reader.curves.close()
