"""The rules relating knobs: each holds where it should, and explains itself in its caller's names."""

import pytest

from diloco.core.rules import (
    FRAGMENTS_WITHIN_INNER_STEPS,
    OVERLAP_WITHIN_FRAGMENT_SPACING,
    QUORUM_WITHIN_ISLANDS,
    RULES,
    SHARDS_WITHIN_FRAGMENTS,
)


def test_tau_must_end_before_the_next_fragment_is_due():
    # H = 10, P = 3: fragments are due every 10 // 3 = 3 steps, so tau may be 0, 1 or 2.
    assert OVERLAP_WITHIN_FRAGMENT_SPACING.holds(overlap_steps=2, inner_steps=10, fragments=3)
    assert not OVERLAP_WITHIN_FRAGMENT_SPACING.holds(overlap_steps=3, inner_steps=10, fragments=3)
    # With P > H it is the fragments rule that is broken; tau is not blamed as well.
    assert OVERLAP_WITHIN_FRAGMENT_SPACING.holds(overlap_steps=0, inner_steps=2, fragments=3)
    assert not FRAGMENTS_WITHIN_INNER_STEPS.holds(fragments=3, inner_steps=2)


def test_a_broken_rule_names_the_knobs_as_its_caller_does():
    with pytest.raises(ValueError) as default:
        QUORUM_WITHIN_ISLANDS.check(quorum=5, islands=4)
    assert str(default.value) == "quorum (K=5) must not exceed the number of islands in the job (4)"
    with pytest.raises(ValueError) as flags:
        QUORUM_WITHIN_ISLANDS.check({"quorum": "--quorum", "islands": "--islands"}, quorum=5, islands=4)
    assert str(flags.value) == "--quorum (K=5) must not exceed the number of islands in --islands (4)"
    with pytest.raises(ValueError, match=r"^shards \(3\) must not exceed fragments \(2\)"):
        SHARDS_WITHIN_FRAGMENTS.check(shards=3, fragments=2)
    SHARDS_WITHIN_FRAGMENTS.check(shards=2, fragments=2)


def test_every_rule_has_a_cel_form_that_blames_a_field_of_the_spec():
    for rule in RULES:
        assert rule.cel.startswith("self.") and rule.field_path.startswith(".")
        assert rule.message.startswith("spec." + rule.field_path[1:]), rule.message
