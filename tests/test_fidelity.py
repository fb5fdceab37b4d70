"""The runner against transformers (the reference) on the same weights, fp32.

Logits agree within 1e-4 max-abs, teacher-forced on the same tokens (prefill and every decode
step); greedy continuations are token-identical, alone, in a batch of 8 prompts of different
lengths, and with a prefix already in the KV pool.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.scheduler.batch_builder import BatchBuilder
from tests.reference import reference_greedy, reference_logits
from tests.static_generator import StaticGenerator

ATOL = 1e-4
STEPS = 32
TEXTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1 2 3 4 5",
    "A radix tree stores shared prefixes once; every request that shares a prefix",
    "Hi",
    "Continuous batching lets new requests join a running batch between decoding steps, so",
    '{"name": "Ada", "age":',
]


def encode(runner, text: str) -> list[int]:
    return runner.tokenizer.encode(text, add_special_tokens=False)


def greedy(max_new_tokens: int = STEPS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"{what}: max-abs logit difference {diff:.3g} > {ATOL}"


def test_prefill_and_decode_logits_teacher_forced(model_case):
    """A batch of 8 prompts: prefill logits at every position, then each decode step's
    logits, fed the reference's own greedy continuation."""
    name, runner, reference = model_case
    prompts = [encode(runner, t) for t in TEXTS]
    continuations = [reference_greedy(reference, p, 8) for p in prompts]
    refs = [reference_logits(reference, p + c) for p, c in zip(prompts, continuations)]

    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    reqs = [Req(f"r{i}", p, greedy()) for i, p in enumerate(prompts)]
    free_before = runner.allocator.num_free
    try:
        batch = builder.extend(reqs, prompts, all_logits=[True] * len(reqs))
        logits = runner.forward(batch).logits
        offset = 0
        for p, ref in zip(prompts, refs):
            assert_close(logits[offset : offset + len(p)], ref[: len(p)], f"{name} prefill")
            offset += len(p)
        for step in range(8):
            for req, c in zip(reqs, continuations):
                req.output_ids.append(c[step])
            logits = runner.forward(builder.decode(reqs)).logits
            for i, (p, ref) in enumerate(zip(prompts, refs)):
                assert_close(logits[i], ref[len(p) + step], f"{name} decode step {step}")
    finally:
        for req in reqs:
            builder.release(req)
    assert runner.allocator.num_free == free_before


def test_greedy_single_request_matches(model_case):
    name, runner, reference = model_case
    prompt = encode(runner, TEXTS[2])
    [result] = StaticGenerator(runner).generate([prompt], [greedy()])
    assert result.output_ids == reference_greedy(reference, prompt, STEPS), name


def test_greedy_batch_of_eight_matches(model_case):
    name, runner, reference = model_case
    prompts = [encode(runner, t) for t in TEXTS]
    assert len({len(p) for p in prompts}) > 4, "prompts should differ in length"
    results = StaticGenerator(runner).generate(prompts, [greedy() for _ in prompts])
    for prompt, result in zip(prompts, results):
        assert result.output_ids == reference_greedy(reference, prompt, STEPS), name
    assert runner.allocator.num_free == runner.allocator.size


@pytest.mark.parametrize("split", [1, 5, -1])
def test_prefix_in_pool_extended_by_suffix(model_case, split):
    """Extend a cached prefix of any length (here 1, 5 and all but one token) by the rest:
    suffix logits match, and greedy decoding from there matches too."""
    name, runner, reference = model_case
    prompt = encode(runner, TEXTS[4])
    split = split % len(prompt)
    ref = reference_logits(reference, prompt)
    expected = reference_greedy(reference, prompt, STEPS)

    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    req = Req("prefix", prompt, greedy())
    try:
        runner.forward(builder.extend([req], [prompt[:split]]))
        logits = runner.forward(builder.extend([req], [prompt[split:]], all_logits=[True])).logits
        assert_close(logits, ref[split:], f"{name} suffix after a {split}-token prefix")
        for _ in range(STEPS):
            req.output_ids.append(int(logits[-1].argmax()))
            if len(req.output_ids) == STEPS:
                break
            logits = runner.forward(builder.decode([req])).logits
        assert req.output_ids == expected, name
    finally:
        builder.release(req)


def test_logprobs_match_reference_log_softmax(model_case):
    name, runner, reference = model_case
    prompt = encode(runner, TEXTS[0])
    [result] = StaticGenerator(runner).generate(
        [prompt], [greedy(8)], return_logprob=True, top_logprobs_num=5
    )
    ref = torch.log_softmax(reference_logits(reference, prompt + result.output_ids), dim=-1)
    for step, token in enumerate(result.output_ids):
        row = ref[len(prompt) - 1 + step]
        assert abs(result.logprobs[step] - row[token].item()) <= ATOL, name
        top_lp, top_ids = row.topk(5)
        got_lp = [lp for lp, _ in result.top_logprobs[step]]
        assert torch.allclose(torch.tensor(got_lp), top_lp, atol=ATOL), name
        assert result.top_logprobs[step][0][1] == top_ids[0].item() == token


def test_mixed_extend_batch_one_token_rows_beside_longer_rows(model_case):
    """The batch a decode step becomes after a jump-forward: some requests extend by one
    token, others by several, each after its own cached prefix. Every row's logits match
    the reference (the two kinds are attended in separate groups)."""
    name, runner, reference = model_case
    prompts = [encode(runner, t) for t in TEXTS[:5]]
    cut = [len(p) - n for p, n in zip(prompts, (1, 4, 1, 3, 1))]
    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    reqs = [Req(f"mixed{i}", p, greedy()) for i, p in enumerate(prompts)]
    try:
        runner.forward(builder.extend(reqs, [p[:c] for p, c in zip(prompts, cut)]))
        rests = [p[c:] for p, c in zip(prompts, cut)]
        logits = runner.forward(builder.extend(reqs, rests, all_logits=[True] * 5)).logits
        row = 0
        for prompt, c, rest in zip(prompts, cut, rests):
            ref = reference_logits(reference, prompt)[c:]
            assert_close(logits[row : row + len(rest)], ref, f"{name} rows extending {len(rest)}")
            row += len(rest)
    finally:
        for req in reqs:
            builder.release(req)


def test_a_sliding_window_bounds_the_context_it_is_exact_within(tmp_path):
    """Mistral with a sliding window shorter than its context: the context is bounded to
    the window, within which full attention is what the window sees: greedy tokens as
    transformers' (which applies the window) up to its last position."""
    from transformers import AutoModelForCausalLM

    from radixserve.config import Config
    from radixserve.model.loader import ModelLoadError
    from radixserve.model.runner import ModelRunner
    from tests.conftest import FP32, build_tiny_model

    folder = build_tiny_model(tmp_path / "mistral", "mistral", window=48)
    config = Config.from_flat(model_path=str(folder), max_total_tokens=4096, dtype=FP32)
    runner = ModelRunner(config, progress=False)
    assert runner.context_len == 48
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = encode(runner, TEXTS[2])[:30]
    [result] = StaticGenerator(runner).generate([prompt], [greedy(48 - len(prompt))])
    assert result.output_ids == reference_greedy(reference, prompt, 48 - len(prompt))
    with pytest.raises(ModelLoadError, match="its sliding window"):
        ModelRunner(Config.from_flat(model_path=str(folder), context_length=64), progress=False)
    unbounded = build_tiny_model(tmp_path / "mistral-full", "mistral")
    config = Config.from_flat(model_path=str(unbounded), max_total_tokens=4096, dtype=FP32)
    full = ModelRunner(config, progress=False)  # (2048 tokens: weights with a window of 48
    with pytest.raises(ModelLoadError, match="a sliding window of 48"):  # would not do)
        full.update_weights(str(folder))
