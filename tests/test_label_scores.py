"""SGLang's decoder-only scoring (`Engine.score`, `POST /v1/score`) against transformers on
the tiny Llama: each item's label-token probabilities after query + item (or item + query),
as probabilities over the vocabulary or softmaxed over the labels; text and token-id
prompts; and the calls that are refused, naming their field."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve import Engine
from radixserve.label_scores import ScoringAborted, plan_label_scoring
from radixserve.native import InvalidRequest
from tests.conftest import FP32

QUERY = "The quick brown fox jumps over the"
ITEMS = [" lazy dog", " sleepy cat", " red"]
LABELS = [5, 17, 42, 300]


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    folder = tiny_model_dirs["llama"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine(str(folder), progress=False, dtype=FP32, max_total_tokens=4096)
    yield engine, reference
    engine.shutdown()


def reference_scores(model, ids: list[int], softmax: bool) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    chosen = torch.log_softmax(logits, -1)[LABELS]
    return (torch.softmax(chosen, -1) if softmax else chosen.exp()).tolist()


@pytest.mark.parametrize("softmax", [False, True])
@pytest.mark.parametrize("item_first", [False, True])
def test_scores_are_transformers_next_token_probabilities(tiny, softmax, item_first):
    engine, reference = tiny
    scores = engine.score(QUERY, ITEMS, LABELS, apply_softmax=softmax, item_first=item_first)
    assert len(scores) == len(ITEMS) and all(len(s) == len(LABELS) for s in scores)
    for item, got in zip(ITEMS, scores, strict=True):
        text = item + QUERY if item_first else QUERY + item
        expected = reference_scores(reference, engine.tokenizer.encode(text), softmax)
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-7)
        if softmax:
            assert sum(got) == pytest.approx(1.0)


def test_token_id_prompts_are_joined_as_lists(tiny):
    engine, reference = tiny
    query = engine.tokenizer.encode(QUERY)
    items = [[7, 8, 9], [10]]
    scores = engine.score(query, items, LABELS)
    for item, got in zip(items, scores, strict=True):
        assert got == pytest.approx(reference_scores(reference, query + item, False), rel=1e-4)


@pytest.mark.parametrize(
    "query, items, labels, param",
    [
        (QUERY, ITEMS, [], "label_token_ids"),
        (QUERY, ITEMS, None, "label_token_ids"),
        (QUERY, ITEMS, [1, -2], "label_token_ids"),
        (QUERY, ITEMS, [1, 10**6], "label_token_ids"),
        (QUERY, ITEMS, [True], "label_token_ids"),
        ("", ITEMS, LABELS, "query"),
        (None, ITEMS, LABELS, "query"),
        (QUERY, [], LABELS, "items"),
        (QUERY, [" a", [1, 2]], LABELS, "items.1"),
        ([1, 2], [" a"], LABELS, "items.0"),
        ([1, 2], [[]], LABELS, "items.0"),
        ({"x": 1}, ITEMS, LABELS, "query"),
        ([1, 600], [[1]], LABELS, "query"),  # outside the vocabulary
        ([1, 2], [[1], [600]], LABELS, "items.1"),
        ("x" * 600, [" a"], LABELS, "items.0"),  # past the context (2 ids a character here)
    ],
)
def test_bad_calls_name_their_field(query, items, labels, param):
    with pytest.raises(InvalidRequest) as e:
        plan_label_scoring(
            lambda text: [1, 2] * len(text), query, items, labels, vocab_size=512, max_seq_len=1024
        )
    assert e.value.param == param, e.value


def test_a_request_aborted_before_it_ran_has_no_scores():
    plan = plan_label_scoring(lambda text: [1, 2], "q", ["a"], LABELS)
    aborted = {"finish_reason": {"type": "abort", "message": "paused"}}
    with pytest.raises(ScoringAborted, match="paused"):
        plan.scores([{"meta_info": aborted | {"output_token_ids_logprobs": []}}])
