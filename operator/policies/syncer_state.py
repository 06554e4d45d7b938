"""A syncer shard that lost its state is loud. A shard resumes from its checkpoint volume; one that comes back
without it (the claim deleted and made anew, a volume whose data went with its claim, a checkpoint older than
what it had served) starts its fragments again from the values the first island seeds it with, at version 0,
with no outer momentum. Training goes on (the islands hold the model), but the outer steps and tokens the
shard counted are gone, and the stop condition would count them again.

So a fragment whose version goes back, as the shards report them pass after pass, is a loss: a Warning Event
names the shard, the fragments and how far they went back; condition SyncerStateLost turns true for the rest
of the job's life; `status.syncer.lastStateLoss` is when (islands that have not synced since do not train,
`island_training`); and the job's outer steps and tokens that went back are carried
(`status.carriedOuterSteps`, `carriedTokens`), still counting toward spec.stopCondition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from diloco.api.conditions import Reason
from diloco.api.job import FragmentProgress
from diloco.operator.events import Event

MAX_NAMED = 8
"""Fragments an Event names at most; the rest are counted."""


@dataclass(frozen=True)
class Regression:
    """A fragment whose version went back from one pass to the next."""

    fragment: int
    shard: int
    was: int
    now: int


def regressions(previous: Sequence[FragmentProgress], current: Sequence[FragmentProgress]) -> list[Regression]:
    """The fragments whose version is lower now than on the last pass."""
    before = {f.fragment: f for f in previous}
    return [
        Regression(f.fragment, f.shard, before[f.fragment].version, f.version)
        for f in current
        if f.fragment in before and f.version < before[f.fragment].version
    ]


def carried(
    carried_before: tuple[int, int], progress_before: tuple[int, int] | None, progress_now: tuple[int, int] | None
) -> tuple[int, int]:
    """Outer steps and tokens carried toward the stop condition: those carried so far, and what the job's progress
    (the slowest fragment's, without them) lost on this pass. The shard that lost its state holds the slowest
    fragments from then on, so the job's progress goes on from where it was."""
    if progress_before is None or progress_now is None:
        return carried_before
    (steps, tokens), (steps_was, tokens_was), (steps_now, tokens_now) = carried_before, progress_before, progress_now
    return steps + max(0, steps_was - steps_now), tokens + max(0, tokens_was - tokens_now)


def loss_message(lost: Sequence[Regression], carried_steps: int) -> str:
    """What was lost, in words: the shards, the fragments and how far they went back."""
    shards = sorted({r.shard for r in lost})
    named = ", ".join(f"{r.fragment} ({r.was} -> {r.now})" for r in lost[:MAX_NAMED])
    more = f" and {len(lost) - MAX_NAMED} more" if len(lost) > MAX_NAMED else ""
    return (
        f"syncer shard{'s' if len(shards) > 1 else ''} {', '.join(map(str, shards))} came back without its state: "
        f"fragments {named}{more} went back in version (a checkpoint volume lost or replaced, or an older "
        f"checkpoint); the islands seed it with the model they hold, and {carried_steps} outer steps are carried "
        "toward the stop condition"
    )


def loss_event(lost: Sequence[Regression], carried_steps: int) -> Event:
    return Event("Warning", Reason.SYNCER_STATE_LOST, loss_message(lost, carried_steps))
