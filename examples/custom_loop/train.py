"""A training loop of one's own as one island of a DiLoCo job: a character-level GRU that learns to add
two-digit numbers, from sums it writes itself ("37+45=82").

What makes it an island is a few lines: `Learner.from_env` (everything the operator injects into the pod:
the syncer shards, the job's token, TLS and training config, the metrics port, the grace period and the
island's checkpoint folder), `with learner:` around the loop (join the shards and take the global model,
restarted: resume at the job's step with the optimizer state the island checkpointed; at the end push the
last steps and leave), `learner.resume_step` (where the schedule starts), `learner.stop_requested`
(SIGTERM: the job is done, suspended or re-forming this island) and `learner.report(...)` (tokens and loss,
served as the metrics the job's status shows). The rest is an ordinary PyTorch loop that steps its own
optimizer: gradient accumulation over four micro-batches, a GradScaler (active with fp16 autocast on a GPU;
a step it skips for an inf or NaN gradient is no inner step) and a warmup schedule it steps itself.

    diloco run -- python examples/custom_loop/train.py --steps 200   # 4 islands on this machine
    python examples/custom_loop/train.py --steps 200                 # with the DILOCO_* variables a pod gets
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from diloco.worker.learner import Learner

VOCAB = "0123456789+=\n"
MICRO_BATCHES = 4


class CharGRU(nn.Module):
    """Next-character prediction: embedding, one GRU layer, a linear head."""

    def __init__(self, vocab: int, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, chars: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(chars))
        return self.head(hidden)


def sums(generator: torch.Generator, rows: int, length: int) -> torch.Tensor:
    """`rows` windows of `length` + 1 characters, each cut from a stream of sums such as '37+45=82\\n'."""
    out = []
    for _ in range(rows):
        text = ""
        while len(text) < length + 12:
            a, b = torch.randint(0, 100, (2,), generator=generator).tolist()
            text += f"{a}+{b}={a + b}\n"
        start = int(torch.randint(0, 10, (1,), generator=generator))
        out.append([VOCAB.index(c) for c in text[start : start + length + 1]])
    return torch.tensor(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=0, help="inner steps to train (0: until the job stops it)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per micro-batch")
    p.add_argument("--length", type=int, default=32, help="characters per row")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warmup")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    fp16 = device.type == "cuda"
    model: nn.Module = CharGRU(len(VOCAB)).to(device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # An island of several ranks (a pod's accelerators, or several pods): its own torch.distributed world,
        # from the WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT its launcher sets, gradients averaged by DDP.
        # Learner.from_env takes this default group to be the island.
        dist.init_process_group("nccl" if fp16 else "gloo")
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    data = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # every island its own sums

    # The tokens of one inner step, so that a restarted island finds the job's step from the shards' count.
    learner = Learner.from_env(model, optimizer, tokens_per_step=MICRO_BATCHES * args.batch_size * args.length)
    with learner:
        # The warmup runs on the island's step: from 0 in a new job, from the job's step after a restart.
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (learner.resume_step + step + 1) / args.warmup)
        )
        start = {
            "resumed_at": learner.resume_step,
            "warm": learner.resumed_warm,
            "lr": scheduler.get_last_lr()[0],
            "device": device.type,
            "fp16": scaler.is_enabled(),
        }
        print(json.dumps(start), flush=True)
        while not args.steps or learner.inner_step < args.steps:
            if learner.stop_requested:
                break
            step_loss = torch.zeros((), device=device)
            for _ in range(MICRO_BATCHES):
                batch = sums(data, args.batch_size, args.length).to(device)
                with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
                    logits = model(batch[:, :-1])
                    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
                scaler.scale(loss / MICRO_BATCHES).backward()
                step_loss += loss.detach() / MICRO_BATCHES
                learner.report(tokens=batch[:, 1:].numel())
            learner.report(loss=step_loss)
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)  # the learner's hook on optimizer.step() counts the inner step and syncs
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if learner.inner_step % args.log_every == 0:
                print(json.dumps({"step": learner.inner_step, "loss": round(float(step_loss), 4)}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
