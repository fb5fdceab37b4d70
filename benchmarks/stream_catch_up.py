"""Many streaming clients on one server, for two source trees side by side (e.g. a
`git worktree` of an older commit next to this checkout): both servers started at once,
rounds alternating between them, each after a cache flush. Each round sends `--clients`
streamed greedy completions at once (unique random prompts, `--output-len` tokens each,
ignore_eos) from one asyncio client (aiohttp), and prints the output tok/s, the median
time per output token seen by a client (from its first chunk to its last), and the SSE
chunks a stream took (fewer than its tokens where outputs that queued up behind a busy
event loop were sent as one).

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/stream_catch_up.py --trees /tmp/before . --clients 256

Both run on this checkout's venv with PYTHONPATH set to their tree. Extra `radixserve
serve` flags go after `--` (default: --max-total-tokens 200000).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_ready import serving  # noqa: E402


async def one(
    session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int
) -> tuple[float, int]:
    """One streamed completion: (seconds per output token after the first, chunks)."""
    body = {
        "model": "m", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    first = last = None
    chunks = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                chunks += 1
                last = time.perf_counter()
                first = first or last
    assert first is not None and last is not None, "no chunk"
    return (last - first) / max(output_len - 1, 1), chunks


async def round_(url: str, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async with session.post(url + "/flush_cache") as response:
            await response.read()
        start = time.perf_counter()
        results = await asyncio.gather(*(one(session, url, p, output_len) for p in prompts))
        seconds = time.perf_counter() - start
    return {
        "tok_s": len(prompts) * output_len / seconds,
        "tpot_ms": 1000 * statistics.median(t for t, _ in results),
        "chunks": statistics.median(c for _, c in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs=2, type=Path, required=True)
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=31199)
    parser.add_argument("flags", nargs="*", help="radixserve serve flags (after --)")
    args = parser.parse_args()
    flags = args.flags or ["--max-total-tokens", "200000"]
    rng = random.Random(0)
    with contextlib.ExitStack() as stack:
        urls = []
        for i, tree in enumerate(args.trees):
            stack.enter_context(serving(tree.resolve(), args.port + i, flags))
            urls.append(f"http://127.0.0.1:{args.port + i}")
        results: dict[int, list[dict[str, float]]] = {0: [], 1: []}
        for r in range(args.rounds):
            for i, url in enumerate(urls):
                prompts = [
                    [rng.randrange(100, 40000) for _ in range(args.input_len)]
                    for _ in range(args.clients)
                ]
                asyncio.run(round_(url, prompts[:4], 4))  # (warm)
                results[i].append(asyncio.run(round_(url, prompts, args.output_len)))
                print(f"round {r + 1} {args.trees[i]}: {json.dumps(results[i][-1])}", flush=True)
    print(
        f"\n{args.clients} streamed completions at once ({args.input_len} prompt tokens, "
        f"{args.output_len} out, greedy); medians of {args.rounds} rounds"
    )
    print(f"{'tree':<28}{'out tok/s':>11}{'TPOT p50 ms':>13}{'chunks/stream':>15}")
    medians = []
    for i, tree in enumerate(args.trees):
        row = {k: statistics.median(x[k] for x in results[i]) for k in results[i][0]}
        medians.append(row)
        print(f"{str(tree):<28}{row['tok_s']:>11.1f}{row['tpot_ms']:>13.1f}{row['chunks']:>15.0f}")
    print(f"second / first tree: {medians[1]['tok_s'] / medians[0]['tok_s']:.2f}x tok/s")


if __name__ == "__main__":
    main()
