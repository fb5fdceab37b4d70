"""Tiny random Gemma 3 (sliding window 16 on four of six layers) through the Engine: prompts
sharing a prefix longer than the window, run alone and batched with the radix cache on
(later prompts start after a cached prefix) and off, and in prefill chunks smaller than the
window, with hybrid sliding-window memory (the default: window layers in their own pool,
tests/test_swa_memory.py) and without it; greedy outputs identical to transformers."""

from __future__ import annotations

import pytest

from radixserve import Engine
from radixserve.cache.swa_pool import HybridSlotAllocator
from tests.conftest import FP32, TINY_GEMMA3_WINDOW
from tests.reference import greedy_of_folder, greedy_params

STEPS = 24
SHARED = [(7 * i) % 400 + 50 for i in range(40)]  # 40 tokens: longer than the window
PROMPTS = [SHARED + [11, 12, 13], SHARED + [21, 22], [5, 6, 7, 8, 9], SHARED[:19] + [99] * 9]


def greedy() -> dict:
    return greedy_params(STEPS)


@pytest.fixture(scope="module")
def expected(tiny_model_dirs) -> list[list[int]]:
    return greedy_of_folder(tiny_model_dirs["gemma3"], PROMPTS, STEPS)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"disable_radix_cache": True},
        {"chunked_prefill_size": 7},
        {"disable_hybrid_swa_memory": True},
        {"disable_hybrid_swa_memory": True, "chunked_prefill_size": 7},
    ],
    ids=["radix-cache", "no-radix-cache", "chunks-of-7", "one-pool", "one-pool-chunks-of-7"],
)
def test_gemma3_greedy_identical_alone_batched_and_cached(tiny_model_dirs, expected, config):
    assert len(SHARED) > TINY_GEMMA3_WINDOW
    engine = Engine(
        str(tiny_model_dirs["gemma3"]), progress=False, dtype=FP32, max_total_tokens=2048, **config
    )
    try:
        hybrid = not config.get("disable_hybrid_swa_memory", False)
        assert isinstance(engine.runner.allocator, HybridSlotAllocator) == hybrid
        alone = [engine.generate(input_ids=p, sampling_params=greedy()) for p in PROMPTS]
        batched = engine.generate(input_ids=PROMPTS, sampling_params=greedy())
        for i, want in enumerate(expected):
            assert alone[i]["output_ids"] == want, f"prompt {i} alone"
            assert batched[i]["output_ids"] == want, f"prompt {i} batched"
        cached = sum(r["meta_info"]["cached_tokens"] for r in batched)
        assert (cached > 0) == (not config.get("disable_radix_cache", False))
        engine.check_kv_accounting()
    finally:
        engine.shutdown()
