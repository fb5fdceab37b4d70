"""Starting the real server (`radixserve serve`) as a subprocess on a free loopback port,
for end-to-end tests. The process and its children are always stopped at the end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import requests

STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`radixserve serve` with the given flags; `url` once `/health` answers 200."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, log: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # fp32 (the reference) unless the flags say otherwise: later flags win
        serve = [sys.executable, "-m", "radixserve", "serve", "--port", str(self.port)]
        cmd = [*serve, "--dtype", "float32", *flags]
        self.log_path = log
        self.log = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.children: list[psutil.Process] = []

    def wait_ready(self, headers: dict[str, str] | None = None) -> ServerProcess:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.logs()}")
            try:
                if requests.get(self.url + "/health", timeout=10).status_code == 200:
                    self.children = psutil.Process(self.proc.pid).children(recursive=True)
                    return self
            except requests.RequestException:  # refused, or slow while the machine is busy
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server did not become healthy: {self.logs()}")

    def logs(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path else "(no log kept)"

    def scheduler_pid(self, headers: dict[str, str] | None = None) -> int:
        info = requests.get(self.url + "/get_server_info", headers=headers, timeout=10).json()
        return info["internal_states"][0]["pid"]

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for child in self.children:  # never leave an orphan behind, even when a test fails
            if child.is_running():
                child.kill()
        if self.log is not subprocess.DEVNULL:
            self.log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def served(log: Path, *flags: str) -> Iterator[ServerProcess]:
    """A module fixture's body: one server with these flags (the default model unless they
    name another), its output in `log`, stopped afterwards."""
    proc = ServerProcess(*flags, log=log)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def tiny_model_server(model_dir: Path, log_dir: Path, *flags: str) -> Iterator[ServerProcess]:
    """A module fixture's body: one server over the tests' tiny model, stopped afterwards."""
    model = ("--model-path", str(model_dir), "--max-total-tokens", "8192")
    yield from served(log_dir / "server.log", *model, *flags)


def state(server: ServerProcess, headers: dict[str, str] | None = None) -> dict:
    """The scheduler's counters, as /get_server_info reports them."""
    r = requests.get(server.url + "/get_server_info", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["internal_states"][0]


def assert_kv_clean(
    server: ServerProcess, settle: float = 10.0, headers: dict[str, str] | None = None
) -> None:
    """Idle: no request holds KV, free + cached == total, and a flush frees everything. A
    request just cancelled or disconnected is aborted asynchronously: its abort is given
    `settle` seconds to reach the scheduler."""
    deadline = time.monotonic() + settle
    while (s := state(server, headers))["num_running"] or s["num_waiting"]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert s["num_running"] == 0 and s["num_waiting"] == 0, s
    assert s["kv_held_by_requests"] == 0, s
    assert s["kv_free"] + s["kv_tree_evictable"] + s["kv_tree_protected"] == s["kv_total"], s
    assert s["kv_tree_protected"] == 0, s
    r = requests.post(server.url + "/flush_cache", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    s = state(server, headers)
    assert s["kv_free"] == s["kv_total"], s


def alive(p: psutil.Process) -> bool:
    """Running code: a zombie (exited, not yet reaped) is not."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_gone(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [(p.pid, " ".join(p.cmdline())[-120:]) for p in procs if alive(p)]
    for p in procs:  # never leave an orphan behind, even when this assertion fails
        if alive(p):
            p.kill()
    assert not left, f"processes still alive {timeout:.0f}s after the server ended: {left}"


def positive_metric(url: str, name: str, seconds: float = 15.0) -> tuple[float | None, str]:
    """(the first sample of /metrics line `name ...` once it is above 0, or the last seen;
    the text): /metrics follows the state the scheduler publishes every ~0.7 s."""
    deadline = time.monotonic() + seconds
    while True:
        text = requests.get(url + "/metrics", timeout=30).text
        samples = [float(x.split()[-1]) for x in text.splitlines() if x.startswith(name)]
        value = samples[0] if samples else None
        if (value is not None and value > 0) or time.monotonic() > deadline:
            return value, text
        time.sleep(0.2)
