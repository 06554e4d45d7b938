"""`diloco-operator`: runs the DiLoCoJob operator until SIGTERM.

Watches the namespaces given by --namespace (repeatable) or DILOCO_WATCH_NAMESPACES (comma-separated),
or every namespace with --all-namespaces, DILOCO_WATCH_NAMESPACES='*', or when none is named. Replicas
coordinate through kopf peering: each takes a random priority and only the live one with the highest acts.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
from collections.abc import Sequence

import kopf

from diloco.logs import setup_logging
from diloco.operator.children import OperatorRef
from diloco.operator.handlers import PEERING_LIFETIME, connections_needed, register
from diloco.operator.kube import Kube, load_config, load_token_key
from diloco.operator.metrics import OperatorMetrics
from diloco.operator.reconcile import PARALLEL_CALLS, Reconciler

PEERING_NAME = "diloco-operator"
DEFAULT_NAMESPACE = "diloco-system"
"""Where the operator keeps its token key when it runs outside a pod (POD_NAMESPACE unset)."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="diloco-operator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], help="namespace to watch (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=float(os.environ.get("DILOCO_RESYNC_SECONDS", "10")),
        help="seconds between two passes over a job (default 10)",
    )
    p.add_argument(
        "--probe-timeout",
        type=float,
        default=2.0,
        help="deadline of each syncer Status call and trainer metrics scrape",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("DILOCO_OPERATOR_METRICS_PORT", "8000")),
        help="Prometheus port; 0 disables",
    )
    p.add_argument("--liveness-port", type=int, default=8080, help="port of /healthz; 0 disables")
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--peering", default=PEERING_NAME, help="kopf peering object shared by the replicas")
    peering.add_argument("--standalone", action="store_true", help="no peering: only ever run one replica")
    p.add_argument("--priority", type=int, default=None, help="peering priority (default: random)")
    p.add_argument(
        "--peering-lifetime",
        type=int,
        default=PEERING_LIFETIME,
        help="seconds before the other replicas take over from one that stopped keeping alive "
        f"(default {PEERING_LIFETIME})",
    )
    p.add_argument(
        "--token-key-namespace",
        default=os.environ.get("POD_NAMESPACE") or DEFAULT_NAMESPACE,
        help="namespace of the Secret diloco-operator-token-key every job's token derives from "
        f"(default: the operator's own, else {DEFAULT_NAMESPACE})",
    )
    p.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    return p.parse_args(argv)


class _DropKopfSettings(logging.Filter):
    """kopf attaches its settings object to the records of its object loggers (for its own Event
    poster, which has seen them by then); a JSON log line cannot hold it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__.pop("settings", None)
        return True


def watched_namespaces(args: argparse.Namespace, environ: dict[str, str]) -> list[str]:
    """The namespaces to watch; an empty list means all of them."""
    if args.all_namespaces:
        return []
    if args.namespace:
        return list(args.namespace)
    named = [ns.strip() for ns in environ.get("DILOCO_WATCH_NAMESPACES", "").split(",") if ns.strip()]
    return [] if "*" in named else named


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropKopfSettings())
    if logging.getLogger().level > logging.DEBUG:
        # kopf reports every handler run at INFO: one line per job per resync. Decisions are logged by
        # the handlers themselves.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    namespaces = watched_namespaces(args, dict(os.environ))
    pod_namespace = os.environ.get("POD_NAMESPACE")
    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    kube = Kube(load_config(connections_needed(PARALLEL_CALLS)), observe=metrics.api_request)
    reconciler = Reconciler(
        kube,
        OperatorRef(namespace=pod_namespace) if pod_namespace else None,
        probe_timeout=args.probe_timeout,
        token_key=load_token_key(kube, args.token_key_namespace),
    )
    registry = kopf.OperatorRegistry()
    register(registry, reconciler, metrics, args.resync_seconds, args.peering_lifetime)
    kopf.run(
        registry=registry,
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.standalone or None,
        peering_name=None if args.standalone else args.peering,
        priority=args.priority if args.priority is not None else 1 + secrets.randbelow(2**31 - 2),
        liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None,
    )


if __name__ == "__main__":
    main()
