"""A shard that lost its state is loud: a fragment whose version went back is named, with how far, and the
job's progress it took away is carried toward the stop condition."""

from diloco.api.job import FragmentProgress
from diloco.operator.policies.syncer_state import Regression, carried, loss_event, regressions


def progress(*versions, shards=2):
    return [FragmentProgress(fragment=f, shard=f % shards, version=v, tokens=v * 100) for f, v in enumerate(versions)]


def test_a_fragment_whose_version_went_back_is_a_regression_and_progress_is_not():
    assert regressions(progress(25, 25, 30), progress(26, 25, 31)) == []
    assert regressions(progress(25, 25, 30), progress(0, 26, 1)) == [Regression(0, 0, 25, 0), Regression(2, 0, 30, 1)]
    assert regressions([], progress(0, 0)) == [], "a new job's first report is no loss"


def test_what_the_job_lost_is_carried_and_what_it_kept_is_not():
    assert carried((0, 0), (25, 2500), (0, 0)) == (25, 2500)
    assert carried((25, 2500), (3, 300), (1, 100)) == (27, 2700), "a second loss adds up"
    assert carried((5, 500), (25, 2500), (25, 2500)) == (5, 500), "a fragment other than the slowest went back"
    assert carried((5, 500), None, (0, 0)) == (5, 500)


def test_the_event_names_the_shard_the_fragments_and_what_is_carried():
    event = loss_event([Regression(0, 0, 25, 0), Regression(2, 0, 30, 1)], carried_steps=25)
    assert (event.type, event.reason) == ("Warning", "SyncerStateLost")
    assert "syncer shard 0 came back without its state" in event.message
    assert "fragments 0 (25 -> 0), 2 (30 -> 1)" in event.message and "25 outer steps are carried" in event.message
