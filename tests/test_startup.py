"""A process's imports run with the cyclic garbage collector paused."""

import gc

from diloco.startup import collection_paused


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
