"""Training across a WAN on one machine: step time and compute utilisation of decoupled DiLoCo, synchronous
DiLoCo and ddp when every island sits behind a shaped link (`diloco run --link-mbps --rtt-ms`: a network
namespace per island, tc tbf both ways, a delay proxy for the round trip; needs root).

The links stand where a 12 B-parameter model's stands on a 2 Gbit/s link with 50 ms RTT: the rate is scaled
so that a step's sync traffic takes the same share of a step (our bytes per step over the 12 B model's, times
its step time over ours), the round trip so that it is the same number of steps; then one tenth of that
rate. All three modes run in each `diloco run --compare`: first without links (each mode's own step rate),
then behind each link. Utilisation is a mode's unshaped mean step time over its shaped one: the share of
the step rate it keeps. A mode that runs out of its --timeout behind a link is measured on the steps it
finished in the time it had (none finished: an upper bound).

Targets: decoupled keeps >= 0.95 of its step rate at the 2 Gbit/s equivalent and >= 0.9 at a tenth, where ddp
falls below 0.2.

Usage: python bench/wan.py [--islands N] [--steps N] [--timeout S] ...   (make bench-wan)
Exit status 1 when a target is missed (the figures are printed either way).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import figures
from training import diloco_run, shape, verdict

from diloco.core.config import Mode, TrainingConfig
from diloco.local.wan import Link, equivalent_link, sync_bytes_per_step
from diloco.progress import StartEvent, StepEvent, read_events
from diloco.settings import DEFAULT_CORPUS_BYTES
from diloco.sim.bandwidth import step_seconds as reference_step_seconds
from diloco.worker.model import build_model

REFERENCE = Link(mbps=2000.0, rtt_ms=50.0)
REFERENCE_PARAMETERS = 12_000_000_000
MODES = (Mode.DILOCO.value, Mode.SYNC_DILOCO.value, Mode.DDP.value)


@dataclass(frozen=True)
class Measured:
    """A mode's steps behind one link: mean step time, the share of the time stepping spent computing rather
    than blocked on a sync (None for ddp, whose all-reduce the worker does not time apart from its step),
    whether it finished its steps in its time, the merges its syncers applied; `bound`: no step finished, so
    the step time is a lower bound."""

    step_seconds: float
    compute_share: float | None
    finished: bool
    merges: int
    bound: bool = False

    def utilisation(self, unshaped: Measured) -> float:
        """The share of its unshaped step rate the mode keeps: for the DiLoCo modes, its compute share over the
        unshaped one (the machine's load, which moves every step time, cancels), for ddp its step rate."""
        if self.compute_share is None or unshaped.compute_share is None:
            return unshaped.step_seconds / self.step_seconds
        return self.compute_share / unshaped.compute_share

    def raw(self, unshaped: Measured) -> float:
        """Unshaped over shaped mean step time, the machine's load as it came."""
        return unshaped.step_seconds / self.step_seconds

    def show(self, unshaped: Measured) -> str:
        sign = "< " if self.bound else ("" if self.finished else "~ ")
        return f"{sign}{self.utilisation(unshaped):.3f}"


def measure(out: Path, summary: dict, workers: int, steps: int) -> Measured:
    """A mode's measure from its progress events. A mode that ran out of time is measured over the time it
    stepped (from its last start to the end): each worker's steps in it, and the blocked rest."""
    events = read_events(out / summary["mode"] / "progress")
    done = [e for e in events if isinstance(e, StepEvent)]
    compute = sum(e.compute_seconds for e in done)
    ddp = summary["mode"] == Mode.DDP.value
    if len(done) >= workers * steps:
        seconds = sum(e.seconds for e in done)
        return Measured(seconds / len(done), None if ddp else compute / seconds, True, summary["merges"])
    starts = [e.t for e in events if isinstance(e, StartEvent)]
    stepping = summary["started_at"] + summary["wall_seconds"] - max(starts, default=summary["started_at"])
    share = None if ddp else compute / (stepping * workers)
    step = stepping / max(len(done) / workers, 1.0)
    return Measured(step, share, False, summary["merges"], bound=not done)


UNSHAPED_TIMEOUT_SECONDS = 1800.0
TIMEOUT_FACTOR = 1.2
TIMEOUT_SLACK_SECONDS = 30.0
"""A mode behind a link may run TIMEOUT_FACTOR times as long as the slowest mode unshaped, and at least
TIMEOUT_SLACK_SECONDS longer: time for decoupled DiLoCo to finish as it does unshaped (the links' set-up
included, which a run of seconds on a quiet machine would otherwise not have), and for a blocked baseline to
show how far it falls behind."""


def compare(args: argparse.Namespace, link: Link | None, timeout: float) -> tuple[dict[str, Measured], float]:
    """One `diloco run --compare` of the three modes, behind `link` (None: on loopback, to completion); each
    mode's measure, and the longest mode's wall time."""
    options = ["--compare", "--eval-every", str(10**9), "--overlap-steps", str(args.overlap_steps), *shape(args)]
    options += ["--timeout", f"{timeout:.0f}"]
    out = args.out / "unshaped"
    if link is not None:
        out = args.out / f"{link.mbps:.4g}mbps"
        options += ["--link-mbps", f"{link.mbps:.6g}", "--rtt-ms", f"{link.rtt_ms:.6g}"]
    summaries = diloco_run(out, *options, timeouts_ok=link is not None)
    return {s["mode"]: measure(out, s, args.islands, args.steps) for s in summaries}, max(
        s["wall_seconds"] for s in summaries
    )


def derive_links(args: argparse.Namespace, unshaped_step: float) -> tuple[Link, Link]:
    """The 2 Gbit/s-equivalent link and its tenth, printing how they follow from the 12 B model's."""
    config = TrainingConfig(inner_steps=args.inner_steps, fragments=args.fragments, overlap_steps=args.overlap_steps)
    parameters = build_model(args.preset, 0, device="meta").num_parameters()
    ours, theirs = sync_bytes_per_step(parameters, config), sync_bytes_per_step(REFERENCE_PARAMETERS, config)
    their_step = reference_step_seconds(REFERENCE_PARAMETERS)
    equivalent = equivalent_link(REFERENCE, theirs, their_step, ours, unshaped_step)
    link = equivalent.link
    print(
        f"\nthe link, scaled (H={config.inner_steps} P={config.fragments} {config.encoding.value}: every parameter"
        " pushed and pulled once per H steps):\n"
        f"  12 B model: {theirs / 1e6:,.1f} MB of sync traffic per step, a step {their_step:.3f} s (6 x params x 2M "
        f"tokens at 2e17 FLOP/s, diloco.sim.bandwidth); on {REFERENCE.describe()} the traffic takes "
        f"{theirs * 8 / (REFERENCE.mbps * 1e6) / their_step:.2f} of a step and the round trip "
        f"{REFERENCE.rtt_ms / 1000 / their_step:.3f} of one\n"
        f"  {args.preset} ({parameters:,} parameters): {ours / 1e3:,.2f} kB per step, a step {unshaped_step:.3f} s "
        f"(decoupled, unshaped, measured)\n"
        f"  rate: {REFERENCE.mbps:g} Mbit/s x {equivalent.bytes_ratio:.3e} (bytes per step) x "
        f"{equivalent.time_ratio:.3f} (12 B step / ours) = {link.mbps:.4g} Mbit/s; round trip: "
        f"{REFERENCE.rtt_ms:g} ms / {equivalent.time_ratio:.3f} = {link.rtt_ms:.4g} ms\n"
        f"  a tenth: {link.mbps / 10:.4g} Mbit/s, the same round trip",
        flush=True,
    )
    return link, Link(mbps=link.mbps / 10, rtt_ms=link.rtt_ms)


def report(args: argparse.Namespace, links: dict[str, Link], results: dict[str, dict[str, Measured]]) -> None:
    """The table, as markdown: per link, each mode's mean step time and utilisation, and ours over each
    baseline; then the raw step-rate ratios and the merges."""
    unshaped = results["unshaped"]
    print(f"\n{args.islands} islands, {args.preset}, {args.steps} steps; utilisation = unshaped step rate kept")
    print("| link | decoupled (ours) | sync-diloco | ddp | ours / sync-diloco | ours / ddp |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, measured in results.items():
        name = f"{label}: {links[label].describe()}" if label in links else "unshaped (loopback)"
        cells = [f"{measured[m].step_seconds * 1000:.0f} ms, {measured[m].show(unshaped[m])}" for m in MODES]
        use = {m: measured[m].utilisation(unshaped[m]) for m in MODES}
        print(
            f"| {name} | {' | '.join(cells)} | {use['diloco'] / use['sync-diloco']:.2f}x | "
            f"{use['diloco'] / use['ddp']:.1f}x |"
        )
    print("(~: ran out of time, measured over the time it stepped; <: no step finished in it, a bound)")
    for label in links:
        raw = ", ".join(f"{m} {results[label][m].raw(unshaped[m]):.3f}" for m in MODES)
        merges = ", ".join(f"{m} {results[label][m].merges} (unshaped {unshaped[m].merges})" for m in MODES[:2])
        print(f"{label}: unshaped/shaped mean step time {raw}; merges {merges}")


def plot(path: Path, links: dict[str, Link], results: dict[str, dict[str, Measured]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    speeds = [link.mbps for link in links.values()]
    for mode in MODES:
        ys = [results[label][mode].utilisation(results["unshaped"][mode]) for label in links]
        ax.plot(speeds, ys, marker="o", label=mode)
        for x, label, y in zip(speeds, links, ys):
            if results[label][mode].bound:
                ax.annotate("upper bound", (x, y), fontsize=7, textcoords="offset points", xytext=(4, 4))
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(0.95, color="tab:blue", linestyle=":", linewidth=1, label="target 0.95 (decoupled, 2 Gbit/s eq.)")
    ax.axhline(0.9, color="tab:blue", linestyle="--", linewidth=1, label="target 0.9 (decoupled, a tenth)")
    ax.axhline(0.2, color="tab:green", linestyle="--", linewidth=1, label="ddp below 0.2")
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(speeds, [f"{label}\n{link.mbps:.3g} Mbit/s" for label, link in links.items()], fontsize=8)
    ax.set_xlabel("link per island (12 B-equivalent)")
    ax.set_ylabel("utilisation (step rate / unshaped)")
    ax.set_ylim(0, 1.1)
    ax.set_title("step rate kept behind a shaped WAN link", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left")
    figures.save(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    job = TrainingConfig()
    p.add_argument("--islands", type=int, default=2, help="islands, each behind its own link")
    p.add_argument("--steps", type=int, default=60, help="inner steps per worker")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--inner-steps", type=int, default=job.inner_steps, help="H (a job's default)")
    p.add_argument("--fragments", type=int, default=job.fragments, help="P (a job's default)")
    p.add_argument("--overlap-steps", type=int, default=job.overlap_steps, help="tau (a job's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="auto")
    p.add_argument("--max-data-bytes", type=int, default=DEFAULT_CORPUS_BYTES)
    p.add_argument(
        "--timeout",
        type=float,
        help=f"seconds each mode may run behind a link (default {TIMEOUT_FACTOR:g} x unshaped, at least "
        f"{TIMEOUT_SLACK_SECONDS:.0f} s more)",
    )
    p.add_argument("--out", type=Path, default=Path("out/bench/wan"), help="the runs")
    p.add_argument("--png-dir", type=Path, default=Path("out/bench"))
    p.set_defaults(reference_step_seconds=None)  # training.shape's: the links, not an emulated device, set the pace
    args = p.parse_args()
    started = time.perf_counter()

    unshaped, longest = compare(args, None, UNSHAPED_TIMEOUT_SECONDS)
    results = {"unshaped": unshaped}
    equivalent, tenth = derive_links(args, unshaped[Mode.DILOCO.value].step_seconds)
    links = {"2 Gbit/s eq.": equivalent, "a tenth": tenth}
    timeout = args.timeout or max(TIMEOUT_FACTOR * longest, longest + TIMEOUT_SLACK_SECONDS)
    print(
        f"each mode behind a link runs at most {timeout:.0f} s ({TIMEOUT_FACTOR:g} x the longest unshaped run, and "
        f"at least {TIMEOUT_SLACK_SECONDS:.0f} s more)"
    )
    for label, link in links.items():
        results[label], _ = compare(args, link, timeout)

    report(args, links, results)
    plot(args.png_dir / "wan_utilisation.png", links, results)
    at = {label: {m: results[label][m].utilisation(unshaped[m]) for m in MODES} for label in links}
    met = [
        verdict(
            at["2 Gbit/s eq."]["diloco"] >= 0.95,
            f"decoupled at the 2 Gbit/s equivalent {at['2 Gbit/s eq.']['diloco']:.3f} >= 0.95",
        ),
        verdict(at["a tenth"]["diloco"] >= 0.9, f"decoupled at a tenth {at['a tenth']['diloco']:.3f} >= 0.9"),
        verdict(at["a tenth"]["ddp"] < 0.2, f"ddp at a tenth {at['a tenth']['ddp']:.3f} < 0.2"),
    ]
    print(
        f"({time.perf_counter() - started:.0f} s; runs under {args.out}, plot {args.png_dir / 'wan_utilisation.png'})"
    )
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
