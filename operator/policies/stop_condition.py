"""spec.stopCondition: when the job has trained enough and succeeds. The slowest fragment is where the model
is, so progress is the minimum over the fragments, and only once every fragment has reported; with it, the
outer steps and tokens a shard lost with its state, which the shard carries (`syncer_state`)."""

from __future__ import annotations

from collections.abc import Sequence

from diloco.api.job import FragmentProgress, ShardLineage, StopCondition


def slowest_fragment(
    fragments: Sequence[FragmentProgress], num_fragments: int, lineages: Sequence[ShardLineage] = ()
) -> tuple[int, int] | None:
    """Outer steps and tokens every fragment has reached, with those its shard carries, or None until every
    fragment has reported."""
    if len(fragments) < num_fragments or not fragments:
        return None
    carried = {s.shard: (s.carried_outer_steps, s.carried_tokens) for s in lineages}
    return (
        min(f.version + carried.get(f.shard, (0, 0))[0] for f in fragments),
        min(f.tokens + carried.get(f.shard, (0, 0))[1] for f in fragments),
    )


def stop_reached(stop: StopCondition, progress: tuple[int, int] | None) -> str | None:
    """Why the job is done (a message), or None, from its progress (outer steps and tokens every fragment has
    reached, with those carried; None until every fragment has reported)."""
    if progress is None:
        return None
    step, tokens = progress
    if stop.outer_steps is not None and step >= stop.outer_steps:
        return f"every fragment reached {step} outer steps (stopCondition.outerSteps {stop.outer_steps})"
    if stop.tokens is not None and tokens >= stop.tokens:
        return f"every fragment merged {tokens} tokens (stopCondition.tokens {stop.tokens})"
    return None
