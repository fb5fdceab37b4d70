"""LoRA serving next to vLLM's CPU build, in one run on one machine: each server (one at a
time, both given every core) serves SmolLM2-135M-Instruct with the same four PEFT
adapters (random, rank 16 on every attention and MLP projection), and the same 16
concurrent greedy `/v1/completions` requests (64 output tokens, `ignore_eos`) run with
`model` the base model, one adapter for all, and the four adapters spread over them,
rounds alternating; prints median output tok/s per server and case, each server's ratio
to its own base model, and radixserve's ratio to vLLM.

    .venv/bin/python benchmarks/lora_vs_vllm.py --vllm-venv /work/vllm-venv --rounds 3

vLLM runs with `--enable-lora --max-loras 4 --max-lora-rank 16` and the preloads its CPU
docs recommend (radixserve.bench.vs_vllm starts both servers as `bench vs-vllm` does).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from lora_overhead import PROMPT, make_adapters  # beside this script

from radixserve.bench.vs_vllm import (
    ServerProcess,
    _free_port,
    find_preloads,
    radixserve_command,
    vllm_command,
    vllm_env,
    wait_until_pool_mapped,
)
from radixserve.config import Config
from radixserve.hardware import cpu_info
from radixserve.model.loader import resolve_model_folder

START_TIMEOUT_S = 600


def run_case(url: str, models: list[str], tokens: int) -> float:
    """Output tokens per second of the requests (one per model), all at once."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

    def one(i: int) -> int:
        reply = client.completions.create(
            model=models[i],
            prompt=f"{PROMPT}(story {i})",
            max_tokens=tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.usage.completion_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(len(models)) as pool:
        produced = sum(pool.map(one, range(len(models))))
    return produced / (time.perf_counter() - start)


def measure(server: ServerProcess, base: str, names: list[str], args) -> dict[str, float]:
    """Median output tok/s per case (the base model alone where `names` is empty)."""
    server.start(START_TIMEOUT_S)
    try:
        wait_until_pool_mapped(server.url, 120)
        n = args.requests
        cases = {"base model": [base] * n}
        if names:
            cases["one adapter"] = [names[0]] * n
            cases["four adapters"] = [names[i % len(names)] for i in range(n)]
        run_case(server.url, cases[list(cases)[-1]], 8)  # warm up (vLLM loads adapters)
        rates: dict[str, list[float]] = {case: [] for case in cases}
        for _ in range(args.rounds):
            for case, models in cases.items():
                rates[case].append(run_case(server.url, models, args.tokens))
        return {case: statistics.median(values) for case, values in rates.items()}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-venv", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args()
    cpu = cpu_info()
    print(cpu.summary(), "; fp32", flush=True)
    folder = resolve_model_folder(None, Config.from_flat().model.cache_dir, progress=False)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="lora-vs-vllm-"))
    venv = Path(args.vllm_venv).expanduser().absolute()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(folder, Path(tmp), 4, args.rank)
        names = list(adapters)
        modules = [f"{name}={path}" for name, path in adapters.items()]
        ours = ServerProcess(
            "radixserve",
            radixserve_command(folder, "float32", port := _free_port(), ["--lora-paths", *modules]),
            dict(os.environ),
            port,
            log_dir / "radixserve.log",
        )
        lora_flags = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", str(args.rank)]
        env = vllm_env(venv, os.sched_getaffinity(0), 4, find_preloads(venv))
        plain = ServerProcess(
            "vLLM without LoRA",
            vllm_command(venv, folder, "float32", port := _free_port()),
            env,
            port,
            log_dir / "vllm-plain.log",
        )
        theirs = ServerProcess(
            "vLLM",
            vllm_command(
                venv,
                folder,
                "float32",
                port := _free_port(),
                [*lora_flags, "--lora-modules", *modules],
            ),
            env,
            port,
            log_dir / "vllm.log",
        )
        figures = {
            "radixserve": measure(ours, "default", names, args),
            "vLLM": measure(theirs, str(folder), names, args),
            "vLLM without LoRA": measure(plain, str(folder), [], args),
        }
    print(
        f"{args.requests} concurrent /v1/completions x {args.tokens} tokens, rank {args.rank}, "
        f"medians of {args.rounds} rounds; logs in {log_dir}"
    )
    print(
        f"{'case':<16}{'radixserve':>12}{'vs base':>9}{'vLLM':>10}{'vs base':>9}{'ours/vLLM':>11}"
    )
    for case in figures["radixserve"]:
        ours_rate, theirs_rate = figures["radixserve"][case], figures["vLLM"][case]
        print(
            f"{case:<16}{ours_rate:>12.1f}{ours_rate / figures['radixserve']['base model']:>8.2f}x"
            f"{theirs_rate:>10.1f}{theirs_rate / figures['vLLM']['base model']:>8.2f}x"
            f"{ours_rate / theirs_rate:>10.2f}x"
        )
    alone = figures["vLLM without LoRA"]["base model"]
    print(
        f"vLLM started without --enable-lora: base model {alone:.1f} tok/s "
        f"(radixserve's base model {figures['radixserve']['base model'] / alone:.2f}x that)"
    )


if __name__ == "__main__":
    main()
