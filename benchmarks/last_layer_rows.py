"""The last decoder layer run for a step's logits rows alone (ForwardBatch.logits_rows) against
every row, on the default model: forward passes of prompt and extend batches, the two ways
alternated in one process, medians; and how far the logits move (the narrowed rows' last
attention goes through the decode kernel instead of the extend kernel: another order of
sums).

    .venv/bin/python benchmarks/last_layer_rows.py [--dtype float32] [--repeats 9] [--model-path P]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve.config import Config
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.hardware import cpu_info
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.batch_builder import BatchBuilder

# (name, cached prefix tokens shared by the requests, new tokens of each request, requests)
CASES = (
    ("one prompt of 544", 0, 544, 1),
    ("a chunk: 2 prompts of 512", 0, 512, 2),
    ("16 questions of 32 after a cached 512", 512, 32, 16),
)


def run_case(runner: ModelRunner, prefix: int, new: int, reqs: int, repeats: int) -> dict:
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    gen = torch.Generator().manual_seed(prefix + new + reqs)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    shared = torch.randint(100, 40000, (prefix,), generator=gen).tolist()
    questions = [torch.randint(100, 40000, (new,), generator=gen).tolist() for _ in range(reqs)]
    times: dict[bool, list[float]] = {True: [], False: []}
    logits: dict[bool, torch.Tensor] = {}
    for i in range(2 * repeats + 2):  # the first round of each way warms up
        narrow = i % 2 == 0
        runner.narrow_last_layer = narrow
        batch_reqs = [Req(f"r{j}", shared + q, params) for j, q in enumerate(questions)]
        try:
            if prefix:  # the prefix computed once, then each request's own tokens after it
                first = batch_reqs[0]
                runner.forward(builder.extend([first], [shared]))
                for req in batch_reqs[1:]:
                    builder.attach_prefix(req, runner.req_to_token.slots(first.row, 0, prefix))
            batch = builder.extend(batch_reqs, [r.input_ids[r.kv_len :] for r in batch_reqs])
            start = time.perf_counter()
            out = runner.forward(batch).logits
            elapsed = time.perf_counter() - start
        finally:
            for req in batch_reqs:
                builder.release(req)
        if i >= 2:
            times[narrow].append(elapsed)
        logits[narrow] = out
    full, narrowed = statistics.median(times[False]), statistics.median(times[True])
    return {
        "every row ms": 1000 * full,
        "logits rows ms": 1000 * narrowed,
        "ratio": full / narrowed,
        "max |logit diff|": (logits[True] - logits[False]).abs().max().item(),
        "same argmax": bool(torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    config = Config.from_flat(model_path=args.model_path, dtype=args.dtype, max_total_tokens=8192)
    runner = ModelRunner(config, progress=False)
    print(cpu_info().summary(), f"dtype {args.dtype}")
    header = f"{'batch':40s} {'every row ms':>12s} {'logits rows ms':>15s} {'ratio':>6s}"
    print(header + "  max |dlogit|  argmax")
    for name, prefix, new, reqs in CASES:
        r = run_case(runner, prefix, new, reqs, args.repeats)
        print(
            f"{name:40s} {r['every row ms']:12.1f} {r['logits rows ms']:15.1f} "
            f"{r['ratio']:5.3f}x  {r['max |logit diff|']:.2e}     {r['same argmax']}"
        )


if __name__ == "__main__":
    main()
