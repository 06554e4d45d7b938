"""The pod's own launcher: one `diloco-worker` process per accelerator, started and supervised by
torch.distributed's elastic agent, as torchrun does it (static rendezvous: `pods` nodes, this pod's node
rank, N processes per node, no restarts).

Each local rank gets torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT and runs the same command line as the pod; `diloco.worker.pod_ranks` says where it sits. A rank
that dies takes the pod down: the agent stops the others and this process exits non-zero, so the island
re-forms as it does for a dead pod. SIGTERM (and SIGINT, SIGHUP, SIGQUIT) to this process reaches every
local rank through the agent, and a rank never outlives this process, however it ends (`diloco.lifetime`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from diloco.lifetime import launcher_env
from diloco.worker.pod_ranks import LOOPBACK, PodShape

if TYPE_CHECKING:  # the elastic agent is imported by a pod that launches ranks, not by every rank it starts
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

log = logging.getLogger("diloco.worker")

WORKER_MODULE = "diloco.worker.main"


def is_local_rank() -> bool:
    """Whether this process was started by a launcher (torchrun's convention: LOCAL_RANK is set)."""
    return "LOCAL_RANK" in os.environ


def exit_code(error: ChildFailedError) -> int:
    """The pod's exit code for its first failed rank: its own, or 128 + N when signal N ended it."""
    _, failure = error.get_first_failure()
    return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode


def launch(
    shape: PodShape, argv: Sequence[str], master_addr: str, master_port: int, run_id: str, grace_seconds: float
) -> int:
    """Runs `python -m diloco.worker.main *argv` as every local rank of this pod until all finish (0) or one
    fails (its exit code, the others stopped). SIGTERM is passed on to every rank, each given the pod's
    `grace_seconds` to push its last steps and say Leave, and then the pod exits 0, as a one-rank pod does.
    The ranks of a one-pod island meet on loopback, and gloo there uses the loopback interface (unless
    GLOO_SOCKET_IFNAME says otherwise): every peer is in the pod, and the pod's address need not sit on an
    interface gloo can find."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    host = shape.rendezvous_host(master_addr)
    os.environ.update(launcher_env())
    if host == LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    config = LaunchConfig(
        min_nodes=shape.pods,
        max_nodes=shape.pods,
        nproc_per_node=shape.ranks_per_pod,
        run_id=run_id,
        rdzv_backend="static",
        rdzv_endpoint=f"{host}:{master_port}",
        rdzv_configs={"rank": shape.node_rank},
        max_restarts=0,
        shutdown_timeout=int(grace_seconds),
    )
    log.info(
        "starting local ranks",
        extra={"pods": shape.pods, "node_rank": shape.node_rank, "local_ranks": shape.ranks_per_pod},
    )
    try:
        elastic_launch(config, sys.executable)("-m", WORKER_MODULE, *argv)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        log.error("a local rank failed: the pod stops", extra={"rank": rank, "exitcode": failure.exitcode})
        return exit_code(error)
    except SignalException as stop:
        log.info("the pod was stopped: its local ranks were signalled and waited for", extra={"signal": stop.sigval})
    return 0
