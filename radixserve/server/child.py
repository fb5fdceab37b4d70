"""What every child process does first: log like the parent, leave Ctrl+C to the parent,
and die with it (no orphans even if the parent is killed with SIGKILL)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal

PR_SET_PDEATHSIG = 1


def prepare_child(role: str, log_level: str, parent_pid: int) -> None:
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides how to stop
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the loops' parent check still holds
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid
