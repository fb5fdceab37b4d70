"""The last decoder layer run past its K/V for a step's logits rows alone
(`ForwardBatch.logits_rows`): which steps it narrows and to what; every row's K/V still in
the pool, bit for bit as when the layer runs every row; the logits within fp32 rounding of
the full layer's (the narrowed rows' attention takes the decode kernel, another order of
sums) and the same greedy tokens; the one C++ call taking the narrowed step bit for bit as
the Python layers; Llama, Qwen2 and Gemma 3 (sliding-window layers) alike."""

from __future__ import annotations

import pytest
import torch

from radixserve.config import Config
from radixserve.core.batch import ForwardBatch, ForwardMode
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.batch_builder import BatchBuilder
from tests.conftest import FP32

PARAMS = SamplingParams(temperature=0.0, ignore_eos=True)


def extend_batch(lens: list[int], prefix_lens: list[int], logits_at: list[int], **kw):
    tokens = sum(lens)
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.arange(100, 100 + tokens),
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, lens)]),
        out_slots=torch.arange(1, 1 + tokens),
        req_rows=torch.arange(len(lens)) + 7,
        prefix_lens=prefix_lens,
        extend_lens=lens,
        logits_indices=torch.tensor(logits_at, dtype=torch.int64),
        **kw,
    )


def test_logits_rows_narrows_to_each_requests_last_rows():
    # a prompt chunk, a one-token decode row, a request wanting every row's logits
    # (input logprobs), one wanting its last two (speculative rows are one-token rows)
    batch = extend_batch([5, 1, 3, 4], [0, 9, 2, 6], [4, 5, 6, 7, 8, 11, 12])
    narrowed = batch.logits_rows()
    assert narrowed is not None
    assert narrowed.extend_lens == [1, 1, 3, 2]
    assert narrowed.prefix_lens == [4, 9, 2, 8]
    assert narrowed.req_rows.tolist() == [7, 8, 9, 10]
    assert torch.equal(narrowed.input_ids, batch.input_ids[batch.logits_indices])
    assert torch.equal(narrowed.positions, torch.tensor([4, 9, 2, 3, 4, 8, 9]))
    assert torch.equal(narrowed.out_slots, batch.out_slots[batch.logits_indices])
    assert narrowed.logits_indices.tolist() == list(range(7))
    assert narrowed.seq_lens == batch.seq_lens

    # a request without logits rows (none asked) is left out
    narrowed = extend_batch([3, 2], [0, 0], [4]).logits_rows()
    assert narrowed is not None and narrowed.req_rows.tolist() == [8]
    assert narrowed.prefix_lens == [1] and narrowed.extend_lens == [1]


@pytest.mark.parametrize(
    ("lens", "logits_at", "why"),
    [
        ([1, 1, 1], [0, 1, 2], "every row wanted: nothing to narrow"),
        ([4, 2], [2, 5], "a request's logits row is not its last"),
        ([4, 2], [3, 3, 5], "a row twice"),
        ([4, 2], [5, 3], "out of order"),
        ([4, 2], [], "no logits rows"),
    ],
)
def test_logits_rows_leaves_other_steps_whole(lens, logits_at, why):
    assert extend_batch(lens, [0] * len(lens), logits_at).logits_rows() is None, why


def test_logits_rows_leaves_embedding_steps_whole():
    batch = extend_batch([4, 2], [0, 0], [3], hidden_indices=torch.tensor([5]))
    assert batch.logits_rows() is None


def forward_both_ways(runner: ModelRunner, make_batch):
    """(logits narrowed, logits of every row, whether every layer's K/V of the step's rows
    came out the same): the same step run twice, narrowed and not."""
    logits, written = [], []
    for narrow in (True, False):
        runner.narrow_last_layer = narrow
        batch = make_batch()
        assert batch.logits_rows() is not None  # a step that narrows
        logits.append(runner.forward(batch).logits)
        slots = batch.out_slots
        written.append([t[slots].clone() for t in (*runner.kv_pool.k, *runner.kv_pool.v)])
    runner.narrow_last_layer = True
    same = all(torch.equal(a, b) for a, b in zip(*written, strict=True))
    return logits[0], logits[1], same


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_narrowed_last_layer_logits_and_kv(tiny_model_dirs, arch):
    config = Config.from_flat(
        model_path=str(tiny_model_dirs[arch]), max_total_tokens=4096, dtype=FP32
    )
    runner = ModelRunner(config, progress=False)
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (37, 5, 64, 2)]
    reqs: list[Req] = []

    def prompt_step():
        for req in reqs:
            builder.release(req)
        reqs[:] = [Req(f"r{i}", p, PARAMS) for i, p in enumerate(prompts)]
        return builder.extend(reqs, [r.input_ids for r in reqs])

    try:
        narrowed, full, same_pool = forward_both_ways(runner, prompt_step)
        assert same_pool  # every row's K/V, the last layer's too
        assert narrowed.shape == full.shape == (4, runner.vocab_size)
        torch.testing.assert_close(narrowed, full, rtol=0, atol=1e-4)
        assert torch.equal(narrowed.argmax(-1), full.argmax(-1))

        # then a mixed step: one-token rows beside a request bringing several new tokens
        for req, token in zip(reqs, full.argmax(-1).tolist(), strict=True):
            req.output_ids.append(token)
        news = [[req.output_ids[-1]] for req in reqs]
        news[2] = news[2] + [11, 12, 13]

        def mixed_step():
            for req in reqs:  # the step's tokens dropped again: the same step twice
                builder.truncate(req, len(req.input_ids))
            return builder.extend(reqs, news)

        narrowed, full, same_pool = forward_both_ways(runner, mixed_step)
        assert same_pool
        torch.testing.assert_close(narrowed, full, rtol=0, atol=1e-4)
        assert torch.equal(narrowed.argmax(-1), full.argmax(-1))
    finally:
        for req in reqs:
            builder.release(req)
    assert runner.allocator.num_free == runner.allocator.size


def test_the_driver_takes_the_narrowed_step_bit_for_bit(tiny_model_dirs):
    config = Config.from_flat(
        model_path=str(tiny_model_dirs["llama"]), max_total_tokens=4096, dtype=FP32
    )
    runner = ModelRunner(config, progress=False)
    driver = runner.model.decode_layers
    if driver is None or runner.attention.extend_kernel is None:
        pytest.skip("the C++ kernels cannot be built on this machine")
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    calls = []

    def spy(*args):
        out = driver(*args)
        calls.append((args[5] is not None, out is not None))  # (x, cos, sin, attn, meta, last)
        return out

    gen = torch.Generator().manual_seed(4)
    reqs = [
        Req(f"r{i}", torch.randint(3, 500, (n,), generator=gen).tolist(), PARAMS)
        for i, n in enumerate((9, 4, 20))
    ]
    logits = []
    try:
        for use in (spy, None):
            runner.model.decode_layers = use
            for req in reqs:
                builder.release(req)
            logits.append(runner.forward(builder.extend(reqs, [r.input_ids for r in reqs])).logits)
    finally:
        runner.model.decode_layers = driver
        for req in reqs:
            builder.release(req)
    assert calls == [(True, True)]  # narrowed, and taken whole by the C++ call
    assert torch.equal(logits[0], logits[1])
