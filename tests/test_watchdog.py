"""--watchdog-timeout: a scheduler step that outlives it is taken for a hang; the watchdog
logs every thread's stack and ends the process (the launcher then ends the server's
requests with 503). Checked on a stand-in loop, and in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from radixserve.config import Config
from radixserve.scheduler.watchdog import EXIT_CODE, Watchdog, resolve_timeout


class _Loop:
    step_started: float | None = None


def test_only_a_step_past_the_timeout_ends_the_process():
    loop, ended = _Loop(), []
    watchdog = Watchdog(loop, timeout_s=10.0, end=ended.append)
    assert not watchdog.check() and not ended  # idle
    loop.step_started = time.monotonic() - 5
    assert not watchdog.check() and not ended  # a long step, within the timeout
    loop.step_started = time.monotonic() - 11
    assert watchdog.check() and ended == [EXIT_CODE]
    with pytest.raises(ValueError, match="watchdog_timeout must be >= 0"):
        Config.from_flat(watchdog_timeout=-1)
    assert (resolve_timeout(None, "cuda"), resolve_timeout(None, "cpu")) == (300.0, 1800.0)
    assert resolve_timeout(0, "cpu") == 0 and resolve_timeout(20.0, "cuda") == 20.0


def test_the_process_ends_even_where_the_stacks_cannot_be_written(monkeypatch):
    loop, ended = _Loop(), []
    loop.step_started = time.monotonic() - 11
    monkeypatch.setattr(sys, "stderr", None)  # (no file to write the stacks to)
    with pytest.raises(RuntimeError, match="stderr"):
        Watchdog(loop, timeout_s=10.0, end=ended.append).check()
    assert ended == [EXIT_CODE]


HUNG = """
import logging, threading, time
from radixserve.scheduler.watchdog import Watchdog
logging.basicConfig()
class Loop:
    step_started = time.monotonic()
def forward_that_never_returns():
    threading.Event().wait()
Watchdog(Loop(), timeout_s=0.2).start()
forward_that_never_returns()
"""


def test_a_hung_step_ends_its_process_with_every_threads_stack():
    done = subprocess.run([sys.executable, "-c", HUNG], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_CODE, done.stderr
    assert "taken for a hang" in done.stderr
    assert "forward_that_never_returns" in done.stderr  # the hung thread's stack
