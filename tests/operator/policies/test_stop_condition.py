"""spec.stopCondition: the job succeeds once every fragment reaches the bound; progress is the slowest
fragment's, and none is counted until every fragment has reported."""

from diloco.api.job import FragmentProgress, StopCondition
from diloco.operator.policies.stop_condition import slowest_fragment, stop_reached

TWO = [
    FragmentProgress(fragment=0, shard=0, version=9, tokens=1000),
    FragmentProgress(fragment=1, shard=0, version=4, tokens=800),
]


def test_stop_reached():
    progress = slowest_fragment(TWO, 2)
    assert stop_reached(StopCondition(outer_steps=4), progress)
    assert stop_reached(StopCondition(outer_steps=5), progress) is None
    assert "800 tokens" in stop_reached(StopCondition(tokens=800), progress)
    assert stop_reached(StopCondition(tokens=801), progress) is None
    assert stop_reached(StopCondition(outer_steps=1), slowest_fragment(TWO[:1], 2)) is None
    assert stop_reached(StopCondition(), progress) is None


def test_the_stop_message_names_the_bound_reached():
    assert stop_reached(StopCondition(outer_steps=4), (4, 800)) == (
        "every fragment reached 4 outer steps (stopCondition.outerSteps 4)"
    )
    assert stop_reached(StopCondition(tokens=500), (4, 800)) == (
        "every fragment merged 800 tokens (stopCondition.tokens 500)"
    )


def test_progress_is_the_slowest_fragment_once_every_fragment_reported():
    assert slowest_fragment(TWO, 2) == (4, 800)
    assert slowest_fragment(TWO[:1], 2) is None
    assert slowest_fragment([], 1) is None
