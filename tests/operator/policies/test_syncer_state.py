"""A shard that lost its state is loud: a shard that reports a new lineage, or a fragment whose version went
back, is named with its fragments and how far they went back, and the shard carries what its lost state had
merged toward the stop condition."""

from diloco.api.job import FragmentProgress, ShardLineage
from diloco.operator.policies.syncer_state import Regression, follow, loss_event, new_states, regressions


def progress(*versions, shards=2):
    return [FragmentProgress(fragment=f, shard=f % shards, version=v, tokens=v * 100) for f, v in enumerate(versions)]


OLD, NEW = "00000000000000aa", "00000000000000bb"


def test_a_fragment_whose_version_went_back_is_a_regression_and_progress_is_not():
    assert regressions(progress(25, 25, 30), progress(26, 25, 31)) == []
    assert regressions(progress(25, 25, 30), progress(0, 26, 1)) == [
        Regression(0, 0, 25, 0, 2500),
        Regression(2, 0, 30, 1, 2900),
    ]
    assert regressions([], progress(0, 0)) == [], "a new job's first report is no loss"


def test_a_new_lineage_is_a_loss_however_far_its_versions_have_got_again():
    had = [ShardLineage(shard=0, lineage=OLD), ShardLineage(shard=1, lineage=OLD)]
    assert new_states(had, {0: NEW, 1: OLD}) == {0}
    assert new_states([], {0: NEW}) == set(), "a lineage first known is no loss"
    assert new_states(had, {0: None}) == set(), "nor one a shard does not say (an older image)"
    assert regressions(progress(5, 5, 6), progress(9, 6, 10), renewed={0}) == [
        Regression(0, 0, 5, 0, 500),
        Regression(2, 0, 6, 0, 600),
    ]


def test_a_shard_carries_the_least_its_fragments_lost_and_keeps_it():
    before, seen = progress(25, 40, 27), progress(30, 41, 31)
    lost = regressions(before, seen, renewed={0})
    (shard0, shard1) = follow([ShardLineage(shard=0, lineage=OLD)], {0: NEW, 1: OLD}, lost, seen)
    assert shard0 == ShardLineage(shard=0, lineage=NEW, carried_outer_steps=25, carried_tokens=2500)
    assert shard1 == ShardLineage(shard=1, lineage=OLD), "a shard first seen carries nothing"
    later = follow([shard0, shard1], {0: NEW}, [], progress(31, 42, 32))
    assert later == [shard0, shard1], "carried once, then kept; a shard that did not answer keeps its lineage"
    older = progress(20, 42, 32)
    (again, _) = follow(later, {0: NEW}, regressions(progress(31, 42, 32), older), older)
    assert (again.carried_outer_steps, again.carried_tokens) == (25, 2500), "fragment 2 did not go back: none carried"


def test_the_event_names_the_shard_the_fragments_and_what_is_carried():
    event = loss_event([Regression(0, 0, 25, 0), Regression(2, 0, 30, 1)])
    assert (event.type, event.reason) == ("Warning", "SyncerStateLost")
    assert "syncer shard 0 came back without its state" in event.message
    assert "fragments 0 (25 -> 0), 2 (30 -> 1)" in event.message and "25 outer steps are carried" in event.message
