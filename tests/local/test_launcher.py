"""A local job's folder: what a run finds there from an earlier run."""

from diloco.core.config import TrainingConfig
from diloco.local.launcher import LocalJob, RunPlan


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
