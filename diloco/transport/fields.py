"""Every field of every message of the contract, with its type, range and finiteness rule: one table, checked
at the wire before anything reads a value, by the shard on each request and by the island on each reply.

Protobuf only says what type a field has; a peer holding the job's token may still send a seconds-per-step of
Inf or 1e-300, 2^64 - 1 inner steps, a negative dimension or a clock reading from the year 30000, and each
of those, taken as it came, was stored and relayed until something far from the wire raised or misbehaved. So
every field is bounded here: counts and ids by what a job can hold, seconds by what a clock or a step can
take, every double finite. `check` refuses a message with the first field out of its rule as a `FieldError`
(INVALID_ARGUMENT) naming the field by its path (`PushHeader.step_seconds`); a test keeps the table complete,
so a field added to the proto without a rule fails it; the property tests draw each field's values at and
beyond its bounds from `Rule.edges`. Rules that relate fields (tokens within what the inner steps could
train, a top-k within its block) belong to whoever reads them together, and stay there.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from diloco.core.config import MAX_BLOCK_SIZE, MAX_FRAGMENTS
from diloco.core.island_id import ISLAND_ID_MAX_CHARS, MAX_KNOWN_ISLANDS, check_island_id
from diloco.core.merge import MAX_TOKENS_PER_INNER_STEP
from diloco.core.pace import MAX_STEP_SECONDS, MIN_STEP_SECONDS
from diloco.core.refusal import Refusal
from diloco.transport.v1 import syncer_pb2 as pb

U32 = 2**32 - 1
U64 = 2**64 - 1
I64 = 2**63 - 1

MAX_CHUNK_BYTES = 4 * 1024 * 1024
"""The most bytes one data message carries (the framing in `wire` splits streams by it)."""
MAX_STREAM_BYTES = 16 * 1024**3
"""The most one stream may declare unless its reader sets a limit: the largest fragment a shard takes by
default, so an island reading a pull never tries to reserve what a lying header declares."""
MAX_TENSORS = 4096
"""Tensors in one fragment: every tensor of the largest preset (292) in one fragment, many times over."""
MAX_DIMS = 8
MAX_DIM = 2**40
"""One dimension of a tensor; the stream's byte limit bounds their product."""
MAX_NAME_CHARS = 1024
"""A tensor's name: a module path of a deep model is a few hundred characters at most."""
MAX_FINGERPRINT_CHARS = 64
"""A token's fingerprint (`auth.token_fingerprint`, 16 hex digits), with room for a longer digest."""
MAX_ACCEPTED_TOKENS = 16
"""Tokens a shard accepts at once: the job's and the one it rotates to, many times over."""
MAX_INNER_STEPS = 2**20
"""Inner steps in one push: a round is H steps and an island that keeps failing to sync adds rounds, but not a
million steps' worth; bounding it bounds the tokens a push may claim (at most 2^32 per step)."""
MAX_TOKENS = MAX_INNER_STEPS * MAX_TOKENS_PER_INNER_STEP
MAX_SLACK_SECONDS = 86_400.0
"""How long after a push an island mixes the merge in: a day, far beyond any island timeout."""
MAX_CLOCK_SECONDS = 2.0**34
"""A shard's clock (Unix seconds): readings beyond the year 2500 are not a clock."""


class FieldError(ValueError):
    """A field out of its rule: `path` names it (`PushHeader.base.version`)."""

    kind = Refusal.INVALID

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.field = path.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Rule(ABC):
    """What one field may hold. `check` raises ValueError with why a value is out; `edges` are values on and
    beyond its bounds (valid, invalid), from which the property tests draw."""

    @abstractmethod
    def check(self, value: Any) -> None:
        """Raises ValueError saying why `value` is outside the rule."""

    @abstractmethod
    def edges(self) -> tuple[list[Any], list[Any]]:
        """Values on the rule's bounds (valid) and just beyond them (invalid)."""

    @abstractmethod
    def describe(self) -> str:
        """The rule in words, for the contract's documentation and error messages."""


@dataclass(frozen=True)
class Count(Rule):
    """An integer in [least, most]; `limit` is its wire type's largest value (nothing beyond it travels)."""

    most: int
    least: int = 0
    limit: int = U64

    def check(self, value: Any) -> None:
        if not self.least <= value <= self.most:
            raise ValueError(f"must be in [{self.least}, {self.most}], got {value}")

    def edges(self) -> tuple[list[Any], list[Any]]:
        beyond = [v for v in (self.most + 1, self.limit) if v <= self.limit and v > self.most]
        below = [self.least - 1] if self.least > 0 else []
        return [self.least, self.most], beyond + below

    def describe(self) -> str:
        return f"integer in [{self.least}, {self.most}]"


@dataclass(frozen=True)
class Seconds(Rule):
    """A finite double in [least, most]; with `unknown_zero`, 0 is also taken (not measured, not known)."""

    most: float
    least: float = 0.0
    unknown_zero: bool = False

    def check(self, value: Any) -> None:
        if not math.isfinite(value):
            raise ValueError(f"must be finite, got {value}")
        if self.unknown_zero and value == 0:
            return
        if not self.least <= value <= self.most:
            zero = "0 or " if self.unknown_zero else ""
            raise ValueError(f"must be {zero}in [{self.least:g}, {self.most:g}], got {value!r}")

    def edges(self) -> tuple[list[Any], list[Any]]:
        valid = [self.least, self.most] + ([0.0] if self.unknown_zero else [])
        invalid = [math.nextafter(self.most, math.inf), 1e300, math.inf, -math.inf, math.nan, -1.0]
        if self.least > 0:
            invalid += [math.nextafter(self.least, 0.0), 1e-300, 5e-324]
        return valid, [v for v in invalid if not (self.unknown_zero and v == 0)]

    def describe(self) -> str:
        zero = "0 or " if self.unknown_zero else ""
        return f"finite, {zero}in [{self.least:g}, {self.most:g}] seconds"


@dataclass(frozen=True)
class IslandId(Rule):
    """An island id (`diloco.core.island_id`); empty only when `optional` (a caller that is no island)."""

    optional: bool = False

    def check(self, value: Any) -> None:
        if value == "" and self.optional:
            return
        check_island_id(value)

    def edges(self) -> tuple[list[Any], list[Any]]:
        valid = ["a", "i" * ISLAND_ID_MAX_CHARS] + ([""] if self.optional else [])
        invalid = ["i" * (ISLAND_ID_MAX_CHARS + 1), "-a", "a b", "ü"] + ([] if self.optional else [""])
        return valid, invalid

    def describe(self) -> str:
        return "island id" + (" or empty" if self.optional else "")


@dataclass(frozen=True)
class Name(Rule):
    """A non-empty string of at most `most` characters."""

    most: int

    def check(self, value: Any) -> None:
        if not 0 < len(value) <= self.most:
            raise ValueError(f"must have 1 to {self.most} characters, got {len(value)}")

    def edges(self) -> tuple[list[Any], list[Any]]:
        return ["w", "w" * self.most], ["", "w" * (self.most + 1)]

    def describe(self) -> str:
        return f"1 to {self.most} characters"


@dataclass(frozen=True)
class Choice(Rule):
    """One of `values` (an enum's numbers the contract names)."""

    values: frozenset[int]

    def check(self, value: Any) -> None:
        if value not in self.values:
            raise ValueError(f"must be one of {sorted(self.values)}, got {value}")

    def edges(self) -> tuple[list[Any], list[Any]]:
        return sorted(self.values), [max(self.values) + 1, -1]

    def describe(self) -> str:
        return f"one of {sorted(self.values)}"


@dataclass(frozen=True)
class Anything(Rule):
    """Any value of the wire type: a flag, a checksum, an identifier whose every value means something."""

    def check(self, value: Any) -> None:
        return

    def edges(self) -> tuple[list[Any], list[Any]]:
        return [], []

    def describe(self) -> str:
        return "any"


@dataclass(frozen=True)
class ReaderLimit(Rule):
    """A byte count or position the stream reader checks against its own limit and the bytes that came
    (RESOURCE_EXHAUSTED beyond the limit, INVALID_ARGUMENT out of place): `wire`, which knows both."""

    def check(self, value: Any) -> None:
        return

    def edges(self) -> tuple[list[Any], list[Any]]:
        return [], []

    def describe(self) -> str:
        return "within the reader's byte limit (checked by the stream reader)"


@dataclass(frozen=True)
class Nested(Rule):
    """A message field: its own fields' rules apply, under this field's path."""

    def check(self, value: Any) -> None:
        return

    def edges(self) -> tuple[list[Any], list[Any]]:
        return [], []

    def describe(self) -> str:
        return "message (its fields' rules)"


@dataclass(frozen=True)
class Repeated(Rule):
    """A repeated field of at most `most` items, each under `item`."""

    item: Rule
    most: int

    def check(self, value: Any) -> None:
        if len(value) > self.most:
            raise ValueError(f"must have at most {self.most} items, got {len(value)}")

    def edges(self) -> tuple[list[Any], list[Any]]:
        return [], []

    def describe(self) -> str:
        return f"at most {self.most} of: {self.item.describe()}"


FRAGMENT_ID = Count(MAX_FRAGMENTS - 1, limit=U32)
ENCODINGS = frozenset(v.number for v in pb.Encoding.DESCRIPTOR.values if v.number)
ISLANDS = Repeated(IslandId(), MAX_KNOWN_ISLANDS)
FRAGMENTS = Repeated(FRAGMENT_ID, MAX_FRAGMENTS)
CLOCK = Seconds(MAX_CLOCK_SECONDS)
ANY = Anything()
READER = ReaderLimit()
NESTED = Nested()

FIELDS: Mapping[str, Mapping[str, Rule]] = {
    "TensorPayload": {
        "name": Name(MAX_NAME_CHARS),
        "shape": Repeated(Count(MAX_DIM, limit=I64), MAX_DIMS),  # a seed refuses tensors of no elements (shard)
        "dtype": Choice(frozenset(v.number for v in pb.DType.DESCRIPTOR.values if v.number)),
        "encoding": Choice(ENCODINGS),
        "block_size": Count(MAX_BLOCK_SIZE, limit=U32),
        "byte_length": READER,
        "top_k": Count(MAX_BLOCK_SIZE, limit=U32),
    },
    "FragmentVersion": {"incarnation": ANY, "version": ANY},
    "FragmentHeader": {
        "fragment_id": FRAGMENT_ID,
        "version": NESTED,
        "tensors": Repeated(NESTED, MAX_TENSORS),
        "delta_base": NESTED,
        "round_opened_seconds": CLOCK,  # 0: unknown
    },
    "FragmentChunk": {"header": NESTED, "data": ANY, "offset": READER, "crc32": ANY},
    "JoinRequest": {"island_id": IslandId(optional=True), "num_fragments": Count(MAX_FRAGMENTS, least=1, limit=U32)},
    "JoinReply": {
        "shard_index": Count(MAX_FRAGMENTS - 1, limit=U32),
        "num_shards": Count(MAX_FRAGMENTS, least=1, limit=U32),
        "owned_fragments": FRAGMENTS,
        "unseeded_fragments": FRAGMENTS,
        "max_chunk_bytes": Count(MAX_CHUNK_BYTES, least=1, limit=U32),
    },
    "SeedReply": {"accepted": ANY, "version": NESTED},
    "PushHeader": {
        "island_id": IslandId(),
        "fragment_id": FRAGMENT_ID,
        "base": NESTED,
        "tokens": Count(MAX_TOKENS),
        "inner_steps": Count(MAX_INNER_STEPS),
        "sequence": ANY,
        "tensors": Repeated(NESTED, MAX_TENSORS),
        "step_seconds": Seconds(MAX_STEP_SECONDS, MIN_STEP_SECONDS, unknown_zero=True),
        "slack_seconds": Seconds(MAX_SLACK_SECONDS),  # unset: unknown
        "last": ANY,
    },
    "PushChunk": {"header": NESTED, "data": ANY, "offset": READER, "crc32": ANY},
    "PushReply": {
        "duplicate": ANY,
        "current": NESTED,
        "staleness": ANY,
        "cadence_step_seconds": Seconds(MAX_STEP_SECONDS, MIN_STEP_SECONDS, unknown_zero=True),
        "arrival_seconds": CLOCK,  # 0: a duplicate's, not known
        "live_islands": Count(MAX_KNOWN_ISLANDS, limit=U32),
    },
    "PullRequest": {
        "fragment_id": FRAGMENT_ID,
        "have": NESTED,
        "encoding": Choice(ENCODINGS | {0}),
        "island_id": IslandId(optional=True),
        "held": NESTED,
        "delta_encoding": Choice(ENCODINGS | {0}),
    },
    "HeldValues": {"version": NESTED, "digest": ANY},
    "LeaveRequest": {"island_id": IslandId()},
    "LeaveReply": {},
    "StatusRequest": {},
    "FragmentStatus": {
        "fragment_id": FRAGMENT_ID,
        "seeded": ANY,
        "version": NESTED,
        "pending": ANY,
        "last_contributors": ANY,
        "last_merge_unix": CLOCK,
        "max_staleness_seen": ANY,
        "tokens_merged": ANY,
    },
    "StatusReply": {
        "shard_index": Count(MAX_FRAGMENTS - 1, limit=U32),
        "num_shards": Count(MAX_FRAGMENTS, least=1, limit=U32),
        "fragments": Repeated(NESTED, MAX_FRAGMENTS),
        "live_islands": ISLANDS,
        "rejected_pushes": ANY,
        "left_islands": ISLANDS,
        "accepted_tokens": Repeated(Name(MAX_FINGERPRINT_CHARS), MAX_ACCEPTED_TOKENS),  # fingerprints (auth)
        "lineage": ANY,  # an id; 0 says "not known"
    },
}
"""Each message's fields and their rules, by message and field name."""


def _check_field(message: Message, field: FieldDescriptor, rule: Rule, path: str) -> None:
    if not field.is_repeated and field.has_presence and not message.HasField(field.name):
        return  # an unset optional field or message: its default, which the reader takes as unknown
    value = getattr(message, field.name)
    items: Sequence[Any] = value if field.is_repeated else [value]
    try:
        rule.check(value)
        if isinstance(rule, Repeated):
            for item in items:
                rule.item.check(item)
    except ValueError as error:
        raise FieldError(path, str(error)) from None
    if field.message_type is not None:
        for index, item in enumerate(items):
            check(item, f"{path}[{index}]" if field.is_repeated else path)


def check(message: Message, path: str | None = None) -> None:
    """Raises FieldError naming the first field of `message` (nested messages included) outside its rule."""
    name = message.DESCRIPTOR.name
    rules = FIELDS[name]
    for field in message.DESCRIPTOR.fields:  # the C implementation's descriptors, typed apart in the stubs
        _check_field(message, cast(FieldDescriptor, field), rules[field.name], f"{path or name}.{field.name}")
