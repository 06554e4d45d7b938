"""Specification of the shard's shared pull replies: made once per fragment version and key, however many
callers ask and however many at once; only the newest version's kept, and a few keys of it."""

import threading

import pytest

from diloco.syncer.replies import SharedReplies


def test_a_reply_is_made_once_and_given_to_every_caller():
    replies: SharedReplies[str] = SharedReplies()
    made = []
    make = lambda: made.append(1) or f"reply {len(made)}"  # noqa: E731
    assert [replies.get(0, 1, "base", make) for _ in range(3)] == ["reply 1"] * 3
    assert replies.get(1, 1, "base", make) == "reply 2", "another fragment"
    assert replies.get(0, 1, "other base", make) == "reply 3"
    assert replies.get(0, 2, "base", make) == "reply 4", "a newer version"
    assert len(made) == 4


def test_callers_at_once_wait_for_the_one_making_it():
    replies: SharedReplies[int] = SharedReplies()
    started, release, calls = threading.Event(), threading.Event(), []

    def make() -> int:
        calls.append(1)
        started.set()
        release.wait(10)
        return 42

    results: list[int] = []
    first = threading.Thread(target=lambda: results.append(replies.get(0, 1, "k", make)))
    first.start()
    assert started.wait(10)
    others = [threading.Thread(target=lambda: results.append(replies.get(0, 1, "k", make))) for _ in range(4)]
    for thread in others:
        thread.start()
    release.set()
    for thread in [first, *others]:
        thread.join(10)
    assert results == [42] * 5 and calls == [1]


def test_a_newer_version_drops_the_older_and_a_few_keys_are_kept():
    replies: SharedReplies[str] = SharedReplies(bases=2)
    for key in "abc":
        replies.get(0, 1, key, lambda key=key: key)
    assert len(replies) == 2, "the least recently used key went"
    replies.get(0, 2, "a", lambda: "new")
    assert len(replies) == 1
    with pytest.raises(ValueError):
        SharedReplies(bases=0)


def test_a_failure_reaches_the_caller_and_is_not_kept():
    replies: SharedReplies[str] = SharedReplies()

    def fail() -> str:
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        replies.get(0, 1, "k", fail)
    assert replies.get(0, 1, "k", lambda: "made again") == "made again"
