"""Linear layers with their weights pre-blocked for oneDNN (`KernelPlan.packed_rows`: bf16 on
CPUs with AMX or AVX512-BF16, 2-64-row fp32 products on Intel's AVX-512 CPUs) or laid out
for the project's blocked kernels (`KernelPlan.blocked_rows`: bf16 decode-sized products as
AMX tiles on CPUs with AMX or AVX512-BF16; fp32 ones in blocks of 16 features on AVX-512
CPUs with AVX512-BF16, and in the AVX2 build elsewhere): the product against F.linear, and
a whole bf16 model packed, with the AMX kernel and with the fused element-wise ops
(`KernelPlan.fused_elementwise`) against the same model with torch's ops, and an fp32 model
through the fp32 kernel, on any CPU (all forced here where the CPU runs them; which
machines get them by default is tests/test_hardware.py's business; the ops alone:
tests/test_cpu_kernels.py)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F

from radixserve.config import Config
from radixserve.core.req import Req
from radixserve.hardware import CODED_LUT_ROWS, cpu_info
from radixserve.model import layers
from radixserve.model.cpu_kernels import (
    CODE_RANGE,
    CodedAmxLinear,
    CodedLinear,
    CodedLutLinear,
    LutSample,
    amx_linear,
    coded_amx_linear,
    coded_linear,
    coded_lut_linear,
    coded_runs,
    cpu_runs,
    fp32_linear,
    fused_ops,
    gemv_kernel,
    measure_coded_lut,
    torch_sum_chunk,
)
from radixserve.model.layers import (
    GatedMLP,
    Linear,
    PackedRows,
    RowKernels,
    pack_weight,
    packed_linear,
    product_shape,
)
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.batch_builder import BatchBuilder
from tests.static_generator import StaticGenerator
from tests.test_fidelity import greedy

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch was built without oneDNN"
)
BF16 = torch.bfloat16
# oneDNN's bf16 products need AVX-512 (or AVX-NE-CONVERT): on an AVX2-only CPU torch refuses
# them, and the kernel plan never packs bf16 there (only with AMX or AVX512-BF16)
ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_onednn_bf16 = pytest.mark.skipif(
    not ONEDNN_BF16, reason="oneDNN runs no bf16 products on this CPU"
)


# the tile-layout bf16 linear kernel as the plan builds it: AMX, else AVX512-BF16
AMX = amx_linear() if cpu_info().amx_bf16 else amx_linear(None, "avx512")
FUSED = fused_ops(None, "avx512") if cpu_runs("avx512") else fused_ops()  # the plan's build
needs_amx = pytest.mark.skipif(AMX is None, reason="this CPU has neither AMX nor AVX512-BF16")
# fp32_linear.cpp as the plan builds it: AVX-512 (with AVX512-BF16), else AVX2
FP32_ISA = "avx512" if cpu_runs("avx512") else "avx2"
FP32 = fp32_linear(None, FP32_ISA)
needs_fp32_kernel = pytest.mark.skipif(
    FP32 is None, reason="this CPU lacks AVX2, or the fp32 kernel did not build"
)
CODED = {form: coded_linear(None, form, FP32_ISA) for form in ("q4_1", "q8_0")}  # its codes
CODED_AMX = coded_amx_linear() if cpu_info().amx_bf16 else None  # fp32_coded_amx.cpp
needs_coded_amx = pytest.mark.skipif(CODED_AMX is None, reason="this CPU has no AMX")
# fp32_coded_lut.cpp's builds that run here: 8 rows a vector (AVX2), 16 (AVX-512)
LUT_LANES = [8, 16] if cpu_runs("avx512") else [8]


def as_codes(weight: torch.Tensor, form: str = "q4_1") -> torch.Tensor:
    """The weight as GGUF keeps it and dequantizes it, per run of 32 columns of a row: Q4_1,
    m its least value and d its range / 15 (both fp16), q = round((w - m) / d) in 0..15, and
    back (d * q) + m in fp32; Q8_0, d its greatest magnitude / 127 (fp16), back d * q."""
    n, k = weight.shape
    runs = weight.detach().float().reshape(n, k // 32, 32)
    if form == "q8_0":
        d = (runs.abs().amax(-1, keepdim=True) / 127).half().float()
        q = torch.round(runs / torch.where(d > 0, d, 1)).clamp(-128, 127) + 0.0  # no -0: ints
        return (d * q).reshape(n, k)
    m = runs.amin(-1, keepdim=True).half().float()
    d = ((runs.amax(-1, keepdim=True) - m) / 15).half().float()
    q = torch.round((runs - m) / torch.where(d > 0, d, 1)).clamp(0, 15)
    return (d * q + m).reshape(n, k)


def bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to bf16 rounding of a sum in another order (one ulp, 2**-7 relative)."""
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-2)


def product_inputs(rows: int, n: int, k: int, bias: bool):
    """x (rows, k), weight (n, k) and a bias (n,) or None, bf16, seeded by the shape."""
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    weight = torch.randn(n, k, generator=gen).to(BF16)
    return x, weight, torch.randn(n, generator=gen).to(BF16) if bias else None


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 65, 300])
@pytest.mark.parametrize(("n", "k"), [(64, 64), (192, 576), (301, 203)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, n, k, bias):
    x, weight, b = product_inputs(rows, n, k, bias)
    out = packed_linear(x, pack_weight(weight), b)
    assert out.shape == (rows, n) and out.dtype == BF16
    bf16_close(out, F.linear(x, weight, b))


@needs_onednn_bf16
def test_a_packed_layer_keeps_its_shape_and_frees_the_plain_weight():
    layer = Linear(48, 32, bias=True).to(BF16)
    x = torch.randn(5, 48).to(BF16)
    expected = layer(x)
    layer.pack(PackedRows())
    assert layer.weight.is_mkldnn and layer.packed_weight.is_mkldnn
    assert layer.weight.shape == (32, 48) and not layer.weight.requires_grad
    bf16_close(layer(x), expected)


def test_fp32_single_rows_and_prefill_keep_the_plain_weight():
    """Rows 2..64 (fp32 on AVX-512) through the packed copy; one row and prefill products
    through F.linear on the plain weight (MKL)."""
    layer = Linear(64, 48, bias=True)
    x = torch.randn(3, 64)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.pack(PackedRows(2, 64))
    assert not layer.weight.is_mkldnn and layer.packed_weight.is_mkldnn
    assert layer.uses_packed(x) and not layer.uses_packed(x[:1])
    assert layer.uses_packed(torch.zeros(64, 64)) and not layer.uses_packed(torch.zeros(65, 64))
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    one = F.linear(x[:1], layer.weight, layer.bias)
    torch.testing.assert_close(layer(x[:1]), one, atol=0, rtol=0)


def test_fp32_single_rows_go_to_the_one_row_kernel_beside_packed_rows():
    """Where MKL's sgemv is slow (AVX-512 CPUs not Intel's) the plan pairs packed 2..64-row
    products with the one-row kernel: one row reads the plain weight through it."""
    gemv = gemv_kernel()
    if gemv is None:
        pytest.skip("the one-row kernel does not build on this CPU (no AVX2)")
    layer = Linear(64, 48, bias=True)
    layer.pack(PackedRows(2, 64))
    layer.kernels = RowKernels(gemv)
    x = torch.randn(3, 64)
    one = gemv(x[:1], layer.weight, layer.bias)
    torch.testing.assert_close(layer(x[:1]), one, atol=0, rtol=0)
    torch.testing.assert_close(one, F.linear(x[:1], layer.weight, layer.bias))
    packed = packed_linear(x, layer.packed_weight, layer.bias)
    torch.testing.assert_close(layer(x), packed, atol=0, rtol=0)


def test_the_blocked_kernels_are_there_wherever_the_cpu_runs_them():
    """On an AMX (or AVX512-BF16) CPU a failed build or a refused tile permission must not
    pass unseen; nor a failed build of the fp32 kernel on any CPU with AVX2."""
    if cpu_runs("avx512"):
        assert AMX is not None and FP32 is not None
    if cpu_runs("avx2"):
        assert FP32 is not None and all(c is not None for c in CODED.values())


@pytest.mark.skipif(not cpu_runs("avx512"), reason="this CPU runs only one build")
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 63, 64, 65, 130])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 576), (96, 1536)])
@pytest.mark.parametrize("chunk", [0, 192])
def test_the_fp32_kernels_avx2_build_gives_the_avx512_builds_bits(rows, n, k, chunk):
    """The AVX2 build (two 256-bit halves a block, 6 rows a pass, panels of 63) sums as the
    AVX-512 one (8 rows a pass, panels of 64): the same products bit for bit, plain and over
    Q4_1 and Q8_0 codes, with and without a bias: what the AVX2-only CPUs run is what the
    AVX-512 ones test against torch."""
    wide, narrow = fp32_linear(None, "avx512"), fp32_linear(None, "avx2")
    assert wide is not None and narrow is not None
    gen = torch.Generator().manual_seed(rows * n + k + chunk)
    x, b = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    weight = torch.randn(n, k, generator=gen) / 24
    kernels = [wide, narrow]
    kernels += [
        coded_linear(None, form, isa) for form in ("q4_1", "q8_0") for isa in ("avx512", "avx2")
    ]
    previous = [kernel.chunk for kernel in kernels]
    try:
        for kernel in kernels:
            kernel.chunk = chunk
        for bias in (None, b):
            out = narrow(x, narrow.pack(weight), n, bias)
            assert torch.equal(out, wide(x, wide.pack(weight), n, bias))
        for a, c in (kernels[2:4], kernels[4:6]):
            codes = as_codes(weight, a.form)
            packed = c.pack(codes)
            assert torch.equal(c(x, packed, n, b), a(x, a.pack(codes), n, b))
            assert torch.equal(c(x, packed, n, b), narrow(x, narrow.pack(codes), n, b))
    finally:
        for kernel, chunk_before in zip(kernels, previous, strict=True):
            kernel.chunk = chunk_before


@needs_fp32_kernel
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 40, 64, 200])
@pytest.mark.parametrize(("n", "k"), [(16, 1), (32, 203), (48, 64), (192, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fp32_blocked_product_matches_a_float64_one(rows, n, k, bias):
    """Row counts around the kernel's 8-row chunks, feature counts around its groups of 3
    blocks of 16 (1, 2, 3, 4 blocks; 36 blocks for 2 threads), odd column counts."""
    gen = torch.Generator().manual_seed(rows * n + k)
    x, weight = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = FP32(x, FP32.pack(weight), n, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    ref = x.double() @ weight.double().T + (0 if b is None else b.double())
    # fp32 sums of k products in order: within k ulps of the exact sum's scale
    scale = (x.double().abs() @ weight.double().abs().T).max().item() + 1
    assert (out.double() - ref).abs().max().item() < 2**-23 * k * scale


@needs_fp32_kernel
@pytest.mark.parametrize("chunk", [0, 16, 100, 192, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fp32_blocked_sums_go_in_chunks_added_in_turn(chunk, bias):
    """With `chunk` columns a partial sum, the product is (bias + the first chunk's product)
    + the next chunk's + ..., each chunk's product from zero: bit for bit. A row of more
    than one chunk and less than two (600 columns at 512) goes in two halves."""
    gen = torch.Generator().manual_seed(chunk)
    rows, n, k = 19, 48, 600  # a tail chunk at 100 and 192; one chunk at 0; halves at 512
    x, weight = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    previous = FP32.chunk
    try:
        FP32.chunk = chunk
        out = FP32(x, FP32.pack(weight), n, b)
        FP32.chunk = 0
        step = k // 2 if chunk == 512 else chunk or k
        expected = None if b is None else b.expand(rows, n)
        for first in range(0, k, step):
            part = x[:, first : first + step].contiguous()
            partial = FP32(part, FP32.pack(weight[:, first : first + step]), n, None)
            expected = partial if expected is None else expected + partial
    finally:
        FP32.chunk = previous
    assert torch.equal(out, expected)


@needs_fp32_kernel
@pytest.mark.parametrize("rows", [16, 64, 544])
@pytest.mark.parametrize(("n", "k"), [(192, 576), (1536, 576), (576, 1536), (64, 256)])
def test_the_fp32_blocked_product_is_torchs_where_its_order_was_found(rows, n, k):
    """Where start-up found the chunk that reproduces torch's F.linear (MKL 2025 on an AMD
    Zen 4: 192, and halves of 256), a product of 16 or more rows with a weight of a shape
    `same_as_torch` vouches for is F.linear's bit for bit, prefill-sized too: what lets a
    prefill take the kernel. Elsewhere the kernel takes no prefill (the plan's row limit;
    tested below) and this has nothing to check."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(rows + n)) / 24
    if not FP32.same_as_torch(weight):
        pytest.skip(f"the kernel does not reproduce this CPU's MKL sgemm at ({n}, {k})")
    gen = torch.Generator().manual_seed(rows + k)
    x, b = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    packed = FP32.pack(weight)
    assert torch.equal(FP32(x, packed, n, None), F.linear(x, weight))
    assert torch.equal(FP32(x, packed, n, b), F.linear(x, weight, b))


def test_no_chunk_is_claimed_where_none_reproduces_torch():
    """torch_sum_chunk answers None for a kernel whose sums cannot match F.linear's, and
    leaves the kernel's chunk as it was."""
    if FP32 is None:
        pytest.skip("this CPU has no build of the fp32 kernel")

    class Skewed:  # the kernel's product, one ulp off in one element
        chunk, pack = FP32.chunk, FP32.pack

        def __call__(self, x, packed, n, bias):
            out = FP32(x, packed, n, bias)
            out[0, 0] = torch.nextafter(out[0, 0], torch.tensor(float("inf")))
            return out

    skewed = Skewed()
    assert torch_sum_chunk(skewed) is None and skewed.chunk == FP32.chunk


@needs_fp32_kernel
def test_the_fp32_blocked_layer_takes_few_rows_and_leaves_the_rest_to_mkl():
    """Rows 1..64 through the blocked copy; prefill products through F.linear on the plain
    weight (MKL), exactly; weights the kernel does not take stay plain."""
    layer = Linear(64, 48, bias=True)
    assert not FP32.fits(layer.weight.to(BF16)) and not FP32.fits(torch.zeros(40, 64))
    few, prefill = torch.randn(64, 64), torch.randn(65, 64)
    expected = F.linear(prefill, layer.weight, layer.bias)
    layer.use_blocked(FP32, PackedRows(1, 64))
    assert layer.uses_blocked(few[:1]) and layer.uses_blocked(few)
    assert not layer.uses_blocked(prefill) and layer.blocked_weight.numel() == 64 * 48
    torch.testing.assert_close(layer(few), F.linear(few, layer.weight, layer.bias))
    torch.testing.assert_close(layer(prefill), expected, atol=0, rtol=0)


@needs_fp32_kernel
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 64), (192, 576), (576, 1536)])
@pytest.mark.parametrize("chunk", [0, 64, 128, 192])
@pytest.mark.parametrize(("form", "bits"), [("q4_1", 6), ("q8_0", 9)])
def test_the_coded_product_is_the_blocked_ones_bit_for_bit(rows, n, k, chunk, form, bits):
    """A weight that is Q4_1 (Q8_0) codes dequantized goes to the coded kernel, which reads
    its codes and sums as the blocked kernel does (chunks of 64, 128 or 192 columns with a
    tail, one chunk, halves of 64 at 64...): the blocked kernel's product bit for bit, with
    and without a bias, from 6 (9) bits a weight: a code of 4 (8), d (and m) fp32 a run."""
    gen = torch.Generator().manual_seed(rows * n + k + chunk)
    weight = as_codes(torch.randn(n, k, generator=gen) / 24, form)
    x, b = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    coded = CODED[form]
    previous = FP32.chunk, coded.chunk
    try:
        FP32.chunk = coded.chunk = chunk
        codes = coded.pack(weight)
        assert codes is not None and codes.dtype == torch.uint8
        assert codes.numel() == n * k * bits // 8
        blocked = FP32.pack(weight)
        for bias in (None, b):
            assert torch.equal(coded(x, codes, n, bias), FP32(x, blocked, n, bias))
    finally:
        FP32.chunk, coded.chunk = previous


@needs_fp32_kernel
@pytest.mark.parametrize("form", ["q4_1", "q8_0"])
def test_coded_runs_gives_codes_that_give_the_weight_back(form):
    """coded_runs' (d, m, q): (d * q) + m (two roundings) is the weight bit for bit, q an
    int16 in the form's range; a run of one value is d = 0, q = 0; a value that is not
    finite, or one an ulp off a run's codes, makes the weight no codes."""
    gen = torch.Generator().manual_seed(11)
    weight = as_codes(torch.randn(48, 160, generator=gen), form)
    weight[5, 64:96] = 0.75 if form == "q4_1" else 0.0
    found = coded_runs(weight, form)
    assert found is not None
    d, m, q = found
    low, high = CODE_RANGE[form]
    assert q.dtype == torch.int16 and int(q.min()) >= low and int(q.max()) <= high
    back = (d[..., None] * q.float() + m[..., None]).view(48, 160)
    assert torch.equal(back.view(torch.int32), weight.view(torch.int32))
    assert float(d[5, 2]) == 0.0 and not q[5, 2].any()
    for bad in (float("inf"), float("nan"), "ulp"):
        broken = weight.clone()
        value = torch.nextafter(broken[40, 100], torch.tensor(9.0)) if bad == "ulp" else bad
        broken[40, 100] = value
        assert coded_runs(broken, form) is None


@needs_fp32_kernel
@pytest.mark.parametrize("form", ["q4_1", "q8_0"])
def test_only_weights_that_are_codes_are_read_as_codes(form):
    """pack says None where some run of 32 columns is no code of the form (random weights;
    a weight of codes with one value an ulp off; Q8_0's codes for the Q4_1 kernel), where
    the columns are no multiple of 32, and for a bf16 weight; a run of one repeated value (d
    = 0 for Q4_1) is codes."""
    coded, other = CODED[form], "q8_0" if form == "q4_1" else "q4_1"
    gen = torch.Generator().manual_seed(5)
    weight = as_codes(torch.randn(64, 96, generator=gen), form)
    assert coded.pack(weight) is not None
    assert coded.pack(torch.randn(64, 96, generator=gen)) is None
    if form == "q4_1":
        assert coded.pack(as_codes(torch.randn(64, 96, generator=gen), other)) is None
    for row in (3, 17):  # an early run, and a later one
        nudged = weight.clone()
        nudged[row, 40] = torch.nextafter(nudged[row, 40], torch.tensor(float("inf")))
        assert coded.pack(nudged) is None
        assert coded_runs(nudged, form) is None
    assert coded_runs(weight, form) is not None
    assert coded.pack(weight[:, :48].contiguous()) is None
    assert coded.pack(weight.to(BF16)) is None
    flat = weight.clone()
    flat[3, 32:64] = 0.375 if form == "q4_1" else 0.0
    codes = coded.pack(flat)
    x = torch.randn(4, 96, generator=gen)
    assert torch.equal(coded(x, codes, 64, None), FP32(x, FP32.pack(flat), 64, None))


@needs_fp32_kernel
def test_an_fp32_model_of_codes_reads_them_with_the_blocked_kernels_bits(
    tiny_model_dirs, model_cache_dir
):
    """A model whose linear weights are Q4_1 codes dequantized (the default model's are):
    with the coded kernel beside the blocked one, every linear layer reads its codes (the
    tied head, no codes here, its blocked copy), and prefill and decode logits are the
    blocked kernel's bit for bit (one runner, its layers switched from one kernel to the
    other: everything else alike)."""
    runner = torch_runner(tiny_model_dirs["llama"], model_cache_dir)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    for module in linears:
        module.weight.data = as_codes(module.weight)
    prompts = [[5, 6, 7, 8, 9, 10], [11] * 40, [12, 13]]
    params = [greedy(12) for _ in prompts]
    results = {}
    for reader in ("blocked", "coded"):
        coded = (CODED["q4_1"],) if reader == "coded" else ()
        runner.model.use_blocked_linears(FP32, PackedRows(1, 64), coded=coded)
        generated = StaticGenerator(runner).generate(prompts, params, return_logprob=True)
        results[reader] = prefill_logits(runner, prompts), generated
    assert linears and all(isinstance(m.blocked, CodedLinear) for m in linears)
    (coded_logits, a), (blocked_logits, b) = results["coded"], results["blocked"]
    assert torch.equal(coded_logits, blocked_logits)
    assert [(x.output_ids, x.logprobs) for x in a] == [(y.output_ids, y.logprobs) for y in b]


@needs_fp32_kernel
def test_the_default_models_linear_layers_are_read_as_codes():
    """SmolLM2 from its GGUF (Q4_1 linear layers, a Q8_0 embedding): the runner's fp32 plan
    reads all 210 (as 180 products: gate and up as one) as Q4_1's codes, its tied head as
    Q8_0's."""
    runner = ModelRunner(Config.from_flat(dtype="float32", max_total_tokens=1024), progress=False)
    if not runner.kernels.coded_linear:
        pytest.skip("the kernel plan reads no codes on this CPU")
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 30 * 6
    assert all(isinstance(m.blocked, CodedLinear) and m.blocked.form == "q4_1" for m in linears)
    head = runner.model.lm_blocked
    assert isinstance(head, CodedLinear) and head.form == "q8_0"


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).abs().max() / exact.abs().max()).item()


@needs_coded_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 130, 300])
@pytest.mark.parametrize(("n", "k"), [(32, 32), (64, 96), (192, 576), (576, 1536)])
@pytest.mark.parametrize("form", ["q4_1", "q8_0"])
def test_the_amx_product_of_codes_is_as_accurate_as_mkls(rows, n, k, form):
    """A weight of Q4_1 (Q8_0) codes on AMX's tiles, x in three bf16 parts: every product
    exact, the sums in fp32, so against the product in fp64 it is off by about what MKL's
    fp32 product is: at most twice that plus 2^-21 of the output's scale (its sums d * P and
    m * S cancel a little where w = d * q + m does; a part of x dropped would be off by
    ~2^-17), with and without a bias, for row counts that are and are not multiples of 16."""
    gen = torch.Generator().manual_seed(rows * n + k)
    weight = as_codes(torch.randn(n, k, generator=gen) / 24, form)
    x, b = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    packed = CODED_AMX.pack(weight)
    assert packed is not None
    codes, scales, has_min = packed
    assert codes.dtype == BF16 and codes.numel() == n * k and has_min == (form == "q4_1")
    for bias in (None, b):
        out = CODED_AMX(x, codes, scales, n, bias, has_min)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        mkl = relative_error(F.linear(x, weight, bias), exact)
        assert relative_error(out, exact) <= 2 * mkl + 2**-21


@needs_coded_amx
def test_x_splits_into_three_bf16_parts_that_sum_to_it_exactly():
    """fp32_amx_split: hi + mid + lo == x exactly (each part bf16), rows padded to 16 with
    zeros, and each run of 32 columns summed; the split of one x serves the products that
    read it (q, k, v), and another x of the same shape gets its own."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 96, generator=gen) * torch.logspace(-6, 6, 96)
    parts, sums, mp = CODED_AMX.split(x)
    assert mp == 48
    hi, mid, lo = parts[: 3 * mp * 96].view(3, mp, 96).double()
    assert torch.equal(hi[:37] + mid[:37] + lo[:37], x.double())
    assert not hi[37:].any() and not mid[37:].any() and not lo[37:].any()
    runs = sums[: mp * 3].view(mp, 3)
    exact = x.double().view(37, 3, 32).sum(-1)
    assert torch.allclose(runs[:37].double(), exact, rtol=1e-5, atol=1e-6 * exact.abs().max())
    assert CODED_AMX.split(x)[0].data_ptr() == parts.data_ptr()
    weight = as_codes(torch.randn(64, 96, generator=gen) / 24)
    codes, scales, has_min = CODED_AMX.pack(weight)
    for y in (x, x * 2, -x):  # one tensor, then two new ones of its shape
        exact = F.linear(y.double(), weight.double())
        assert relative_error(CODED_AMX(y, codes, scales, 64, None, has_min), exact) < 1e-6


@needs_coded_amx
def test_only_weights_of_codes_go_to_the_amx_product():
    """pack says None for random weights, 48 output features (pairs of 16-feature blocks
    only), columns no multiple of 32, and bf16."""
    gen = torch.Generator().manual_seed(4)
    weight = as_codes(torch.randn(64, 96, generator=gen))
    assert CODED_AMX.pack(weight) is not None
    assert CODED_AMX.pack(torch.randn(64, 96, generator=gen)) is None
    assert CODED_AMX.pack(weight[:48].contiguous()) is None
    assert CODED_AMX.pack(weight[:, :80].contiguous()) is None
    assert CODED_AMX.pack(weight.to(BF16)) is None


@pytest.mark.parametrize("kernel", ["amx", "lookup"])
def test_a_default_model_prefill_on_a_product_of_codes_is_as_near_fp64_as_transformers(
    kernel, monkeypatch
):
    """SmolLM2 fp32 with products of many rows over the weights' codes: on AMX's tiles where
    the plan puts products of CODED_AMX_ROWS rows or more there, or by tables of subset sums
    (forced here for CODED_LUT_ROWS rows or more, as the plan does on CPUs without AMX where
    it measures faster than MKL). All 180 linear layers take it, a batch prefill of 8 prompts
    (over 300 rows) has logits as near transformers run in fp64 as transformers' own fp32
    logits are (measured on an Intel Xeon, max / mean: AMX 8.8e-5 / 8.7e-6, lookups 1.13e-4 /
    8.9e-6, transformers fp32 8.75e-5 / 9.3e-6; a part of x dropped or a wrong lookup would
    put it orders of magnitude off), and its greedy continuations are transformers' fp32
    ones. With lookups, each layer's q, k and v go in one call (their x's tables built once),
    o, gate/up and down in one each."""
    from transformers import AutoModelForCausalLM

    from tests.reference import reference_greedy
    from tests.test_fidelity import TEXTS

    if kernel == "amx" and CODED_AMX is None:
        pytest.skip("this CPU has no AMX")
    runner = ModelRunner(Config.from_flat(dtype="float32", max_total_tokens=4096), progress=False)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    if kernel == "amx":
        rows = runner.kernels.coded_amx_rows
        assert rows > 0
        assert all(isinstance(m.coded_prefill, CodedAmxLinear) for m in linears)
    else:
        rows, lut = CODED_LUT_ROWS, coded_lut_linear(max(LUT_LANES), 2)
        assert all(m.use_coded_prefill(lut, PackedRows(rows, None)) for m in linears)
        calls: list[int] = []
        products = lut.products
        monkeypatch.setattr(
            lut, "products", lambda x, parts: calls.append(len(parts)) or products(x, parts)
        )
    assert len(linears) == 180
    prompts = [runner.tokenizer.encode(" ".join([t] * 4), add_special_tokens=False) for t in TEXTS]
    assert sum(map(len, prompts)) >= max(rows, 300)
    logits = prefill_logits(runner, prompts).double()
    if kernel == "lookup":
        assert calls == [3, 1, 1, 1] * 30, calls
    references = {}
    for dtype in (torch.float32, torch.float64):
        model = AutoModelForCausalLM.from_pretrained(runner.model_folder, dtype=dtype).eval()
        with torch.no_grad():
            references[dtype] = torch.cat([model(torch.tensor([p])).logits[0] for p in prompts])
        if dtype == torch.float32:
            expected = [reference_greedy(model, p, 8) for p in prompts]
    exact = references[torch.float64]
    ours, theirs = (logits - exact).abs(), (references[torch.float32].double() - exact).abs()
    assert ours.max() <= 1.5 * theirs.max(), (ours.max(), theirs.max())
    assert ours.mean() <= 1.25 * theirs.mean(), (ours.mean(), theirs.mean())
    results = StaticGenerator(runner).generate(prompts, [greedy(8) for _ in prompts])
    assert [r.output_ids for r in results] == expected


@pytest.mark.parametrize("lanes", LUT_LANES)
@pytest.mark.parametrize("chunk", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 130])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (20, 64), (64, 96), (192, 576)])
def test_the_lookup_product_of_codes_is_as_accurate_as_mkls(lanes, chunk, rows, n, k):
    """A weight of Q4_1 codes by tables of subset sums of x (fp32_coded_lut.cpp): no
    product rounded, only sums of x, so against the product in fp64 it is off by about what
    MKL's fp32 product is (at most twice that plus 2^-21 of the output's scale; a wrong
    lookup would be off by whole terms), with and without a bias, for row and feature counts
    that are and are not multiples of a vector's rows, each build and chunk of groups."""
    kernel = coded_lut_linear(lanes, chunk)
    assert isinstance(kernel, CodedLutLinear)
    gen = torch.Generator().manual_seed(rows * n + k + lanes + chunk)
    weight = as_codes(torch.randn(n, k, generator=gen) / 24)
    x, b = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    offsets, scales, has_min = kernel.pack(weight)
    assert offsets.dtype == torch.uint16 and offsets.numel() == n * k // 2 and has_min
    for bias in (None, b):
        out = kernel(x, offsets, scales, n, bias, has_min)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        mkl = relative_error(F.linear(x, weight, bias), exact)
        assert relative_error(out, exact) <= 2 * mkl + 2**-20


def test_products_of_one_input_in_one_lookup_call_are_each_alone_bit_for_bit():
    """Several products of one x in one call (q, k and v: x's tables built once, read by
    every part's features) give each part's product as a call of its own does, bit for bit,
    and as the product of the weights stacked into one: with and without biases and m * S
    terms, feature counts no multiple of a vector's rows, each build."""
    gen = torch.Generator().manual_seed(8)
    weights = [as_codes(torch.randn(n, 96, generator=gen) / 24) for n in (48, 20, 20)]
    biases = [torch.randn(48, generator=gen), None, torch.randn(20, generator=gen)]
    q = torch.randint(0, 16, (20, 3, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # m = 0 in every run: no m * S term for this part
    weights[1] = (torch.rand(20, 3, 1, generator=gen).half().float() * q).view(20, 96)
    x = torch.randn(37, 96, generator=gen)
    for lanes in LUT_LANES:
        kernel = coded_lut_linear(lanes, 2)
        packed = [kernel.pack(w) for w in weights]
        assert [p[2] for p in packed] == [True, False, True]
        parts = [(o, s, w.shape[0], b, m) for (o, s, m), w, b in zip(packed, weights, biases)]
        together = kernel.products(x, parts)
        alone = [kernel(x, *part) for part in parts]
        assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
        stacked = torch.cat(weights)
        o, s, m = kernel.pack(stacked)
        no_bias = kernel.products(x, [(o, s, 88, None, m)])[0]
        parts = [(o, s, n, None, m) for (o, s, m), n in zip(packed, (48, 20, 20))]
        assert torch.equal(no_bias, torch.cat(kernel.products(x, parts), dim=1))


def test_the_start_up_measurement_takes_each_layers_q_k_v_as_one_product(monkeypatch):
    """On a plan with the lookup kernel and no AMX, the runner measures the default model's
    linear units: each attention's q, k and v as the one 960 x 576 product they make in one
    call, every other layer alone. At margin 0 every unit's shape takes the kernel and every
    linear layer gets it; at an unreachable margin none."""
    from radixserve.model import runner as runner_module

    q4 = coded_linear(None, "q4_1", FP32_ISA)
    if q4 is None:
        pytest.skip("this CPU has no build of the blocked fp32 kernel over codes")
    runner = ModelRunner(Config.from_flat(dtype="float32", max_total_tokens=4096), progress=False)
    model = runner.model
    units = model.linear_units()
    assert sorted(map(len, units)) == [1] * 90 + [3] * 30
    assert {u[0] for u in units if len(u) == 3} == {
        m.self_attn.q_proj for m in model.modules() if hasattr(m, "self_attn")
    }
    shapes = {(960, 576), (576, 576), (3072, 576), (576, 1536)}
    assert {product_shape(u) for u in units} == shapes
    plan = dataclasses.replace(runner.kernels, coded_amx_rows=0, coded_lut_rows=CODED_LUT_ROWS)
    monkeypatch.setattr(runner_module, "CODED_LUT_MARGIN", 0.0)
    prefill, taken = runner_module.coded_prefill_kernel(model, plan, (q4,), None)
    assert prefill is not None and isinstance(prefill[0], CodedLutLinear)
    assert prefill[1].first == CODED_LUT_ROWS and taken == shapes
    monkeypatch.setattr(runner_module, "CODED_LUT_MARGIN", float("inf"))
    assert runner_module.coded_prefill_kernel(model, plan, (q4,), None) == (None, None)


def test_only_weights_of_4_bit_codes_go_to_the_lookup_product():
    """pack says None for random weights, Q8_0 codes (8 bits: no 4 bit planes), columns no
    multiple of 32, and bf16; Q4_1 codes whose least value is 0 in every run (m = 0) need no
    m * S term."""
    kernel = coded_lut_linear(8, 2)
    gen = torch.Generator().manual_seed(5)
    weight = as_codes(torch.randn(64, 96, generator=gen))
    assert kernel.pack(weight) is not None
    assert kernel.pack(torch.randn(64, 96, generator=gen)) is None
    assert kernel.pack(as_codes(torch.randn(64, 96, generator=gen), "q8_0")) is None
    assert kernel.pack(weight[:, :80].contiguous()) is None
    assert kernel.pack(weight.to(BF16)) is None
    q = torch.randint(0, 16, (64, 3, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # each run's least value 0 (m = 0), greatest 15 d
    d = torch.rand(64, 3, 1, generator=gen).half().float()
    positive = (d * q).view(64, 96)
    offsets, scales, has_min = kernel.pack(positive)
    x = torch.randn(20, 96, generator=gen)
    exact = F.linear(x.double(), positive.double())
    assert not has_min and relative_error(kernel(x, offsets, scales, 64, None, False), exact) < 1e-6


def test_the_lookup_kernel_is_measured_per_shape_against_what_makes_the_products_otherwise():
    """measure_coded_lut times its builds on one weight of each shape against what makes its
    products otherwise (MKL by default) and keeps the shapes where the fastest build beats
    that by the margin: every shape at margin 0, none at an unreachable one; each measured
    shape has a positive ratio. Given another way (the blocked kernel on a Zen 4), it times
    that on the sampled rows instead: one much slower than the kernel makes the shape its
    at a margin MKL's products do not reach."""
    gen = torch.Generator().manual_seed(6)
    samples = {}
    for n, k in [(64, 96), (32, 64)]:
        weight = as_codes(torch.randn(n, k, generator=gen) / 24)
        samples[(n, k)] = LutSample(weight, coded_runs(weight), 3)
    every = measure_coded_lut(samples, rows=32, margin=0.0, reps=1)
    assert every is not None and every.shapes == set(samples)
    assert set(every.speedups) == set(samples) and min(every.speedups.values()) > 0
    assert every.kernel.lanes in LUT_LANES
    none = measure_coded_lut(samples, rows=32, margin=float("inf"), reps=1)
    assert none is not None and not none.shapes

    seen = []

    def slow(x: torch.Tensor) -> None:  # 100 ms: far slower than 32 rows of lookups
        seen.append(x.shape)
        time.sleep(0.1)

    slow_way = {(64, 96): dataclasses.replace(samples[(64, 96)], otherwise=slow)}
    taken = measure_coded_lut(slow_way | {(32, 64): samples[(32, 64)]}, rows=32, margin=4.0)
    assert taken is not None and taken.shapes == {(64, 96)}, taken.speedups
    builds = 3 if cpu_runs("avx512") else 2
    assert seen == [(32, 96)] * (7 + 1) * builds  # each build: 7 timed, one warm-up


@needs_fp32_kernel
def test_the_coded_prefill_kernels_rows_leave_the_blocked_kernel_that_takes_every_row_count(
    tiny_model_dirs, model_cache_dir, monkeypatch
):
    """Where the blocked kernel takes every row count (its sums are torch's F.linear's: AMD's
    Zen 4), a layer given the lookup kernel for CODED_LUT_ROWS rows or more sends those to
    it, and fewer to the blocked kernel: a prefill of that many rows calls it for each
    layer's q, k and v (one call), o, gate/up (no SiLU in the blocked kernel's product
    then) and down, and for the untied head (every row's logits asked), and a prefill of
    fewer rows never; the logits stay within fp32 rounding of torch's."""
    plain = torch_runner(tiny_model_dirs["llama"], model_cache_dir)
    runner = torch_runner(tiny_model_dirs["llama"], model_cache_dir)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    plain_linears = [m for m in plain.model.modules() if isinstance(m, Linear)]
    for module, twin in zip(linears, plain_linears, strict=True):
        module.weight.data = twin.weight.data = as_codes(module.weight)
    found = runner.model.use_blocked_linears(FP32, PackedRows(1, None), coded=(CODED["q4_1"],))
    assert set(found) == set(linears) and all(codes is not None for codes in found.values())
    lut = coded_lut_linear(max(LUT_LANES), 2)
    rows = PackedRows(CODED_LUT_ROWS, None)
    assert runner.model.use_coded_prefill_linears(lut, rows, found) == len(linears)
    width = linears[0].in_features
    few, many = torch.empty(CODED_LUT_ROWS - 1, width), torch.empty(CODED_LUT_ROWS, width)
    assert all(m.uses_blocked(few) and not m.uses_coded_prefill(few) for m in linears)
    assert all(m.uses_coded_prefill(many) and not m.uses_blocked(many) for m in linears)
    mlps = [m for m in runner.model.modules() if isinstance(m, GatedMLP)]
    assert not any(mlp.act_in_product(many) for mlp in mlps)
    calls: list[int] = []
    products = lut.products
    monkeypatch.setattr(lut, "products", lambda x, p: calls.append(len(p)) or products(x, p))
    prompts = [list(range(5, 5 + CODED_LUT_ROWS)), [11] * 20]
    logits = prefill_logits(runner, prompts)
    assert runner.model.lm_head in linears
    assert calls == [3, 1, 1, 1] * len(mlps) + [1], calls
    expected = prefill_logits(plain, prompts)
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()
    calls.clear()
    prefill_logits(runner, [[5, 6, 7]])
    assert calls == []


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64, 200])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 64), (192, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_amx_product_matches_f_linear(rows, n, k, bias):
    x, weight, b = product_inputs(rows, n, k, bias)
    out = AMX(x, AMX.pack(weight), n, None if b is None else b.float())
    assert out.shape == (rows, n) and out.dtype == BF16
    bf16_close(out, F.linear(x, weight, b))


@needs_amx
@pytest.mark.parametrize("rows", [32, 75, 544])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (80, 96), (160, 64), (192, 576)])
def test_the_amx_product_of_many_rows_is_the_16_row_chunks_bit_for_bit(rows, n, k):
    """Past 32 rows the AMX build goes 32 rows x 2 blocks at a time (and a group's odd
    block alone), in groups of up to 6 blocks (5 and 6 here: the rows past the last 32 four
    blocks at a time, then the rest); every sum takes the same tile products in the same
    order as a product of 16 rows: the same bits."""
    x, weight, b = product_inputs(rows, n, k, True)
    packed, bias = AMX.pack(weight), b.float()
    chunks = [AMX(x[r : r + 16], packed, n, bias) for r in range(0, rows, 16)]
    assert torch.equal(AMX(x, packed, n, bias), torch.cat(chunks))


@needs_amx
def test_the_gate_up_product_with_its_activation_is_the_two_steps_bit_for_bit():
    """The AMX build's gate/up product with SiLU * up in its epilogue (32-row x 2-block
    tiles, their rows written while the next tiles' products run, and 16-row chunks with a
    partial last one): the bits of the plain product followed by the fused silu_mul. The
    AVX512-BF16 build has no such entry."""
    if not cpu_info().amx_bf16:
        assert AMX.silu_mul_address is None
        return
    assert AMX.silu_mul_address is not None and FUSED is not None
    for n, k in [(16, 32), (48, 64), (96, 576), (64, 1536)]:
        for rows in (1, 5, 16, 17, 31, 32, 40, 75, 200):
            x, weight, _ = product_inputs(rows, 2 * n, k, False)
            x = x * 3  # activations past silu's knee, both signs
            packed = AMX.pack(weight)
            expected = FUSED.silu_mul(AMX(x, packed, 2 * n, None))
            assert torch.equal(AMX.silu_mul(x, packed, n), expected), (n, k, rows)
    mlp = GatedMLP(64, 96, "silu").to(BF16)  # a model's MLP takes it for its blocked rows
    mlp.fused = FUSED
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.use_blocked(AMX, PackedRows(1, 64))
    x = torch.randn(40, 64).to(BF16)
    assert mlp.act_in_product(x) and not mlp.act_in_product(torch.randn(65, 64).to(BF16))
    assert torch.equal(mlp(x), mlp.down_proj(FUSED.silu_mul(mlp.gate_up_proj(x))))


@needs_amx
def test_the_amx_layer_takes_few_rows_and_leaves_the_rest_to_onednn():
    layer = Linear(64, 48, bias=True).to(BF16)
    small, big = torch.randn(7, 64).to(BF16), torch.randn(9, 64).to(BF16)
    expected = F.linear(small, layer.weight, layer.bias), F.linear(big, layer.weight, layer.bias)
    layer.use_blocked(AMX, PackedRows(1, 8))
    layer.pack(PackedRows())
    assert layer.uses_blocked(small) and not layer.uses_blocked(big) and layer.uses_packed(big)
    assert layer.blocked_weight.numel() == 64 * 48
    bf16_close(layer(small), expected[0])
    bf16_close(layer(big), expected[1])
    odd = Linear(64, 40).to(BF16)  # 40 output features: not whole 16-wide tiles
    odd.use_blocked(AMX, PackedRows(1, 8))
    assert odd.blocked is None and not odd.uses_blocked(small)


def torch_runner(folder, cache_dir, dtype: str = "float32") -> ModelRunner:
    """A tiny model's runner on torch's ops alone: nothing chosen by this CPU."""
    config = Config.from_flat(
        model_path=str(folder),
        max_total_tokens=1024,
        model_cache_dir=str(cache_dir),
        dtype=dtype,
        kernels="torch",
    )
    return ModelRunner(config, progress=False)


def runner_of(folder, cache_dir, pack: bool) -> ModelRunner:
    """A bf16 runner with the torch kernels (nothing chosen by this CPU), or that model
    packed (where oneDNN runs bf16 products) and with the fused ops (where they can be
    built)."""
    runner = torch_runner(folder, cache_dir, "bfloat16")
    if pack:
        if AMX is not None:  # the products of up to 64 rows: every one in these tests
            runner.model.use_blocked_linears(AMX, PackedRows(1, 64))
        if ONEDNN_BF16:
            runner.model.pack_linears()
        if FUSED is not None:
            runner.model.use_fused_ops(FUSED)
    return runner


def prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    reqs = [Req(f"p{i}", p, greedy(1)) for i, p in enumerate(prompts)]
    try:
        return runner.forward(builder.extend(reqs, prompts, all_logits=[True] * len(reqs))).logits
    finally:
        for req in reqs:
            builder.release(req)


# llama: untied LM head; qwen2: q/k/v biases and a tied head (its own packed copy of the
# embedding); qwen3: q/k norms (fused); gemma3: its MLP and norms (torch ops), soft-capped
# logits
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_packed_model_computes_what_the_plain_one_does(tiny_model_dirs, model_cache_dir, arch):
    if not ONEDNN_BF16 and FUSED is None:
        pytest.skip("neither oneDNN's bf16 products nor the fused ops run on this CPU")
    plain = runner_of(tiny_model_dirs[arch], model_cache_dir, pack=False)
    packed = runner_of(tiny_model_dirs[arch], model_cache_dir, pack=True)
    if ONEDNN_BF16:
        linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.packed_weight is not None for m in linears)
        assert (packed.model.lm_packed is not None) == (packed.model.lm_head is None)
    if AMX is not None:
        linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.blocked is not None for m in linears)
        assert (packed.model.lm_blocked is not None) == (packed.model.lm_head is None)
    prompts = [[5, 6, 7, 8, 9, 10], [11] * 40, [12, 13]]
    ours, ref = prefill_logits(packed, prompts), prefill_logits(plain, prompts)
    # the same up to bf16 rounding of sums taken in another order (measured on an Intel
    # Xeon with AMX, packed alone: llama and qwen2 0, gemma3 0.060; the bf16 mode's own
    # drift against transformers is bounded by 0.25 in tests/test_fidelity_bf16.py)
    drift = (torch.log_softmax(ours, -1) - torch.log_softmax(ref, -1)).abs().max().item()
    print(f"\n{arch}: packed vs plain bf16, max logprob drift {drift:.3g}")
    assert drift < 0.12
    params = [greedy(12) for _ in prompts]
    a = StaticGenerator(packed).generate(prompts, params)
    b = StaticGenerator(plain).generate(prompts, params)
    same = sum(x.output_ids == y.output_ids for x, y in zip(a, b, strict=True))
    assert same >= 2  # bf16 near-ties may flip one prompt; a broken layer flips them all


@needs_fp32_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_fp32_model_through_the_blocked_kernel_decodes_as_the_plain_one(
    tiny_model_dirs, model_cache_dir, arch
):
    """llama: an untied LM head (a Linear); qwen2: q/k/v biases and a tied head (the
    blocked copy of the embedding matrix). Decode steps (one row per request) through the
    kernel, greedy, against torch's ops on the same fp32 weights."""
    plain = torch_runner(tiny_model_dirs[arch], model_cache_dir)
    blocked = torch_runner(tiny_model_dirs[arch], model_cache_dir)
    blocked.model.use_blocked_linears(FP32, PackedRows(1, 64))
    linears = [m for m in blocked.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.blocked is not None for m in linears)
    assert (blocked.model.lm_blocked is not None) == (blocked.model.lm_head is None)
    prompts = [[5, 6, 7, 8, 9, 10], [11] * 40, [12, 13]]
    params = [greedy(12) for _ in prompts]
    a = StaticGenerator(blocked).generate(prompts, params, return_logprob=True)
    b = StaticGenerator(plain).generate(prompts, params, return_logprob=True)
    assert [x.output_ids for x in a] == [y.output_ids for y in b]
    for x, y in zip(a, b, strict=True):  # the chosen tokens' logprobs, every step
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0
        )


@needs_fp32_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_fp32_prefill_through_the_blocked_kernel_is_the_plain_one_bit_for_bit(
    tiny_model_dirs, model_cache_dir, arch
):
    """Where the kernel sums in MKL's order (`reproduces_torch`) the runner gives it every
    product, prefills too: a batch's prefill logits are then those of torch's ops exactly
    (58 rows: MKL splits fewer than 12 rows between 2 threads, and some of those go through
    its other paths)."""
    plain = torch_runner(tiny_model_dirs[arch], model_cache_dir)
    blocked = torch_runner(tiny_model_dirs[arch], model_cache_dir)
    blocked.model.use_blocked_linears(FP32, PackedRows(1, 8), exact_rows=PackedRows(1, None))
    linears = [m for m in blocked.model.modules() if isinstance(m, Linear)]
    for m in linears:  # which layers take the prefill: those the check vouched for
        assert m.blocked_rows.last == (None if FP32.same_as_torch(m.weight) else 8)
    if not any(m.blocked_rows.last is None for m in linears):
        pytest.skip("the kernel reproduces this CPU's MKL sgemm for none of the layers")
    # the head alone stays on the plain path: with every row's logits the plain one takes
    # (vocabulary chunk @ x.T), another product than F.linear (which the kernel reproduces)
    if blocked.model.lm_head is None:
        blocked.model.lm_blocked_rows = None
    else:
        blocked.model.lm_head.blocked_rows = None
    prompts = [list(range(5, 45)), [11] * 18]
    assert torch.equal(prefill_logits(blocked, prompts), prefill_logits(plain, prompts))


@needs_fp32_kernel
def test_an_fp32_prefill_mlp_in_row_chunks_is_the_whole_one_bit_for_bit(
    tiny_model_dirs, model_cache_dir, monkeypatch
):
    """A prefill's MLP goes a chunk of rows at a time where the blocked kernel takes its
    products at every row count (layers.GatedMLP._in_chunks): the same logits as in one
    piece, bit for bit (chunks of 256 rows here, a tail of 88)."""
    runner = torch_runner(tiny_model_dirs["llama"], model_cache_dir)
    runner.model.use_blocked_linears(FP32, PackedRows(1, 8), exact_rows=PackedRows(1, None))
    mlp = next(m for m in runner.model.modules() if isinstance(m, GatedMLP))
    if not FP32.same_as_torch(mlp.gate_up_proj.weight):
        pytest.skip("the kernel does not reproduce this CPU's MKL sgemm for the MLP")
    x = torch.zeros(600, mlp.gate_up_proj.in_features)
    prompts = [[(7 * i) % 500 + 3 for i in range(300)], [(11 * i) % 500 + 3 for i in range(300)]]
    monkeypatch.setattr(layers, "MLP_CHUNK_ROWS", 10**6)
    assert not mlp._in_chunks(x)
    whole = prefill_logits(runner, prompts)
    monkeypatch.setattr(layers, "MLP_CHUNK_ROWS", 256)
    assert mlp._in_chunks(x) == FP32.same_as_torch(mlp.down_proj.weight)
    assert torch.equal(prefill_logits(runner, prompts), whole)
