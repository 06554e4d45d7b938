"""`diloco status`: what a syncer shard reports, per fragment, for people at a terminal."""

from __future__ import annotations

import argparse
import time

from diloco.settings import add_tls_arguments, load_security, load_token
from diloco.transport.client import SyncerClient
from diloco.transport.tls import Role


def render(reply: object, now: float) -> str:
    """A table of the shard's fragments: version, pending pushes, last merge, staleness, tokens."""
    lines = [
        f"shard {reply.shard_index} of {reply.num_shards}; live islands: {', '.join(reply.live_islands) or '-'}; "
        f"rejected pushes: {reply.rejected_pushes}",
        f"{'fragment':>8} {'seeded':>6} {'version':>8} {'pending':>7} {'last merge':>11} {'contrib':>7} "
        f"{'max stale':>9} {'tokens':>12}",
    ]
    for f in reply.fragments:
        ago = f"{now - f.last_merge_unix:.1f}s ago" if f.last_merge_unix else "never"
        lines.append(
            f"{f.fragment_id:>8} {'yes' if f.seeded else 'no':>6} {f.version.version:>8} {f.pending:>7} "
            f"{ago:>11} {f.last_contributors:>7} {f.max_staleness_seen:>9} {f.tokens_merged:>12}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        token, security = load_token(args.token_file), load_security(Role.CLIENT, args)
    except (ValueError, OSError) as error:
        raise SystemExit(f"diloco status: {error}") from None
    with SyncerClient(args.target, token, security=security, timeout=10, retry_for=10) as client:
        print(render(client.status(), time.time()))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show a syncer shard's fragments", description=__doc__)
    parser.add_argument("target", nargs="?", default="127.0.0.1:50051", help="host:port of the shard")
    parser.add_argument("--token-file", help="file with the job token (else DILOCO_TOKEN_FILE or DILOCO_TOKEN)")
    add_tls_arguments(parser)
    parser.set_defaults(func=run)
