"""The offline Engine on a GPU, decode steps replayed from CUDA graphs or not, in one run.

The whole scheduler (continuous batching, the radix cache, chunked prefill with mixed
steps) over a SmolLM2-135M-shaped model with random weights, the same workloads through
three Engines: with CUDA graphs, with `disable_cuda_graph`, and with graphs but
`speculative_algorithm="none"` (n-gram drafting is on by default); rounds alternate, the
cache flushed before each. Prints and writes (OUT/engine_check.{json,md}) req/s and output
tok/s per round, their medians and ratio, the cached tokens, and how many greedy outputs
the Engines give alike (reported, not judged: a graph pads the batch, and another matmul
shape may round differently).

On a lent GPU machine (the image has no msgspec: carry its wheel, see README.md):
    python3 benchmarks/gpu/engine_check.py --out $OUT
Dry run on CPU (2 layers, small workloads; on CPU both Engines run eagerly):
    .venv/bin/python benchmarks/gpu/engine_check.py --device cpu --quick --out /tmp/engine_check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
NO_SPEC = "graphs, no speculation"  # the third Engine: what n-gram drafting costs or buys
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu.check import build_smollm2_shaped, environment  # noqa: E402


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_len: int


def workloads(vocab: int, quick: bool) -> list[Workload]:
    """vs-vLLM's shared-prefix and no-sharing shapes (64 prompts, 32 output tokens), and a
    decode-heavy one (256 prompts of 64 tokens, 128 output tokens); small on --quick."""
    from radixserve.bench.datasets import random_ids, shared_prefix_prompts

    gen = torch.Generator().manual_seed(1)
    if quick:
        shared = shared_prefix_prompts(2, 2, 64, 8, vocab, 0)
        plain = [random_ids(gen, 68, vocab) for _ in range(8)]
        short = [random_ids(gen, 16, vocab) for _ in range(32)]
        lens = (8, 8, 16)
    else:
        shared = shared_prefix_prompts(8, 8, 512, 32, vocab, 0)
        plain = [random_ids(gen, 544, vocab) for _ in range(64)]
        short = [random_ids(gen, 64, vocab) for _ in range(256)]
        lens = (32, 32, 128)
    return [
        Workload("shared prefix (8 groups x 8, 512 + 32 tokens)", shared, lens[0]),
        Workload("no sharing (64 x 544 tokens)", plain, lens[1]),
        Workload("decode-heavy (256 x 64 tokens, 128 out)", short, lens[2]),
    ]


def run_round(engine, workload: Workload) -> dict[str, Any]:
    from radixserve.bench.offline import Row  # the offline bench's sums of native results

    engine.flush_cache()
    params = {"temperature": 0, "max_new_tokens": workload.output_len, "ignore_eos": True}
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    results = engine.generate(input_ids=workload.prompts, sampling_params=params)
    row = Row.of_results(workload.name, time.perf_counter() - start, results)
    return {
        "seconds": row.seconds,
        "req_per_s": len(results) / row.seconds,
        "output_tok_per_s": row.output_throughput,
        "cached_tokens": row.cached_tokens,
        "prompt_tokens": row.prompt_tokens,
        "output_ids": [r["output_ids"] for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="/tmp/engine_check")
    args = parser.parse_args(argv)
    from radixserve.engine import Engine

    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"environment": environment(device), "dtype": dtype, "rows": []}
    with tempfile.TemporaryDirectory(prefix="engine_check-") as work:
        folder = build_smollm2_shaped(
            Path(work) / "model", 2 if args.quick else 30, getattr(torch, dtype)
        )
        common = dict(device=str(device), dtype=dtype, max_total_tokens=65536, progress=False)
        start = time.perf_counter()
        graphs = Engine(str(folder), **common)
        report["graph_engine_start_s"] = time.perf_counter() - start
        start = time.perf_counter()
        eager = Engine(str(folder), disable_cuda_graph=True, **common)
        report["eager_engine_start_s"] = time.perf_counter() - start
        plain = Engine(str(folder), speculative_algorithm="none", **common)
        engines = {"graphs": graphs, "eager": eager, NO_SPEC: plain}
        captured = graphs.runner.decode_graphs
        report["graph_sizes"] = None if captured is None else captured.sizes
        try:
            for workload in workloads(graphs.runner.vocab_size, args.quick):
                for engine in engines.values():  # warm-up
                    run_round(engine, Workload(workload.name, workload.prompts[:8], 4))
                rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
                for _ in range(args.rounds):
                    for name, engine in engines.items():
                        rounds[name].append(run_round(engine, workload))
                report["rows"].append(summarise(workload, rounds))
                print(
                    json.dumps({k: v for k, v in report["rows"][-1].items() if k != "rounds"}),
                    flush=True,
                )
                write(report, out)
            for name, engine in engines.items():
                engine.check_kv_accounting()
                report[f"{name}_kv_accounting"] = "ok"
        finally:
            for engine in engines.values():
                engine.shutdown()
    write(report, out)
    print((out / "engine_check.md").read_text())
    return 0


def summarise(workload: Workload, rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[name])

    def same(other: str) -> int:
        pairs = zip(rounds["graphs"][0]["output_ids"], rounds[other][0]["output_ids"])
        return sum(a == b for a, b in pairs)

    return {
        "workload": workload.name,
        "requests": len(workload.prompts),
        "graphs_req_per_s": median("graphs", "req_per_s"),
        "eager_req_per_s": median("eager", "req_per_s"),
        "graphs_output_tok_per_s": median("graphs", "output_tok_per_s"),
        "eager_output_tok_per_s": median("eager", "output_tok_per_s"),
        "ratio": median("graphs", "req_per_s") / median("eager", "req_per_s"),
        "no_spec_req_per_s": median(NO_SPEC, "req_per_s"),
        "identical_without_speculation": same(NO_SPEC),
        "cached_tokens": {n: [r["cached_tokens"] for r in rs] for n, rs in rounds.items()},
        "prompt_tokens": rounds["graphs"][0]["prompt_tokens"],
        "identical_outputs": same("eager"),
        "rounds": {
            n: [{k: v for k, v in r.items() if k != "output_ids"} for r in rs]
            for n, rs in rounds.items()
        },
    }


def write(report: dict[str, Any], out: Path) -> None:
    (out / "engine_check.json").write_text(json.dumps(report, indent=1))
    env = report["environment"]
    where = env["gpu"] or "CPU"
    sizes = report.get("graph_sizes")
    lines = [
        f"# Engine check — {env['date']}",
        "",
        f"- device: {where}; torch {env['torch']}; {report['dtype']}; SmolLM2-135M shape, "
        "random weights; greedy, EOS ignored; rounds alternate between the three Engines, the "
        "cache flushed before each; medians",
        f"- CUDA graphs: {f'{len(sizes)} batch sizes' if sizes else 'none (eager both)'}; "
        f"Engine start {report['graph_engine_start_s']:.1f} s with graphs, "
        f"{report['eager_engine_start_s']:.1f} s without",
        "",
        "| workload | req/s graphs | req/s eager | ratio | req/s graphs, no speculation "
        "| out tok/s graphs | out tok/s eager | cached / prompt tokens | identical outputs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        cached = row["cached_tokens"]["graphs"][0]
        lines.append(
            f"| {row['workload']} | {row['graphs_req_per_s']:.1f} | {row['eager_req_per_s']:.1f} "
            f"| {row['ratio']:.2f}x | {row['no_spec_req_per_s']:.1f} "
            f"| {row['graphs_output_tok_per_s']:.0f} "
            f"| {row['eager_output_tok_per_s']:.0f} | {cached} / {row['prompt_tokens']} "
            f"| {row['identical_outputs']}/{row['requests']} |"
        )
    (out / "engine_check.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
