"""A job's token rotation (`diloco.dev/rotate-token`), without a refused push: the shards accept the new token
beside the old one before any island presents it, the islands roll onto it as spec.updateStrategy says, and the
shards drop the old one only once no island pod holds it.

Decided afresh on every pass from what exists: the job's token Secret as it lives (the token presented, those
accepted), the token the job should have now (`tokens.job_token`), the token fingerprints the island pods carry
(their template's `diloco.dev/token-hash`, terminating pods included: they push their last steps with it), and
whether every shard took a Status call with the new token (its `diloco-syncer` re-reads the Secret's accepted
tokens when the kubelet updates the mounted file, within a minute or so, and takes no restart).

1. The job's token changed: the Secret accepts both, and still presents the old one. Nothing rolls.
2. Every shard accepts the new token: the Secret presents it. Its fingerprint in the island templates changes,
   so the islands roll onto it, `maxUnavailable` at a time (`rolling_update`); the shards' templates carry no
   fingerprint of the token, so they do not restart.
3. No island pod holds the old token any more: the Secret accepts the new one alone.
"""

from __future__ import annotations

from collections.abc import Collection

from diloco.api.conditions import Reason
from diloco.operator.events import Event
from diloco.operator.tokens import JobTokens, fingerprint


def rotation_step(
    wanted: str, live: JobTokens | None, held: Collection[str], shards_accept_wanted: bool
) -> tuple[JobTokens, tuple[Event, ...]]:
    """The tokens to render on this pass and the Events that announce a step. `held`: the token fingerprints of
    the job's island pods; `shards_accept_wanted`: every shard answered the operator's call with `wanted`."""
    if live is None:
        return JobTokens.only(wanted), ()
    if live.presented != wanted:
        accepted = tuple(dict.fromkeys([*live.accepted, live.presented, wanted]))
        if not shards_accept_wanted:
            events = () if wanted in live.accepted else (Event("Normal", Reason.TOKEN_ROTATING, MSG_ACCEPTING),)
            return JobTokens(live.presented, accepted), events
        return JobTokens(wanted, accepted), (Event("Normal", Reason.TOKEN_ROTATING, MSG_PRESENTING),)
    still_held = tuple(t for t in live.accepted if t != wanted and fingerprint(t) in held)
    if len(live.accepted) > 1 and not still_held:
        return JobTokens.only(wanted), (Event("Normal", Reason.TOKEN_ROTATED, MSG_DROPPED),)
    return JobTokens(wanted, tuple(dict.fromkeys([*still_held, wanted]))), ()


MSG_ACCEPTING = "token rotation: the syncer shards are given the new token beside the old one; no pod restarts"
MSG_PRESENTING = (
    "token rotation: every syncer shard accepts the new token; the islands roll onto it "
    "(spec.updateStrategy.maxUnavailable at a time), the shards accepting both meanwhile"
)
MSG_DROPPED = "token rotation: every island pod holds the new token; the syncer shards no longer accept the old one"
