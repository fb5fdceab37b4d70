"""Where a decode step's time goes, at several running-batch sizes: matmuls, attention,
element-wise ops, the decoder layers driven from one C++ call where the kernel plan has it
(`decode_layers.cpp`: its products, attention and element-wise ops together; with
`--layer-by-layer` the Python model runs them one by one instead, which these categories
then split), and the rest (Python, dispatch, the batch building), from torch's profiler
over the model runner's decode steps."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from radixserve.config import CacheConfig, ModelConfig, add_config_args, config_from_args
from radixserve.model.cpu_kernels import profiled
from radixserve.model.sampler import first_argmax

PARTS = (ModelConfig, CacheConfig)
CHUNK_REQS = 16  # most requests prefilled in one extend batch
KV_MARGIN = 64  # KV slots beyond what the workload needs, when the pool is sized here
CATEGORIES = ("matmul", "attention", "elementwise", "layers")
LAYERS_OPS = frozenset({"kernel:decode_layers"})  # decode_layers.py's one call

MATMUL_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::matmul",
        "aten::linear",
        "aten::_weight_int8pack_mm",
        "kernel:linear",  # the project's one-row fp32 / int8 linear kernels (ctypes)
    }
)
ATTENTION_OPS = frozenset(
    {
        "kernel:attention",  # the C++ decode-attention kernel (ctypes)
        "aten::index_select",  # the torch path's K/V gather from the pool (attention.py)
    }
)


def classify(name: str) -> str | None:
    """The category of a profiler event by its name: "matmul", "attention", "elementwise"
    (any other aten op), "layers" (the decoder layers in one C++ call), or None (not an
    op: its time stays in "other")."""
    if name in LAYERS_OPS:
        return "layers"
    if name in MATMUL_OPS or "mkldnn" in name or "mkl_linear" in name:
        return "matmul"
    if name in ATTENTION_OPS or "scaled_dot_product" in name:
        return "attention"
    if name.startswith("aten::") or name == "kernel:elementwise":  # fused_ops.cpp
        return "elementwise"
    return None


def breakdown_us(events: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Self CPU microseconds per category from (name, self_us) pairs; unclassified events
    (neither aten ops nor the kernel labels) are left out."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for name, self_us in events:
        category = classify(name)
        if category is not None:
            totals[category] += self_us
    return totals


def attributed_events(function_events) -> list[list[tuple[str, float]]]:
    """Per profiled step (the events under each STEP_LABEL, in order), (name, self_us) for
    every profiler event, the name being that of its outermost ancestor that is an op (an
    aten op or a "kernel:" label), i.e. the op the Python code called: the bmm and softmax
    inside a math-path SDPA count as attention, the index_select inside aten::embedding as
    element-wise, the addmm inside aten::linear as a matmul. Each event's self time is
    counted once, so a step's totals add up to no more than its wall time."""
    steps: dict[int, tuple[float, list[tuple[str, float]]]] = {}
    for event in function_events:
        owner, node, root = event.name, event, event
        while node is not None:
            if classify(node.name) is not None:
                owner = node.name
            root, node = node, node.cpu_parent
        if root.name == STEP_LABEL:  # the label itself too: its self time is "other"
            step = steps.setdefault(id(root), (root.time_range.start, []))
            step[1].append((owner, float(event.self_cpu_time_total)))
    return [pairs for _, pairs in sorted(steps.values(), key=lambda s: s[0])]


def middle(values: list[float]) -> list[int]:
    """The indices of the median: the middle value, or the two middle ones."""
    order = sorted(range(len(values)), key=values.__getitem__)
    n = len(order)
    return order[(n - 1) // 2 : n // 2 + 1]


@dataclass
class Row:
    batch_size: int
    ms_per_step: float  # median wall time of the profiled steps
    matmul_ms: float
    attention_ms: float
    elementwise_ms: float
    layers_ms: float  # the decoder layers in one C++ call (their products, attention...)
    other_ms: float  # ms_per_step minus the four above
    unprofiled_ms_per_step: float  # median of as many steps without the profiler
    tok_per_s: float  # batch_size / unprofiled_ms_per_step: the speed without the profiler
    max_ms_per_step: float  # the slowest profiled step: far above the median = noise
    top_elementwise: list[tuple[str, float]]  # the largest element-wise ops, ms per step

    def pct(self, part: str) -> float:
        return 100.0 * getattr(self, f"{part}_ms") / self.ms_per_step


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--context-len", type=int, default=512, help="prompt tokens of each request"
    )
    parser.add_argument(
        "--steps", type=int, default=8, help="profiled decode steps (after 3 warm-up steps)"
    )
    parser.add_argument("--output-json", default=None, help="also write the rows here")
    parser.add_argument(
        "--layer-by-layer",
        action="store_true",
        help="run the decoder layers from Python one kernel at a time even where the kernel "
        "plan drives them from one C++ call (decode_layers), to split their time by kind",
    )
    add_config_args(parser, PARTS)


WARMUP_STEPS = 3
STEP_LABEL = "step-breakdown:step"  # around each profiled step
NOISY = 1.2  # the slowest profiled step over the median, past which the row is flagged


def run(args: argparse.Namespace) -> int:
    from radixserve.config import SchedulerConfig
    from radixserve.model.runner import ModelRunner

    if min(args.batch_sizes) < 1 or args.context_len < 1 or args.steps < 1:
        print("radixserve: error: batch sizes, context and steps must be >= 1", file=sys.stderr)
        return 2
    config = config_from_args(args, PARTS)
    # each request decodes warm-up + unprofiled + profiled steps after its prompt
    per_req = args.context_len + WARMUP_STEPS + 2 * args.steps
    need = max(args.batch_sizes) * per_req
    if config.cache.max_total_tokens is None:
        cache = dataclasses.replace(config.cache, max_total_tokens=need + KV_MARGIN)
        config = dataclasses.replace(config, cache=cache)
    elif config.cache.max_total_tokens < need:
        print(
            f"radixserve: error: --max-total-tokens {config.cache.max_total_tokens} is below "
            f"the {need} KV tokens this run needs",
            file=sys.stderr,
        )
        return 2
    if max(args.batch_sizes) > (config.scheduler.max_running_requests or 256):
        scheduler = SchedulerConfig(max_running_requests=max(args.batch_sizes))
        config = dataclasses.replace(config, scheduler=scheduler)
    runner = ModelRunner(config, progress=False)
    if args.layer_by_layer:
        runner.model.decode_layers = None
    if per_req > runner.context_len:
        print(
            f"radixserve: error: {per_req} tokens per request exceed the model's context "
            f"length {runner.context_len}",
            file=sys.stderr,
        )
        return 2
    gen = torch.Generator().manual_seed(0)
    rows = [measure(runner, batch, args.context_len, args.steps, gen) for batch in args.batch_sizes]
    print_table(rows, runner, args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(row) for row in rows], f, indent=2)
    return 0


def measure(runner, batch: int, context_len: int, steps: int, gen: torch.Generator) -> Row:
    """Prefill `batch` random prompts of `context_len` tokens (at most CHUNK_REQS requests
    per extend batch), then WARMUP_STEPS decode steps, `steps` timed ones without the
    profiler and `steps` timed ones under it; the requests' KV is given back after."""
    from radixserve.core.req import Req
    from radixserve.core.sampling_params import SamplingParams
    from radixserve.scheduler.batch_builder import BatchBuilder

    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    ids = torch.randint(100, runner.vocab_size, (batch, context_len), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    reqs = [Req(f"breakdown-{i}", p, params) for i, p in enumerate(ids)]
    try:
        for start in range(0, batch, CHUNK_REQS):
            chunk = reqs[start : start + CHUNK_REQS]
            logits = runner.forward(builder.extend(chunk, [r.input_ids for r in chunk])).logits
            for req, token in zip(chunk, logits.argmax(-1).tolist(), strict=True):
                req.output_ids.append(token)

        def step() -> float:
            begin = time.perf_counter()
            with profiled(STEP_LABEL):  # nothing while the profiler is off
                logits = runner.forward(builder.decode(reqs)).logits
                for req, token in zip(reqs, first_argmax(logits).tolist(), strict=True):
                    req.output_ids.append(token)
            return time.perf_counter() - begin

        for _ in range(WARMUP_STEPS):
            step()
        unprofiled = [step() for _ in range(steps)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            walls = [step() for _ in range(steps)]
    finally:
        for req in reqs:
            builder.release(req)
    per_step = attributed_events(prof.events())
    assert len(per_step) == steps, (len(per_step), steps)
    # The breakdown of the median step (the mean of the two middle ones for an even count):
    # its parts add up to its wall time, which a slow outlier step cannot upset.
    picked = middle(walls)
    pairs = [pair for i in picked for pair in per_step[i]]
    parts_ms = {k: v / 1000 / len(picked) for k, v in breakdown_us(pairs).items()}
    wall_ms = statistics.median(walls) * 1000
    elementwise: dict[str, float] = {}
    for name, self_us in pairs:
        if classify(name) == "elementwise":
            elementwise[name] = elementwise.get(name, 0.0) + self_us / 1000 / len(picked)
    top = sorted(elementwise.items(), key=lambda kv: -kv[1])[:5]
    return Row(
        batch_size=batch,
        ms_per_step=wall_ms,
        matmul_ms=parts_ms["matmul"],
        attention_ms=parts_ms["attention"],
        elementwise_ms=parts_ms["elementwise"],
        layers_ms=parts_ms["layers"],
        other_ms=wall_ms - sum(parts_ms.values()),
        unprofiled_ms_per_step=statistics.median(unprofiled) * 1000,
        tok_per_s=batch / statistics.median(unprofiled),
        max_ms_per_step=max(walls) * 1000,
        top_elementwise=[(name, round(ms, 4)) for name, ms in top],
    )


def print_table(rows: list[Row], runner, args: argparse.Namespace) -> None:
    from radixserve.hardware import cpu_info

    kv = str(runner.kv_dtype).removeprefix("torch.")
    dtype = str(runner.dtype).removeprefix("torch.")
    print(
        f"\n{cpu_info().summary()}\nmodel {runner.model_folder.name}  dtype {dtype}  "
        f"kv dtype {kv}  kernels {runner.kernels}  threads {torch.get_num_threads()}  "
        f"context {args.context_len}  median of {args.steps} profiled steps  decoder layers "
        f"{'in one C++ call' if runner.model.decode_layers else 'one by one from Python'}"
    )
    parts = (*CATEGORIES, "other")
    heads = "".join(f"{p + ' ms':>15}{'%':>6}" for p in parts)
    print(f"{'batch':>6}{'ms/step':>10}{heads}{'tok/s':>10}{'unprof ms':>11}")
    for row in rows:
        cells = "".join(f"{getattr(row, f'{p}_ms'):>15.2f}{row.pct(p):>6.1f}" for p in parts)
        print(
            f"{row.batch_size:>6}{row.ms_per_step:>10.2f}{cells}{row.tok_per_s:>10.1f}"
            f"{row.unprofiled_ms_per_step:>11.2f}"
        )
    print(
        "ms/step: the median profiled step; matmul / attention / elementwise / layers: "
        "profiler self CPU time per step (layers: the decoder layers in one C++ call, their "
        "products, attention and element-wise ops together); other: the rest (Python, "
        "dispatch, batch building, profiler overhead); tok/s and unprof ms: the same steps "
        "without the profiler"
    )
    for row in rows:
        top = ", ".join(f"{n.removeprefix('aten::')} {ms:.2f}" for n, ms in row.top_elementwise)
        print(f"batch {row.batch_size} largest element-wise ops, ms/step: {top}")
        if row.other_ms < 0 or row.max_ms_per_step > NOISY * row.ms_per_step:
            print(
                f"batch {row.batch_size}: noisy, the slowest step took "
                f"{row.max_ms_per_step / row.ms_per_step:.2f}x the median (another load on "
                "the CPU?)"
            )
