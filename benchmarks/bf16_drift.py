"""How far 16-bit inference moves SmolLM2's logprobs from transformers' fp32, and how far
transformers' own bf16 moves them, in one run: over a few chat prompts, teacher forced, the
mean / p90 / max |logprob difference| of every prompt token, for transformers bf16 and for
radixserve with each dtype:kernels pair given (default: float32:auto bfloat16:torch
bfloat16:auto). bf16 needs a CPU where it is not ~50x slower than fp32 (AMX, AVX512-BF16).

    .venv/bin/python benchmarks/bf16_drift.py
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixserve import Engine
from radixserve.config import Config
from radixserve.hardware import cpu_info
from radixserve.model.loader import resolve_model_folder

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain how a radix tree stores shared prefixes of strings, and why a KV cache for "
    "language models benefits from one.",
    "Write a short poem about the sea at night, with rhymes.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]


def main() -> None:
    modes = sys.argv[1:] or ["float32:auto", "bfloat16:torch", "bfloat16:auto"]
    folder = resolve_model_folder(None, Config.from_flat().model.cache_dir, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    ids = [tokenizer(p).input_ids for p in prompts]

    def transformers_logprobs(dtype: torch.dtype) -> list[torch.Tensor]:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        out = []
        with torch.no_grad():
            for x in ids:
                logits = model(torch.tensor([x])).logits[0].float()
                lp = torch.log_softmax(logits, -1)
                out.append(lp[torch.arange(len(x) - 1), torch.tensor(x[1:])])
        return out

    reference = transformers_logprobs(torch.float32)
    print(f"cpu: {cpu_info().summary()}")

    def report(name: str, logprobs: list[torch.Tensor]) -> None:
        d = torch.cat([(a - b).abs() for a, b in zip(logprobs, reference, strict=True)])
        print(f"{name:24s} mean {d.mean():.4f}  p90 {d.quantile(0.9):.4f}  max {d.max():.3f}")

    report("transformers bfloat16", transformers_logprobs(torch.bfloat16))
    for mode in modes:
        dtype, kernels = mode.split(":")
        with Engine(dtype=dtype, kernels=kernels, progress=False) as engine:
            outs = engine.generate(
                input_ids=ids,
                sampling_params={"temperature": 0, "max_new_tokens": 1},
                return_logprob=True,
                logprob_start_len=0,
            )
        ours = [
            torch.tensor([e[0] for e in o["meta_info"]["input_token_logprobs"][1:]]) for o in outs
        ]
        report(f"radixserve {mode}", ours)


if __name__ == "__main__":
    main()
