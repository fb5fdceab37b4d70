"""The C++ CPU kernels against torch: decode attention (`decode_attention.cpp`) against the
gather + SDPA path on the same pool (ragged lengths, scattered slots, GQA groups, shapes it
does not take, decode batches and mixed extend batches); the one-row linear
(`fp32_gemv.cpp`) against F.linear; and greedy generation of the tiny model alike with
`--kernels auto` and `--kernels torch`, batched and alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve import Engine
from radixserve.cache import KVPool, ReqToTokenPool
from radixserve.core.batch import ForwardBatch, ForwardMode
from radixserve.hardware import KernelPlan
from radixserve.model.attention import (
    TorchNativeAttention,
    decode_attention_kernel,
    extend_attention_kernel,
)
from radixserve.model.cpu_kernels import cpu_runs, fused_ops, gemm_small_kernel, gemv_kernel
from radixserve.model.layers import GatedMLP, RMSNorm, RotaryTables
from tests.conftest import FP32

pytestmark = pytest.mark.skipif(
    decode_attention_kernel() is None or gemv_kernel() is None or gemm_small_kernel() is None,
    reason="the C++ kernels cannot be built on this machine",
)
BF16 = torch.bfloat16
needs_avx512_bf16 = pytest.mark.skipif(
    not cpu_runs("avx512"), reason="this CPU has no AVX-512 with AVX512-BF16"
)
# each build of the decode-attention kernel; the AVX-512 one where this CPU runs it
ISAS = [
    "avx2",
    pytest.param("avx512", marks=needs_avx512_bf16),
    pytest.param(
        "amx", marks=pytest.mark.skipif(not cpu_runs("amx"), reason="this CPU has no AMX-BF16")
    ),
]


def attend_both_ways(
    heads,
    kv_heads,
    dim,
    prefix_lens,
    extend_lens,
    seed=0,
    kernel_fits=True,
    kv_dtype=torch.float32,
    q_dtype=torch.float32,
    window=0,
    inputs=None,
    isa="avx2",
    consecutive=False,
    extend_kernel=False,
):
    """(kernel output, torch output) of one layer over a pool with scattered slots, or
    with each request's slots in a row (`consecutive`) (a sliding-window layer with
    `window` > 0); `inputs`, a dict, gets the pool, the table, the batch and q, k, v. With
    `extend_kernel` the kernel side sends rows of more than one token to the extend
    kernel (a pool in q's dtype)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    size = sum(seq_lens) + 7
    pool = KVPool(size, 1, kv_heads, dim, kv_dtype, "cpu")
    pool.k[0][1:] = torch.randn(size, kv_heads, dim, generator=gen)
    pool.v[0][1:] = torch.randn(size, kv_heads, dim, generator=gen)
    table = ReqToTokenPool(len(seq_lens) + 2, max(512, max(seq_lens)), "cpu")
    order = torch.arange(size) if consecutive else torch.randperm(size, generator=gen)
    slots = (order + 1).tolist()  # scattered over the pool, or in a row
    rows, out_slots = [], []
    for i, n in enumerate(seq_lens):
        row = len(seq_lens) + 1 - i  # rows out of order too
        taken, slots = slots[:n], slots[n:]
        table.write(row, 0, torch.tensor(taken))
        rows.append(row)
        out_slots += taken[prefix_lens[i] :]
    tokens = sum(extend_lens)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if set(extend_lens) == {1} else ForwardMode.EXTEND,
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        positions=torch.zeros(tokens, dtype=torch.int64),
        out_slots=torch.tensor(out_slots),
        req_rows=torch.tensor(rows),
        prefix_lens=list(prefix_lens),
        extend_lens=list(extend_lens),
        logits_indices=torch.zeros(1, dtype=torch.int64),
    )
    q = torch.randn(tokens, heads, dim, generator=gen).to(q_dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(q_dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(q_dtype)
    if inputs is not None:
        inputs.update(pool=pool, table=table, batch=batch, q=q, k=k, v=v)
    results = []
    for use_kernel in (True, False):
        backend = TorchNativeAttention(
            *(pool, table, dim**-0.5, heads),
            use_kernel=use_kernel,
            windows=[window],
            kernel_isa=isa,
            use_extend_kernel=use_kernel and extend_kernel,
        )
        if use_kernel and extend_kernel:
            assert backend.extend_kernel is extend_attention_kernel(None, isa) is not None
        if use_kernel and kernel_fits:
            assert backend.decode_kernel is decode_attention_kernel(None, isa)
        assert (backend.decode_kernel is not None) == (use_kernel and kernel_fits)
        results.append(backend.forward(0, q, k, v, backend.prepare(batch)))
    return results


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (16, 2, 128), (6, 1, 32)]
)
def test_decode_kernel_matches_torch_path(heads, kv_heads, dim, isa):
    # ragged lengths around the kernels' 8- and 16-position blocks, a first token with no
    # prefix
    prefix_lens = [0, 1, 5, 7, 8, 15, 16, 31, 37, 140, 3, 300]
    n = len(prefix_lens)
    kernel, reference = attend_both_ways(heads, kv_heads, dim, prefix_lens, [1] * n, isa=isa)
    assert kernel.shape == reference.shape == (n, heads * dim)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_reads_16_bit_pools_like_the_torch_path(kv_dtype, q_dtype, isa):
    """--kv-cache-dtype bfloat16/float16 (under an fp32 or a bf16 model): the kernel widens
    the pool's 16-bit rows in registers; the torch path gathers them and widens the copy.
    Both read the same rounded values, so they agree to fp32 rounding; with bf16 queries
    to bf16's (SDPA computes in bf16, the kernel in fp32)."""
    prefix_lens = [0, 3, 8, 21, 130]
    kernel, reference = attend_both_ways(
        9, 3, 64, prefix_lens, [1] * 5, kv_dtype=kv_dtype, q_dtype=q_dtype, isa=isa
    )
    assert kernel.dtype == reference.dtype == q_dtype
    tol = {"atol": 2e-6, "rtol": 1e-5} if q_dtype == torch.float32 else {"atol": 1e-2, "rtol": 0}
    torch.testing.assert_close(kernel, reference, **tol)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 20), (6, 1, 16), (18, 2, 64)])
def test_shapes_the_kernel_does_not_take_stay_on_the_torch_path(heads, kv_heads, dim):
    """Head size not a multiple of 32, or more than 8 query heads per KV head."""
    kernel = decode_attention_kernel()
    assert not kernel.supports(heads, kv_heads, dim)
    first, second = attend_both_ways(heads, kv_heads, dim, [3, 9], [1, 1], kernel_fits=False)
    torch.testing.assert_close(first, second, atol=0, rtol=0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("consecutive", [False, True])
def test_decode_kernel_bf16_products_are_exact(isa, consecutive):
    """A bf16 model over a bf16 pool: the AVX-512 kernel takes q . k with vdpbf16ps (bf16
    pairs multiplied exactly, summed in fp32), its AMX build on the tile unit (K rows read
    in place where 16 slots are consecutive, else copied), the AVX2 kernel widens both to
    fp32; each equals attention computed in fp64 on the same bf16 values, to the bf16
    rounding of the output."""
    inputs = {}
    prefix_lens = [0, 3, 8, 15, 16, 21, 130, 411]
    kernel, _ = attend_both_ways(
        9,
        3,
        64,
        prefix_lens,
        [1] * 8,
        kv_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
        inputs=inputs,
        isa=isa,
        consecutive=consecutive,
    )
    pool, table, batch, q = inputs["pool"], inputs["table"], inputs["batch"], inputs["q"]
    for i, (row, n) in enumerate(zip(batch.req_rows.tolist(), prefix_lens, strict=True)):
        slots = table.table[row, : n + 1]
        keys = pool.k[0][slots].double().repeat_interleave(3, dim=1)  # (S, H, D)
        values = pool.v[0][slots].double().repeat_interleave(3, dim=1)
        scores = torch.einsum("hd,shd->hs", q[i].double(), keys) * 64**-0.5
        exact = torch.einsum("hs,shd->hd", torch.softmax(scores, -1), values).flatten()
        torch.testing.assert_close(kernel[i].double(), exact, atol=2**-8, rtol=2**-8)


@pytest.mark.parametrize("isa", ISAS[1:])
def test_bf16_query_and_output_passed_as_they_are_change_nothing(isa):
    """The AVX-512 builds read a bf16 query and write a bf16 output themselves (code 4):
    the same bits as the query widened to fp32 and the fp32 output rounded by torch (code 3).
    The slots are shuffled (AMX: K rows copied) but for two runs of 16 in a row (read in
    place)."""
    kernel = decode_attention_kernel(isa=isa)
    assert kernel.bf16_io
    gen = torch.Generator().manual_seed(4)
    k_pool, v_pool = (torch.randn(600, 3, 64, generator=gen).to(BF16) for _ in range(2))
    table = torch.randperm(600, generator=gen)[:594].view(3, 198).contiguous()
    table[0, 16:48] = torch.arange(200, 232)  # one more occurrence of a slot: harmless
    q = torch.randn(3, 9, 64, generator=gen).to(BF16)
    rows, seq_lens = torch.tensor([2, 0, 1]), torch.tensor([198, 17, 1])
    direct = kernel(q, k_pool, v_pool, table, rows, seq_lens, 0.125)
    kernel.bf16_io = False
    try:
        widened = kernel(q, k_pool, v_pool, table, rows, seq_lens, 0.125)
    finally:
        kernel.bf16_io = True
    assert direct.dtype == widened.dtype == BF16
    assert torch.equal(direct, widened)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pool_dtype, q_dtype", [(torch.float32,) * 2, (BF16,) * 2, (BF16, None)])
@pytest.mark.parametrize("layout", ["one request", "mixed"])
def test_a_requests_verified_rows_equal_each_row_alone(isa, pool_dtype, q_dtype, layout):
    """Speculative decoding verifies a request's token and its drafted tokens as one-token
    rows of one request (one table row, lengths +1 each): the kernel attends such rows
    together; every row's output has the same bits as that row attended alone."""
    kernel = decode_attention_kernel(isa=isa)
    gen = torch.Generator().manual_seed(7)
    k_pool, v_pool = (torch.randn(900, 3, 64, generator=gen).to(pool_dtype) for _ in range(2))
    table = torch.randperm(900, generator=gen)[:880].view(4, 220).contiguous()
    if layout == "one request":
        rows, seq_lens = [1] * 9, list(range(150, 159))  # a token and 8 drafted tokens
    else:  # verified drafts beside plain decode rows, one draft longer than kMaxRows
        rows = [3, 0, 0, 0, 2, *[1] * 19]
        seq_lens = [40, 17, 18, 19, 200, *range(100, 119)]
    q = torch.randn(len(rows), 9, 64, generator=gen).to(q_dtype or torch.float32)
    rows_t, lens_t = torch.tensor(rows), torch.tensor(seq_lens)
    together = kernel(q, k_pool, v_pool, table, rows_t, lens_t, 0.125)
    for i in range(len(rows)):
        alone = kernel(
            q[i : i + 1], k_pool, v_pool, table, rows_t[i : i + 1], lens_t[i : i + 1], 0.125
        )
        assert torch.equal(together[i : i + 1], alone), i


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pool_dtype, q_dtype", [(torch.float32,) * 2, (BF16,) * 2, (BF16, None)])
def test_requests_sharing_a_cached_prefix_equal_each_alone(isa, pool_dtype, q_dtype):
    """Requests whose first slots are one cached prefix (a system prompt) are attended
    together by both builds of the kernel, that prefix's K/V read once for all of them: each
    request's output has the same bits as alone, whatever the batch's order; and it
    matches softmax(q K^T) V over its own slots."""
    kernel = decode_attention_kernel(isa=isa)
    gen = torch.Generator().manual_seed(11)
    k_pool, v_pool = (torch.randn(14000, 3, 64, generator=gen).to(pool_dtype) for _ in range(2))
    prefixes = [torch.arange(0, 150), torch.arange(150, 450), torch.arange(450, 514)]
    lens = torch.randint(310, 700, (19,), generator=gen).tolist()
    lens[17:] = [40, 160]  # one shorter than the grouping asks; one 10 past its prefix
    table = torch.zeros(19, 720, dtype=torch.int64)
    free = 600
    for i, n in enumerate(lens):
        shared = prefixes[i % 3][:n]
        own = n - len(shared)
        table[i, : len(shared)] = torch.as_tensor(shared, dtype=torch.int64)
        table[i, len(shared) : n] = torch.arange(free, free + own)
        free += own
    rows = torch.randperm(19, generator=gen)  # sharers scattered over the batch
    seq_lens = torch.tensor(lens)[rows]
    q = torch.randn(19, 9, 64, generator=gen).to(q_dtype or torch.float32)
    together = kernel(q, k_pool, v_pool, table, rows, seq_lens, 0.125)
    for i in range(19):
        one = slice(i, i + 1)
        alone = kernel(q[one], k_pool, v_pool, table, rows[one], seq_lens[one], 0.125)
        assert torch.equal(together[i : i + 1], alone), i
        slots = table[rows[i], : seq_lens[i]]
        keys = k_pool[slots].float().repeat_interleave(3, dim=1)
        values = v_pool[slots].float().repeat_interleave(3, dim=1)
        probs = (torch.einsum("hd,shd->hs", q[i].float(), keys) * 0.125).softmax(-1)
        expected = torch.einsum("hs,shd->hd", probs, values).reshape(-1)
        tolerance = 1e-5 if q.dtype == torch.float32 and pool_dtype == torch.float32 else 3e-2
        torch.testing.assert_close(together[i].float(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 1), (4, 4), (16, 2)])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("window", [0, 64])
def test_every_kind_of_piece_equals_each_row_alone(heads, kv_heads, threads, window):
    """The AVX2 build (whose tasks take all of a piece's KV heads, or one, by the pieces per
    thread and their queries; the AVX-512 builds' pieces are tested above), query groups of
    8 and of 1, on one thread and on more: three requests sharing a cached prefix, one
    request's token with two drafted tokens and a request of its own, in one batch, with and
    without a sliding window. Every row gets the bits it gets alone, and softmax(q K^T) V
    over its own (last `window`) slots."""
    kernel = decode_attention_kernel(isa="avx2")
    gen = torch.Generator().manual_seed(5)
    k_pool, v_pool = (torch.randn(1200, kv_heads, 64, generator=gen) for _ in range(2))
    table = torch.zeros(5, 300, dtype=torch.int64)
    free = 101
    for row, length in enumerate([150, 180, 120, 90, 300]):
        own = length - 100 if row < 3 else length  # rows 0-2: the prefix in slots 1..100
        if row < 3:
            table[row, :100] = torch.arange(1, 101)
        table[row, length - own : length] = torch.arange(free, free + own)
        free += own
    rows = torch.tensor([2, 0, 4, 4, 4, 1, 3])
    seq_lens = torch.tensor([120, 150, 298, 299, 300, 180, 90])
    q = torch.randn(len(rows), heads, 64, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = kernel(q, k_pool, v_pool, table, rows, seq_lens, 0.125, window)
        alone = [
            kernel(q[one], k_pool, v_pool, table, rows[one], seq_lens[one], 0.125, window)
            for one in (slice(i, i + 1) for i in range(len(rows)))
        ]
    finally:
        torch.set_num_threads(before)
    for i, (row, length) in enumerate(zip(rows.tolist(), seq_lens.tolist(), strict=True)):
        assert torch.equal(together[i : i + 1], alone[i]), i
        slots = table[row, max(0, length - window) if window else 0 : length]
        keys = k_pool[slots].repeat_interleave(heads // kv_heads, dim=1)
        values = v_pool[slots].repeat_interleave(heads // kv_heads, dim=1)
        probs = (torch.einsum("hd,shd->hs", q[i], keys) * 0.125).softmax(-1)
        expected = torch.einsum("hs,shd->hd", probs, values).reshape(-1)
        torch.testing.assert_close(together[i], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("isa", ISAS)
def test_decode_rows_of_a_mixed_extend_batch_use_the_kernel_alike(isa):
    """Jump-forward makes extend batches of one-token rows beside longer rows: the one-token
    rows go to the kernel, the others to SDPA; the result equals the torch path's."""
    kernel, reference = attend_both_ways(9, 3, 64, [10, 0, 33, 4], [1, 6, 1, 3], isa=isa)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens"),
    [
        ([10, 0, 33, 4, 20], [6, 3, 1, 1, 1]),  # a mixed step: prefill rows, then decode rows
        ([10, 0, 33, 4], [1, 6, 1, 3]),  # a one-token extend among longer ones (jump-forward)
    ],
    ids=["stretches", "interleaved"],
)
def test_a_mixed_batch_attends_each_request_as_alone(isa, prefix_lens, extend_lens):
    """A batch of one-token and longer rows is attended in two groups; put back together,
    each request's output rows are what it gets attended alone, bit for bit (the decode
    and extend kernels work per request)."""
    inputs = {}
    together, _ = attend_both_ways(
        9, 3, 64, prefix_lens, extend_lens, inputs=inputs, isa=isa, extend_kernel=True
    )
    batch, q, k, v = (inputs[name] for name in ("batch", "q", "k", "v"))
    backend = TorchNativeAttention(
        *(inputs["pool"], inputs["table"], 64**-0.5, 9),
        use_kernel=True,
        kernel_isa=isa,
        use_extend_kernel=True,
    )
    start = 0
    for i, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        rows = slice(start, start + extend)
        alone = ForwardBatch(
            mode=ForwardMode.DECODE if extend == 1 else ForwardMode.EXTEND,
            input_ids=torch.zeros(extend, dtype=torch.int64),
            positions=torch.zeros(extend, dtype=torch.int64),
            out_slots=batch.out_slots[rows],
            req_rows=batch.req_rows[i : i + 1],
            prefix_lens=[prefix],
            extend_lens=[extend],
            logits_indices=torch.zeros(1, dtype=torch.int64),
        )
        out = backend.forward(0, q[rows], k[rows], v[rows], backend.prepare(alone))
        assert torch.equal(out, together[rows]), i
        start += extend


# the extend kernel's builds and the dtypes each takes: AVX2 fp32; AVX-512 fp32 and bf16;
# the AMX build (bf16 on the tile unit, fp32 as the AVX-512 build)
needs_amx = pytest.mark.skipif(not cpu_runs("amx"), reason="this CPU has no AMX-BF16")
EXTEND_BUILDS = [
    ("avx2", torch.float32),
    pytest.param("avx512", torch.float32, marks=needs_avx512_bf16),
    pytest.param("avx512", BF16, marks=needs_avx512_bf16),
    pytest.param("amx", torch.float32, marks=needs_amx),
    pytest.param("amx", BF16, marks=needs_amx),
]


@pytest.mark.parametrize(("isa", "dtype"), EXTEND_BUILDS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (16, 2, 128), (8, 1, 256)]
)
@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens"),
    [
        ([0], [544]),  # a prompt: 17 blocks of 32 tokens, causal inside each
        ([0, 0, 0, 0], [2, 5, 16, 17]),  # around a lane group's 16 tokens
        ([3, 31, 32, 33, 100], [33, 2, 31, 70, 1]),  # cached prefixes off the key blocks
        ([512] * 3, [32] * 3),  # the shared-prefix workload's extends
        ([512], [32]),  # one of them: tasks of 16 tokens on 2 threads (extend_tasks.h)
    ],
    ids=["prompt", "short", "ragged", "shared-prefix", "one-question"],
)
def test_extend_kernel_matches_exact_attention_as_closely_as_sdpa(
    heads, kv_heads, dim, prefix_lens, extend_lens, isa, dtype
):
    """The extend kernel against attention in fp64 over the same inputs. fp32: within
    fp32 rounding, as torch's SDPA path. bf16 (bf16 products, probabilities rounded to bf16
    before P . V, as torch's flash attention rounds them): its error is the size of torch's
    bf16 SDPA's on the same inputs (rounding the output to bf16 is most of either)."""
    inputs = {}
    kernel, sdpa = attend_both_ways(
        *(heads, kv_heads, dim, prefix_lens, extend_lens),
        kv_dtype=dtype,
        q_dtype=dtype,
        inputs=inputs,
        isa=isa,
        extend_kernel=True,
    )
    assert kernel.dtype == sdpa.dtype == dtype
    reference = plain_windowed_attention(inputs, 1 << 30, dim**-0.5, torch.float64)
    if dtype == torch.float32:
        torch.testing.assert_close(kernel.double(), reference, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(kernel, sdpa, atol=2e-6, rtol=1e-5)
        return
    kernel_error = (kernel.double() - reference).abs().max().item()
    sdpa_error = (sdpa.double() - reference).abs().max().item()
    assert kernel_error <= 1.25 * sdpa_error + 1e-3, (kernel_error, sdpa_error)


@pytest.mark.parametrize(("isa", "dtype"), EXTEND_BUILDS)
@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens", "thread_counts"),
    [
        # 3 tasks, which 2 threads take as 6 of 16 tokens and 3 threads as they are
        ([512], [32], (2, 3)),
        # a prompt of 544: the AVX-512 build's tasks of 64 tokens on 2 threads (27 tasks),
        # of 32 on 8 (too few of 64 to keep 8 threads busy)
        ([0], [544], (2, 8)),
    ],
    ids=["split-for-idle-threads", "longer-tasks"],
)
def test_extend_tasks_of_any_size_give_the_same_bits(
    isa, dtype, prefix_lens, extend_lens, thread_counts
):
    """The tasks' size follows the batch and the thread count (extend_tasks.h); each query's
    arithmetic is the same at any size (its lane group attends the same key blocks), so the
    outputs are bit for bit."""
    outputs = []
    threads = torch.get_num_threads()
    try:
        for n in thread_counts:
            torch.set_num_threads(n)
            kernel, _ = attend_both_ways(
                9, 3, 64, prefix_lens, extend_lens, kv_dtype=dtype, q_dtype=dtype, isa=isa,
                extend_kernel=True,
            )  # fmt: skip
            outputs.append(kernel)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("group", [2, 3, 4, 5, 7, 8])
def test_each_query_head_gets_the_bits_it_gets_alone(group):
    """The AVX2 build runs up to three query heads of a KV head together (each key's
    broadcast serves them all); each head's output is still its own arithmetic: the bits
    it gets as the only query head of its KV head."""
    kernel = extend_attention_kernel(None, "avx2")
    assert kernel is not None
    gen = torch.Generator().manual_seed(group)
    kv_heads, dim, prefix_lens, extend_lens = 2, 64, [0, 40], [70, 33]
    lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    k_pool = torch.randn(sum(lens) + 1, kv_heads, dim, generator=gen)
    v_pool = torch.randn(sum(lens) + 1, kv_heads, dim, generator=gen)
    slots = (torch.randperm(sum(lens), generator=gen) + 1).split(lens)
    table = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for row, taken in enumerate(slots):
        table[row, : len(taken)] = taken
    batch = (torch.arange(len(lens)), torch.tensor(prefix_lens), torch.tensor(extend_lens))
    q = torch.randn(sum(extend_lens), kv_heads * group, dim, generator=gen)
    together = kernel(q, k_pool, v_pool, table, *batch, dim**-0.5).view(q.shape)
    for g in range(group):
        alone = kernel(q[:, g::group].contiguous(), k_pool, v_pool, table, *batch, dim**-0.5)
        assert torch.equal(alone.view(-1, kv_heads, dim), together[:, g::group]), g


@pytest.mark.parametrize("isa", ["avx2", pytest.param("avx512", marks=needs_avx512_bf16)])
def test_extend_kernel_beside_decode_rows_and_windows(isa):
    """A mixed batch (one-token rows to the decode kernel, the rest to the extend kernel)
    and a sliding-window layer (rows longer than the window stay on SDPA's masks, the
    others take the kernel) both equal plain attention over each query's keys."""
    for window, prefix_lens, extend_lens in [
        (0, [10, 0, 33, 4, 0], [1, 6, 1, 3, 40]),
        (16, [0, 10], [40, 9]),  # longer than the window: SDPA
        (64, [0, 10], [40, 9]),  # the window holds every key: the kernel
    ]:
        inputs = {}
        kernel, _ = attend_both_ways(
            *(4, 1, 64, prefix_lens, extend_lens),
            window=window,
            inputs=inputs,
            isa=isa,
            extend_kernel=True,
        )
        reference = plain_windowed_attention(inputs, window or 1 << 30, 64**-0.5, torch.float64)
        torch.testing.assert_close(kernel.double(), reference, atol=2e-6, rtol=1e-5)


def plain_windowed_attention(
    inputs: dict, window: int, scale: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Each query of the batch at position p over its request's keys at p - window < s <= p,
    written out with a softmax over the scores (in `dtype`): the reference for both
    backends' paths."""
    pool, table, batch, q = inputs["pool"], inputs["table"], inputs["batch"], inputs["q"]
    outs, token = [], 0
    group = q.shape[1] // pool.k[0].shape[1]
    for row, prefix, extend in zip(
        batch.req_rows.tolist(), batch.prefix_lens, batch.extend_lens, strict=True
    ):
        slots = table.table[row, : prefix + extend]
        keys = pool.k[0][slots].to(dtype).repeat_interleave(group, dim=1)  # (S, H, D)
        values = pool.v[0][slots].to(dtype).repeat_interleave(group, dim=1)
        for pos in range(prefix, prefix + extend):
            first = max(0, pos - window + 1)
            scores = torch.einsum("hd,shd->hs", q[token].to(dtype), keys[first : pos + 1]) * scale
            weights = torch.softmax(scores, dim=-1)
            outs.append(torch.einsum("hs,shd->hd", weights, values[first : pos + 1]).flatten())
            token += 1
    return torch.stack(outs)


@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens"),
    [
        ([0, 1, 5, 15, 16, 17, 40, 300], [1] * 8),  # decode rows around the window's edge
        ([0, 10, 33, 4, 0], [1, 6, 1, 3, 40]),  # mixed: kernel rows beside SDPA rows
        ([0, 0], [40, 9]),  # prompts with no prefix, one longer than the window
    ],
    ids=["decode", "mixed", "causal"],
)
@pytest.mark.parametrize("isa", ISAS)
def test_sliding_window_attends_only_the_last_window_keys(prefix_lens, extend_lens, isa):
    """A sliding-window layer (Gemma 3's local layers): the decode kernel, which starts
    each request's keys `window` positions back, and the torch path's masks (decode, with a
    cached prefix, and per-request causal SDPA) both equal plain attention over the
    window."""
    window, inputs = 16, {}
    kernel, torch_path = attend_both_ways(
        4, 1, 64, prefix_lens, extend_lens, window=window, inputs=inputs, isa=isa
    )
    reference = plain_windowed_attention(inputs, window, 64**-0.5)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(torch_path, reference, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("n", "k"), [(1, 8), (7, 13), (301, 203), (576, 576), (4099, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(n, k, bias):
    """Odd sizes exercise the leftover rows (n % 4) and columns (k % 8)."""
    gen = torch.Generator().manual_seed(n * k)
    x, weight = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = gemv_kernel()(x, weight, b)
    assert out.shape == (1, n)
    # fp32 sums of k products of N(0, 1) values (~sqrt(k)) in another order
    reference = torch.nn.functional.linear(x, weight, b)
    torch.testing.assert_close(out, reference, atol=1e-6 * k, rtol=1e-5)


@pytest.mark.parametrize(
    ("m", "n", "k"), [(2, 8, 8), (3, 7, 13), (5, 301, 203), (16, 576, 576), (17, 64, 1536)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_kernel_matches_linear(m, n, k, bias):
    """Rows in groups of 4 and leftovers (m % 4), weight rows in blocks of 3 and leftovers
    (n % 3), columns in 8s and leftovers (k % 8)."""
    gen = torch.Generator().manual_seed(m * n * k)
    x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = gemm_small_kernel()(x, weight, b)
    assert out.shape == (m, n)
    reference = torch.nn.functional.linear(x, weight, b)
    torch.testing.assert_close(out, reference, atol=1e-6 * k, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases through the kernel
def test_greedy_generation_is_the_same_with_either_backend(tiny_model_dirs, arch):
    prompts = [[5, 6, 7, 8], [9] * 30, [11, 12]]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    outputs = []
    for kernels in ("auto", "torch"):
        with Engine(
            str(tiny_model_dirs[arch]), kernels=kernels, max_total_tokens=512, dtype=FP32
        ) as engine:
            plan = engine.runner.kernels
            assert plan == KernelPlan.choose(
                kernels, torch.device("cpu"), torch.float32, torch.float32
            )
            kernels = engine.runner.model.row_kernels
            assert (kernels.gemv is not None) == plan.gemv
            assert (kernels.few is not None) == (plan.few_rows_max > 0)
            assert (engine.runner.attention.decode_kernel is not None) == plan.decode_attention
            batched = engine.generate(input_ids=prompts, sampling_params=params)
            alone = engine.generate(input_ids=prompts[1], sampling_params=params)  # batch 1
        outputs.append(([r["output_ids"] for r in batched], alone["output_ids"]))
    assert outputs[0] == outputs[1]
    assert all(len(ids) == 24 for ids in outputs[0][0])


def ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference between two tensors in units of ref's last place (its dtype's:
    bf16 or fp32)."""
    ulp = torch.finfo(ref.dtype).eps * ref.float().abs().clamp(min=1e-30)
    return ((out.float() - ref.float()).abs() / ulp).max().item()


# each build of the fused element-wise ops; the AVX-512 one where this CPU runs it
FUSED_ISAS = ISAS[:2]
FUSED_DTYPES = [BF16, torch.float32]
# fp32: the sum of squares in another order, SiLU's e^x from another polynomial, each a
# rounding or two of fp32; bf16 rounds those away but for one last place
ROUNDINGS = {BF16: 1.0, torch.float32: 4.0}


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("isa", FUSED_ISAS)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_rms_norm_matches_the_torch_ops(rows, isa, dtype):
    """`RMSNorm` through fused_ops.cpp against its own torch ops: within a rounding of the
    dtype (the mean of squares is summed in another order)."""
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (1 + 0.3 * torch.randn(576, generator=gen)).to(dtype)
    x = (3 * torch.randn(rows, 576, generator=gen)).to(dtype)
    reference = norm(x)
    norm.fused = fused_ops(None, isa)
    out = norm(x)
    assert out.dtype == dtype and out.shape == x.shape
    assert ulps(out, reference) <= ROUNDINGS[dtype]


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("isa", FUSED_ISAS)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_residual_add_and_norm_match_the_torch_ops(rows, isa, dtype):
    """A decoder layer's residual add and the norm after it in one pass: the sum bit for
    bit as torch's add rounds it, its norm bit for bit the fused norm of that sum (so
    within a rounding or two of torch's norm)."""
    gen = torch.Generator().manual_seed(rows + 1)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (1 + 0.3 * torch.randn(576, generator=gen)).to(dtype)
    x = (3 * torch.randn(rows, 576, generator=gen)).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    ref_sum, ref_norm = norm.add_forward(x, delta)  # torch's ops
    norm.fused = fused_ops(None, isa)
    total, normed = norm.add_forward(x, delta)
    assert torch.equal(total, x + delta) and torch.equal(total, ref_sum)
    assert torch.equal(normed, norm(total))
    assert ulps(normed, ref_norm) <= 2 * ROUNDINGS[dtype]


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("isa", FUSED_ISAS)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"), [(1, 9, 3, 64), (37, 4, 1, 128)])
def test_fused_rotary_matches_the_torch_ops(tokens, heads, kv_heads, dim, isa, dtype):
    """The rotary embedding in place, rounding each product and the sum as torch does (in
    fp32 no multiply-add fused either): the same bits."""
    gen = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 100
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    ref_q, ref_k = RotaryTables(cos, sin).apply(q, k)
    fused = fused_ops(None, isa)
    assert fused.fits(q, k, cos, sin, widths=2)
    out_q, out_k = RotaryTables(cos, sin, fused).apply(q.clone(), k.clone())
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("isa", FUSED_ISAS)
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_fused_silu_mul_matches_the_torch_ops(rows, isa, dtype):
    """fp32: torch's bits (its e^x is torch's own); bf16 within a rounding. The values
    reach past where e^-x flushes to 0 or overflows, and the row counts keep torch on its
    vector path (a thread's share of the elements a multiple of 32: past it, torch takes
    libm's expf)."""
    gen = torch.Generator().manual_seed(rows)
    h = (4 * torch.randn(rows, 2 * 1536, generator=gen)).to(dtype)
    h[:, :64] *= 40  # |x| up to ~700
    reference = F.silu(h[:, :1536]) * h[:, 1536:]
    out = fused_ops(None, isa).silu_mul(h)
    assert out.shape == (rows, 1536)
    if dtype == torch.float32:
        assert torch.equal(out, reference)
    else:
        assert ulps(out, reference) <= ROUNDINGS[dtype]


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("isa", FUSED_ISAS)
@pytest.mark.parametrize(
    ("rows", "features", "stacked"),
    [(1, 70, False), (6, 64, False), (9, 70, True), (13, 37, True), (300, 67, True)],
)
def test_fused_lora_add_is_the_torch_ops(rows, features, stacked, isa, dtype):
    """lora_add (the fused decode layers' LoRA) against LoraSite.add's torch ops: one
    adapter, or a stack whose rows use either adapter or the base model (left untouched),
    a module with no B (untouched), widths and inputs off the vector width (the tails),
    rows in blocks of 4 and a remainder, several threads. fp32 within the sums' order; bf16
    within a rounding or two (x @ A.T rounded to bf16 as torch's product is, each output
    rounded once: bit for bit where torch's bf16 product sums as the kernel does)."""
    from radixserve.lora.adapter import SiteWeights
    from radixserve.lora.state import site_fields

    gen = torch.Generator().manual_seed(rows)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    x, a = rand(rows, features), rand(13, features)
    bs = (rand(5, 21), None, rand(8, 33))  # modules of 21, 19 (untrained) and 33 columns
    owners = torch.tensor([0, 0, 1, 1, 1] + [0, 0, 0] + [1] * 5) if stacked else None
    weights = SiteWeights(a, ((0, 5), (5, 5), (5, 13)), bs, owners)
    row_owner = torch.randint(-1, 2, (rows,), generator=gen) if stacked else None
    out = rand(rows, 21 + 19 + 33)
    expected = out.clone()
    xa = F.linear(x, a)
    if stacked:
        xa = xa * (row_owner[:, None] == owners[None, :]).to(dtype)
    expected[:, :21].addmm_(xa[:, :5], bs[0])
    expected[:, 40:].addmm_(xa[:, 5:], bs[2])
    fields = torch.tensor(site_fields(weights))
    fused_ops(None, isa).lora_add_(x, fields, [out[:, :21], out[:, 21:40], out[:, 40:]], row_owner)
    assert torch.equal(out[:, 21:40], expected[:, 21:40])
    if stacked:
        assert torch.equal(out[row_owner < 0], expected[row_owner < 0])
        assert (row_owner >= 0).any()
    if dtype == torch.float32:
        assert torch.allclose(out, expected, rtol=1e-6, atol=1e-4)
    else:
        assert torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=0.25)


@pytest.mark.parametrize("isa", FUSED_ISAS)
def test_fused_silu_is_torchs_on_every_kind_of_fp32(isa):
    """Every binade of fp32 (a stride through all bit patterns, both signs), infinities
    and NaN: the fused SiLU (times 1) has torch's bits, NaN where torch's is NaN."""
    bits = torch.arange(-(2**31), 2**31, 4099, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat([torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0]), x])
    x = x[: x.numel() // 32 * 32]
    ones = torch.ones_like(x)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's vector path over the whole tensor
    try:
        reference = F.silu(x)
    finally:
        torch.set_num_threads(threads)
    out = fused_ops(None, isa).silu_mul_halves(x.view(1, -1), ones.view(1, -1)).view(-1)
    same = out.view(torch.int32) == reference.view(torch.int32)
    assert bool((same | (out.isnan() & reference.isnan())).all())


@pytest.mark.parametrize("isa", FUSED_ISAS)
@pytest.mark.parametrize("rows", [1, 100, 300])
def test_fused_gated_mlp_matches_the_torch_ops_on_every_cpu_path(rows, isa):
    """fp32 GatedMLP on CPU: one row (one product), 2..255 rows (the product transposed:
    its halves are flat blocks) and prefill rows (two products), the fused SiLU * up
    against torch's, within fp32 rounding."""
    gen = torch.Generator().manual_seed(rows)
    mlp = GatedMLP(64, 128, "silu")
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=gen) / 8
    x = torch.randn(rows, 64, generator=gen)
    reference = mlp(x)
    calls = []

    class Counted:  # the ops, counting the SiLU * up passes
        def __getattr__(self, name):
            if name.startswith("silu"):
                calls.append(name)
            return getattr(fused_ops(None, isa), name)

    mlp.fused = Counted()
    torch.testing.assert_close(mlp(x), reference, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1  # the fused pass ran, not torch's ops
