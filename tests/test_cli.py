"""The command line end to end, as a user runs it (a real subprocess, the real model)."""

from __future__ import annotations

import subprocess
import sys


def radixserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "radixserve", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_generate_answers_a_chat_prompt_with_the_default_model():
    # fp32, as the other tests' servers: `--dtype auto` is bf16 on CPUs with bf16 units, and
    # SmolLM2-135M's greedy answer in bf16 depends on the CPU's kernels (on an Intel Xeon with
    # AMX it wanders off before naming the city, before and after the AMX extend kernel)
    proc = radixserve(
        "generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "24",
        "--dtype", "float32",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_generate_raw_text_with_a_tiny_model(tiny_model_dirs):
    proc = radixserve(
        "generate",
        "--model-path",
        str(tiny_model_dirs["qwen2"]),
        "--prompt",
        "The quick",
        "--no-chat-template",
        "--max-new-tokens",
        "5",
        "--log-level",  # after the command as well as before it (default: warning)
        "info",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert " INFO radixserve." in proc.stderr


def test_missing_model_path_is_a_clear_error(tmp_path):
    proc = radixserve("generate", "--model-path", str(tmp_path / "nope"), "--prompt", "hi")
    assert proc.returncode == 2
    assert "model path does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_sampling_value_is_a_clear_error(tiny_model_dirs):
    proc = radixserve(
        "generate", "--model-path", str(tiny_model_dirs["llama"]), "--prompt", "hi", "--top-p", "0"
    )
    assert proc.returncode == 2
    assert "top_p" in proc.stderr and "Traceback" not in proc.stderr
