"""The offline Engine on a shared-prefix workload (groups of prompts sharing a system
prompt), with the radix cache on and off, next to transformers' static batching — all in
one run, greedy, fixed output length."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from radixserve.bench.datasets import shared_prefix_prompts
from radixserve.config import CacheConfig, ModelConfig, SchedulerConfig, config_from_args
from radixserve.config import add_config_args as add_flags

PARTS = (ModelConfig, CacheConfig, SchedulerConfig)


@dataclass
class Row:
    name: str
    seconds: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_throughput(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.seconds

    @classmethod
    def of_results(cls, name: str, seconds: float, results: list[dict]) -> Row:
        """The row of a run whose results are native API dicts (Engine or /generate)."""
        metas = [r["meta_info"] for r in results]
        return cls(
            name,
            seconds,
            sum(m["completion_tokens"] for m in metas),
            sum(m["prompt_tokens"] for m in metas),
            sum(m["cached_tokens"] for m in metas),
        )


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The shared-prefix workload: groups of prompts sharing a random system prompt."""
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--system-prompt-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def add_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    parser.add_argument("--baseline-batch-size", type=int, default=16)
    parser.add_argument("--baseline", choices=["transformers", "none"], default="transformers")
    add_flags(parser, PARTS)


def workload_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """The shared-prefix prompts the workload flags describe, as token ids."""
    return shared_prefix_prompts(
        args.num_groups,
        args.prompts_per_group,
        args.system_prompt_len,
        args.question_len,
        vocab_size,
        args.seed,
    )


def engine_options(args: argparse.Namespace) -> dict:
    """The Engine keyword arguments the model, cache and scheduler flags give."""
    config = config_from_args(args, PARTS)
    parts = (config.model, config.cache, config.scheduler)
    return {k: v for part in parts for k, v in asdict(part).items()}


def run(args: argparse.Namespace) -> int:
    from radixserve.engine import Engine

    flat = engine_options(args)
    params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    rows: list[Row] = []
    folder = None
    prompts: list[list[int]] = []
    for name, disable in (("radixserve", False), ("radixserve, radix cache off", True)):
        with Engine(progress=True, **(flat | {"disable_radix_cache": disable})) as engine:
            folder = engine.runner.model_folder
            prompts = prompts or workload_prompts(args, engine.runner.vocab_size)
            engine.generate(input_ids=prompts[0][:16], sampling_params=params)  # warm-up
            engine.flush_cache()
            start = time.perf_counter()
            results = engine.generate(input_ids=prompts, sampling_params=params)
            seconds = time.perf_counter() - start
        rows.append(Row.of_results(name, seconds, results))
    if args.baseline == "transformers":
        rows.append(transformers_row(folder, prompts, args))
    _print(rows, args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                [asdict(r) | {"output_throughput": r.output_throughput} for r in rows], f, indent=2
            )
    return 0


@torch.inference_mode()
def transformers_row(folder, prompts: list[list[int]], args: argparse.Namespace) -> Row:
    """transformers `generate`: static batches, left padding, greedy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    start = time.perf_counter()
    produced = 0
    for i in range(0, len(prompts), args.baseline_batch_size):
        chunk = prompts[i : i + args.baseline_batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            pad_token_id=0,
        )
        produced += (out.shape[1] - width) * len(chunk)
    seconds = time.perf_counter() - start
    return Row(
        f"transformers (static batch {args.baseline_batch_size})",
        seconds,
        produced,
        sum(map(len, prompts)),
        0,
    )


def _print(rows: list[Row], args: argparse.Namespace) -> None:
    base = rows[-1].output_throughput
    print(
        f"\nshared-prefix workload: {args.num_groups} groups x {args.prompts_per_group} prompts, "
        f"system {args.system_prompt_len} + question {args.question_len} tokens, "
        f"{args.output_len} output tokens, threads {torch.get_num_threads()}"
    )
    print(
        f"{'run':<36}{'seconds':>9}{'out tok/s':>11}{'total tok/s':>13}{'hit rate':>10}"
        f"{'vs last':>9}"
    )
    for r in rows:
        hit = r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        print(
            f"{r.name:<36}{r.seconds:>9.1f}{r.output_throughput:>11.1f}"
            f"{r.total_throughput:>13.1f}{hit:>10.1%}{r.output_throughput / base:>8.2f}x"
        )
