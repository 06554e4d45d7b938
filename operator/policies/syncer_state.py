"""A syncer shard that lost its state is loud. A shard resumes from its checkpoint volume; one that comes back
without it (the claim deleted and made anew, a volume whose data went with its claim, a checkpoint older than
what it had served) starts its fragments again from the values the first island seeds it with, at version 0,
with no outer momentum. Training goes on (the islands hold the model), but the outer steps and tokens the
shard counted are gone, and the stop condition would count them again.

A shard's state went back when, from one pass to the next, it reports a new lineage (the id a shard draws when
it starts without a checkpoint: a new state, however far its versions have got again by the time the operator
looks), or a fragment of it a lower version in the same lineage (an older checkpoint). That is a loss: a Warning
Event names the shard, the fragments and how far they went back; condition SyncerStateLost turns true for the
rest of the job's life; `status.syncer.lastStateLoss` is when (islands that have not synced since do not train,
`island_training`); and the shard carries the outer steps and tokens its lost state had merged (the least of
its fragments, `status.syncer.lineages`), still counting toward spec.stopCondition.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from diloco.api.conditions import Reason
from diloco.api.job import FragmentProgress, ShardLineage
from diloco.operator.events import Event

MAX_NAMED = 8
"""Fragments an Event names at most; the rest are counted."""


@dataclass(frozen=True)
class Regression:
    """A fragment whose state went back from one pass to the next: from version `was` to `now` (0 in a new
    state, whatever it has reached since), losing the merges of `tokens` tokens."""

    fragment: int
    shard: int
    was: int
    now: int
    tokens: int = 0


def new_states(previous: Sequence[ShardLineage], reported: Mapping[int, str | None]) -> set[int]:
    """The shards that report a lineage other than the one they had (one first known, or not known, is none)."""
    had = {s.shard: s.lineage for s in previous}
    return {
        shard
        for shard, lineage in reported.items()
        if lineage is not None and had.get(shard) is not None and had[shard] != lineage
    }


def regressions(
    previous: Sequence[FragmentProgress], current: Sequence[FragmentProgress], renewed: Collection[int] = ()
) -> list[Regression]:
    """The fragments whose state went back on this pass: every fragment of a shard in `renewed` (`new_states`),
    and any other whose version is lower now."""
    before = {f.fragment: f for f in previous}
    found = []
    for f in current:
        if (b := before.get(f.fragment)) is None:
            continue
        if f.shard in renewed:
            found.append(Regression(f.fragment, f.shard, b.version, 0, b.tokens))
        elif f.version < b.version:
            found.append(Regression(f.fragment, f.shard, b.version, f.version, max(0, b.tokens - f.tokens)))
    return found


def follow(
    previous: Sequence[ShardLineage],
    reported: Mapping[int, str | None],
    lost: Sequence[Regression],
    current: Sequence[FragmentProgress],
) -> list[ShardLineage]:
    """Each shard's lineage as last reported, carrying what its lost states had merged: for each loss, the least
    any of its fragments lost (one that did not go back lost nothing), so the stop condition never comes early."""
    by_shard = {s.shard: s for s in previous}
    for shard, lineage in reported.items():
        had = by_shard.get(shard, ShardLineage(shard=shard, lineage=lineage))
        steps, tokens = had.carried_outer_steps, had.carried_tokens
        if its := [r for r in lost if r.shard == shard]:
            went_back = {r.fragment: r for r in its}
            fragments = [went_back.get(f.fragment) for f in current if f.shard == shard]
            steps += min(r.was - r.now if r else 0 for r in fragments)
            tokens += min(r.tokens if r else 0 for r in fragments)
        by_shard[shard] = ShardLineage(shard=shard, lineage=lineage, carried_outer_steps=steps, carried_tokens=tokens)
    return [by_shard[k] for k in sorted(by_shard)]


def loss_message(lost: Sequence[Regression]) -> str:
    """What was lost, in words: the shards, the fragments, how far they went back and what the slowest carries."""
    shards = sorted({r.shard for r in lost})
    named = ", ".join(f"{r.fragment} ({r.was} -> {r.now})" for r in lost[:MAX_NAMED])
    more = f" and {len(lost) - MAX_NAMED} more" if len(lost) > MAX_NAMED else ""
    return (
        f"syncer shard{'s' if len(shards) > 1 else ''} {', '.join(map(str, shards))} came back without its state: "
        f"fragments {named}{more} went back (a checkpoint volume lost or replaced, or an older "
        "checkpoint); the islands seed it with the model they hold, and "
        f"{min(r.was - r.now for r in lost)} outer steps are carried toward the stop condition"
    )


def loss_event(lost: Sequence[Regression]) -> Event:
    return Event("Warning", Reason.SYNCER_STATE_LOST, loss_message(lost))
