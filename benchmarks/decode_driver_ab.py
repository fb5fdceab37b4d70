"""What the one-call decoder layers (decode_layers.cpp) save a model's decode steps, in one
run on one ModelRunner: decode steps of B running requests (`--context-len` cached tokens
each) timed with the driver and with the Python layers (the driver turned off for those
steps alone, as a model it did not take ran before), alternating step by step; prints the
median step time of each and their ratio per batch size. Both ways compute the same
logits bit for bit (tests/test_decode_layers.py), so only the time differs.

With `--arriving N [N ...]`, mixed steps instead: each of the B running requests' one
decode row and, after them, whole prompts of those lengths arriving (the step a continuous
batch runs when requests arrive; past 256 rows, on AVX2 CPUs, its products go to MKL,
which the driver calls as torch's F.linear does), the same step timed again and again.

Any model folder the runner loads (default: SmolLM2). A Qwen3-shaped model with random
weights (the driver now takes per-head q/k norms) is made by `--random-qwen3 DIR`:
Qwen3-0.6B's layer shapes (28 layers, hidden 1024, 16 heads of 128, 8 KV heads,
intermediate 3072) over the tests' 512-token vocabulary.

    .venv/bin/python benchmarks/decode_driver_ab.py --random-qwen3 /tmp/qwen3 --dtype float32
    .venv/bin/python benchmarks/decode_driver_ab.py --batch-sizes 16 --context-len 544 \
        --arriving 544 310 --steps 10
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from radixserve.config import Config
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.hardware import cpu_info
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.batch_builder import BatchBuilder

TOKENIZER = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny_tokenizer"


def random_qwen3(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    if (folder / "config.json").exists():
        return folder
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for file in TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def alternated(
    runner: ModelRunner, steps: int, batch_of: Callable[[int], object]
) -> tuple[list[float], list[float]]:
    """(driver, Python layers) seconds of `steps` forwards each of the batch `batch_of(run)`
    gives for each run, the two ways alternating run by run (the first two of each way warm
    up)."""
    model, driver = runner.model, runner.model.decode_layers
    timed: tuple[list[float], list[float]] = ([], [])
    try:
        for run in range(2 * steps + 4):
            batch = batch_of(run)
            way = run % 2
            model.decode_layers = driver if way == 0 else None
            start = time.perf_counter()
            runner.forward(batch)
            if run >= 4:
                timed[way].append(time.perf_counter() - start)
    finally:
        model.decode_layers = driver
    return timed


def step_times(
    runner: ModelRunner, batch: int, context: int, steps: int
) -> tuple[list[float], list[float]]:
    """(driver, Python layers) seconds of `steps` decode steps each, alternating."""
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    reqs = [
        Req(f"r{i}", torch.randint(3, vocab, (context,), generator=gen).tolist(), params)
        for i in range(batch)
    ]

    def next_step(run: int):
        for req in reqs:
            req.output_ids.append(5)
        return builder.decode(reqs)

    try:
        runner.forward(builder.extend(reqs, [r.input_ids for r in reqs]))
        return alternated(runner, steps, next_step)
    finally:
        for req in reqs:
            builder.release(req)


def mixed_times(
    runner: ModelRunner, batch: int, context: int, arriving: list[int], steps: int
) -> tuple[list[float], list[float]]:
    """(driver, Python layers) seconds of `steps` runs each, alternating, of one mixed step:
    `batch` requests' decode rows after `context` cached tokens, then prompts of the
    `arriving` lengths whole (the same step each time: its K/V go to the same slots)."""
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(batch + sum(arriving))
    tokens = lambda n: torch.randint(3, vocab, (n,), generator=gen).tolist()  # noqa: E731
    running = [Req(f"r{i}", tokens(context), params) for i in range(batch)]
    new = [Req(f"a{i}", tokens(n), params) for i, n in enumerate(arriving)]
    model, driver = runner.model, runner.model.decode_layers
    try:
        for req in running:
            runner.forward(builder.extend([req], [req.input_ids]))
        step = builder.extend(
            running + new, [tokens(1) for _ in running] + [r.input_ids for r in new]
        )
        taken = []
        model.decode_layers = lambda *a, **k: taken.append(driver(*a, **k)) or taken[-1]
        try:
            runner.forward(step)
        finally:
            model.decode_layers = driver
        if taken[-1] is None:
            raise SystemExit("the driver does not take this mixed step (too many rows?)")
        return alternated(runner, steps, lambda run: step)
    finally:
        for req in running + new:
            builder.release(req)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--random-qwen3", type=Path, default=None, metavar="DIR")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--arriving", type=int, nargs="+", default=None, metavar="N",
        help="mixed steps: prompts of these lengths arrive beside the running requests' rows",
    )  # fmt: skip
    args = parser.parse_args()
    path = args.model_path
    if args.random_qwen3 is not None:
        path = str(random_qwen3(args.random_qwen3))
    config = Config.from_flat(model_path=path, dtype=args.dtype, max_total_tokens=32768)
    runner = ModelRunner(config, progress=False)
    if runner.model.decode_layers is None:
        raise SystemExit("the driver does not take this model (or this CPU's plan)")
    print(f"cpu: {cpu_info().summary()}  threads: {torch.get_num_threads()}")
    print(f"model: {runner.model_folder}  dtype: {args.dtype}  context: {args.context_len}")
    if args.arriving:
        rows = [f"{b} + {'+'.join(map(str, args.arriving))}" for b in args.batch_sizes]
        print(f"mixed steps: running decode rows + arriving prompts' tokens: {', '.join(rows)}")
    print(f"{'running':>8} {'driver ms':>10} {'python ms':>10} {'python/driver':>14}")
    for batch in args.batch_sizes:
        if args.arriving:
            driver, python = mixed_times(runner, batch, args.context_len, args.arriving, args.steps)
        else:
            driver, python = step_times(runner, batch, args.context_len, args.steps)
        d, p = 1e3 * statistics.median(driver), 1e3 * statistics.median(python)
        print(f"{batch:>8} {d:>10.2f} {p:>10.2f} {p / d:>13.2f}x", flush=True)


if __name__ == "__main__":
    main()
