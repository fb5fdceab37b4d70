"""The blocked fp32 kernel (fp32_linear.cpp, the build this CPU runs) and its coded form
against the kernel plan's row kernels and MKL, on the default model's 180 linear weights
(SmolLM2's 30 layers, each weight read from memory as a decode step reads it): ms per pass
over all of them, at each row count, the ways alternated, medians. Every product is checked
first: the blocked kernel's against torch's F.linear (bit for bit where start-up found MKL's
order of sums; 4 rows or more, where MKL takes its sgemm paths), the coded form's against the
blocked kernel's.

    .venv/bin/python benchmarks/fp32_blocked_vs_plan.py [--rows 1,4,16,64,256,1024] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from radixserve.config import Config
from radixserve.hardware import cpu_info
from radixserve.model.cpu_kernels import coded_linear, cpu_runs, fp32_linear
from radixserve.model.layers import Linear
from radixserve.model.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,256,1024")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    isa = "avx512" if cpu_runs("avx512") else "avx2"
    blocked, coded = fp32_linear(None, isa), coded_linear(None, "q4_1", isa)
    if blocked is None or coded is None:
        raise SystemExit(f"the fp32 kernel's {isa} build does not run or build here")
    cpu = cpu_info()
    print(
        f"CPU: {cpu.model_name} ({isa} build), {torch.get_num_threads()} threads; blocked "
        f"kernel's sums in chunks of {blocked.chunk} (torch's: {blocked.reproduces_torch})"
    )
    config = Config.from_flat(dtype="float32", max_total_tokens=4096, kernels="torch")
    runner = ModelRunner(config, progress=False)
    plan = ModelRunner(Config.from_flat(dtype="float32", max_total_tokens=4096), progress=False)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    planned = [m for m in plan.model.modules() if isinstance(m, Linear)]
    packed = [blocked.pack(m.weight) for m in linears]
    codes = [coded.pack(m.weight) for m in linears]
    usable = all(c is not None for c in codes)
    print(f"{len(linears)} linear weights; as Q4_1 codes: {usable}; the plan: {plan.kernels}")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {m.in_features for m in linears}}
        ways = {
            "plan": lambda xs=xs: [m(xs[m.in_features]) for m in planned],
            "mkl": lambda xs=xs: [F.linear(xs[m.in_features], m.weight) for m in linears],
            "blocked": lambda xs=xs: [
                blocked(xs[m.in_features], w, m.out_features, None)
                for m, w in zip(linears, packed, strict=True)
            ],
        }
        if usable:
            ways["coded"] = lambda xs=xs: [
                coded(xs[m.in_features], c, m.out_features, None)
                for m, c in zip(linears, codes, strict=True)
            ]
        for m, w, c in zip(linears[:6], packed, codes, strict=False):
            x = xs[m.in_features]
            out = blocked(x, w, m.out_features, None)
            if blocked.reproduces_torch and rows >= 4:
                assert torch.equal(out, F.linear(x, m.weight)), "blocked != torch"
            if usable:
                assert torch.equal(coded(x, c, m.out_features, None), out), "coded != blocked"
        times: dict[str, list[float]] = {name: [] for name in ways}
        for rep in range(args.repeats + 1):
            for name, run in ways.items():
                start = time.perf_counter()
                run()
                if rep:
                    times[name].append(time.perf_counter() - start)
        line = " | ".join(f"{n} {statistics.median(t) * 1e3:8.1f}" for n, t in times.items())
        print(f"{rows:5d} rows, ms: {line}", flush=True)


if __name__ == "__main__":
    main()
