"""`diloco-worker`: the built-in trainer as a container command. Every flag has a `DILOCO_*` variable,
which is how the operator configures it. torch.distributed inside the island uses WORLD_SIZE (every rank of
the island), MASTER_ADDR and MASTER_PORT, and RANK, or with DILOCO_ACCELERATORS_PER_POD=N > 1 the pod's
NODE_RANK: then this process starts and supervises N local ranks, one per accelerator (pod_launcher.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from diloco.startup import collection_paused

with collection_paused():  # torch and its kin: seconds of a start on a busy machine
    import torch

    from diloco.core.config import Mode, Precision
    from diloco.lifetime import follow_launcher
    from diloco.logs import setup_logging
    from diloco.settings import (
        DEFAULT_CORPUS_BYTES,
        add_tls_arguments,
        env_default,
        load_security,
        load_token,
        load_training_config,
    )
    from diloco.transport.tls import PLAINTEXT, Role
    from diloco.worker.learner import CHECKPOINT_EVERY
    from diloco.worker.metrics import serve_metrics
    from diloco.worker.pod_launcher import WORKER_MODULE, is_local_rank, launch_pod
    from diloco.worker.pod_ranks import PodShape, local_position, metrics_port
    from diloco.worker.shutdown import StopRequest
    from diloco.worker.trainer import Trainer, TrainerSettings

log = logging.getLogger("diloco.worker")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = env_default
    p = argparse.ArgumentParser(prog="diloco-worker", description=__doc__)
    p.add_argument(
        "--mode",
        choices=[m.value for m in Mode],
        default=env("MODE", Mode.DILOCO.value),
        help="diloco (default), sync-diloco (a barrier at every sync) or ddp (all-reduce every step)",
    )
    p.add_argument("--island", default=env("ISLAND"), help="this island's id (DILOCO_ISLAND)")
    p.add_argument("--syncers", default=env("SYNCERS", ""), help="comma-separated shard addresses, in index order")
    p.add_argument("--config", help="training config JSON file (else DILOCO_CONFIG_FILE, DILOCO_CONFIG, defaults)")
    p.add_argument("--token-file", help="file holding the job token (else DILOCO_TOKEN_FILE or DILOCO_TOKEN)")
    add_tls_arguments(p)
    p.add_argument(
        "--model",
        default=env("MODEL", ""),
        help="a preset (tiny, small, medium, large, xl), a transformers configuration as inline JSON, or a "
        "config.json; unset: --init-from's configuration, else tiny",
    )
    p.add_argument("--init-from", default=env("INIT_FROM"), help="a Hugging Face checkpoint folder to start from")
    p.add_argument(
        "--tokenizer", default=env("TOKENIZER"), help="a tokenizer.json (default: the preset's: bytes or its BPE)"
    )
    p.add_argument(
        "--data",
        default=env("DATA"),
        help="a file or folder of shards: token files (.bin/.npy) or text (.txt/.jsonl/.parquet); default: the "
        "embedded corpus",
    )
    p.add_argument("--text-field", default=env("TEXT_FIELD", "text"), help="the text of .jsonl and .parquet rows")
    p.add_argument(
        "--data-shard",
        type=int,
        default=int(env("DATA_SHARD", "0")),
        help="this island's share of the training set: shard i of --data-shards (the island's place in the job)",
    )
    p.add_argument("--data-shards", type=int, default=int(env("DATA_SHARDS", "1")), help="the islands sharing it")
    p.add_argument("--max-data-bytes", type=int, default=int(env("MAX_DATA_BYTES", str(DEFAULT_CORPUS_BYTES))))
    p.add_argument("--batch-size", type=int, default=int(env("BATCH_SIZE", "16")))
    p.add_argument(
        "--steps",
        type=int,
        default=int(env("STEPS", "0")) or None,
        help="inner steps to train (default: until SIGTERM, which ends a job's pods when it is done)",
    )
    p.add_argument(
        "--termination-grace-seconds",
        type=float,
        default=float(env("TERMINATION_GRACE_SECONDS", "30")),
        help="seconds from SIGTERM to SIGKILL (the pod's terminationGracePeriodSeconds, which the operator "
        "passes down): the last pushes and Leave must fit in them",
    )
    p.add_argument("--eval-every", type=int, default=int(env("EVAL_EVERY", "50")))
    p.add_argument("--seed", type=int, default=int(env("SEED", "0")))
    p.add_argument(
        "--slowdown",
        type=float,
        default=float(env("SLOWDOWN", "1")),
        help="run this many times slower, standing in for older hardware",
    )
    p.add_argument(
        "--jitter",
        type=float,
        default=float(env("JITTER", "0")),
        help="each step lasts a random 0 to 2 x this share of its own time more, as on a machine shared with "
        "other work (on average this much slower)",
    )
    p.add_argument(
        "--reference-step-seconds",
        type=float,
        default=float(env("REFERENCE_STEP_SECONDS", "0")) or None,
        help="the emulated full-speed device's step time: every step lasts --slowdown times this, whatever the "
        "islands beside it compute (unset: --slowdown scales the step's own time)",
    )
    p.add_argument("--threads", type=int, default=int(env("THREADS", "0")) or None, help="torch CPU threads")
    p.add_argument("--device", default=env("DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
    p.add_argument(
        "--precision",
        choices=[p.value for p in Precision],
        default=env("PRECISION", Precision.AUTO.value),
        help="auto (bf16 autocast on accelerators that have it), bf16 or fp32; master weights stay fp32",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=env("ACTIVATION_CHECKPOINTING", "0") == "1",
        help="recompute block activations in the backward pass (less memory, about a third more compute)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=float(env("PEAK_TFLOPS", "0")) or None,
        help="the accelerator's dense bf16 peak, for MFU on devices the built-in table does not know",
    )
    p.add_argument(
        "--progress-file",
        default=env("PROGRESS_FILE"),
        help="append JSON progress events here; {rank} in it becomes the rank in the island",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=env("CHECKPOINT_DIR"),
        help="checkpoints for restarts: an island's inner-optimizer state (a replacement starts warm), or in "
        "ddp mode the whole training state",
    )
    p.add_argument(
        "--tensorboard-dir",
        default=env("TENSORBOARD_DIR"),
        help="rank 0 writes the island's TensorBoard curves (loss, held-out loss, learning rate, tokens/s) under "
        "<dir>/<island>/: a volume the job's podTemplate mounts",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=int(env("CHECKPOINT_EVERY", str(CHECKPOINT_EVERY))), help="inner steps"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("METRICS_PORT", "0")),
        help="serve Prometheus metrics on this port (0: none)",
    )
    p.add_argument("--metrics-host", default=env("METRICS_HOST", "0.0.0.0"), help="address the metrics server binds")
    p.add_argument("--log-level", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    follow_launcher()
    args = parse_args(argv)
    setup_logging(args.log_level)
    syncers = [t.strip() for t in args.syncers.split(",") if t.strip()]
    try:
        shape = PodShape.from_env(os.environ)
        rank = os.environ.get("RANK", "0")
        settings = TrainerSettings(
            mode=args.mode,
            model=args.model,
            init_from=args.init_from,
            tokenizer=args.tokenizer,
            data=args.data,
            text_field=args.text_field,
            data_shard=args.data_shard,
            data_shards=args.data_shards,
            max_data_bytes=args.max_data_bytes,
            batch_size=args.batch_size,
            steps=args.steps,
            eval_every=args.eval_every,
            seed=args.seed,
            slowdown=args.slowdown,
            jitter=args.jitter,
            reference_step_seconds=args.reference_step_seconds,
            threads=args.threads,
            device=args.device,
            precision=args.precision,
            activation_checkpointing=args.activation_checkpointing,
            peak_tflops=args.peak_tflops,
            progress_file=Path(args.progress_file.format(rank=rank)) if args.progress_file else None,
            checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
            tensorboard_dir=Path(args.tensorboard_dir) if args.tensorboard_dir else None,
            checkpoint_every=args.checkpoint_every,
        )
        config = load_training_config(args.config)
        needs_syncers = settings.mode != Mode.DDP
        token = load_token(args.token_file) if needs_syncers else ""
        security = load_security(Role.CLIENT, args) if needs_syncers else PLAINTEXT
        if needs_syncers and not (syncers and args.island):
            raise ValueError("a DiLoCo worker needs --syncers and --island (DILOCO_SYNCERS, DILOCO_ISLAND)")
    except (ValueError, OSError) as error:
        raise SystemExit(f"diloco-worker: {error}") from None
    if shape.launches_ranks and not is_local_rank():
        arguments = sys.argv[1:] if argv is None else argv
        command = [sys.executable, "-m", WORKER_MODULE, *arguments]
        return launch_pod(command, "diloco-worker", args.termination_grace_seconds)
    stop = StopRequest(args.termination_grace_seconds)
    stop.install()
    trainer = Trainer(
        settings, config, island=args.island or "ddp", syncers=syncers, token=token, security=security, stop=stop
    )
    port = metrics_port(args.metrics_port, local_position(os.environ)[0])
    if port:
        serve_metrics(trainer.snapshot, port, args.metrics_host)
    try:
        loss = trainer.run()
    finally:
        trainer.close()
    log.info("training finished", extra={"island": args.island, "steps": trainer.step, "eval_loss": loss})
    return 0


if __name__ == "__main__":
    sys.exit(main())
