"""Shared fixtures: tiny random-weight Llama/Qwen2/Qwen3/Gemma3 folders (weights from a
seed, committed tokenizer), the real SmolLM2, and runners over them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from radixserve.config import Config
from radixserve.model.runner import ModelRunner

FIXTURES = Path(__file__).parent / "fixtures"
TINY_TOKENIZER = FIXTURES / "tiny_tokenizer"
# The fidelity reference is fp32 on every machine: `--dtype auto` would be bf16 where the
# CPU has AMX, so the tests that compare with transformers in fp32 ask for it.
FP32 = "float32"

TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    initializer_range=0.08,  # larger than usual so greedy choices are not near-ties
    eos_token_id=2,
    bos_token_id=None,
    pad_token_id=0,
)
# Gemma 3's shape (one KV head, head_dim 64) with sliding windows of 16 positions on all but
# two of six layers, so that the test prompts and their continuations outgrow the window.
TINY_GEMMA3_WINDOW = 16
TINY_GEMMA3 = dict(
    TINY_SHAPE,
    num_hidden_layers=6,
    num_key_value_heads=1,
    head_dim=64,
    query_pre_attn_scalar=64,
    sliding_window=TINY_GEMMA3_WINDOW,
    layer_types=["sliding_attention"] * 2
    + ["full_attention"]
    + ["sliding_attention"] * 2
    + ["full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    final_logit_softcapping=30.0,  # not in Gemma 3's own configs; here so it is exercised
    # Untied: with random weights the sqrt(hidden)-scaled embedding dominates the residual,
    # and a tied head then predicts the input token again and again (greedy output of one
    # repeated token). The tied head is the real Gemma 3's (tests/test_gemma3_real.py).
    tie_word_embeddings=False,
)


def build_tiny_model(
    folder: Path,
    arch: str,
    seed: int = 0,
    added_tokens: tuple[str, ...] = (),
    window: int | None = None,
) -> Path:
    """A random-weight model folder: deterministic weights + the committed tokenizer, with
    `added_tokens` (plain text tokens, ids from 512 on, the vocabulary grown to hold them);
    `window`: Mistral's sliding window."""
    shape = {**TINY_SHAPE, "vocab_size": TINY_SHAPE["vocab_size"] + len(added_tokens)}
    if arch == "llama":
        config = LlamaConfig(**shape, tie_word_embeddings=False)
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    elif arch == "mistral":  # (its sliding window off, as Mistral 7B v0.3's)
        config = MistralConfig(**shape, sliding_window=window, tie_word_embeddings=False)
        config.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
    elif arch == "qwen2":
        config = Qwen2Config(**shape, tie_word_embeddings=True)
        config.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
    elif arch == "qwen3":  # head_dim 96: q is 384 wide over a 256 hidden
        config = Qwen3Config(**shape, head_dim=96, tie_word_embeddings=True)
        config.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
    elif arch == "gemma3":
        config = Gemma3TextConfig(**TINY_GEMMA3)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch in ("qwen3", "gemma3"):  # the llama/qwen2 weights stay as other tests know them
        _randomize_norms(model, seed)
    model.save_pretrained(folder)
    for file in TINY_TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    if added_tokens:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.add_tokens(list(added_tokens))
        tokenizer.save_pretrained(folder)
    return folder


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights away from their initial ones / zeros (Gemma: 1 + w), so that a norm
    applied wrongly, or the wrong one, shows in the logits."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))


TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def reference(tiny_model_dirs):
    """transformers' own model on the tiny Llama's weights: the fidelity reference."""
    path = tiny_model_dirs["llama"]
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session", params=["llama", "mistral", "qwen2", "qwen3", "gemma3", "smollm2"])
def model_case(request, tiny_model_dirs):
    """(runner, reference HF model) for each model the fidelity tests cover."""
    path = None if request.param == "smollm2" else str(tiny_model_dirs[request.param])
    runner = ModelRunner(
        Config.from_flat(model_path=path, max_total_tokens=8192, dtype=FP32), progress=False
    )
    reference = AutoModelForCausalLM.from_pretrained(runner.model_folder, dtype=torch.float32)
    return request.param, runner, reference.eval()
