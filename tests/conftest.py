"""Shared fixtures: tiny random-weight Llama/Qwen2 folders (weights from a seed, committed
tokenizer), the real SmolLM2, and runners over them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

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


def build_tiny_model(folder: Path, arch: str, seed: int = 0) -> Path:
    """A random-weight model folder: deterministic weights + the committed tokenizer."""
    if arch == "llama":
        config = LlamaConfig(**TINY_SHAPE, tie_word_embeddings=False)
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    elif arch == "qwen2":
        config = Qwen2Config(**TINY_SHAPE, tie_word_embeddings=True)
        config.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    for file in TINY_TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def reference(tiny_model_dirs):
    """transformers' own model on the tiny Llama's weights: the fidelity reference."""
    path = tiny_model_dirs["llama"]
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session", params=["llama", "qwen2", "smollm2"])
def model_case(request, tiny_model_dirs):
    """(runner, reference HF model) for each model the fidelity tests cover."""
    path = None if request.param == "smollm2" else str(tiny_model_dirs[request.param])
    runner = ModelRunner(
        Config.from_flat(model_path=path, max_total_tokens=8192, dtype=FP32), progress=False
    )
    reference = AutoModelForCausalLM.from_pretrained(runner.model_folder, dtype=torch.float32)
    return request.param, runner, reference.eval()
