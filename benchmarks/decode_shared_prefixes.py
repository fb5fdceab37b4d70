"""A 16-row decode step of the default model by how its requests share cached prefixes: 16
requests of 544 positions sharing nothing, or in groups sharing a 512-token prefix (1, 2 or
8 groups: the shared-prefix workload's running mix is ~8 groups of 2). ModelRunner decode
steps in one process, medians of 10 after 2, each layout twice.

    .venv/bin/python benchmarks/decode_shared_prefixes.py [--dtype float32]
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

ROWS, PREFIX, OWN = 16, 512, 32
PARAMS = SamplingParams(temperature=0.0, ignore_eos=True)


def requests(runner: ModelRunner, builder: BatchBuilder, groups: int, gen) -> list[Req]:
    """ROWS prefilled requests of PREFIX + OWN tokens: in `groups` groups sharing their
    first PREFIX (cached once), or sharing nothing (groups 0)."""

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=gen).tolist()

    reqs: list[Req] = []
    if groups == 0:
        for i in range(ROWS):
            req = Req(f"n{i}", tokens(PREFIX + OWN), PARAMS)
            runner.forward(builder.extend([req], [req.input_ids]))
            reqs.append(req)
        return reqs
    for g in range(groups):
        shared = tokens(PREFIX)
        first = Req(f"g{g}", shared + tokens(OWN), PARAMS)
        runner.forward(builder.extend([first], [first.input_ids]))
        reqs.append(first)
        for i in range(ROWS // groups - 1):
            req = Req(f"g{g}.{i}", shared + tokens(OWN), PARAMS)
            builder.attach_prefix(req, runner.req_to_token.slots(first.row, 0, PREFIX))
            runner.forward(builder.extend([req], [req.input_ids[PREFIX:]]))
            reqs.append(req)
    return reqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    runner = ModelRunner(Config.from_flat(dtype=args.dtype, max_total_tokens=20000), progress=False)
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    gen = torch.Generator().manual_seed(0)
    print(cpu_info().summary(), f"dtype {args.dtype}")
    layouts = {
        0: "nothing shared",
        8: "8 prefixes, 2 requests each",
        2: "2 prefixes of 8",
        1: "1 prefix",
    }
    results: dict[int, list[float]] = {g: [] for g in layouts}
    for _ in range(2):
        for groups in layouts:
            reqs = requests(runner, builder, groups, gen)
            times = []
            try:
                for step in range(12):
                    for req in reqs:
                        req.output_ids.append(5 + step)
                    start = time.perf_counter()
                    runner.forward(builder.decode(reqs))
                    times.append(time.perf_counter() - start)
            finally:
                for req in reqs:
                    builder.release(req)
            results[groups].append(1000 * statistics.median(times[2:]))
    for groups, name in layouts.items():
        runs = ", ".join(f"{ms:.1f}" for ms in results[groups])
        print(f"{ROWS} rows, {name:28s} decode step ms: {runs}")


if __name__ == "__main__":
    main()
