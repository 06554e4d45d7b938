"""A process's imports run with the cyclic garbage collector paused; what they made is frozen out of every
later collection."""

import gc

import pytest

from diloco.startup import collection_paused


@pytest.fixture(autouse=True)
def thawed():
    """This process's objects are the test runner's: not left frozen for the tests after these."""
    yield
    gc.unfreeze()


def test_nothing_is_collected_inside_and_collection_resumes_after():
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_what_was_made_inside_is_frozen_out_of_later_collections():
    gc.unfreeze()
    with collection_paused():
        made = [[index] for index in range(10_000)]
    assert gc.get_freeze_count() >= len(made)
    assert not any(obj is made for obj in gc.get_objects()), "no generation a collection walks holds it"
