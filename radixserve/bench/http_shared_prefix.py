"""The shared-prefix workload through the HTTP server with the radix cache on and off (each a
`radixserve serve` subprocess fed by concurrent /generate clients), next to transformers
static batching (left padding, greedy) on the same prompts, all in one run; prints each
side's output throughput and the server's ratios to the other two."""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict

import torch

from radixserve.bench.offline import (
    PARTS,
    Row,
    add_workload_args,
    transformers_row,
    workload_prompts,
)
from radixserve.bench.server_vs_engine import Server, serve_round, server_flags
from radixserve.config import add_config_args, config_from_args

RADIX_ON, RADIX_OFF = "server, radix cache", "server, radix cache off"


def add_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    parser.add_argument("--concurrency", type=int, default=16, help="clients at once")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every side, alternating")
    parser.add_argument("--baseline-batch-size", type=int, default=16)
    add_config_args(parser, PARTS)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from radixserve.model.loader import resolve_model_folder

    config = config_from_args(args, PARTS)
    flags = server_flags(config)
    folder = resolve_model_folder(config.model.model_path, config.model.cache_dir)
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    prompts = workload_prompts(args, vocab_size)
    params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    rows: dict[str, list[Row]] = {RADIX_ON: [], RADIX_OFF: [], "transformers": []}
    for round_ in range(args.rounds):
        for name, extra in ((RADIX_ON, []), (RADIX_OFF, ["--disable-radix-cache"])):
            with Server([*flags, *extra]) as url:
                rows[name].append(serve_round(url, name, prompts, params, args.concurrency, True))
        rows["transformers"].append(transformers_row(folder, prompts, args))
        print(
            f"round {round_ + 1}: "
            + ", ".join(f"{name} {r[-1].output_throughput:.1f}" for name, r in rows.items())
            + " out tok/s",
            flush=True,
        )
    _print(args, rows)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({name: [asdict(r) for r in r_] for name, r_ in rows.items()}, f, indent=2)
    return 0


def _print(args: argparse.Namespace, rows: dict[str, list[Row]]) -> None:
    median = {name: statistics.median(r.output_throughput for r in r_) for name, r_ in rows.items()}
    print(
        f"\nshared-prefix workload through HTTP: {args.num_groups} groups x "
        f"{args.prompts_per_group} prompts, system {args.system_prompt_len} + question "
        f"{args.question_len} tokens, {args.output_len} output tokens; {args.concurrency} "
        f"concurrent streaming clients; transformers static batch {args.baseline_batch_size}; "
        f"threads {torch.get_num_threads()}; medians of {args.rounds} round(s)"
    )
    print(f"{'run':<28}{'out tok/s':>11}{'hit rate':>10}{'radix on / this':>17}")
    for name, r_ in rows.items():
        hit = statistics.median(r.cached_tokens / r.prompt_tokens for r in r_)
        ratio = median[RADIX_ON] / median[name]
        print(f"{name:<28}{median[name]:>11.1f}{hit:>10.1%}{ratio:>16.2f}x")
