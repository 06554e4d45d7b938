"""Specification of the shard's record of what it served each island: exact matches only, bounded memory."""

import pytest
import torch

from diloco.syncer.references import Reference, References


def _ref(version: int, numel: int = 10, crc: int = 7, incarnation: int = 1) -> Reference:
    return Reference(incarnation, version, (torch.zeros(numel),), crc)


def test_matches_only_the_exact_incarnation_version_and_checksum():
    refs = References(max_bytes=1000)
    refs.record("a", 0, _ref(3))
    assert refs.match("a", 0, 1, 3, 7) is not None
    assert refs.match("a", 0, 2, 3, 7) is None, "another incarnation"
    assert refs.match("a", 0, 1, 2, 7) is None, "another version"
    assert refs.match("a", 0, 1, 3, 8) is None, "other values"
    assert refs.match("b", 0, 1, 3, 7) is None, "another island"
    assert refs.match("a", 1, 1, 3, 7) is None, "another fragment"


def test_a_new_record_replaces_the_island_s_old_one():
    refs = References(max_bytes=1000)
    refs.record("a", 0, _ref(3))
    refs.record("a", 0, _ref(4))
    assert refs.match("a", 0, 1, 3, 7) is None
    assert refs.match("a", 0, 1, 4, 7) is not None
    assert len(refs) == 1


def test_the_least_recently_served_are_dropped_beyond_the_memory_bound():
    refs = References(max_bytes=100)  # two references of 40 bytes fit, three do not
    refs.record("a", 0, _ref(1))
    refs.record("b", 0, _ref(1))
    refs.record("a", 0, _ref(2))  # a was served again: b is now the oldest
    refs.record("c", 0, _ref(1))
    assert refs.match("b", 0, 1, 1, 7) is None
    assert refs.match("a", 0, 1, 2, 7) is not None and refs.match("c", 0, 1, 1, 7) is not None


def test_a_reference_larger_than_the_bound_is_not_kept():
    refs = References(max_bytes=10)
    refs.record("a", 0, _ref(1, numel=100))
    assert len(refs) == 0 and refs.match("a", 0, 1, 1, 7) is None
    with pytest.raises(ValueError):
        References(max_bytes=-1)


def test_a_reference_several_islands_hold_is_counted_once():
    """One reply sent to every island that held the same values: kept once, so it does not crowd others out."""
    refs = References(max_bytes=100)  # two references of 40 bytes fit
    shared = _ref(1)
    for island in "abcd":
        refs.record(island, 0, shared)
    refs.record("e", 0, _ref(1))
    assert refs.nbytes == 80 and len(refs) == 5
    assert all(refs.match(island, 0, 1, 1, 7) is not None for island in "abcde")
    refs.record("f", 0, _ref(1))  # 120 bytes: the least recently served go, the shared one with its last holder
    assert refs.nbytes == 80 and len(refs) == 2
    assert refs.match("e", 0, 1, 1, 7) is not None and refs.match("f", 0, 1, 1, 7) is not None
