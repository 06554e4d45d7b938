"""A process of the job never outlives the launcher that started it.

Launchers start their children in sessions of their own (so that a kill reaches a child's whole process
group, as a container runtime kills a container whole), which also means a SIGKILL of the launcher, or of
its process group, reaches none of them: a local rank would hang in its island's collectives, and a
`diloco run` killed with -9 would leave its syncers and workers training on. So a launcher names itself in
the children's environment, and each child asks the kernel to kill it when that parent dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

LAUNCHER_PID = "DILOCO_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # prctl(2)


def launcher_env() -> dict[str, str]:
    """What a launcher adds to a child's environment so that the child follows it."""
    return {LAUNCHER_PID: str(os.getpid())}


def follow_launcher() -> None:
    """Be killed when the launcher that started this process dies. Linux only; a process that no launcher of
    ours started (a pod's first process, a command run by hand) is left alone."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before the line above took effect
        os.kill(os.getpid(), signal.SIGKILL)
