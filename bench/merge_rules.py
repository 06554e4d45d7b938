"""The outer update rule, decided by experiment: the held-out loss of the global model when the same islands'
pushes are grouped differently in time, with the shard's rule against the alternatives.

Four islands of the tiny preset train in one process, in lockstep, on the embedded corpus, through the real
`ShardState` (K = 1, no grace window: a merge takes whoever pushed at that step) with int4 deltas, alpha
mixing tau steps after a push, and their last partial rounds pushed at the end, as `diloco run` does. Only
when each island's schedule starts differs:
- in phase: every island pushes a fragment at the same step, so every merge holds all four (as sync-diloco's
  merges do, without the barrier);
- spread: island i's schedule starts i x H/4 steps late, so every merge holds one island, three quarters of
  a round stale at worst;
- drifting: each island's pushes come 0 to 3 steps late at random, as on a busy machine.
Everything else (data, seeds, initial values) is the same, and nothing depends on the machine's speed or
load: the figures are reproducible to the last digit.

The rules:
- shard: the shard's, momentum advanced once per round of shares, its coefficient scaled by the share of the
  last round whose deltas were fresh (`diloco.core.outer_optimizer`);
- rounds: rounds of shares with the job's momentum whatever the freshness;
- scaled: the rule before rounds, kept here as the baseline: each merge a full Nesterov step scaled by its
  share k/M, momentum decayed by mu^share (`scaled_outer_step` below, as `outer_step` was);
- no-momentum: the shard's rule with outer momentum 0.

Usage: python bench/merge_rules.py [--steps 200] [--seeds 0 1] [--rules shard rounds scaled no-momentum]
Prints a table and writes out/bench/merge_rules.png.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import figures
import torch

from diloco.core.config import InnerOptimizerConfig, OuterOptimizerConfig, TrainingConfig
from diloco.core.encoding import decode, encode
from diloco.core.fragments import fragments_due, plan_fragments
from diloco.syncer import shard as shard_module
from diloco.syncer.shard import PushKey, ShardState, TensorSpec
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.worker.data import IslandReader, evaluate, load_tokens, split_holdout
from diloco.worker.model import build_model
from diloco.worker.trainer import inner_optimizer

RULES = ("shard", "rounds", "scaled", "no-momentum")
PHASES = ("in phase", "spread", "drifting")
INCARNATION = 1


def scaled_outer_step(
    params: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor],
    outer_grad: Sequence[torch.Tensor],
    *,
    lr: float,
    momentum_coef: float,
    nesterov: bool = True,
    share: float = 1.0,
    round_progress: float = 0.0,
) -> float:
    """The baseline: the outer step as shards took it before rounds of shares (commit 3610371), a full
    Nesterov step per merge with the gradient and momentum's push scaled by the merge's share and momentum
    decayed by mu^share. Rounds mean nothing to it."""
    with torch.no_grad():
        for param, buf, grad in zip(params, momentum, outer_grad):
            scaled = grad * share
            buf.mul_(momentum_coef**share).add_(scaled)
            step = torch.add(scaled, buf, alpha=momentum_coef * share) if nesterov else buf * share
            param.add_(step, alpha=-lr)
    return 0.0


def fixed_momentum(momentum: float, freshness: float) -> float:
    """The job's momentum whatever the last round's freshness: rounds of shares as first written."""
    return momentum


@contextlib.contextmanager
def shard_rule(rule: str) -> Iterator[None]:
    """The shard merging by `rule` for the duration."""
    replaced = {
        "rounds": {"round_momentum": fixed_momentum},
        "scaled": {"round_momentum": fixed_momentum, "outer_step": scaled_outer_step},
    }.get(rule, {})
    originals = {name: getattr(shard_module, name) for name in replaced}
    for name, function in replaced.items():
        setattr(shard_module, name, function)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(shard_module, name, function)


@dataclass
class Island:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    reader: IslandReader
    delay: int  # steps its schedule starts late
    base: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    version: dict[int, int] = field(default_factory=dict)
    mix_at: dict[int, int] = field(default_factory=dict)  # fragment -> step its pushed round mixes in
    tokens: dict[int, int] = field(default_factory=dict)
    sequence: int = 0


@dataclass(frozen=True)
class Result:
    rule: str
    phase: str
    seed: int
    global_loss: float
    islands_loss: float
    merges: int
    islands_per_merge: float


def train(rule: str, phase: str, seed: int, args: argparse.Namespace) -> Result:
    torch.manual_seed(seed)
    config = TrainingConfig(
        inner_steps=args.inner_steps,
        fragments=args.fragments,
        overlap_steps=args.overlap_steps,
        quorum=1,
        grace_seconds=0.0,
        max_staleness=64,
        island_timeout_seconds=1e9,
        inner=InnerOptimizerConfig(),
        outer=OuterOptimizerConfig(momentum=0.0 if rule == "no-momentum" else OuterOptimizerConfig().momentum),
    )
    tokens = load_tokens(None, args.max_data_bytes)
    train_tokens, heldout = split_holdout(tokens)
    template = build_model("tiny", seed)
    named = [(name, tuple(p.shape)) for name, p in template.named_parameters()]
    plan = plan_fragments(named, config.fragments)
    shard = ShardState(config, shard_index=0, num_shards=1, incarnation=INCARNATION)
    params = dict(template.named_parameters())
    for fragment in plan:
        specs = [TensorSpec(name, tuple(params[name].shape), pb.FLOAT32) for name in fragment.names]
        shard.seed(fragment.index, specs, [params[name].detach() for name in fragment.names])
    rng = random.Random(seed)
    islands = []
    for i in range(args.islands):
        model = build_model("tiny", seed)
        delay = i * config.inner_steps // args.islands if phase == "spread" else 0
        reader = IslandReader(
            train_tokens, model.preset.context, shard=i, shards=args.islands, rank=0, ranks=1, seed=seed
        )
        island = Island(model, inner_optimizer(model, config.inner), reader, delay)
        for fragment in plan:
            island.base[fragment.index] = [params[name].detach().clone() for name in fragment.names]
            island.version[fragment.index] = 0
            island.tokens[fragment.index] = 0
        shard.join(f"island-{i}", 0.0)
        islands.append(island)
    batch_tokens = args.batch_size * template.preset.context
    contributions = 0
    merges = 0

    def push(i: int, fragment: int, step: int) -> None:
        island = islands[i]
        names = plan[fragment].names
        local = dict(island.model.named_parameters())
        delta = []
        for name, base in zip(names, island.base[fragment]):
            exact = base - local[name].detach()
            delta.append(
                decode(
                    encode(exact, config.encoding, config.block_size), exact.shape, config.encoding, config.block_size
                )
            )
        specs = [TensorSpec(name, tuple(local[name].shape), pb.FLOAT32) for name in names]
        island.sequence += 1
        key = PushKey(f"island-{i}", INCARNATION, island.version[fragment], island.sequence)
        steps = max(1, island.tokens[fragment] // batch_tokens)
        shard.submit(key, fragment, specs, delta, island.tokens[fragment], steps, float(step))
        island.tokens[fragment] = 0
        island.mix_at[fragment] = step + config.overlap_steps

    def mix(i: int, fragment: int) -> None:
        island = islands[i]
        held = shard.fragments[fragment]
        values, version = held.values, held.version
        local = dict(island.model.named_parameters())
        with torch.no_grad():
            for name, value in zip(plan[fragment].names, values):
                local[name].copy_(torch.lerp(value, local[name], config.mix_alpha))
        island.base[fragment] = [v.clone() for v in values]
        island.version[fragment] = version
        del island.mix_at[fragment]

    def merge_due(step: int) -> None:
        nonlocal merges, contributions
        for fragment in shard.poll(float(step)):
            record = shard.merge(fragment, float(step))
            merges += 1
            contributions += len(record.pushes)

    for step in range(1, args.steps + 1):
        for i, island in enumerate(islands):
            for fragment, at in list(island.mix_at.items()):
                if step > at:
                    mix(i, fragment)
            inputs, targets = island.reader.next_batch(args.batch_size)
            _, loss = island.model(inputs, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(island.model.parameters(), config.inner.grad_clip)
            island.optimizer.step()
            island.optimizer.zero_grad()
            for fragment in island.tokens:
                island.tokens[fragment] += batch_tokens
            late = rng.randint(0, 3) if phase == "drifting" else 0
            scheduled = step - island.delay - late
            if scheduled >= 1:
                for fragment in fragments_due(scheduled, config.inner_steps, config.fragments):
                    if fragment not in island.mix_at:
                        push(i, fragment, step)
        merge_due(step)
    end = args.steps + 1
    for i, island in enumerate(islands):  # the end of the run: mix what came back, push the rest, leave
        for fragment in list(island.mix_at):
            mix(i, fragment)
        for fragment in island.tokens:
            if island.tokens[fragment]:
                push(i, fragment, end)
        shard.leave(f"island-{i}")
    merge_due(end)
    assembled = build_model("tiny", seed)
    values = dict(assembled.named_parameters())
    with torch.no_grad():
        for fragment in plan:
            for name, value in zip(fragment.names, shard.fragments[fragment.index].values):
                values[name].copy_(value)
    context = template.preset.context
    global_loss = evaluate(assembled, heldout, context, args.batch_size)
    islands_loss = statistics.mean(evaluate(island.model, heldout, context, args.batch_size) for island in islands)
    return Result(rule, phase, seed, global_loss, islands_loss, merges, contributions / max(1, merges))


def plot(path: Path, results: list[Result]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = sorted({r.rule for r in results}, key=RULES.index)
    phases = sorted({r.phase for r in results}, key=PHASES.index)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.8 / len(rules)
    for k, rule in enumerate(rules):
        means = [statistics.mean(r.global_loss for r in results if r.rule == rule and r.phase == p) for p in phases]
        bars = ax.bar([x + (k - (len(rules) - 1) / 2) * width for x in range(len(phases))], means, width, label=rule)
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
    islands = statistics.mean(r.islands_loss for r in results if r.phase == phases[0])
    ax.axhline(islands, color="black", linestyle="--", linewidth=1, label=f"islands' own, {phases[0]}")
    ax.set_xticks(range(len(phases)), phases)
    low = min(r.global_loss for r in results)
    ax.set_ylim(low * 0.97, None)
    ax.set_ylabel("held-out loss of the global model")
    ax.set_title("the same pushes grouped differently in time (4 islands, tiny)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    figures.save(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--islands", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--inner-steps", type=int, default=20, help="H")
    p.add_argument("--fragments", type=int, default=2, help="P")
    p.add_argument("--overlap-steps", type=int, default=2, help="tau")
    p.add_argument("--max-data-bytes", type=int, default=4_000_000)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--png", type=Path, default=Path("out/bench/merge_rules.png"))
    args = p.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    results = []
    print(f"{'rule':>12} {'phase':>9} {'seed':>4} {'global':>7} {'islands':>7} {'merges':>6} {'islands/merge':>13}")
    for rule, phase, seed in itertools.product(args.rules, args.phases, args.seeds):
        with shard_rule(rule):
            r = train(rule, phase, seed, args)
        results.append(r)
        print(
            f"{r.rule:>12} {r.phase:>9} {r.seed:>4} {r.global_loss:>7.4f} {r.islands_loss:>7.4f} {r.merges:>6} "
            f"{r.islands_per_merge:>13.2f}",
            flush=True,
        )
    print("\nmean global loss over the seeds (islands' own in brackets):")
    for rule in args.rules:
        cells = []
        for phase in args.phases:
            picked = [r for r in results if r.rule == rule and r.phase == phase]
            g = statistics.mean(r.global_loss for r in picked)
            own = statistics.mean(r.islands_loss for r in picked)
            cells.append(f"{phase} {g:.4f} ({own:.4f})")
        print(f"  {rule:>12}: " + ", ".join(cells))
    plot(args.png, results)
    print(f"({time.perf_counter() - started:.0f} s; plot {args.png})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
