"""`diloco-syncer`: runs one syncer shard until SIGTERM or SIGINT, then writes a final checkpoint."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

from diloco.startup import collection_paused

# Transparent huge pages for torch's large tensors (read at its first allocation): a fresh fragment-sized
# buffer (a snapshot, the values a difference gives) faults in 2 MiB pages, not 4 KiB ones, which took most
# of the time of making it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

with collection_paused():  # torch and its kin: seconds of a restart on a busy machine
    import torch

    from diloco.lifetime import follow_launcher
    from diloco.logs import setup_logging
    from diloco.progress import ProgressWriter, Source
    from diloco.settings import (
        add_tls_arguments,
        env_default,
        load_accepted_tokens,
        load_security,
        load_training_config,
    )
    from diloco.syncer.metrics import SyncerMetrics
    from diloco.syncer.server import SyncerServer
    from diloco.transport.tls import Role


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="diloco-syncer", description=__doc__)
    p.add_argument("--host", default=env_default("SYNCER_HOST", "0.0.0.0"), help="address to bind")
    p.add_argument("--port", type=int, default=int(env_default("SYNCER_PORT", "50051")), help="gRPC port")
    p.add_argument("--shard-index", type=int, default=int(env_default("SHARD_INDEX", "0")))
    p.add_argument("--num-shards", type=int, default=int(env_default("NUM_SHARDS", "1")))
    p.add_argument("--config", help="training config JSON file (else DILOCO_CONFIG_FILE, DILOCO_CONFIG, defaults)")
    p.add_argument(
        "--token-file",
        help="file of the tokens accepted, one per line, re-read when it changes (else DILOCO_TOKEN_FILE or "
        "DILOCO_TOKEN)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=env_default("CHECKPOINT_DIR"),
        help="where checkpoints live; none: state is lost on restart",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=float,
        default=float(env_default("CHECKPOINT_INTERVAL", "30")),
        help="seconds between checkpoints",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=int(env_default("HEALTH_PORT", "0")),
        help="plaintext port of grpc.health.v1 alone, for the kubelet's probes (they cannot speak TLS); 0: none",
    )
    p.add_argument(
        "--metrics-port", type=int, default=int(env_default("METRICS_PORT", "9090")), help="Prometheus port; 0 disables"
    )
    p.add_argument(
        "--progress-file",
        default=env_default("PROGRESS_FILE"),
        help="append a line per merge here, naming the pushes in it (the local runner's goodput accounting)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=int(env_default("SYNCER_THREADS", "0")),
        help="cores merges, differences and digests work on (the operator sets its CPU request); 0: every CPU "
        "the process may run on",
    )
    add_tls_arguments(p)
    p.add_argument(
        "--islands",
        type=int,
        default=int(env_default("ISLANDS", "0")),
        help="islands the job declares, the most a round of merges is made of (0: not known, and every id that "
        "joined counts for a round until an island timeout after it joined)",
    )
    p.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    return p.parse_args(argv)


def threads(requested: int) -> int:
    """The cores a shard works on: as requested, else every CPU this process may run on."""
    if requested < 0:
        raise ValueError(f"--threads must not be negative, got {requested}")
    return requested or len(os.sched_getaffinity(0))


def _merge_progress(args: argparse.Namespace) -> ProgressWriter:
    source = Source(island=f"shard-{args.shard_index}", rank=0, mode="syncer", pid=os.getpid())
    return ProgressWriter(Path(args.progress_file), source)


def main(argv: Sequence[str] | None = None) -> None:
    follow_launcher()
    args = parse_args(argv)
    setup_logging(args.log_level)
    try:
        config, tokens = load_training_config(args.config), load_accepted_tokens(args.token_file)
        security = load_security(Role.SERVER, args)
        cores = threads(args.threads)
    except (ValueError, OSError) as error:
        raise SystemExit(f"diloco-syncer: {error}") from None
    torch.set_num_threads(cores)  # merges and differences run torch's arithmetic on this many threads
    metrics = SyncerMetrics()
    server = SyncerServer(
        config,
        shard_index=args.shard_index,
        num_shards=args.num_shards,
        token=tokens,
        security=security,
        host=args.host,
        port=args.port,
        health_port=args.health_port or None,
        checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        checkpoint_interval=args.checkpoint_interval,
        metrics=metrics,
        progress=_merge_progress(args) if args.progress_file else None,
        threads=cores,
        declared_islands=args.islands,
    )
    if args.metrics_port:
        metrics.serve(args.metrics_port, addr=args.host)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
