"""Why a peer's call or stream is refused, named by what the caller can do about it.

The shard's decisions and the stream readers say which kind of refusal they mean; the transport states once
which status code each kind travels as (`diloco.transport.codes`), and the island reads it back from there
to choose between pulling afresh and giving up.
"""

import enum


class Refusal(enum.Enum):
    """The kinds of refusal in the contract."""

    UNAUTHENTICATED = "unauthenticated"  # no or wrong job token: the caller is not part of this job
    INVALID = "invalid"  # malformed, or not this job's layout: repeating the call can never succeed
    OUT_OF_STEP = "out_of_step"  # the caller's view of the fragment is not the shard's: pull afresh (or seed)
    TOO_LARGE = "too_large"  # more than the shard takes: bytes in a message or call, islands, calls at once
