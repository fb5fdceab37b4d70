"""Tensor parallelism's cost and gain: the same model and workload in the in-process Engine
with --tp-size 1 and N (and with each of the ways ranks sum their results, shared memory
and gloo); prints the decode step time (the median of the rounds' mean step) at each batch
size, the ratio to --tp-size 1 in the same run, the prefill time, and the weights per rank.
On a machine with few cores this measures the price of the collectives, not a speed-up."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from radixserve.bench.offline import PARTS
from radixserve.config import add_config_args, config_from_args


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp-sizes", default="1,3", help="tensor-parallel sizes, in order")
    parser.add_argument(
        "--comms", default="auto,gloo", help="how ranks sum (--tp-comm) for sizes above 1"
    )
    parser.add_argument("--batch-sizes", default="1,16", help="running requests per round")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cpu-threads", type=int, default=0, help="threads per rank (0: the cores / ranks)"
    )
    parser.add_argument("--output-json", default=None)
    add_config_args(parser, PARTS)
    parser.set_defaults(max_total_tokens=8192, dtype="float32")


def run(args: argparse.Namespace) -> int:
    import radixserve
    from radixserve.hardware import cpu_info

    config = config_from_args(args, PARTS)
    ours = ("tp_size", "tp_comm", "cpu_threads")
    flat = {k: v for k, v in config.to_flat().items() if k not in ours}
    cores = len(os.sched_getaffinity(0))
    print(f"CPU: {cpu_info().summary()}; {cores} cores for all ranks", flush=True)
    results = []
    for tp in (int(t) for t in args.tp_sizes.split(",")):
        for comm in args.comms.split(",") if tp > 1 else ["auto"]:
            start = time.perf_counter()
            ranks = dict(tp_size=tp, tp_comm=comm, cpu_threads=args.cpu_threads)
            with radixserve.Engine(progress=False, **ranks, **flat) as engine:
                startup = time.perf_counter() - start
                info = engine.get_server_info()
                row = {
                    "tp_size": tp,
                    "comm": "none" if tp == 1 else comm,
                    "startup_s": startup,
                    "weight_mib_per_rank": [b / 2**20 for b in info["weight_bytes"]],
                    "threads_per_rank": _threads(tp, args.cpu_threads, cores),
                }
                row["by_batch"] = {b: _measure(engine, args, b) for b in _ints(args.batch_sizes)}
            results.append(row)
            print(_line(row), flush=True)
    _print(results)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _threads(tp: int, cpu_threads: int, cores: int) -> int:
    """Threads of each rank, as the Engine sets them."""
    return cpu_threads or max(cores // tp, 1)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _measure(engine, args: argparse.Namespace, batch: int) -> dict[str, float]:
    """Median over rounds of the mean decode step and of the prefill time, `batch` prompts
    of random-free distinct tokens decoded together."""
    steps, prefills = [], []
    params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    engine.generate(input_ids=[[7] * 8], sampling_params={**params, "max_new_tokens": 2})
    for r in range(args.rounds):
        prompts = [[(r * 997 + i * 131 + j) % 500 + 3 for j in range(args.prompt_len)]
                   for i in range(batch)]  # fmt: skip
        before = engine.get_server_info()["internal_states"][0]
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - start
        after = engine.get_server_info()["internal_states"][0]
        mixed = after["mixed_steps"] - before["mixed_steps"]  # counted as prefill time
        n = after["decode_steps"] - before["decode_steps"] - mixed
        decode = after["decode_step_seconds"] - before["decode_step_seconds"]
        steps.append(decode / max(n, 1))
        prefills.append(wall - decode)
        engine.flush_cache()
    return {"step_ms": 1e3 * statistics.median(steps), "prefill_s": statistics.median(prefills)}


def _line(row: dict) -> str:
    parts = [f"B={b}: {m['step_ms']:.1f} ms/step" for b, m in row["by_batch"].items()]
    return f"tp {row['tp_size']} ({row['comm']}): " + ", ".join(parts)


def _print(results: list[dict]) -> None:
    base = next((r for r in results if r["tp_size"] == 1), None)
    print(
        f"\n{'tp':>3} {'sums via':<9}{'threads':>8}{'MiB/rank':>10}{'start s':>9}   per batch size"
    )
    for row in results:
        cells = []
        for b, m in row["by_batch"].items():
            ratio = ""
            if base is not None and b in base["by_batch"]:
                ratio = f" ({m['step_ms'] / base['by_batch'][b]['step_ms']:.2f}x tp1)"
            cells.append(f"B={b}: {m['step_ms']:.1f} ms/step{ratio}, prefill {m['prefill_s']:.2f}s")
        mib = max(row["weight_mib_per_rank"])
        print(
            f"{row['tp_size']:>3} {row['comm']:<9}{row['threads_per_rank']:>8}{mib:>10.1f}"
            f"{row['startup_s']:>9.1f}   " + "; ".join(cells)
        )
