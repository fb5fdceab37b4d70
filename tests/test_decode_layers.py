"""A step's decoder layers in one C++ call (`decode_layers.cpp`) against the Python model
calling the same kernels layer by layer: the same logits bit for bit for decode steps,
prompts, and steps mixing one-token rows with new tokens after cached prefixes, under this
CPU's kernel plan and under the AVX2-only CPUs' plans (the blocked fp32 kernel's AVX2
build, or the one-row and few-row linear kernels; 8-lane builds; they run on any AVX2
CPU), in fp32 and bf16, with and without q/k/v biases and per-head q/k norms (Qwen3);
the steps and models it leaves to Python; and greedy generation with its logprobs alike
with the driver and without over prompts that share a cached prefix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve import Engine
from radixserve.config import Config
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.hardware import FEW_ROWS_MAX, FP32_BLOCKED_ROWS, FP32_EXACT_ROWS_AVX2, KernelPlan
from radixserve.model.decode_layers import LORA_MAX_ROWS, MAX_ROWS, decode_layers_library
from radixserve.model.layers import Linear
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.batch_builder import BatchBuilder
from tests.conftest import FP32

pytestmark = pytest.mark.skipif(
    decode_layers_library() is None, reason="the C++ kernels cannot be built on this machine"
)

# an AVX2-only CPU's plan for an fp32 model where the blocked kernel cannot be built: the
# one-row and few-rows linear kernels, the AVX2 builds of decode and extend attention and
# the fused ops
AVX2_PLAN = KernelPlan(
    True,
    True,
    FEW_ROWS_MAX,
    48,
    fused_elementwise="avx2",
    decode_layers=True,
    extend_attention=True,
)
# and as hardware.KernelPlan.choose makes it: the blocked fp32 kernel's AVX2 build first
AVX2_BLOCKED_PLAN = dataclasses.replace(
    AVX2_PLAN,
    blocked_rows=FP32_BLOCKED_ROWS,
    blocked_isa="avx2",
    blocked_exact_rows=FP32_EXACT_ROWS_AVX2,
)
PLANS = {"avx2": AVX2_PLAN, "avx2-blocked": AVX2_BLOCKED_PLAN}
CASES = [
    ("llama", FP32, "auto"),
    ("qwen2", FP32, "auto"),  # q/k/v biases
    ("qwen3", FP32, "auto"),  # per-head q/k norms
    ("llama", "bfloat16", "auto"),
    ("qwen3", "bfloat16", "auto"),
    ("llama", FP32, "avx2"),
    ("qwen2", FP32, "avx2"),
    ("qwen3", FP32, "avx2"),
    ("llama", FP32, "avx2-blocked"),
    ("qwen2", FP32, "avx2-blocked"),
]
ROWS = (1, 3, 24, FEW_ROWS_MAX + 8)  # one row, a few, more than the few-rows kernel takes


def make_runner(path, dtype: str, plan: str, monkeypatch) -> ModelRunner:
    if plan in PLANS:
        chosen = PLANS[plan]
        monkeypatch.setattr(KernelPlan, "choose", classmethod(lambda cls, *a, **k: chosen))
    config = Config.from_flat(model_path=str(path), max_total_tokens=4096, dtype=dtype)
    runner = ModelRunner(config, progress=False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the tiny checkpoints' norms are all ones: tell them apart
        for name, param in runner.model.named_parameters():
            if "norm" in name:
                param.mul_(torch.rand(param.shape, generator=gen) + 0.5)
    return runner


def driver_takes(runner: ModelRunner, rows: int) -> bool:
    """Every product of a step of `rows` rows goes to a C kernel under the runner's plan:
    the blocked kernel's rows (more where each weight's products are torch's F.linear's:
    `blocked_exact_rows`, None for every row count), or the row kernels'."""
    plan = runner.kernels
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    exact = bool(plan.blocked_rows) and all(
        m.blocked is not None and m.blocked.same_as_torch(m.weight) for m in linears
    )
    return (
        rows <= plan.blocked_rows
        or (exact and (plan.blocked_exact_rows is None or rows <= plan.blocked_exact_rows))
        or (rows == 1 and plan.gemv)
        or (1 < rows <= plan.few_rows_max and plan.packed_rows is None)
    )


def both_ways(runner: ModelRunner, batch) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(logits with the driver, logits layer by layer in Python, whether the driver took
    the step) for one batch, run twice: the same K/V go to the same slots."""
    model = runner.model
    driver, taken = model.decode_layers, []

    def spy(*args):
        out = driver(*args)
        taken.append(out is not None)
        return out

    model.decode_layers = spy
    try:
        with_driver = runner.forward(batch).logits
        model.decode_layers = None
        layer_by_layer = runner.forward(batch).logits
    finally:
        model.decode_layers = driver
    return with_driver, layer_by_layer, taken == [True]


@pytest.mark.parametrize(("arch", "dtype", "plan"), CASES)
def test_decode_steps_are_the_python_layers_bit_for_bit(
    tiny_model_dirs, arch, dtype, plan, monkeypatch
):
    runner = make_runner(tiny_model_dirs[arch], dtype, plan, monkeypatch)
    assert runner.model.decode_layers is not None
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    gen = torch.Generator().manual_seed(len(arch) + len(dtype))
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    for rows in ROWS:
        lens = torch.randint(5, 80, (rows,), generator=gen).tolist()
        reqs = [
            Req(f"r{i}", torch.randint(3, 500, (n,), generator=gen).tolist(), params)
            for i, n in enumerate(lens)
        ]
        try:
            logits = runner.forward(builder.extend(reqs, [r.input_ids for r in reqs])).logits
            for step in range(3):
                for req, token in zip(reqs, logits.argmax(-1).tolist(), strict=True):
                    req.output_ids.append(token)
                logits, python, taken = both_ways(runner, builder.decode(reqs))
                assert taken == driver_takes(runner, rows), (rows, step)
                assert torch.equal(logits, python), (rows, step)
        finally:
            for req in reqs:
                builder.release(req)
    assert runner.allocator.num_free == runner.allocator.size


@pytest.mark.parametrize(("arch", "dtype", "plan"), CASES)
def test_prompts_and_mixed_steps_are_the_python_layers_bit_for_bit(
    tiny_model_dirs, arch, dtype, plan, monkeypatch
):
    """Prompts (the extend kernel over no prefix), then steps where some requests run one
    token (the decode kernel) while others bring several after their cached ones (the
    extend kernel): the two kinds each one stretch of rows, either first, or interleaved
    (gathered by index: left to Python)."""
    runner = make_runner(tiny_model_dirs[arch], dtype, plan, monkeypatch)
    if not runner.kernels.extend_attention:  # bf16 on a CPU without AVX512-BF16
        pytest.skip("this CPU's plan has no extend kernel for the model's dtype")
    assert runner.attention.extend_kernel is not None
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    gen = torch.Generator().manual_seed(len(arch) + len(dtype) + 1)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    reqs = [
        Req(f"r{i}", torch.randint(3, 500, (n,), generator=gen).tolist(), params)
        for i, n in enumerate((3, 7, 2, 5))  # 17 prompt rows: every plan's kernels take them
    ]
    new = lambda n: torch.randint(3, 500, (n,), generator=gen).tolist()  # noqa: E731
    try:
        logits, python, taken = both_ways(runner, builder.extend(reqs, [r.input_ids for r in reqs]))
        assert taken and torch.equal(logits, python)
        layouts = {
            "several first": [new(4), new(3), new(1), new(1)],
            "one first": [new(1), new(1), new(2), new(6)],
            "interleaved": [new(1), new(5), new(1), new(2)],
        }
        for layout, tokens in layouts.items():
            logits, python, taken = both_ways(runner, builder.extend(reqs, tokens))
            assert taken == (layout != "interleaved"), layout
            assert torch.equal(logits, python), layout
    finally:
        for req in reqs:
            builder.release(req)
    assert runner.allocator.num_free == runner.allocator.size


LORA_CASES = [
    ("llama", FP32, "auto", 1e-4),
    ("llama", "bfloat16", "auto", 0.1),
    ("llama", FP32, "avx2", 1e-4),
    ("llama", FP32, "avx2-blocked", 1e-4),
    ("qwen3", FP32, "auto", 1e-4),  # q and k normed after the adapters' products
]


@pytest.mark.parametrize(("arch", "dtype", "plan", "tolerance"), LORA_CASES)
def test_steps_with_lora_adapters_are_the_python_layers(
    tiny_model_dirs, tmp_path, arch, dtype, plan, tolerance, monkeypatch
):
    """Decode steps whose rows use LoRA adapters (one adapter for every row; two of
    different shapes beside the base model's rows, their stack), and prompts' steps of up
    to LORA_MAX_ROWS rows, run in the driver, each
    adapter's products added where `LoraSite.add` adds them: the logits are the Python
    layers' up to the products' order of sums (fp32: ~1e-5; bf16: a rounding or two)."""
    from transformers import AutoModelForCausalLM

    from tests.test_lora import ADAPTERS, make_adapter

    folder = tiny_model_dirs[arch]
    if plan in PLANS:
        chosen = PLANS[plan]
        monkeypatch.setattr(KernelPlan, "choose", classmethod(lambda cls, *a, **k: chosen))
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    paths = [
        f"{name}={make_adapter(base, tmp_path / name, seed, **config)}"
        for seed, (name, config) in enumerate(ADAPTERS.items(), start=1)
    ]
    config = Config.from_flat(
        model_path=str(folder), max_total_tokens=4096, dtype=dtype, lora_paths=paths
    )
    runner = ModelRunner(config, progress=False)
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    extends_taken = []
    for rows, owners in ((1, [1]), (3, [2, 2, 2]), (3, [1, 0, 2]), (24, [0, 1, 2] * 8)):
        reqs = []
        for i, uid in enumerate(owners):
            prompt = torch.randint(3, 500, (int(torch.randint(5, 60, (1,), generator=gen)),))
            reqs.append(Req(f"r{i}", prompt.tolist(), params))
            reqs[-1].lora_id = uid
        try:
            prompts = builder.extend(reqs, [r.input_ids for r in reqs])
            logits, python, taken = both_ways(runner, prompts)
            extend_rows = len(prompts.input_ids)
            small = extend_rows <= LORA_MAX_ROWS[runner.dtype]
            assert taken == (small and driver_takes(runner, extend_rows)), extend_rows
            extends_taken.append(taken)
            assert torch.allclose(logits, python, atol=tolerance, rtol=0), (rows, owners)
            for _ in range(2):
                for req, token in zip(reqs, logits.argmax(-1).tolist(), strict=True):
                    req.output_ids.append(token)
                batch = builder.decode(reqs)
                # the base model's logits first (its K/V are written over next)
                plain = runner.forward(dataclasses.replace(batch, lora_ids=None)).logits
                logits, python, taken = both_ways(runner, batch)
                assert taken == driver_takes(runner, rows), (rows, owners)
                error = (logits - python).abs().max()
                assert torch.allclose(logits, python, atol=tolerance, rtol=0), (rows, owners, error)
                moved = (plain - logits).abs().amax(-1).tolist()  # adapters' rows alone
                assert [m > 10 * tolerance for m in moved] == [bool(u) for u in owners], moved
        finally:
            for req in reqs:
                builder.release(req)
    # (the few-rows plan's kernels take FEW_ROWS_MAX rows, these have more; bf16 without
    # AVX512-BF16 has no extend kernel)
    assert any(extends_taken) or plan == "avx2" or not runner.kernels.extend_attention
    assert runner.allocator.num_free == runner.allocator.size


LARGE_CASES = [
    ("llama", FP32, "auto"),
    ("llama", FP32, "avx2-blocked"),
    ("llama", FP32, "avx2"),
    ("qwen2", FP32, "avx2-blocked"),  # q/k/v biases: F.linear adds them, the driver declines
    ("llama", "bfloat16", "auto"),
]


@pytest.mark.parametrize(("arch", "dtype", "plan"), LARGE_CASES)
def test_large_prompts_and_mixed_steps_are_the_python_layers_bit_for_bit(
    tiny_model_dirs, arch, dtype, plan, monkeypatch
):
    """Steps of SMALL_BATCH_ROWS to MAX_ROWS rows (a prefill chunk, a large mixed step)
    whose products the Python layers give to torch's F.linear (the AVX2 plans past the
    blocked kernel's rows): the driver calls torch's own sgemm for them as F.linear does,
    with the same bits, where no product has a bias; with one, or where another kernel than
    F.linear and the driver's has the rows, it leaves the step to Python."""
    runner = make_runner(tiny_model_dirs[arch], dtype, plan, monkeypatch)
    if not runner.kernels.extend_attention:  # bf16 on a CPU without AVX512-BF16
        pytest.skip("this CPU's plan has no extend kernel for the model's dtype")
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    biased = any(m.bias is not None for m in linears)
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    gen = torch.Generator().manual_seed(len(arch) + len(plan))
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    new = lambda n: torch.randint(3, 500, (n,), generator=gen).tolist()  # noqa: E731
    reqs = [Req(f"r{i}", new(n), params) for i, n in enumerate((300, 2, 5))]
    try:
        for tokens, rows in (
            ([r.input_ids for r in reqs], 307),  # prompts
            ([new(1), new(1), new(600)], 602),  # two decode rows, then 600 new tokens
            ([new(1), new(1), new(MAX_ROWS - 2)], MAX_ROWS),
        ):
            logits, python, taken = both_ways(runner, builder.extend(reqs, tokens))
            by_torch = dtype == FP32 and not driver_takes(runner, rows) and not biased
            # the last layer runs for the three logits rows alone: their products too
            by_torch = by_torch and driver_takes(runner, len(reqs))
            assert taken == (driver_takes(runner, rows) or by_torch), rows
            assert torch.equal(logits, python), rows
    finally:
        for req in reqs:
            builder.release(req)
    assert runner.allocator.num_free == runner.allocator.size


def test_the_driver_leaves_other_steps_and_models_to_python(tiny_model_dirs):
    config = Config.from_flat(  # another decoder (sandwich norms, Gemma's norms, GELU)
        model_path=str(tiny_model_dirs["gemma3"]), max_total_tokens=1024, dtype=FP32
    )
    assert ModelRunner(config, progress=False).model.decode_layers is None
    config = Config.from_flat(
        model_path=str(tiny_model_dirs["llama"]), max_total_tokens=4096, dtype=FP32
    )
    runner = ModelRunner(config, progress=False)
    attention = runner.attention
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    reqs = [Req("a", [5, 6, 7, 8], params), Req("b", [9, 10], params)]
    prefill = attention.prepare(builder.extend(reqs, [r.input_ids for r in reqs]))
    if attention.extend_kernel is not None:
        assert attention.driver_view(prefill, torch.float32) is not None
    assert attention.driver_view(prefill, torch.bfloat16) is None  # an fp32 pool
    for req in reqs:
        req.output_ids.append(11)
    decode = attention.prepare(builder.decode(reqs))
    assert attention.driver_view(decode, torch.float32) is not None
    assert attention.driver_view(decode, torch.bfloat16) is None
    for req in reqs:
        builder.release(req)
    # more rows than the Python MLP takes at once: the driver declines the step
    long = Req("c", [3 + i % 400 for i in range(MAX_ROWS + 1)], params)
    try:
        logits, python, taken = both_ways(runner, builder.extend([long], [long.input_ids]))
        assert not taken and torch.equal(logits, python)
    finally:
        builder.release(long)


def test_greedy_generation_and_logprobs_alike_with_and_without_the_driver(tiny_model_dirs):
    """Prompts sharing a cached prefix (the decode kernel reads its K/V once for all of
    them) and one that does not, through the scheduler and the radix cache."""
    prefix = list(range(20, 120))
    prompts = [prefix + [7, 8, 9], prefix + [10, 11], prefix + [12], [5, 6, 7, 8]]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    results = []
    with Engine(str(tiny_model_dirs["llama"]), max_total_tokens=2048, dtype=FP32) as engine:
        driver = engine.runner.model.decode_layers
        assert driver is not None
        for use in (driver, None):
            engine.runner.model.decode_layers = use
            engine.flush_cache()
            out = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            results.append(
                [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in out]
            )
    assert results[0] == results[1]
    assert all(len(ids) == 12 for ids, _ in results[0])


def test_the_plan_turns_the_driver_off(tiny_model_dirs, monkeypatch):
    plan = dataclasses.replace(AVX2_PLAN, decode_layers=False)
    monkeypatch.setattr(KernelPlan, "choose", classmethod(lambda cls, *a, **k: plan))
    config = Config.from_flat(
        model_path=str(tiny_model_dirs["llama"]), max_total_tokens=1024, dtype=FP32
    )
    assert ModelRunner(config, progress=False).model.decode_layers is None
