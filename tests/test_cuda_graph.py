"""Decode steps from static buffers (model/cuda_graph.py), run uncaptured on CPU.

A CUDA graph replays what `DecodeGraphs._step` runs; these tests pin that step itself (the
padding rows, the buffers, the padding slot) against the runner's own decode step. The
capture and the Triton kernel it replays run on a GPU only: benchmarks/gpu/check.py checks
them there (its fidelity part: graphs against transformers and against eager steps).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve.cache.allocator import PADDING_SLOT
from radixserve.config import Config
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.model.cuda_graph import GRAPH_BATCH_SIZES, DecodeGraphs, graph_batch_sizes
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.batch_builder import BatchBuilder
from tests.conftest import FP32
from tests.static_generator import StaticGenerator


@pytest.fixture(scope="module")
def runner(tiny_model_dirs):
    runner = ModelRunner(
        Config.from_flat(
            model_path=str(tiny_model_dirs["llama"]), max_total_tokens=512, dtype=FP32
        ),
        progress=False,
    )
    if runner.attention.decode_kernel is None:
        pytest.skip("the static step needs a decode kernel (the C++ ones: x86 with AVX2)")
    return runner


def uncaptured(runner: ModelRunner, max_batch: int) -> DecodeGraphs:
    return DecodeGraphs(runner.model, runner.attention, max_batch, capture=False)


def test_graph_batch_sizes_end_at_the_largest_batch():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(10) == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert graph_batch_sizes(16)[-2:] == [8, 16]
    assert graph_batch_sizes(1000)[-1] == 1000
    assert graph_batch_sizes(256) == list(GRAPH_BATCH_SIZES)
    with pytest.raises(ValueError, match=">= 1"):
        graph_batch_sizes(0)


def test_static_steps_decode_as_the_runner_does(runner):
    """Greedy outputs and logprobs of 11 requests finishing at different steps (the batch
    shrinks from 11 rows, padded to 16, through sizes without padding) are the eager
    runner's; the padding slot stays zero and every slot comes back."""
    gen = StaticGenerator(runner)
    prompts = [[5 + i] * (3 + 2 * i) for i in range(11)]
    params = [
        SamplingParams(temperature=0, max_new_tokens=4 + i, ignore_eos=True) for i in range(11)
    ]
    eager = gen.generate(prompts, params, return_logprob=True)
    runner.decode_graphs = uncaptured(runner, 16)
    try:
        static = gen.generate(prompts, params, return_logprob=True)
    finally:
        runner.decode_graphs = None
    assert [r.output_ids for r in static] == [r.output_ids for r in eager]
    for s, e in zip(static, eager, strict=True):
        assert s.logprobs == pytest.approx(e.logprobs, abs=1e-5)
    for pool in (*runner.kv_pool.k, *runner.kv_pool.v):
        assert not pool[PADDING_SLOT].any()
    assert runner.allocator.num_free == runner.allocator.size


def test_only_plain_decode_steps_replay(runner):
    graphs = uncaptured(runner, 4)
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    reqs = [Req(f"g{i}", [7, 8, 9], SamplingParams(max_new_tokens=4)) for i in range(7)]
    try:
        prefill = builder.extend(reqs, [r.input_ids for r in reqs])
        assert not graphs.can_run(prefill)
        for r in reqs:
            r.output_ids.append(3)
        assert not graphs.can_run(builder.decode(reqs[:5]))  # 5 rows, 4 at most
        step = builder.decode(reqs[5:])
        assert graphs.can_run(step)
        assert not graphs.can_run(dataclasses.replace(step, hidden_indices=torch.arange(2)))
    finally:
        for r in reqs:
            builder.release(r)


def test_graphs_need_the_decode_kernel(runner):
    kernel, runner.attention.decode_kernel = runner.attention.decode_kernel, None
    try:
        with pytest.raises(ValueError, match="decode kernel"):
            uncaptured(runner, 4)
    finally:
        runner.attention.decode_kernel = kernel


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_decode_as_eager_steps_on_cuda(tiny_model_dirs, dtype):
    """On a GPU: the runner captures its graphs at start-up, and greedy outputs of a batch
    that shrinks through padded sizes are the eager steps' (the same runner, graphs set
    aside), with the padding slot zero after."""
    config = Config.from_flat(
        model_path=str(tiny_model_dirs["llama"]), device="cuda", dtype=dtype,
        max_total_tokens=4096, max_running_requests=16,
    )  # fmt: skip
    runner = ModelRunner(config, progress=False)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.sizes[-1] == 16 and len(graphs.graphs) == len(graphs.sizes)
    gen = StaticGenerator(runner)
    prompts = [[5 + i] * (3 + 2 * i) for i in range(11)]
    params = [
        SamplingParams(temperature=0, max_new_tokens=4 + i, ignore_eos=True) for i in range(11)
    ]
    replayed = gen.generate(prompts, params, return_logprob=True)
    runner.decode_graphs = None
    eager = gen.generate(prompts, params, return_logprob=True)
    assert [r.output_ids for r in replayed] == [r.output_ids for r in eager]
    for r, e in zip(replayed, eager, strict=True):
        assert r.logprobs == pytest.approx(e.logprobs, abs=1e-4 if dtype == "float32" else 5e-2)
    for pool in (*runner.kv_pool.k, *runner.kv_pool.v):
        assert not pool[PADDING_SLOT].any()
    assert runner.allocator.num_free == runner.allocator.size


@needs_cuda
@pytest.mark.parametrize("window", [0, 40])
def test_the_triton_decode_kernel_attends_as_softmax_does(window):
    """The Triton kernel against attention written out in fp32: rows of 1 to 130 keys
    (more than one block), GQA, a bf16 pool, and a sliding window."""
    from radixserve.model.triton_attention import TritonDecodeKernel

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, slots = 9, 3, 64, 300
    pool_k = torch.randn(slots + 1, kv_heads, dim, generator=gen).cuda()
    pool_v = torch.randn(slots + 1, kv_heads, dim, generator=gen).cuda()
    table = torch.randint(1, slots + 1, (6, 200), generator=gen).cuda()
    rows = torch.tensor([5, 0, 2, 3]).cuda()
    lens = torch.tensor([1, 70, 130, 5]).cuda()
    q = torch.randn(4, heads, dim, generator=gen).cuda()
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        out = TritonDecodeKernel()(
            q.to(dtype), pool_k.to(dtype), pool_v.to(dtype), table, rows, lens, dim**-0.5, window
        )
        for b in range(4):
            n = int(lens[b])
            keys = table[rows[b], max(n - window, 0) if window else 0 : n]
            k = pool_k.to(dtype)[keys].float().repeat_interleave(heads // kv_heads, 1)
            v = pool_v.to(dtype)[keys].float().repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("hd,nhd->hn", q[b].to(dtype).float(), k) * dim**-0.5
            want = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).reshape(-1)
            assert (out[b].float() - want).abs().max() <= atol, (dtype, b)
