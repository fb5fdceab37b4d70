"""return_hidden_states (SGLang's): a generation request reports the final-norm hidden state
of every position it ran, in meta_info.hidden_states as SGLang shapes it (the prompt's rows,
then one row per decode step), and they are transformers' hidden states of the same tokens:
whatever the batch, a cached prefix, prefill chunks, or speculative decoding's verify steps
(drafted rows a step rejects are not reported) made of the steps."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve import Engine
from tests.conftest import FP32

STEPS = 8
GREEDY = {"temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "def add(a, b):\n    return",
    "Once upon a time, in a land far away, there lived a king who had three daughters and",
]


def reference_hidden(model, ids: list[int]) -> torch.Tensor:
    """transformers' final-norm hidden states of `ids` (its last hidden_states entry)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()


def rows_of(result: dict) -> torch.Tensor:
    """meta_info.hidden_states as one (positions, hidden) tensor, checking SGLang's shape."""
    meta = result["meta_info"]
    prompt, *steps = meta["hidden_states"]
    assert len(prompt) == meta["prompt_tokens"]
    assert len(steps) == meta["completion_tokens"] - 1  # the last token never ran
    assert all(isinstance(step[0], float) for step in steps)
    return torch.tensor(prompt + steps)


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    folder = tiny_model_dirs["llama"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine(
        str(folder),
        progress=False,
        dtype=FP32,
        max_total_tokens=4096,
        chunked_prefill_size=16,  # the longer prompts' prefills run in pieces
        enable_return_hidden_states=True,
    )
    yield engine, reference
    engine.shutdown()


def test_hidden_states_are_transformers_whatever_the_steps(tiny):
    engine, reference = tiny
    tokenizer = engine.tokenizer
    outs = engine.generate(PROMPTS, GREEDY, return_hidden_states=True)
    again = engine.generate(PROMPTS[2], GREEDY, return_hidden_states=True)  # its prefix cached
    plain = engine.generate(PROMPTS[0], GREEDY)
    assert "hidden_states" not in plain["meta_info"]
    assert plain["output_ids"] == outs[0]["output_ids"]
    for prompt, out in zip(PROMPTS + [PROMPTS[2]], outs + [again], strict=True):
        ids = tokenizer.encode(prompt) + out["output_ids"][:-1]
        expected = reference_hidden(reference, ids)
        ours = rows_of(out)
        assert ours.shape == expected.shape
        assert torch.allclose(ours, expected, atol=1e-4), (ours - expected).abs().max()
    assert again["meta_info"]["cached_tokens"] == 0  # every position is run again
    assert rows_of(again).equal(rows_of(outs[2]))
    awaited = asyncio.run(engine.async_generate(PROMPTS[2], GREEDY, return_hidden_states=True))
    assert rows_of(awaited).equal(rows_of(outs[2]))
    engine.check_kv_accounting()


def test_forced_tokens_run_before_the_request_ends(tiny):
    """Jump-forward is off for such requests: a constrained output whose end is forced
    still runs every position but its last token (and the flag may be one per prompt)."""
    engine, reference = tiny
    params = {"temperature": 0, "max_new_tokens": 40, "regex": "[ab] the end of the story"}
    outs = engine.generate(PROMPTS[:2], params, return_hidden_states=[True, False])
    rows = rows_of(outs[0])
    ids = engine.tokenizer.encode(PROMPTS[0]) + outs[0]["output_ids"][:-1]
    assert torch.allclose(rows, reference_hidden(reference, ids), atol=1e-4)
    assert "hidden_states" not in outs[1]["meta_info"]


def test_a_prefill_only_request_reports_its_prompt(tiny):
    engine, reference = tiny
    out = engine.generate(PROMPTS[1], {"max_new_tokens": 0}, return_hidden_states=True)
    (prompt,) = out["meta_info"]["hidden_states"]
    expected = reference_hidden(reference, engine.tokenizer.encode(PROMPTS[1]))
    assert torch.allclose(torch.tensor(prompt), expected, atol=1e-4)


def test_an_engine_without_the_flag_refuses_them(tiny_model_dirs):
    with Engine(str(tiny_model_dirs["llama"]), progress=False, dtype=FP32) as engine:
        with pytest.raises(ValueError, match="enable_return_hidden_states"):
            engine.generate(PROMPTS[0], GREEDY, return_hidden_states=True)


def test_verify_steps_report_the_accepted_rows_alone():
    """SmolLM2 repeating a text: speculative decoding drafts it, and each verify step runs
    drafted rows, some rejected; the hidden states are those of a run without drafts."""
    text = (
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. "
        "It is named after the engineer Gustave Eiffel, whose company designed and built it."
    )
    results = {}
    for spec in ("none", "ngram"):
        with Engine(
            None,
            progress=False,
            dtype=FP32,
            max_total_tokens=4096,
            speculative_algorithm=spec,
            enable_return_hidden_states=True,
        ) as engine:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
                tokenize=False,
                add_generation_prompt=True,
            )
            params = {"temperature": 0, "max_new_tokens": 40}
            results[spec] = engine.generate(prompt, params, return_hidden_states=True)
    drafted, plain = results["ngram"], results["none"]
    assert drafted["meta_info"]["spec_verify_ct"] > 0  # drafts were verified
    assert drafted["output_ids"] == plain["output_ids"]
    assert torch.allclose(rows_of(drafted), rows_of(plain), atol=1e-4)
