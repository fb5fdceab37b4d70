"""SGLang's decoder-only scoring (`POST /v1/score`, `Engine.score`): for each item, the
probability of each of a few label tokens being the next token after query + item (or item
+ query). A classifier or a ranker made of a language model: "Is this review positive?
Answer:" with labels " Yes" / " No", one item per review.

    query "Is this city the capital of France? "   items ["Paris", "London"]
    prompts  query + "Paris",  query + "London"     (text joined, then tokenized; token
                                                     ids joined as lists)
    each prompt runs as one request that samples one token greedily, reporting the
    logprobs of the label tokens at that next position (token_ids_logprob); a score is
    exp(logprob) (a probability over the whole vocabulary), or with apply_softmax the
    softmax of the label tokens' logprobs (they then sum to 1 over the labels)

All prompts of a call are one submission, so the scheduler batches them and the radix cache
serves the shared query to all but the first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.core.req import Req
from radixserve.native import InvalidRequest, expand_request

MAX_LABELS = 1024  # the labels are token_ids_logprob, held to its bound (checks.py)
MAX_ITEMS = 256  # one call's items (checks.MAX_SEQUENCES_PER_REQUEST's size)
SCORE_PARAMS = {"max_new_tokens": 1, "temperature": 0}  # the prefill's next token


class ScoringAborted(RuntimeError):
    """A request of the call ended before its prompt ran (aborted): no scores."""


@dataclass(frozen=True)
class LabelScoring:
    """One call's prompts (token ids) and how their results read."""

    prompts: list[list[int]]
    label_token_ids: list[int]
    apply_softmax: bool

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def requests(self, rid: str | None = None, lora_id: int = 0) -> list[Req]:
        """One request per prompt (`{rid}_{i}`), reporting the labels' logprobs."""
        expanded = expand_request(
            _no_text,
            None,
            SCORE_PARAMS,
            self.prompts,
            return_logprob=True,
            rid=rid,
            token_ids_logprob=self.label_token_ids,
            lora_ids=lora_id,
        )
        return expanded.reqs

    def scores(self, results: Sequence[dict[str, Any]]) -> list[list[float]]:
        """Each prompt's scores, in the order of label_token_ids, from its native result."""
        return [self._scores(result["meta_info"]) for result in results]

    def _scores(self, meta: dict[str, Any]) -> list[float]:
        given = meta.get("output_token_ids_logprobs") or []
        if not given:  # it ended before its prompt ran: aborted (a pause, a weight update)
            reason = meta.get("finish_reason") or {}
            raise ScoringAborted(
                f"a scoring request was aborted before it ran: {reason.get('message')}"
            )
        logprobs = {token: logprob for logprob, token, *_ in given[0]}
        ordered = [logprobs[token] for token in self.label_token_ids]
        if not self.apply_softmax:
            return [math.exp(x) for x in ordered]
        top = max(ordered)
        if top == -math.inf:  # no label can follow (a broken model's -inf everywhere)
            return [0.0] * len(ordered)
        weights = [math.exp(x - top) for x in ordered]
        total = sum(weights)
        return [w / total for w in weights]


def plan_label_scoring(
    encode: Callable[[str], list[int]],
    query: str | list[int] | None,
    items: str | list[str] | list[list[int]] | None,
    label_token_ids: Sequence[int] | None,
    apply_softmax: bool = False,
    item_first: bool = False,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
) -> LabelScoring:
    """The prompts of a scoring call, within the model's vocabulary and context (where
    given); an InvalidRequest names the field at fault (query, items, items.<i>,
    label_token_ids; code context_length_exceeded for a prompt too long)."""
    labels = _checked_labels(label_token_ids, vocab_size)
    if query is None or (isinstance(query, str | list) and not query):
        raise InvalidRequest("query is required: a non-empty text or list of token ids", "query")
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("items must be a text, or a non-empty list of them", "items")
    if len(items) > MAX_ITEMS:
        raise InvalidRequest(f"items holds at most {MAX_ITEMS}, got {len(items)}", "items")
    text = isinstance(query, str)
    if not text and not (isinstance(query, list) and all(_is_id(t) for t in query)):
        raise InvalidRequest("query must be a text or a list of token ids", "query")
    if not text and vocab_size is not None and any(t >= vocab_size for t in query):
        message = f"query has token ids outside the vocabulary [0, {vocab_size})"
        raise InvalidRequest(message, "query")
    prompts = []
    for i, item in enumerate(items):  # each checked as it comes: a refusal costs little
        field = f"items.{i}"
        if text and not isinstance(item, str):
            raise InvalidRequest(
                f"{field}: a text query takes text items (token-id items need a token-id query)",
                field,
            )
        if not text and (not isinstance(item, list) or not item or not all(map(_is_id, item))):
            raise InvalidRequest(
                f"{field}: a token-id query takes items of token ids (non-empty lists)", field
            )
        joined = item + query if item_first else query + item
        try:
            prompt = encode(joined) if text else joined
        except InvalidRequest as e:  # (the tokenizer's own bound on a text's length)
            raise InvalidRequest(f"{field}: query + item: {e}", field, e.code) from None
        if not text and vocab_size is not None and any(t >= vocab_size for t in item):
            raise InvalidRequest(
                f"{field} has token ids outside the vocabulary [0, {vocab_size})", field
            )
        if max_seq_len is not None and len(prompt) + 1 > max_seq_len:
            raise InvalidRequest(
                f"{field}: query + item is {len(prompt)} tokens, and the scored token past "
                f"them exceeds the model's maximum context length of {max_seq_len} tokens",
                field,
                code="context_length_exceeded",
            )
        prompts.append(prompt)
    return LabelScoring(prompts, labels, apply_softmax)


def text_bytes(query: Any, items: Any) -> int:
    """About how much text a call tokenizes (its query once per item): what decides
    whether its plan is made off the event loop."""
    if not isinstance(query, str):
        return 0
    count = len(items) if isinstance(items, list) else 1
    return len(query) * count + sum(len(i) for i in (items or []) if isinstance(i, str))


def _checked_labels(labels: Sequence[int] | None, vocab_size: int | None) -> list[int]:
    if not isinstance(labels, list | tuple) or not labels:
        raise InvalidRequest(
            "label_token_ids is required: the token ids whose probabilities to score",
            "label_token_ids",
        )
    if len(labels) > MAX_LABELS:
        raise InvalidRequest(
            f"label_token_ids holds at most {MAX_LABELS} token ids, got {len(labels)}",
            "label_token_ids",
        )
    bad = [t for t in labels if not _is_id(t) or (vocab_size is not None and t >= vocab_size)]
    if bad:
        bound = f" [0, {vocab_size})" if vocab_size is not None else ""
        raise InvalidRequest(
            f"label_token_ids must be token ids{bound}, got {bad[:5]}", "label_token_ids"
        )
    return list(labels)


def _is_id(token: Any) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and token >= 0


def _no_text(text: str) -> list[int]:
    raise AssertionError("a scoring request is given as token ids")
