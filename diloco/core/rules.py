"""The rules that relate knobs to one another, each stated once: its predicate, its CEL form and its messages.

`TrainingConfig` checks the rules among its own knobs; the `DiLoCoJob` model checks the ones that involve the
job's islands and shards, and renders every rule into the CRD as a CEL rule over the spec, so that the API
server refuses what the model refuses; `diloco run` and the simulator check the quorum against their islands.
A rule's `message` is what the API server prints; `explain` says the same with the values that broke it,
naming each knob the way its caller does (`TrainingConfig`'s camelCase names unless told otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

NAMES: Mapping[str, str] = {
    "inner_steps": "innerSteps",
    "fragments": "fragments",
    "overlap_steps": "overlapSteps",
    "quorum": "quorum",
    "islands": "the job",
    "shards": "shards",
}
"""How a knob is named in a message unless the caller says otherwise."""


@dataclass(frozen=True)
class KnobRule:
    """A rule relating knobs. `holds` and `explain` take the knobs as keyword arguments (`explain` the names
    to print first); `cel` is the same predicate over a `DiLoCoJob` spec, `field_path` the field it blames."""

    holds: Callable[..., bool]
    explain: Callable[..., str]
    cel: str
    message: str
    field_path: str

    def check(self, names: Mapping[str, str] | None = None, **knobs: int) -> None:
        """Raises ValueError, with the values, when the rule does not hold; `names` renames knobs in it."""
        if not self.holds(**knobs):
            raise ValueError(self.explain({**NAMES, **(names or {})}, **knobs))


FRAGMENTS_WITHIN_INNER_STEPS = KnobRule(
    holds=lambda fragments, inner_steps: fragments <= inner_steps,
    explain=lambda n, fragments, inner_steps: (
        f"{n['fragments']} (P={fragments}) must not exceed {n['inner_steps']} (H={inner_steps}): fragment syncs are "
        "staggered by H/P inner steps, which must be at least one step"
    ),
    cel="self.training.fragments <= self.training.innerSteps",
    message="spec.training.fragments (P) must not exceed spec.training.innerSteps (H)",
    field_path=".training.fragments",
)
"""P <= H: fragment syncs are staggered by H/P inner steps."""

OVERLAP_WITHIN_FRAGMENT_SPACING = KnobRule(
    # Blames only tau: when P > H the rule above is the one broken.
    holds=lambda overlap_steps, inner_steps, fragments: (
        fragments > inner_steps or overlap_steps < inner_steps // fragments
    ),
    explain=lambda n, overlap_steps, inner_steps, fragments: (
        f"{n['overlap_steps']} (tau={overlap_steps}) must be less than {n['inner_steps']} // {n['fragments']} "
        f"({inner_steps} // {fragments} = {inner_steps // fragments}): a fragment's merged values must be mixed in "
        "before the next fragment's sync is due, so at most one fragment is in flight at a time"
    ),
    cel="self.training.fragments > self.training.innerSteps || "
    "self.training.overlapSteps < self.training.innerSteps / self.training.fragments",
    message="spec.training.overlapSteps (tau) must be less than spec.training.innerSteps / spec.training.fragments",
    field_path=".training.overlapSteps",
)
"""tau < H/P (integer division): at most one fragment in flight at a time."""

QUORUM_WITHIN_ISLANDS = KnobRule(
    holds=lambda quorum, islands: quorum <= islands,
    explain=lambda n, quorum, islands: (
        f"{n['quorum']} (K={quorum}) must not exceed the number of islands in {n['islands']} ({islands})"
    ),
    cel="self.training.quorum <= size(self.islands)",
    message="spec.training.quorum must not exceed the number of islands in spec.islands",
    field_path=".training.quorum",
)
"""K <= M: a merge must be able to gather its quorum."""

SHARDS_WITHIN_FRAGMENTS = KnobRule(
    holds=lambda shards, fragments: shards <= fragments,
    explain=lambda n, shards, fragments: (
        f"{n['shards']} ({shards}) must not exceed {n['fragments']} ({fragments}): a shard owns fragments p with "
        "p mod shards = its index"
    ),
    cel="self.syncer.shards <= self.training.fragments",
    message="spec.syncer.shards must not exceed spec.training.fragments: a shard owns fragments p with "
    "p mod shards = its index",
    field_path=".syncer.shards",
)
"""shards <= P: every shard owns at least one fragment."""

RULES = (QUORUM_WITHIN_ISLANDS, FRAGMENTS_WITHIN_INNER_STEPS, OVERLAP_WITHIN_FRAGMENT_SPACING, SHARDS_WITHIN_FRAGMENTS)
"""Every rule, in the order the CRD lists them."""
