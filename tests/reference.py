"""transformers as the reference implementation: logits and greedy continuations."""

from __future__ import annotations

import torch


@torch.no_grad()
def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) logits of every position, one full forward pass."""
    return reference(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def reference_greedy(reference, ids: list[int], steps: int) -> list[int]:
    """Plain argmax decoding with transformers' own KV cache; eos is just another token
    (generate's min_new_tokens would suppress it, which our ignore_eos does not)."""
    out = reference(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = reference(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens


def greedy_params(steps: int) -> dict:
    """Sampling parameters of a greedy run of exactly `steps` tokens."""
    return {"temperature": 0, "max_new_tokens": steps, "ignore_eos": True}


def greedy_of_folder(folder, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """transformers' greedy continuations of `prompts` with the model in `folder` (fp32)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [reference_greedy(reference, p, steps) for p in prompts]


FREE_VERIFICATION = (1.0, 1e-3)  # (a, b) seconds: a step of 1000 tokens costs as one


def verification_free(engine):
    """`engine` with its speculation controller counting verification as free, so that it
    drafts whatever this CPU's step times say about whether drafting pays (on an AVX-512
    CPU the tiny models' multi-token steps cost so much more than one-token ones that the
    real controller drafts almost nothing): for tests of what drafts do to the outputs.
    The controller's own rules are tested in tests/test_speculative.py."""
    if engine.scheduler.spec is not None:
        cost = engine.scheduler.spec.cost
        cost.coefficients = lambda: FREE_VERIFICATION
        cost.seconds = lambda tokens: FREE_VERIFICATION[0] + FREE_VERIFICATION[1] * tokens
    return engine
