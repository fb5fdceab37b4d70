"""What LoRA adapters cost a batch, in one run on one Engine (SmolLM2-135M-Instruct): the
same 16 concurrent greedy requests (fixed prompts, `ignore_eos`) run on the base model,
all under one adapter, and spread over four adapters (4 requests each), rounds alternating;
prints the median output tokens/s of each and its ratio to the base model's.

The adapters are PEFT's (random weights, rank --rank on every attention and MLP
projection), made in a temporary folder. A decode step with adapter rows runs in the fused
C++ decode layers (decode_layers.cpp), which add each site's adapter products with
fused_ops.cpp's lora_add; the adapter cases run a second time with the Python layers
(the driver turned off for those runs alone), the way such steps ran before, as the
baseline of that change.

    .venv/bin/python benchmarks/lora_overhead.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from radixserve.config import Config
from radixserve.engine import Engine
from radixserve.hardware import cpu_info
from radixserve.model.loader import resolve_model_folder

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. "


def make_adapters(folder: Path, root: Path, count: int, rank: int) -> dict[str, Path]:
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapters = {}
    for i in range(count):
        torch.manual_seed(i)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=MODULES, init_lora_weights=False
        )
        model = get_peft_model(base, config)
        model.save_pretrained(root / f"lora{i}")
        model.unload()
        adapters[f"lora{i}"] = root / f"lora{i}"
    return adapters


def run(engine: Engine, prompts: list[str], tokens: int, adapters: list[str | None]) -> float:
    """Output tokens per second of one call of every prompt (they run as one batch)."""
    params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(prompts, params, lora_path=adapters)
    seconds = time.perf_counter() - start
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print(cpu_info().summary(), "; dtype", args.dtype, flush=True)
    folder = resolve_model_folder(None, Config.from_flat().model.cache_dir, progress=False)
    prompts = [f"{PROMPT}(story {i})" for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(folder, Path(tmp), 4, args.rank)
        paths = [f"{name}={path}" for name, path in adapters.items()]
        engine = Engine(None, progress=False, dtype=args.dtype, lora_paths=paths)
        names = list(adapters)
        cases = {
            "base model": [None] * args.requests,
            "one adapter": [names[0]] * args.requests,
            "four adapters": [names[i % 4] for i in range(args.requests)],
        }
        model = engine.runner.model
        driver = model.decode_layers
        python_layers = {f"{case}, Python layers": lora for case, lora in cases.items()}
        del python_layers["base model, Python layers"]
        try:
            run(engine, prompts, 8, cases["four adapters"])  # warm up
            rates: dict[str, list[float]] = {case: [] for case in (*cases, *python_layers)}
            for _ in range(args.rounds):
                for case, lora in cases.items():
                    rates[case].append(run(engine, prompts, args.tokens, lora))
                model.decode_layers = None
                for case, lora in python_layers.items():
                    rates[case].append(run(engine, prompts, args.tokens, lora))
                model.decode_layers = driver
        finally:
            engine.shutdown()
    base = statistics.median(rates["base model"])
    print(
        f"{args.requests} requests x {args.tokens} tokens, rank {args.rank}, {args.rounds} rounds"
    )
    print(f"{'batch':<32}{'median tok/s':>14}{'vs base':>10}")
    for case, values in rates.items():
        median = statistics.median(values)
        print(f"{case:<32}{median:>14.1f}{median / base:>9.2f}x")


if __name__ == "__main__":
    main()
