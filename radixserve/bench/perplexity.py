"""Perplexity of the model on a fixed English text, unquantized and quantized in one run:
what --quantization costs in accuracy, measured through the Engine (input logprobs)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from radixserve.config import QUANTIZATIONS

# Five paragraphs written for this benchmark (721 SmolLM2 tokens), so no model saw them.
DEFAULT_TEXT = Path(__file__).with_name("perplexity_text.txt")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--text-file", default=str(DEFAULT_TEXT), help="the text to score")
    parser.add_argument(
        "--quantizations",
        nargs="+",
        choices=QUANTIZATIONS,
        default=list(QUANTIZATIONS),
        help="the first is the reference the others are compared with",
    )
    parser.add_argument(
        "--max-total-tokens", type=int, default=16384, help="KV pool of each engine"
    )
    parser.add_argument("--output-json", default=None, help="also write the figures here")


def run(args: argparse.Namespace) -> int:
    from radixserve.engine import Engine

    text = Path(args.text_file).read_text()
    results: dict[str, float] = {}
    for quantization in args.quantizations:
        with Engine(
            args.model_path,
            quantization=quantization,
            max_total_tokens=args.max_total_tokens,
        ) as engine:
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
            results[quantization] = perplexity(engine, ids)
            model = engine.runner.model_folder.name
    reference = results[args.quantizations[0]]
    print(f"\nmodel {model}  text {Path(args.text_file).name} ({len(ids)} tokens)")
    print(f"{'quantization':<14}{'perplexity':>12}{'vs ' + args.quantizations[0]:>12}")
    for quantization, value in results.items():
        change = f"{100 * (value / reference - 1):+.2f}%"
        print(f"{quantization:<14}{value:>12.4f}{change:>12}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": model, "tokens": len(ids), "perplexity": results}, f, indent=2)
    return 0


def perplexity(engine, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of tokens 2..n, each given all tokens before it,
    from one prefill of the whole text."""
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
    )
    scored = out["meta_info"]["input_token_logprobs"][1:]  # the first token has no context
    return math.exp(-sum(entry[0] for entry in scored) / len(scored))
