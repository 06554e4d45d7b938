"""A token rotation refuses no push: the shards accept the new token beside the old before any island presents
it, the islands then roll onto it, and the old one is dropped only once no island pod holds it."""

from diloco.operator.policies.token_rotation import rotation_step
from diloco.operator.tokens import JobTokens, fingerprint

OLD, NEW = "old-token", "new-token"


def test_a_new_job_or_a_lost_secret_starts_with_the_job_token_alone():
    assert rotation_step(NEW, None, set(), shards_accept_wanted=False) == (JobTokens.only(NEW), ())


def test_a_job_at_rest_keeps_its_token():
    assert rotation_step(OLD, JobTokens.only(OLD), {fingerprint(OLD)}, True) == (JobTokens.only(OLD), ())


def test_first_the_shards_are_given_the_new_token_while_the_islands_present_the_old():
    tokens, events = rotation_step(NEW, JobTokens.only(OLD), {fingerprint(OLD)}, shards_accept_wanted=False)
    assert tokens == JobTokens(OLD, (OLD, NEW))
    assert [e.reason for e in events] == ["TokenRotating"]
    again, events = rotation_step(NEW, tokens, {fingerprint(OLD)}, shards_accept_wanted=False)
    assert again == tokens and events == (), "waiting on the shards says nothing more"


def test_once_every_shard_accepts_it_the_islands_present_the_new_token_and_both_stay_accepted():
    tokens, events = rotation_step(NEW, JobTokens(OLD, (OLD, NEW)), {fingerprint(OLD)}, shards_accept_wanted=True)
    assert tokens == JobTokens(NEW, (OLD, NEW))
    assert [e.reason for e in events] == ["TokenRotating"] and "islands roll" in events[0].message


def test_the_old_token_stays_accepted_while_any_island_pod_holds_it_then_goes():
    rolling = JobTokens(NEW, (OLD, NEW))
    held = {fingerprint(OLD), fingerprint(NEW)}
    assert rotation_step(NEW, rolling, held, True) == (rolling, ())
    done, events = rotation_step(NEW, rolling, {fingerprint(NEW)}, True)
    assert done == JobTokens.only(NEW) and [e.reason for e in events] == ["TokenRotated"]


def test_a_second_rotation_during_the_first_keeps_every_token_someone_may_still_present():
    third = "third-token"
    tokens, _ = rotation_step(third, JobTokens(NEW, (OLD, NEW)), {fingerprint(OLD)}, shards_accept_wanted=False)
    assert tokens == JobTokens(NEW, (OLD, NEW, third))
    tokens, _ = rotation_step(third, tokens, {fingerprint(OLD)}, shards_accept_wanted=True)
    assert tokens == JobTokens(third, (OLD, NEW, third))
    tokens, _ = rotation_step(third, tokens, {fingerprint(NEW), fingerprint(third)}, True)
    assert tokens == JobTokens(third, (NEW, third)), "nobody holds the first token any more"
