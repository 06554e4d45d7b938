"""The DiLoCo training configuration: one validated model shared by the CLI, the workers, the syncer and the CRD.

The same model is embedded in the `DiLoCoJob` spec, so field names serialise in camelCase (the Kubernetes
convention) while Python code uses snake_case; every field carries a description that becomes the CRD's
documentation, and every bound is enforced here so a bad value is refused with the field's name whichever
way it arrives (manifest, JSON file, command line).
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from diloco.core.rules import FRAGMENTS_WITHIN_INNER_STEPS, OVERLAP_WITHIN_FRAGMENT_SPACING

MAX_FRAGMENTS = 512
"""Each fragment has its own entry in a job's status and its own slot in the sync schedule; 512 is well above
the tensor count of any built-in model preset (large: 292)."""


class CamelModel(BaseModel):
    """Immutable model that reads and writes camelCase keys, accepts snake_case too, and refuses unknown keys."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class Mode(str, enum.Enum):
    """How islands train together: decoupled DiLoCo (the product), or one of the baselines it is measured against:
    synchronous DiLoCo (a barrier across all islands at every outer step) and data-parallel (an all-reduce of
    the gradients at every step)."""

    DILOCO = "diloco"
    SYNC_DILOCO = "sync-diloco"
    DDP = "ddp"


class Precision(str, enum.Enum):
    """The arithmetic of a trainer's forward and backward passes. Master weights, optimizer state and outer
    deltas stay float32 whatever this says; AUTO is bf16 autocast on an accelerator that has it, else float32."""

    AUTO = "auto"
    BF16 = "bf16"
    FP32 = "fp32"


class Encoding(str, enum.Enum):
    """How an outer gradient is encoded on the wire (INT8 and INT4 carry one float32 scale per block; SPARSE
    keeps each block's top-k values at 2 bits, the rest carried by the island into its next delta)."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"
    SPARSE = "sparse"


MAX_BLOCK_SIZE = 65536
"""Most elements per scale block: one float32 scale per 64 Ki values already costs int4 under 0.02% of its
bytes, larger blocks only coarsen it, and a receiver refuses a declared block beyond this up front."""


DEFAULT_MIN_TRANSFER_MBPS = 0.5
"""Below any link a job would train across: a tenth of 2 Gbit/s (200 Mbit/s) carries a 12B model's int4
fragment, 1.5 GB, in a minute, which at this rate may take seven hours before a call is given up."""


class EncodingError(ValueError):
    """Data or parameters that no valid encoder produces: wrong length, unknown encoding, NaN or Inf."""


class InnerOptimizerConfig(CamelModel):
    """AdamW run by every island between syncs."""

    lr: float = Field(1e-3, gt=0, description="Peak learning rate of the inner AdamW optimizer.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay of the inner AdamW optimizer.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay, in [0, 1).")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW second-moment decay, in [0, 1).")
    warmup_steps: int = Field(0, ge=0, description="Inner steps of linear learning-rate warmup (0 = none).")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clipping threshold (0 = no clipping).")


class OuterOptimizerConfig(CamelModel):
    """SGD with (Nesterov) momentum applied by the syncer to the merged outer gradients."""

    lr: float = Field(0.7, gt=0, description="Outer learning rate applied to the merged outer gradient.")
    momentum: float = Field(0.9, ge=0, lt=1, description="Outer momentum coefficient, in [0, 1).")
    nesterov: bool = Field(True, description="Use Nesterov momentum (as in DiLoCo) rather than heavy-ball.")


ISLAND_ONLY_KNOBS = frozenset({"inner_steps", "overlap_steps", "mix_alpha", "encoding", "speed_aware", "inner"})
"""TrainingConfig fields only islands act on: a shard reads H, the encoding and the counts from each push's
header, never from its config. Every other field, including any added later, counts as the shards' own."""


class TrainingConfig(CamelModel):
    """The DiLoCo knobs: sync schedule (H, P, tau, alpha), wire encoding, merge policy and both optimizers."""

    inner_steps: int = Field(100, ge=1, description="H: inner steps between two syncs of the same fragment.")
    fragments: int = Field(
        4,
        ge=1,
        le=MAX_FRAGMENTS,
        description="P: fragments the model is cut into; their syncs are staggered by H/P inner steps.",
    )
    overlap_steps: int = Field(
        5,
        ge=0,
        description="tau: inner steps a fragment keeps training after its delta is sent before the merged "
        "values are mixed in. Must be below innerSteps / fragments.",
    )
    mix_alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        description="alpha: on receipt, fragment = alpha * local + (1 - alpha) * merged global; 0 takes the "
        "global values as they are.",
    )
    encoding: Encoding = Field(
        Encoding.INT4, description="Wire encoding of outer gradients: fp32, bf16, int8, int4 or sparse."
    )
    block_size: int = Field(
        128,
        ge=2,
        le=MAX_BLOCK_SIZE,
        multiple_of=2,
        description=f"Elements per scale block for int8/int4/sparse encodings; must be even (int4 packs pairs), at "
        f"most {MAX_BLOCK_SIZE}.",
    )
    top_k_fraction: float = Field(
        1 / 64,
        gt=0,
        le=1,
        description="Share of each block's values the sparse encoding sends: its top-k by magnitude, at least "
        "one per block (SparseLoCo sends 1-3%).",
    )
    quorum: int = Field(
        1, ge=1, description="K: contributions a syncer shard waits for before merging (capped by live islands)."
    )
    grace_seconds: float | None = Field(
        None,
        ge=0,
        description="The most seconds a shard waits for more contributions once the quorum is reached (0: merge at "
        "once). Unset, the islands' slack sizes the wait: where the pushes in a merge say their slack (their "
        "round less their sync), the merge waits for every live island until 0.8 of it, at most "
        "islandTimeoutSeconds; where they say none (an island's first push), it waits an adaptive window sized "
        "from how late contributions have arrived, at most 2 s. It never waits for an island that left or timed "
        "out.",
    )
    max_staleness: int = Field(
        4, ge=0, description="Contributions based on a fragment version older than this many merges are refused."
    )
    staleness_decay: float = Field(
        1.0,
        gt=0,
        le=1,
        description="A contribution's merge weight is multiplied by stalenessDecay ** staleness; 1 = no decay.",
    )
    radial_directional: bool = Field(
        False,
        description="Merge with radial-directional averaging (mean norm times mean direction) instead of a "
        "plain weighted mean.",
    )
    speed_aware: bool = Field(
        True,
        description="Islands slower than the fastest run fewer inner steps per round (H x its speed / the "
        "fastest's), so that every island pushes at about the fastest's cadence; islands of equal speed run H.",
    )
    island_timeout_seconds: float = Field(
        60.0, gt=0, description="An island unseen for longer than this no longer counts towards the quorum cap."
    )
    min_transfer_mbps: float = Field(
        DEFAULT_MIN_TRANSFER_MBPS,
        gt=0,
        description="The slowest rate, in Mbit/s, at which a sync's bytes must cross between an island and a "
        "shard: an island gives each push, pull or seed a minute plus its bytes at this rate before it "
        "retries, and a shard cancels a stream slower than this. Set it below an island's link shared by "
        "the fragments it syncs at once.",
    )
    inner: InnerOptimizerConfig = Field(
        default_factory=InnerOptimizerConfig, description="Inner (per-island) AdamW optimizer."
    )
    outer: OuterOptimizerConfig = Field(
        default_factory=OuterOptimizerConfig, description="Outer (syncer) Nesterov SGD optimizer."
    )

    @model_validator(mode="after")
    def _schedule_fits(self) -> TrainingConfig:
        FRAGMENTS_WITHIN_INNER_STEPS.check(fragments=self.fragments, inner_steps=self.inner_steps)
        OVERLAP_WITHIN_FRAGMENT_SPACING.check(
            overlap_steps=self.overlap_steps, inner_steps=self.inner_steps, fragments=self.fragments
        )
        return self

    @property
    def top_k(self) -> int:
        """Values the sparse encoding keeps per block of `block_size`."""
        return max(1, round(self.top_k_fraction * self.block_size))

    def updated(self, **changes: Any) -> TrainingConfig:
        """A copy with `changes` (snake_case names) applied and validated, which `model_copy` does not do."""
        return self.model_validate({**self.model_dump(), **changes})

    def to_json(self) -> str:
        """Serialise with camelCase keys, the form the operator writes and `from_json` reads."""
        return self.model_dump_json(by_alias=True)

    def syncer_json(self) -> str:
        """The knobs a syncer shard acts on, as `to_json`: a change of any other (`ISLAND_ONLY_KNOBS`) need
        not restart the shards."""
        return self.model_dump_json(by_alias=True, exclude=set(ISLAND_ONLY_KNOBS))

    @classmethod
    def from_json(cls, text: str) -> TrainingConfig:
        """Parse and validate a JSON document (camelCase or snake_case keys)."""
        return cls.model_validate_json(text)
