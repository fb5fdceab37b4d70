"""fp32 products of 4-bit codes by tables of subset sums (fp32_coded_lut.cpp) against MKL on
the default model's weights, and against the blocked kernel over the same codes
(fp32_linear.cpp's coded form, where it builds: AVX-512 with AVX512-BF16), which is
what a CPU whose MKL sums the blocked kernel reproduces (AMD's Zen 4) runs them on without
the tables: each build of the kernel (16 or 8 rows a vector, chunks of 1, 2 or 4 groups) on
one layer's six products at several row counts (q, k and v in one call, as the model makes
them), then a prefill forward through the runner with every linear layer on the best build
against the runner's plan without it, the ways alternated in one process, medians; and how
far each lands from the products in fp64.

    .venv/bin/python benchmarks/coded_lut_vs_mkl.py [--rows 128,512,1024] [--repeats 7] \
        [--prefill 2x512] [--blocked-prefill]

With MKL_ENABLE_INSTRUCTIONS=AVX2 in the environment MKL runs its AVX2 code: on an AVX-512
CPU that issues two 512-bit FMAs a cycle, a stand-in for a core that issues one (Zen 4).

(The runner makes the same comparison, coarser, at every start on CPUs without AMX and logs
it: hardware.CODED_LUT.)
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixserve.config import Config
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.hardware import CODED_LUT_ROWS, cpu_info
from radixserve.model.cpu_kernels import (
    CodedLinear,
    coded_linear,
    coded_lut_linear,
    coded_runs,
    cpu_runs,
)
from radixserve.model.layers import Linear, PackedRows
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.batch_builder import BatchBuilder


def alternated(ways: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each way, the ways run in turn `repeats` times after a warm-up."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(repeats + 1):
        for name, run in ways.items():
            start = time.perf_counter()
            run()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def products(layer, xs, kernel, packed) -> None:
    """The layer's products of xs (by K): MKL's, one by one, or `kernel`'s on the `packed`
    weights, as the model calls it: q, k and v (the first three) in one call."""
    if kernel is None:
        for w, _ in layer:
            F.linear(xs[w.shape[1]], w)
        return
    if isinstance(kernel, CodedLinear):  # the blocked kernel over codes: one by one
        for (w, _), codes in zip(layer, packed):
            kernel(xs[w.shape[1]], codes, w.shape[0], None)
        return
    parts = [(o, s, w.shape[0], None, m) for (w, _), (o, s, m) in zip(layer, packed)]
    kernel.products(xs[layer[0][0].shape[1]], parts[:3])
    for (w, _), part in zip(layer[3:], parts[3:]):
        kernel(xs[w.shape[1]], *part)


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).abs().max() / exact.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="128,512,1024")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefill", default="2x512", help="prompts x tokens of the forward")
    parser.add_argument(
        "--blocked-prefill",
        action="store_true",
        help="the prefill's layers without tables on the blocked kernel at every row count, as "
        "on a CPU whose MKL sums it reproduces (Zen 4); elsewhere its bits are not MKL's",
    )
    args = parser.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu.model_name} (AVX-512: {cpu.avx512}, AMX: {cpu.amx_bf16}), "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    if os.environ.get("MKL_ENABLE_INSTRUCTIONS"):  # e.g. AVX2: MKL held to half the FMAs
        print(f"MKL_ENABLE_INSTRUCTIONS={os.environ['MKL_ENABLE_INSTRUCTIONS']}")
    runner = ModelRunner(Config.from_flat(dtype="float32", max_total_tokens=4096), progress=False)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    layer = [(m.weight.detach(), coded_runs(m.weight.detach())) for m in linears[:6]]
    blocked = coded_linear(None, "q4_1")
    blocked_codes = None if blocked is None else [blocked.pack(w, f) for w, f in layer]
    builds = [(16, 1), (16, 2), (16, 4)] if cpu_runs("avx512") else []
    builds += [(8, 1), (8, 2), (8, 4)]
    gen = torch.Generator().manual_seed(0)
    best: tuple[float, tuple[int, int]] | None = None
    for lanes, chunk in builds:
        kernel = coded_lut_linear(lanes, chunk)
        packed = [kernel.pack(w, found) for w, found in layer]
        errors = []
        for (w, _), (offsets, scales, has_min) in zip(layer, packed):
            x = torch.randn(100, w.shape[1], generator=gen)
            exact = F.linear(x.double(), w.double())
            out = kernel(x, offsets, scales, w.shape[0], None, has_min)
            errors.append((relative_error(out, exact), relative_error(F.linear(x, w), exact)))
        print(f"{lanes} rows a vector, chunks of {chunk} groups: error against fp64 (max |error| "
              f"/ max |output|) {max(e for e, _ in errors):.2e}, MKL's "
              f"{max(m for _, m in errors):.2e}")  # fmt: skip
        for rows in map(int, args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=gen) for k in {w.shape[1] for w, _ in layer}}

            ways = {
                "mkl": functools.partial(products, layer, xs, None, None),
                "lut": functools.partial(products, layer, xs, kernel, packed),
            }
            if blocked is not None:
                ways["blocked"] = functools.partial(products, layer, xs, blocked, blocked_codes)
            t = alternated(ways, args.repeats)
            line = (f"  {rows:5d} rows: MKL {t['mkl'] * 1e3:7.2f} ms, tables "
                    f"{t['lut'] * 1e3:7.2f} ms ({t['mkl'] / t['lut']:.2f}x)")  # fmt: skip
            if blocked is not None:
                line += (f", blocked over codes {t['blocked'] * 1e3:7.2f} ms (tables "
                         f"{t['blocked'] / t['lut']:.2f}x it)")  # fmt: skip
            print(line)
            other = min(t[name] for name in ways if name != "lut")
            if best is None or other / t["lut"] > best[0]:
                best = (other / t["lut"], (lanes, chunk))
    assert best is not None
    lanes, chunk = best[1]
    kernel = coded_lut_linear(lanes, chunk)
    for m in linears:
        m.use_coded_prefill(kernel, PackedRows(CODED_LUT_ROWS, None))
    prompts, tokens = map(int, args.prefill.split("x"))
    batch_prompts = [torch.randint(100, 40000, (tokens,), generator=gen).tolist()] * prompts
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    params = SamplingParams(temperature=0.0, ignore_eos=True)

    def prefill() -> None:
        reqs = [Req(f"r{i}", p, params) for i, p in enumerate(batch_prompts)]
        try:
            runner.forward(builder.extend(reqs, batch_prompts))
        finally:
            for req in reqs:
                builder.release(req)

    def prefill_on(rows: PackedRows | None) -> Callable[[], None]:
        def run() -> None:
            for m in linears:
                m.coded_prefill_rows = rows
            prefill()

        return run

    lut_rows = PackedRows(CODED_LUT_ROWS, None)
    for m in linears:
        m.coded_prefill_rows = None
        if args.blocked_prefill and m.blocked_rows is not None:
            m.blocked_rows = PackedRows(1, None)
    probe = torch.empty(tokens * prompts, linears[0].in_features, device="meta")
    plan = "the blocked kernel" if linears[0].uses_blocked(probe) else "MKL"
    t = alternated({"plan": prefill_on(None), "lut": prefill_on(lut_rows)}, args.repeats)
    print(f"prefill {args.prefill} through the runner, {lanes} rows a vector, chunks of {chunk}:"
          f" without tables ({plan}) {t['plan'] * 1e3:.1f} ms, tables {t['lut'] * 1e3:.1f} ms"
          f" ({t['plan'] / t['lut']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
