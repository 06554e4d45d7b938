"""The pod's own launcher: one training process per accelerator, started and supervised by
torch.distributed's elastic agent, as torchrun does it (static rendezvous: `pods` nodes, this pod's node
rank, N processes per node, no restarts).

Each local rank gets torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT and runs the same command; `diloco.worker.pod_ranks` says where it sits. A rank that dies takes
the pod down: the agent stops the others and this process exits non-zero, so the island re-forms as it does
for a dead pod. SIGTERM (and SIGINT, SIGHUP, SIGQUIT) to this process reaches every local rank through the
agent, and a rank never outlives this process, however it ends (`diloco.lifetime`).

`diloco-worker` launches its own ranks so. A loop of one's own gets the same launcher as a command:

    python -m diloco.worker.pod_launcher python train.py --steps 200

runs `python train.py --steps 200` as every local rank of the pod the environment describes
(DILOCO_ACCELERATORS_PER_POD, WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT: what the operator sets), or,
in a pod of one process, as the pod's process itself. `diloco run -- COMMAND` starts each island so.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from diloco import pod_env
from diloco.lifetime import follow_launcher, launcher_env
from diloco.worker.pod_ranks import LOOPBACK, PodShape

if TYPE_CHECKING:  # the elastic agent is imported by a pod that launches ranks, not by every rank it starts
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

log = logging.getLogger("diloco.worker")

WORKER_MODULE = "diloco.worker.main"
LAUNCHER_MODULE = "diloco.worker.pod_launcher"


def is_local_rank() -> bool:
    """Whether this process was started by a launcher (torchrun's convention: LOCAL_RANK is set)."""
    return "LOCAL_RANK" in os.environ


def exit_code(error: ChildFailedError) -> int:
    """The pod's exit code for its first failed rank: its own, or 128 + N when signal N ended it."""
    _, failure = error.get_first_failure()
    return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode


def launch(
    shape: PodShape, command: Sequence[str], master_addr: str, master_port: int, run_id: str, grace_seconds: float
) -> int:
    """Runs `command` as every local rank of this pod until all finish (0) or one fails (its exit code, the
    others stopped). SIGTERM is passed on to every rank, each given the pod's `grace_seconds` to push its
    last steps and say Leave, and then the pod exits 0, as a one-rank pod does. The ranks of a one-pod
    island meet on loopback, and gloo there uses the loopback interface (unless GLOO_SOCKET_IFNAME says
    otherwise): every peer is in the pod, and the pod's address need not sit on an interface gloo can find."""
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
        elastic_launch(config, command[0])(*command[1:])
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        log.error("a local rank failed: the pod stops", extra={"rank": rank, "exitcode": failure.exitcode})
        return exit_code(error)
    except SignalException as stop:
        log.info("the pod was stopped: its local ranks were signalled and waited for", extra={"signal": stop.sigval})
    return 0


def launch_pod(command: Sequence[str], run_id: str, grace_seconds: float) -> int:
    """`launch` for the pod the environment describes: its shape, and its island's rendezvous (MASTER_ADDR,
    MASTER_PORT)."""
    master_addr = os.environ.get(pod_env.MASTER_ADDR, LOOPBACK)
    master_port = int(os.environ.get(pod_env.MASTER_PORT, "29500"))
    return launch(PodShape.from_env(os.environ), command, master_addr, master_port, run_id, grace_seconds)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m diloco.worker.pod_launcher COMMAND ARGS...`: the pod's process, or as a local rank (its
    launcher started it: LOCAL_RANK is set), the rank's; either way one that dies with its launcher."""
    command = list(sys.argv[1:] if argv is None else argv)
    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        raise SystemExit("usage: python -m diloco.worker.pod_launcher COMMAND [ARGS...]")
    follow_launcher()
    if is_local_rank() or not PodShape.from_env(os.environ).launches_ranks:
        os.execvp(command[0], command)  # the death signal follow_launcher asked for outlives the exec
    grace = float(os.environ.get(pod_env.TERMINATION_GRACE_SECONDS, pod_env.DEFAULT_GRACE_SECONDS))
    return launch_pod([sys.executable, "-m", LAUNCHER_MODULE, *command], "diloco-pod", grace)


if __name__ == "__main__":
    sys.exit(main())
