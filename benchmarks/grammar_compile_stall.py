"""How long a request already streaming stalls while new grammars compile, for two source
trees of the project side by side (e.g. a `git worktree` of an older commit next to this
checkout), alternating rounds on a fresh server each; prints each round and the medians.

In each round a free request streams 160 tokens from /generate; after its 16th chunk,
`--grammars` constrained requests arrive one after another, each with a regex no earlier
request used: `a{1000000}`-like ones, which llguidance takes ~0.3 s to refuse (a 400), the
first of them also wrapping the tokenizer (~1 s). The figures are the stream's longest gap
between chunks and its median one, and the stream's time from the 16th chunk to its end.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/grammar_compile_stall.py --trees /tmp/before . --rounds 3

Both run on this checkout's venv with PYTHONPATH set to their tree. Extra `radixserve
serve` flags go after `--`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from server_ready import serving  # noqa: E402

CHUNKS = 160
START_AT = 16  # the chunk after which the constrained requests arrive


def post(port: int, body: dict) -> urllib.request.Request:
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )


def constrained(port: int, count: int, salt: int, statuses: list[int]) -> None:
    for i in range(count):
        regex = f"b{{{salt * 100 + i}}}a{{1000000}}"  # a distinct grammar every time
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "regex": regex}}
        try:
            with urllib.request.urlopen(post(port, body), timeout=120) as r:
                statuses.append(r.status)
        except urllib.error.HTTPError as e:
            statuses.append(e.code)


def one_round(port: int, grammars: int, salt: int) -> dict:
    body = {
        "text": "Write a long story about a lighthouse keeper.",
        "sampling_params": {"max_new_tokens": CHUNKS, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }
    times: list[float] = []
    statuses: list[int] = []
    sender = threading.Thread(target=constrained, args=(port, grammars, salt, statuses))
    with urllib.request.urlopen(post(port, body), timeout=300) as r:
        for line in r:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                times.append(time.perf_counter())
                if len(times) == START_AT:
                    sender.start()
    sender.join()
    gaps = [b - a for a, b in zip(times[START_AT - 1 :], times[START_AT:])]
    return {
        "max_gap_ms": 1000 * max(gaps),
        "median_gap_ms": 1000 * statistics.median(gaps),
        "rest_s": times[-1] - times[START_AT - 1],
        "statuses": sorted(set(statuses)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grammars", type=int, default=6)
    parser.add_argument("--port", type=int, default=31098)
    parser.add_argument("flags", nargs="*", help="radixserve serve flags (after --)")
    args = parser.parse_args()
    results: dict[Path, list[dict]] = {tree: [] for tree in args.trees}
    for round_ in range(args.rounds):
        for tree in args.trees:
            with serving(tree.resolve(), args.port, args.flags):
                warm = {"text": "Hi", "sampling_params": {"max_new_tokens": 8}}
                urllib.request.urlopen(post(args.port, warm), timeout=120).read()
                result = one_round(args.port, args.grammars, round_)
            results[tree].append(result)
            print(f"round {round_ + 1}: {tree}: " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()
            ), flush=True)  # fmt: skip
    for tree in args.trees:
        rounds = results[tree]
        print(
            f"{tree}: median of rounds: longest gap "
            f"{statistics.median(r['max_gap_ms'] for r in rounds):.0f} ms, median gap "
            f"{statistics.median(r['median_gap_ms'] for r in rounds):.1f} ms, rest of the "
            f"stream {statistics.median(r['rest_s'] for r in rounds):.2f} s"
        )


if __name__ == "__main__":
    main()
