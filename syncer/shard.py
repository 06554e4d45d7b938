"""The merge decisions of one syncer shard: quorum, grace window, staleness, idempotency and outer step.

No I/O, no threads and no clock: every method takes `now`, so tests drive it with explicit times, and the
server wraps it in a lock, a merge thread and checkpoints. Refusals are raised as `Refused`, carrying the
kind of refusal (the transport answers each kind with its status code) and a short reason used as a
metrics label; a refused call never changes the state.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.core import robust
from diloco.core.config import TrainingConfig
from diloco.core.encoding import Encoded, decoded
from diloco.core.fragments import owned_fragments
from diloco.core.grace import HISTORY, adaptive_max, grace_window, merge_closes, slack_max
from diloco.core.island_id import MAX_KNOWN_ISLANDS, check_island_id, forget_before
from diloco.core.merge import (
    CHUNK,
    MAX_TOKENS_PER_INNER_STEP,
    Contribution,
    Delta,
    MergedGradient,
    delta_norm,
    is_too_stale,
    merge_deltas,
    tokens_are_possible,
)
from diloco.core.outer_optimizer import (
    ROUND_EPSILON,
    init_momentum,
    land_bound,
    land_chunked,
    largest_magnitude,
    outer_momentum,
    outer_step_chunked,
    round_momentum,
    step_bounds,
)
from diloco.core.refusal import Refusal

CHECKPOINT_FORMAT = 3
READABLE_FORMATS = frozenset({1, 2, CHECKPOINT_FORMAT})
"""Format 2 added the outer round's progress, format 3 took a round's look-ahead at its end rather than its
opening (`outer_step`) and marked the islands' last pushes: an older checkpoint resumes with a round opening,
so that a round whose look-ahead was taken does not take it again."""
MAX_PENDING_BYTES = 16 * 1024**3
"""Pending deltas a shard holds in memory, as it holds them (as sent: int4 0.53 bytes a parameter): 8 islands'
float32 deltas of the whole `large` preset (1.4 GB) and room, or 16 islands' int4 pushes of a 2 B model."""
IN_PLACE_BOUND = 2.0**126
"""A merge whose values and momentum are proven to stay below this magnitude (a quarter of float32's largest)
steps in place; one that cannot be proven so steps on copies, so that a result that is not finite changes
nothing."""


class Refused(Exception):
    """A call the shard will not take: its kind of refusal, and `reason` a metrics label."""

    def __init__(self, kind: Refusal, reason: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: int


@dataclass(frozen=True)
class PushKey:
    """What makes a push unique: a retry repeats all four, so it is recognised and counted once."""

    island: str
    incarnation: int
    base_version: int
    sequence: int


@dataclass
class Pending:
    key: PushKey
    delta: list[Delta]  # as pushed: encoded on the wire (a shard's), or float32 values
    tokens: int
    inner_steps: int
    arrived: float = 0.0  # the shard's clock when it was taken
    on_time: bool = True  # based on the version then current: pushed in the round it was trained for
    slack: float | None = None  # seconds after the push the island mixes the merge in (None: unknown)
    norm: float = 0.0  # the delta's L2 norm, by which its merge may leave it out as an outlier (`robust`)
    last: bool = False  # the island's last push of the fragment: its merge lands it (`outer_optimizer.land`)


@dataclass(frozen=True)
class PushResult:
    duplicate: bool
    version: int
    staleness: int
    arrived: float = 0.0  # the shard's clock when the push was taken (0 for a duplicate)
    live_islands: int = 0  # islands live when it was taken


@dataclass(frozen=True)
class MergeRecord:
    """What a merge did; `dropped` names why its contributions were dropped instead (None when applied)."""

    fragment: int
    version: int
    pushes: tuple[PushKey, ...]
    tokens: int
    max_staleness: int
    dropped: str | None
    outliers: tuple[PushKey, ...] = ()  # pushes left out of the merge, their deltas far beyond their peers' (`robust`)
    landed: int = 0  # of `pushes`, the islands' last, landed rather than stepped past (`outer_optimizer.land`)

    @property
    def contributors(self) -> tuple[str, ...]:
        return tuple(key.island for key in self.pushes)


@dataclass
class ShardFragment:
    """One fragment as its shard holds it: the global values and momentum, their version, the pending
    contributions to the next merge, and counters for the status reply."""

    index: int
    specs: tuple[TensorSpec, ...] = ()
    values: list[torch.Tensor] = field(default_factory=list)
    momentum: list[torch.Tensor] = field(default_factory=list)
    version: int = 0
    pending: dict[str, Pending] = field(default_factory=dict)
    quorum_since: float | None = None
    merged_quorum_since: float | None = None  # when the last merge's quorum was reached
    merged_keys: set[PushKey] = field(default_factory=set)
    magnitudes: tuple[float, float] | None = None  # largest |value| and |momentum| (None: not measured yet)
    round_progress: float = 0.0  # the share of the outer round in progress already merged (outer_step)
    round_left: set[str] = field(default_factory=set)  # islands that left while the round was in progress
    round_fresh: float = 0.0  # the share of the round in progress merged from fresh deltas (staleness 0)
    freshness: float = 1.0  # the share of the last complete round that was fresh: scales its successor's momentum
    round_opened: float = 0.0  # when the round in progress opened: its first merge's median arrival (0: unknown)
    delta_norms: dict[str, list[float]] = field(default_factory=dict)  # per island, the norms of its last merged
    last_merge_unix: float = 0.0
    last_contributors: int = 0
    max_staleness_seen: int = 0
    tokens_merged: int = 0

    @property
    def seeded(self) -> bool:
        return bool(self.specs)

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * 4 for v in self.values)


class ShardState:
    """Every fragment the shard owns (p mod shards == index) and the islands it has heard from."""

    def __init__(
        self,
        config: TrainingConfig,
        shard_index: int,
        num_shards: int,
        incarnation: int,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        chunk: int = CHUNK,
        declared_islands: int = 0,
        lineage: int = 0,
    ) -> None:
        """`max_pending_bytes` bounds the pending deltas of all the shard's fragments together; a merge works on
        `chunk` elements of a tensor at a time (`diloco.core.outer_optimizer.outer_step_chunked`);
        `declared_islands` is how many islands the job declares (0: not known), the most a round is made of;
        `lineage` names this state for as long as checkpoints carry it (0: not known), so that a shard that comes
        back without it is told from one that resumed."""
        if declared_islands < 0:
            raise ValueError(f"declared islands must be non-negative, got {declared_islands}")
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ValueError(f"shard index {shard_index} is outside 0..{num_shards - 1}")
        self.chunk = chunk
        self.config = config
        self.declared_islands = declared_islands
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.incarnation = incarnation
        self.lineage = lineage
        self.max_pending_bytes = max_pending_bytes
        self.fragments = {p: ShardFragment(p) for p in owned_fragments(shard_index, num_shards, config.fragments)}
        self.islands: dict[str, float] = {}  # joined: when last heard of
        self.left: dict[str, float] = {}  # left: when last heard of before leaving
        self.contributed: set[str] = set()  # known islands that had a push taken (and not left out since)
        self.newcomers: dict[str, float] = {}  # joined, no push taken yet: when they first joined
        self.rejected_pushes = 0
        self.step_seconds: dict[str, float] = {}
        self.lateness: deque[float] = deque(maxlen=HISTORY)

    # Islands

    def check_island(self, island: str) -> None:
        """Refuses an id outside the island id rule: the first check of every call that names an island."""
        try:
            check_island_id(island)
        except ValueError as error:
            raise Refused(Refusal.INVALID, "island_id", str(error)) from None

    def join(self, island: str, now: float) -> None:
        """Counts the island live (again, if it had left): the one way an island becomes one merges wait for.
        A caller with no island id (a probe, a seeder) learns the layout and counts as nobody."""
        if not island:
            return
        self.check_island(island)
        self.forget(now)
        known = island in self.islands or island in self.left
        if not known and len(self.islands) + len(self.left) >= MAX_KNOWN_ISLANDS:
            raise Refused(
                Refusal.TOO_LARGE, "islands", f"the shard already knows {MAX_KNOWN_ISLANDS} islands, the most it takes"
            )
        self.left.pop(island, None)
        self.islands[island] = now
        if island not in self.contributed:
            self.newcomers.setdefault(island, now)  # joining again does not make an id new again

    def touch(self, island: str, now: float) -> None:
        """Refreshes a joined island. Calls of one that never joined make nothing live (an invented id dilutes
        no merge), and one that left stays gone until it joins again (a late retry is no return)."""
        if island in self.islands:
            self.islands[island] = now

    def leave(self, island: str) -> None:
        """An island that finished no longer caps the quorum nor holds a grace window open. Only an island
        that joined can leave; a retried Leave is answered as the first was."""
        self.check_island(island)
        if island in self.left:
            return
        if island not in self.islands:
            raise Refused(Refusal.OUT_OF_STEP, "not_joined", f"island {island!r} never joined this shard")
        seen = self.left[island] = self.islands.pop(island)
        # it still counts for the round it was a member of (`members`, as of its last call)
        if (
            island in self.contributed
            or self.newcomers.get(island, -math.inf) >= seen - self.config.island_timeout_seconds
        ):
            for frag in self.fragments.values():
                frag.round_left.add(island)

    def forget(self, now: float) -> None:
        """Forgets the islands, left or silent, unheard of since `forget_before`: ids come and go over a long
        job (restarts, new pods), and those gone must not count against MAX_KNOWN_ISLANDS for good."""
        horizon = forget_before(now, self.config.island_timeout_seconds)
        for known in (self.islands, self.left):
            for island in [island for island, seen in known.items() if seen < horizon]:
                del known[island]
                self.step_seconds.pop(island, None)
                self.contributed.discard(island)
                self.newcomers.pop(island, None)

    def live_islands(self, now: float) -> list[str]:
        horizon = now - self.config.island_timeout_seconds
        return sorted(name for name, seen in self.islands.items() if seen >= horizon)

    def effective_quorum(self, now: float) -> int:
        """K, capped by the islands alive, so dead islands never hold a merge back."""
        return max(1, min(self.config.quorum, len(self.live_islands(now))))

    def cadence_step_seconds(self, now: float) -> float:
        """The job's cadence for speed-aware islands: the fewest seconds per inner step a live island
        reported with its pushes (0 while none has)."""
        live = self.step_seconds.keys() & set(self.live_islands(now))
        return min((self.step_seconds[island] for island in live), default=0.0)

    def grace_seconds(self) -> float:
        """How long a merge waits once its quorum is in when no push in it said its slack: sized from the lateness
        seen, at most graceSeconds (2 s where it is unset)."""
        return grace_window(self.lateness, adaptive_max(self.config.grace_seconds))

    # Fragments

    def fragment(self, index: int) -> ShardFragment:
        try:
            return self.fragments[index]
        except KeyError:
            raise Refused(
                Refusal.INVALID,
                "unknown_fragment",
                f"fragment {index} is not owned by shard {self.shard_index} of {self.num_shards} "
                f"(owned: {sorted(self.fragments)})",
            ) from None

    def seeded_fragment(self, index: int) -> ShardFragment:
        frag = self.fragment(index)
        if not frag.seeded:
            raise Refused(Refusal.OUT_OF_STEP, "not_seeded", f"fragment {index} has not been seeded yet")
        return frag

    def unseeded(self) -> list[int]:
        return sorted(p for p, f in self.fragments.items() if not f.seeded)

    def seed(self, index: int, specs: Sequence[TensorSpec], values: Sequence[torch.Tensor]) -> bool:
        """Takes a fragment's initial values; the first seed wins and later ones change nothing."""
        frag = self.fragment(index)
        if frag.seeded:
            return False
        if not specs:
            raise Refused(Refusal.INVALID, "empty", f"seed of fragment {index} has no tensors")
        if any(math.prod(s.shape) == 0 for s in specs):  # the first seed wins: no island could ever push to it
            raise Refused(Refusal.INVALID, "empty", f"seed of fragment {index} has a tensor of no elements")
        frag.specs = tuple(specs)
        frag.values = [v.detach().to(torch.float32).clone() for v in values]
        frag.momentum = init_momentum(frag.values)
        return True

    # Pushes

    def check_push(
        self,
        key: PushKey,
        fragment: int,
        specs: Sequence[TensorSpec],
        tokens: int,
        inner_steps: int,
        slack_seconds: float | None = None,
        nbytes: int | None = None,
    ) -> PushResult | None:
        """Validates a push header before its data is read: a duplicate's result, None to go on, or Refused.
        `nbytes`: the bytes its delta will be held in (as the header declares them; None: float32 values)."""
        self.check_island(key.island)
        if slack_seconds is not None and not (math.isfinite(slack_seconds) and slack_seconds >= 0):
            raise Refused(
                Refusal.INVALID, "slack", f"slack seconds must be finite and non-negative, got {slack_seconds}"
            )
        frag = self.seeded_fragment(fragment)
        if key in frag.merged_keys or (key.island in frag.pending and frag.pending[key.island].key == key):
            return PushResult(duplicate=True, version=frag.version, staleness=0)
        self._check_specs(frag, specs)
        self._check_room(frag, key.island)
        self._check_pending_bytes(frag, key.island, frag.nbytes if nbytes is None else nbytes)
        if not tokens_are_possible(tokens, inner_steps):
            raise Refused(
                Refusal.INVALID,
                "tokens",
                f"fragment {frag.index}: {tokens} tokens in {inner_steps} inner steps is more than "
                f"{MAX_TOKENS_PER_INNER_STEP} tokens per step",
            )
        self._staleness(frag, key)
        return None

    def submit(
        self,
        key: PushKey,
        fragment: int,
        specs: Sequence[TensorSpec],
        delta: Sequence[Delta],
        tokens: int,
        inner_steps: int,
        now: float,
        step_seconds: float = 0.0,
        slack_seconds: float | None = None,
        norm: float | None = None,
        last: bool = False,
    ) -> PushResult:
        """Takes a delta as the island's pending contribution to the fragment's next merge: as it came over the
        wire (checked, not decoded: its merge decodes it chunk by chunk) or as float values.

        An island has at most one pending contribution per fragment: its deltas are cumulative against its
        base, so a newer push replaces an older one, and a late retry of an older push changes nothing.
        `step_seconds` is the island's measured seconds per inner step, `slack_seconds` how long after the
        push it mixes the merge in (0 and None: not measured). `norm` is the delta's L2 norm (`delta_norm`)
        when the caller took it before holding the shard's lock, as the server does; else it is taken here.
        `last` marks the island's last push of the fragment, which its merge lands rather than steps past.
        """
        duplicate = self.check_push(key, fragment, specs, tokens, inner_steps, slack_seconds, _held_bytes(delta))
        if duplicate is not None:
            return duplicate
        frag = self.fragments[fragment]
        staleness = self._staleness(frag, key)
        current = frag.pending.get(key.island)
        if current is not None and (current.key.base_version, current.key.sequence) > (
            key.base_version,
            key.sequence,
        ):
            return PushResult(duplicate=True, version=frag.version, staleness=staleness)
        self._record_lateness(frag, staleness, now)
        delta32 = [d if isinstance(d, Encoded) else d.to(torch.float32) for d in delta]
        norm = delta_norm(delta32, self.chunk) if norm is None else norm
        frag.pending[key.island] = Pending(
            key, delta32, tokens, inner_steps, now, staleness == 0, slack_seconds, norm, last
        )
        frag.max_staleness_seen = max(frag.max_staleness_seen, staleness)
        self.touch(key.island, now)
        if key.island in self.islands:
            self.contributed.add(key.island)
            self.newcomers.pop(key.island, None)
            if step_seconds > 0:
                self.step_seconds[key.island] = step_seconds
        live = len(self.live_islands(now))
        return PushResult(duplicate=False, version=frag.version, staleness=staleness, arrived=now, live_islands=live)

    def _record_lateness(self, frag: ShardFragment, staleness: int, now: float) -> None:
        """How long after its round's quorum a contribution arrived. One based on the version before the last
        merge was a round late: it counts from that merge's quorum, so a window too short to take it in
        still learns how late it was."""
        if staleness == 0 and frag.quorum_since is not None:
            self.lateness.append(now - frag.quorum_since)
        elif staleness == 1 and frag.merged_quorum_since is not None:
            self.lateness.append(now - frag.merged_quorum_since)

    def pending_room(self) -> int:
        """How many pending contributions a fragment holds before it takes no more from islands that have
        not joined: one per joined island, and at least a quorum's worth (a shard may be pushed to before it
        hears the joins, e.g. after a restart without its state). Every island holds at most one per fragment,
        and the shard knows at most MAX_KNOWN_ISLANDS, so the pending deltas of a shard never take more than
        (MAX_KNOWN_ISLANDS + this) times the fragments' bytes, however many ids push."""
        return max(len(self.islands), self.config.quorum)

    def _check_room(self, frag: ShardFragment, island: str) -> None:
        """Refuses a new contribution from an island that has not joined once the fragment is full."""
        if island in frag.pending or island in self.islands or len(frag.pending) < self.pending_room():
            return
        raise Refused(
            Refusal.TOO_LARGE,
            "pending",
            f"fragment {frag.index} already holds {len(frag.pending)} pending contributions, the most it takes "
            f"from islands that have not joined; join first",
        )

    def pending_bytes(self) -> int:
        """The bytes of every pending delta the shard holds, as it holds them: encoded as sent, or float32."""
        return sum(_held_bytes(p.delta) for f in self.fragments.values() for p in f.pending.values())

    def _check_pending_bytes(self, frag: ShardFragment, island: str, nbytes: int) -> None:
        """Refuses a new pending delta of `nbytes` that would take the shard beyond `max_pending_bytes`; one
        replacing the island's own pending delta is always taken."""
        if island in frag.pending or self.pending_bytes() + nbytes <= self.max_pending_bytes:
            return
        raise Refused(
            Refusal.TOO_LARGE,
            "pending_bytes",
            f"fragment {frag.index}: the shard's pending deltas take {self.pending_bytes()} bytes, and "
            f"{nbytes} more would pass its bound of {self.max_pending_bytes}; push again after a merge",
        )

    def _check_specs(self, frag: ShardFragment, specs: Sequence[TensorSpec]) -> None:
        if len(specs) != len(frag.specs):
            raise Refused(
                Refusal.INVALID,
                "shape",
                f"fragment {frag.index} has {len(frag.specs)} tensors, the push has {len(specs)}",
            )
        for got, want in zip(specs, frag.specs):
            if got.name != want.name or got.shape != want.shape:
                raise Refused(
                    Refusal.INVALID,
                    "shape",
                    f"fragment {frag.index}: expected tensor {want.name} of shape {list(want.shape)}, "
                    f"got {got.name} of shape {list(got.shape)}",
                )
            if got.dtype != want.dtype:
                raise Refused(
                    Refusal.INVALID,
                    "dtype",
                    f"fragment {frag.index}: tensor {want.name} has dtype {want.dtype}, the push says {got.dtype}",
                )

    def _staleness(self, frag: ShardFragment, key: PushKey) -> int:
        if key.incarnation != self.incarnation:
            raise Refused(
                Refusal.OUT_OF_STEP,
                "incarnation",
                f"fragment {frag.index}: base is from incarnation {key.incarnation}, the shard is at "
                f"{self.incarnation} after a restart; pull the fragment again",
            )
        if key.base_version > frag.version:
            raise Refused(
                Refusal.OUT_OF_STEP,
                "ahead",
                f"fragment {frag.index}: base version {key.base_version} is ahead of {frag.version}; pull again",
            )
        staleness = frag.version - key.base_version
        if is_too_stale(staleness, self.config.max_staleness):
            raise Refused(
                Refusal.OUT_OF_STEP,
                "stale",
                f"fragment {frag.index}: base version {key.base_version} is {staleness} versions behind "
                f"{frag.version}, beyond maxStaleness {self.config.max_staleness}; pull again",
            )
        return staleness

    # Merges

    def poll(self, now: float) -> list[int]:
        """Fragments due for a merge: quorum reached and either every live island has reported, or the merge
        window is over (`closes`). With nobody live that is vacuous only once every island has left: one that
        timed out may yet come back within the window."""
        self.forget(now)
        live = set(self.live_islands(now))
        everyone_left = bool(self.left) and not self.islands
        quorum = self.effective_quorum(now)
        due = []
        for frag in self.fragments.values():
            if len(frag.pending) < quorum:
                frag.quorum_since = None
                continue
            if frag.quorum_since is None:
                frag.quorum_since = now
            awaited = live - frag.pending.keys()
            if (not awaited and (live or everyone_left)) or now >= self.closes(frag):
                due.append(frag.index)
        return due

    def closes(self, frag: ShardFragment) -> float:
        """When the merge of a fragment whose quorum is in closes: within the slack of the islands already in it,
        or the adaptive window where none said it (`diloco.core.grace`)."""
        if frag.quorum_since is None:
            raise ValueError(f"fragment {frag.index} has no quorum")
        pushed = [(p.arrived, p.slack) for p in frag.pending.values()]
        longest = slack_max(self.config.grace_seconds, self.config.island_timeout_seconds)
        return merge_closes(frag.quorum_since, self.grace_seconds(), pushed, longest)

    def next_deadline(self) -> float | None:
        """When the earliest running merge window closes, for the server's merge thread to wake."""
        return min((self.closes(f) for f in self.fragments.values() if f.quorum_since is not None), default=None)

    def members(self, now: float) -> set[str]:
        """The islands a round is made of: those heard from within an island timeout that have had a push taken
        (and not left out since), and those that joined within it and have not pushed yet (their first round
        is still being trained). Ids that joined and never push stop counting then, however often they call:
        thousands of them would make every real merge a vanishing share of a round.

        An island that left counts until then too, as one gone silent does: it holds no merge back, but the
        slowest island's last rounds, merged alone after the others finished, stay its share of a round rather
        than whole rounds that pull the model towards its own (docs/training-benchmarks.md)."""
        horizon = now - self.config.island_timeout_seconds
        new = {island for island, joined in self.newcomers.items() if joined >= horizon}
        finished = {island for island, seen in self.left.items() if seen >= horizon}
        return (set(self.live_islands(now)) | finished) & (self.contributed | new)

    def round_members(self, frag: ShardFragment, now: float) -> int:
        """The islands a round of the fragment is made of: its `members`, and those that left while it was in
        progress, so that islands finishing one after another do not make the last merges larger shares; never
        more than the job declares, so ids invented by a holder of the job's token, however many join, do not
        make every real merge a vanishing share of a round."""
        members = len(self.members(now) | frag.round_left)
        return min(members, self.declared_islands) if self.declared_islands else members

    def merge_share(self, frag: ShardFragment, contributors: int, now: float) -> float:
        """The share of a round a merge of `contributors` islands stands for (the outer step's `share`): with K
        below M and islands out of phase, a round of M islands arrives as several merges, and together they
        must move the fragment, momentum included, as one merge of all M would (`outer_step`)."""
        return contributors / max(contributors, self.round_members(frag, now))

    def merge(self, index: int, now: float) -> MergeRecord:
        """Merges the pending contributions into the fragment with the outer optimizer; bumps its version. The
        islands' last pushes among them (`Pending.last`) are merged apart and landed (`land`: the mean of their
        models, no step past it), as their own share of the round.

        One pass over the fragment: each chunk of the merged outer gradient is decoded from the pending deltas and
        stepped into the values and momentum while in cache, in place. A delta whose norm is far beyond its peers'
        and the fragment's (`robust`; the norm taken from its bytes a chunk at a time when it arrived) is left out
        first, so a finite but huge one does not move the fragment; a merge of nothing else is not taken
        (`dropped="outliers"`), and the fragment, its version and momentum stay. A merge whose values or momentum
        would not be finite (finite deltas can still overflow float32) is refused: the fragment and its version stay
        as they were, its contributions are dropped and counted as rejected, and the momentum restarts from zero, so
        that honest deltas merge again. Their pushes were already answered as taken; their islands see no newer
        version for them, so each round ends with the next merge of others or at its timeout, and the island pushes
        again from its unchanged base. The step is taken in place when the magnitudes of the fragment, its momentum
        and the deltas prove it finite (`step_bounds`; always, at the magnitudes training reaches), else on copies,
        holding the fragment twice for the time of one outer step."""
        frag = self.seeded_fragment(index)
        if not frag.pending:
            raise ValueError(f"fragment {index} has nothing to merge")
        pushed = sorted(frag.pending.values(), key=lambda p: p.key.island)
        peers = robust.peers(frag.delta_norms, (p.key.island for p in pushed))
        bound = robust.outlier_bound([p.norm for p in pushed], peers, lambda: robust.norm(frag.values))
        pending = [p for p in pushed if p.norm <= bound]
        outliers = tuple(p.key for p in pushed if p.norm > bound)
        self.rejected_pushes += len(outliers)
        # An island whose delta is left out has contributed nothing: no round waits on it or is shared with it.
        self.contributed -= {key.island for key in outliers}
        if not pending:
            frag.pending.clear()
            frag.quorum_since = None
            return MergeRecord(index, frag.version, (), 0, 0, dropped="outliers", outliers=outliers)
        contributions = {
            p.key: Contribution(p.key.island, p.delta, p.tokens, frag.version - p.key.base_version) for p in pending
        }
        stepping = [p for p in pending if not p.last]
        landing = [p for p in pending if p.last]
        outer = self.config.outer
        momentum_coef = round_momentum(outer_momentum(self.config), frag.freshness)
        step_gradient = self._gradient([contributions[p.key] for p in stepping]) if stepping else None
        land_gradient = self._gradient([contributions[p.key] for p in landing]) if landing else None
        share = self.merge_share(frag, len(stepping), now) if stepping else 0.0
        land_share = self.merge_share(frag, len(landing), now) if landing else 0.0
        value_magnitude, momentum_magnitude = value_bound, momentum_bound = _magnitudes(frag)
        if step_gradient is not None:
            value_bound, momentum_bound = step_bounds(
                value_bound,
                momentum_bound,
                step_gradient.bound,
                lr=outer.lr,
                momentum_coef=momentum_coef,
                nesterov=outer.nesterov,
            )
        if land_gradient is not None:
            value_bound = land_bound(value_bound, land_gradient.bound, share=land_share)
        in_place = max(value_bound, momentum_bound) < IN_PLACE_BOUND
        values = frag.values if in_place else [v.clone() for v in frag.values]
        momentum = frag.momentum if in_place else [m.clone() for m in frag.momentum]
        progress = frag.round_progress
        if step_gradient is not None:
            step = outer_step_chunked(
                values,
                momentum,
                step_gradient,
                lr=outer.lr,
                momentum_coef=momentum_coef,
                nesterov=outer.nesterov,
                share=share,
                round_progress=frag.round_progress,
                chunk=self.chunk,
            )
            progress, value_magnitude, momentum_magnitude = step.progress, step.value_magnitude, step.momentum_magnitude
        if land_gradient is not None:
            value_magnitude = land_chunked(values, land_gradient, share=land_share, chunk=self.chunk)
        frag.pending.clear()
        frag.merged_quorum_since, frag.quorum_since = frag.quorum_since, None
        tokens = sum(p.tokens for p in pending)
        finite = math.isfinite(value_magnitude) and math.isfinite(momentum_magnitude)
        dropped = None if finite else "non_finite"
        if dropped is None:
            frag.values, frag.momentum = values, momentum
            frag.magnitudes = (value_magnitude, momentum_magnitude)
            if stepping:
                self._advance_round(frag, stepping, [contributions[p.key] for p in stepping], share, progress)
            frag.version += 1
            frag.merged_keys |= {p.key for p in pending}
            oldest_useful = frag.version - self.config.max_staleness
            frag.merged_keys = {k for k in frag.merged_keys if k.base_version >= oldest_useful}
            frag.last_merge_unix = now
            frag.last_contributors = len(pending)
            frag.tokens_merged += tokens
            robust.remember(frag.delta_norms, ((p.key.island, p.norm) for p in pending))
        else:  # momentum is what carries a merge into every later one: it restarts, so the next merge can land
            self.rejected_pushes += len(pending)
            frag.momentum = init_momentum(frag.values)
            frag.round_progress, frag.round_fresh = 0.0, 0.0
        return MergeRecord(
            fragment=index,
            version=frag.version,
            pushes=tuple(p.key for p in pending),
            tokens=tokens,
            max_staleness=max(c.staleness for c in contributions.values()),
            dropped=dropped,
            outliers=outliers,
            landed=len(landing),
        )

    def _gradient(self, contributions: Sequence[Contribution]) -> MergedGradient:
        return merge_deltas(
            contributions,
            staleness_decay=self.config.staleness_decay,
            radial_directional=self.config.radial_directional,
            chunk=self.chunk,
        )

    @staticmethod
    def _advance_round(
        frag: ShardFragment,
        stepping: Sequence[Pending],
        contributions: Sequence[Contribution],
        share: float,
        progress: float,
    ) -> None:
        """The round bookkeeping of a step of `share` that left the round at `progress`: when it opened, which
        islands it waits on, and how fresh its deltas were (the next round's momentum)."""
        if frag.round_progress == 0 or frag.round_progress + share > 1 + ROUND_EPSILON:
            frag.round_opened = merged_arrival(stepping)  # this merge opened a round (or carried into one)
        fresh = sum(c.staleness == 0 for c in contributions) / len(contributions)
        if frag.round_progress + share >= 1 - ROUND_EPSILON:  # a round completed: the next is of those live
            frag.round_left.clear()
            completing = 1 - frag.round_progress
            frag.freshness = min(1.0, frag.round_fresh + fresh * completing)
            frag.round_fresh = fresh * max(0.0, share - completing)
        else:
            frag.round_fresh += fresh * share
        frag.round_progress = progress

    # Checkpoints

    def to_state_dict(self, clean: bool) -> dict[str, Any]:
        """A copy of everything a restarted shard needs; `clean` marks a final checkpoint after a stop."""
        return {
            "format": CHECKPOINT_FORMAT,
            "shard_index": self.shard_index,
            "num_shards": self.num_shards,
            "num_fragments": self.config.fragments,
            "incarnation": self.incarnation,
            "lineage": self.lineage,
            "clean": clean,
            "islands": dict(self.islands),
            "left": dict(self.left),
            "contributed": sorted(self.contributed),
            "newcomers": dict(self.newcomers),
            "fragments": {p: _saved_fragment(f) for p, f in self.fragments.items()},
        }

    @classmethod
    def from_state_dict(
        cls,
        config: TrainingConfig,
        shard_index: int,
        num_shards: int,
        state: dict[str, Any],
        new_incarnation: int,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        chunk: int = CHUNK,
        declared_islands: int = 0,
    ) -> ShardState:
        """Resumes a shard. After an unclean stop the versions it served may be ahead of the checkpoint, so
        it takes a new incarnation: islands holding such versions are told to pull again. When each island
        was last heard from survives either way, so the quorum cap does not fall to one after a restart."""
        if state.get("format") not in READABLE_FORMATS:
            raise ValueError(f"checkpoint format {state.get('format')} is not one of {sorted(READABLE_FORMATS)}")
        saved = (state["shard_index"], state["num_shards"], state["num_fragments"])
        wanted = (shard_index, num_shards, config.fragments)
        if saved != wanted:
            raise ValueError(
                f"checkpoint is for shard {saved[0]} of {saved[1]} with {saved[2]} fragments, "
                f"but this shard is {wanted[0]} of {wanted[1]} with {wanted[2]} fragments"
            )
        clean = bool(state["clean"])
        incarnation = state["incarnation"] if clean else new_incarnation
        lineage = int(state.get("lineage", 0))  # not known in a checkpoint from before lineages
        shard = cls(config, shard_index, num_shards, incarnation, max_pending_bytes, chunk, declared_islands, lineage)
        shard.islands = dict(state["islands"])
        left = state.get("left", {})  # none before Leave existed; a list of ids before they were forgotten
        shard.left = (
            dict(left) if isinstance(left, dict) else dict.fromkeys(left, max(shard.islands.values(), default=0.0))
        )
        # before contributors were told apart, every known island was taken for one
        shard.contributed = set(state.get("contributed", shard.islands.keys() | shard.left.keys()))
        shard.newcomers = dict(state.get("newcomers", {}))
        for p, fragment in state["fragments"].items():
            _restore_fragment(
                shard.fragment(p), fragment, keep_pushes=clean, rounds=state["format"] == CHECKPOINT_FORMAT
            )
        return shard


def _held_bytes(delta: Sequence[Delta]) -> int:
    """The bytes a pending delta is held in: as sent when encoded, float32 values otherwise."""
    return sum(d.nbytes if isinstance(d, Encoded) else 4 * d.numel() for d in delta)


def _magnitudes(frag: ShardFragment) -> tuple[float, float]:
    """The largest |value| and |momentum| of the fragment, measured in a pass the first time (after a seed or a
    restart), then kept by each merge's own pass (inf: not finite)."""
    if frag.magnitudes is None:
        frag.magnitudes = (largest_magnitude(frag.values), largest_magnitude(frag.momentum))
    return frag.magnitudes


def merged_arrival(pending: Sequence[Pending]) -> float:
    """The median arrival of a merge's pushes that came in the round they were trained for (of all of them when
    none did): a push that missed the last merge and arrived early in this one is no measure of this round."""
    on_time = [p.arrived for p in pending if p.on_time]
    return statistics.median(on_time or [p.arrived for p in pending])


def _saved_fragment(frag: ShardFragment) -> dict[str, Any]:
    return {
        "specs": [(s.name, list(s.shape), s.dtype) for s in frag.specs],
        "values": [v.clone() for v in frag.values],
        "momentum": [m.clone() for m in frag.momentum],
        "version": frag.version,
        "pending": [
            {
                "key": [p.key.island, p.key.incarnation, p.key.base_version, p.key.sequence],
                "delta": [decoded(d).clone() if isinstance(d, Encoded) else d.clone() for d in p.delta],
                "tokens": p.tokens,
                "inner_steps": p.inner_steps,
                "last": p.last,
            }
            for p in frag.pending.values()
        ],
        "merged_keys": [[k.island, k.incarnation, k.base_version, k.sequence] for k in frag.merged_keys],
        "round_progress": frag.round_progress,
        "round_left": sorted(frag.round_left),
        "round_fresh": frag.round_fresh,
        "freshness": frag.freshness,
        "last_merge_unix": frag.last_merge_unix,
        "last_contributors": frag.last_contributors,
        "max_staleness_seen": frag.max_staleness_seen,
        "tokens_merged": frag.tokens_merged,
    }


def _restore_fragment(frag: ShardFragment, saved: dict[str, Any], keep_pushes: bool, rounds: bool) -> None:
    """Fills a fresh fragment from its checkpoint; pending pushes and keys survive only a clean stop,
    since after a crash their bases belong to an incarnation that no longer exists. Without `rounds` (an
    older format's round), the next merge opens a round."""
    frag.specs = tuple(TensorSpec(name, tuple(shape), dtype) for name, shape, dtype in saved["specs"])
    frag.values = list(saved["values"])
    frag.momentum = list(saved["momentum"])
    frag.version = saved["version"]
    if keep_pushes:
        for p in saved["pending"]:
            key = PushKey(*p["key"])
            frag.pending[key.island] = Pending(
                key, list(p["delta"]), p["tokens"], p["inner_steps"], last=p.get("last", False)
            )
        frag.merged_keys = {PushKey(*k) for k in saved["merged_keys"]}
    frag.round_progress = saved.get("round_progress", 0.0) if rounds else 0.0
    frag.round_left = set(saved.get("round_left", ()))
    frag.round_fresh = saved.get("round_fresh", 0.0)
    frag.freshness = saved.get("freshness", 1.0)
    frag.last_merge_unix = saved["last_merge_unix"]
    frag.last_contributors = saved["last_contributors"]
    frag.max_staleness_seen = saved["max_staleness_seen"]
    frag.tokens_merged = saved["tokens_merged"]
