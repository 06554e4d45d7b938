"""Link bandwidth a training scheme needs between sites to keep a target compute utilisation.

One transfer model serves every scheme: every `period_steps` inner steps a site exchanges `fraction` of the
parameters at `bits_per_param`, as a ring all-reduce over `sites` (2·(n−1)/n of the payload on each link),
and the transfer may hide behind `overlap_steps` steps of compute. Whatever does not fit is exposed and
stalls compute, so utilisation = compute / (compute + exposed transfer time) over one period.

- Data-parallel: the bf16 gradient every step, hidden behind that step's own compute.
- DiLoCo: the whole outer gradient every H steps, not overlapped.
- Streaming DiLoCo: one of P fragments every H/P steps, in 4 bits (or the job's encoding: under half a bit
  per value when sparse), hidden behind tau steps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncScheme:
    """What crosses the link, how often, and how much compute can run while it does."""

    name: str
    bits_per_param: float
    period_steps: float
    fraction: float
    overlap_steps: float

    def __post_init__(self) -> None:
        if self.bits_per_param <= 0 or self.period_steps <= 0 or not 0 < self.fraction <= 1:
            raise ValueError(f"{self.name}: bits, period and fraction must be positive (fraction at most 1)")
        if self.overlap_steps < 0:
            raise ValueError(f"{self.name}: overlap_steps must be >= 0")


def data_parallel(bits: float = 16) -> SyncScheme:
    """The gradient all-reduce of every step, overlapped with that step's compute."""
    return SyncScheme("data-parallel", bits, 1, 1.0, 1)


def diloco(inner_steps: int = 100, bits: float = 16) -> SyncScheme:
    """The whole outer gradient every H steps, while compute waits."""
    return SyncScheme(f"DiLoCo H={inner_steps}", bits, inner_steps, 1.0, 0)


def streaming_diloco(inner_steps: int = 100, fragments: int = 4, overlap_steps: int = 5, bits: float = 4) -> SyncScheme:
    """One fragment's outer gradient every H/P steps, overlapped with tau steps, in low precision: `bits` per
    value of the encoding (`diloco.core.encoding.bits_per_value`; a fraction of a bit when sparse)."""
    return SyncScheme(
        f"Streaming DiLoCo H={inner_steps} P={fragments} tau={overlap_steps} {bits:.3g}-bit",
        bits,
        inner_steps / fragments,
        1.0 / fragments,
        overlap_steps,
    )


def step_seconds(params: float, tokens_per_step: float = 2**21, site_flops: float = 2e17) -> float:
    """Step time from compute: 6·params·tokens FLOPs at `site_flops` (default ≈ 512 chips × 1 PFLOP/s × 40%)."""
    return 6.0 * params * tokens_per_step / site_flops


def transfer_bits(scheme: SyncScheme, params: float, sites: int) -> float:
    """Bits one site's link carries per transfer (ring all-reduce: 2·(n−1)/n of the payload)."""
    if sites < 2:
        raise ValueError("a link needs at least two sites")
    return 2.0 * (sites - 1) / sites * params * scheme.fraction * scheme.bits_per_param


def required_gbps(scheme: SyncScheme, params: float, step_s: float, utilisation: float, sites: int = 2) -> float:
    """Gbit/s per site that keeps compute busy `utilisation` of the time."""
    if not 0 < utilisation < 1:
        raise ValueError("utilisation must be in (0, 1)")
    window = scheme.overlap_steps * step_s + scheme.period_steps * step_s * (1 - utilisation) / utilisation
    return transfer_bits(scheme, params, sites) / window / 1e9


def utilisation_at(scheme: SyncScheme, params: float, step_s: float, link_gbps: float, sites: int = 2) -> float:
    """Share of time compute is busy when each site has `link_gbps`."""
    compute = scheme.period_steps * step_s
    exposed = max(0.0, transfer_bits(scheme, params, sites) / (link_gbps * 1e9) - scheme.overlap_steps * step_s)
    return compute / (compute + exposed)
