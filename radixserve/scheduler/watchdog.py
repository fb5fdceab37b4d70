"""SGLang's --watchdog-timeout: a thread of the scheduler process that takes a step running
longer than the timeout for a hang (a forward pass that never returns: a deadlocked
kernel, a collective whose peer died). It logs that and every thread's stack, then ends the
process; the launcher, seeing its child gone, ends every request in flight with a 503 and
exits 1, so a supervisor restarts the server instead of its clients waiting for good. The
offline Engine runs none: it lives in its user's process, which is not its to end."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)
EXIT_CODE = 3  # the scheduler's exit code after the watchdog fired
# --watchdog-timeout's default: a GPU step takes well under a second; a CPU one may take
# minutes (a 1,024-token chunk of a 30B model at ~100 GFLOP/s: ~10 min)
DEFAULT_TIMEOUT_S = {"cuda": 300.0, "cpu": 1800.0}


def resolve_timeout(given: float | None, device_type: str) -> float:
    """The watchdog's timeout: --watchdog-timeout, else the device's default (0: none)."""
    return given if given is not None else DEFAULT_TIMEOUT_S.get(device_type, 1800.0)


MAX_POLL_S = 5.0


class Stepping(Protocol):
    step_started: float | None  # time.monotonic() when the running step began; None: idle


class Watchdog:
    def __init__(
        self,
        loop: Stepping,
        timeout_s: float,
        end: Callable[[int], object] = os._exit,
    ) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.end = end
        self.poll_s = min(timeout_s / 4, MAX_POLL_S)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.watch, name="radixserve-watchdog", daemon=True)
        thread.start()
        return thread

    def watch(self) -> None:
        while not self.check():
            time.sleep(self.poll_s)

    def check(self) -> bool:
        """End the process if the running step has outlived the timeout (True: it has)."""
        started = self.loop.step_started
        if started is None or time.monotonic() - started <= self.timeout_s:
            return False
        logger.error(
            "a scheduler step has run for more than %.0f s (--watchdog-timeout): taken for a "
            "hang, the server stops; every thread's stack follows",
            self.timeout_s,
        )
        try:
            for handler in logging.getLogger().handlers:
                handler.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        finally:  # (ends the process even where the stacks cannot be written)
            self.end(EXIT_CODE)
        return True
