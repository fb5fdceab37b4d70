"""Time from `radixserve serve` to its first /health 200, for two source trees of the project
side by side (e.g. a `git worktree` of an older commit next to this checkout), alternating
rounds; prints each start and the medians.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/server_ready.py --trees /tmp/before . --rounds 3

Both run on this checkout's venv with PYTHONPATH set to their tree (the editable install
is found after it). Extra `radixserve serve` flags go after `--`. `--first-start`: each
start gets a fresh `--model-cache-dir` holding links to the converted models of the default
cache, so that it builds its kernels (a first start after setup, models converted).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from radixserve.config import default_model_cache_dir


@contextlib.contextmanager
def fresh_kernel_cache() -> Iterator[list[str]]:
    """`--model-cache-dir` flags for a cache without kernels, its converted models linked
    from the default cache."""
    with tempfile.TemporaryDirectory(prefix="first-start-") as folder:
        for entry in Path(default_model_cache_dir()).iterdir():
            if entry.is_dir() and entry.name != "kernels":
                (Path(folder) / entry.name).symlink_to(entry)
        yield ["--model-cache-dir", folder]


@contextlib.contextmanager
def serving(tree: Path, port: int, flags: list[str], timeout_s: float = 300) -> Iterator[float]:
    """A server of `tree` on `port`; yields the seconds it took to answer /health 200, and
    stops it on exit."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, "-m", "radixserve", "serve", "--port", str(port), *flags]
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield _wait_ready(proc, tree, port, start, timeout_s)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _wait_ready(
    proc: subprocess.Popen, tree: Path, port: int, start: float, timeout_s: float
) -> float:
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server in {tree} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"the server in {tree} was not ready in {timeout_s:g} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=31099)
    parser.add_argument("--first-start", action="store_true", help="build kernels each start")
    parser.add_argument("flags", nargs="*", help="radixserve serve flags (after --)")
    args = parser.parse_args()
    flags = args.flags or ["--dtype", "float32"]
    times: dict[Path, list[float]] = {tree: [] for tree in args.trees}
    for round_ in range(args.rounds):
        for tree in args.trees:
            with contextlib.ExitStack() as stack:
                fresh = stack.enter_context(fresh_kernel_cache()) if args.first_start else []
                seconds = stack.enter_context(serving(tree.resolve(), args.port, flags + fresh))
                times[tree].append(seconds)
            print(f"round {round_ + 1}: {tree}: {times[tree][-1]:.2f} s", flush=True)
    first = statistics.median(times[args.trees[0]])
    for tree in args.trees:
        median = statistics.median(times[tree])
        print(f"{tree}: median {median:.2f} s ({first / median:.2f}x the first tree's speed)")


if __name__ == "__main__":
    main()
