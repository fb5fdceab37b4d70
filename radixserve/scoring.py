"""Scoring several continuations of one prefix in one call, with token healing: the shared
half of the server's `POST /score_continuations` and `Engine.score_continuations`.

A text prefix P and a continuation c are tokenized together, T_c = tokenize(P + c), so a
continuation whose first characters merge with the prefix's last token ("is " + "Paris" →
"is", " Paris") is scored as the model would read the whole text. The scored span of c
starts where T_c leaves the prefix's own tokens:

    prefix ids  | p0 p1 p2 p3 |                 P = 4
    T_c         | p0 p1 p2 q3 q4 q5 |           start = 3 (common prefix), healed = 1
    span        |          q3 q4 q5 |           each scored from the logits before it

An input_ids prefix is never re-tokenized: T_c = prefix ids + the continuation's tokens.
Every T_c runs as one prefill-only request (max_new_tokens 0, logprobs from its span's
start), all of them in one submission, so the scheduler batches them and the radix cache
serves the shared prefix to those admitted after the first. With `unconditional`, each span
also runs alone (its first token then has no logprob).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.core.req import Req
from radixserve.core.tokens import common_prefix_len
from radixserve.native import InvalidRequest, expand_request

MAX_CONTINUATIONS = 256  # one call's continuations (checks.MAX_SEQUENCES_PER_REQUEST's size)
SCORE_PARAMS = {"max_new_tokens": 0, "temperature": 0}  # a prefill, nothing sampled


class ContextTooLong(InvalidRequest):
    """A sequence to score does not fit in the model's context."""


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class Span:
    """One continuation's sequence and where its scored tokens start in it."""

    ids: list[int]  # T_c: the (healed) prefix tokens, then the continuation's
    start: int  # the first scored position, < len(ids); 0 only if the whole prefix merged

    @property
    def tokens(self) -> list[int]:
        return self.ids[self.start :]


@dataclass(frozen=True)
class ScoringPlan:
    """What one scoring call runs: a span per continuation, and how the results read."""

    prefix_ids: list[int]
    spans: list[Span]
    unconditional: bool

    @property
    def prompt_tokens(self) -> int:
        return len(self.prefix_ids)

    def requests(self, rid: str | None = None, lora_id: int = 0) -> list[Req]:
        """One prefill-only request per span (`{rid}_{i}`), then with `unconditional` one
        per span alone (`{rid}_u{i}`), in that order; all run with the LoRA adapter of
        uid `lora_id` (0: the base model)."""
        base = rid or uuid.uuid4().hex
        reqs = [
            _prefill(span.ids, span.start, f"{base}_{i}", lora_id)
            for i, span in enumerate(self.spans)
        ]
        if self.unconditional:
            reqs += [
                _prefill(s.tokens, 0, f"{base}_u{i}", lora_id) for i, s in enumerate(self.spans)
            ]
        return reqs

    def response(
        self, results: Sequence[dict[str, Any]], token_text: Callable[[int], str]
    ) -> dict[str, Any]:
        """The call's answer from the native results of `requests()`, in their order;
        `token_text`: a token's text (as /generate's return_text_in_logprobs gives it)."""
        count = len(self.spans)
        assert len(results) == count * (2 if self.unconditional else 1), len(results)
        alone = results[count:] if self.unconditional else [None] * count
        return {
            "prompt_tokens": self.prompt_tokens,
            "continuations": [
                self._entry(span, result, other) | {"tokens": [token_text(t) for t in span.tokens]}
                for span, result, other in zip(self.spans, results[:count], alone)
            ],
        }

    def _entry(
        self, span: Span, result: dict[str, Any], alone: dict[str, Any] | None
    ) -> dict[str, Any]:
        meta = result["meta_info"]
        return {
            "token_ids": span.tokens,
            "logprobs": _span_logprobs(meta, span.tokens),
            "unconditional_logprobs": (
                _span_logprobs(alone["meta_info"], span.tokens) if alone is not None else None
            ),
            "healed_tokens": max(self.prompt_tokens - span.start, 0),
            "cached_tokens": meta["cached_tokens"],
        }


def token_texts(tokenizer: Any) -> Callable[[int], str]:
    """A token's text, as /generate's return_text_in_logprobs gives it: decoded alone, each
    id once (the continuations of one call share most of theirs)."""
    return functools.cache(lambda token: tokenizer.decode([token]))


def plan_scoring(
    tokenizer: Encoder,
    continuations: Sequence[str],
    prompt: str | None = None,
    input_ids: Sequence[int] | None = None,
    unconditional: bool = False,
) -> ScoringPlan:
    """The spans to score; an InvalidRequest names the field at fault (text, input_ids,
    continuations, continuations.<i>)."""
    if (prompt is None) == (input_ids is None):
        raise InvalidRequest("give exactly one of text and input_ids (the prefix)", "text")
    _check_continuations(continuations)
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("text must be a non-empty string", "text")
        prefix = tokenizer.encode(prompt)
        if not prefix:
            raise InvalidRequest("text tokenizes to no tokens", "text")
        spans = [_healed_span(prefix, tokenizer.encode(prompt + c)) for c in continuations]
    else:
        prefix = _checked_ids(input_ids)
        spans = [
            Span(prefix + tokenizer.encode(c, add_special_tokens=False), len(prefix))
            for c in continuations
        ]
    for i, span in enumerate(spans):
        if not span.tokens:
            field = f"continuations.{i}"
            raise InvalidRequest(f"{field} tokenizes to no tokens", field)
    return ScoringPlan(prefix, spans, unconditional)


def check_fits(plan: ScoringPlan, vocab_size: int, max_seq_len: int, prompt_field: str) -> None:
    """Every sequence within the served model's vocabulary and context; an InvalidRequest
    (a ContextTooLong for the context) names the prefix's field or the continuation at
    fault."""
    bad = [t for t in plan.prefix_ids if not 0 <= t < vocab_size]
    if bad:
        message = f"{prompt_field} has token ids outside the vocabulary [0, {vocab_size}): "
        raise InvalidRequest(message + str(bad[:8]), prompt_field)
    if plan.prompt_tokens >= max_seq_len:
        raise ContextTooLong(
            f"the prefix has {plan.prompt_tokens} tokens: it leaves no room for a continuation "
            f"in the model's maximum context length of {max_seq_len} tokens",
            prompt_field,
        )
    for i, span in enumerate(plan.spans):
        field = f"continuations.{i}"
        if len(span.ids) > max_seq_len:
            raise ContextTooLong(
                f"{field}: prefix + continuation is {len(span.ids)} tokens, more than the "
                f"model's maximum context length of {max_seq_len} tokens",
                field,
            )
        if any(not 0 <= t < vocab_size for t in span.tokens):
            message = f"{field} tokenizes to ids outside the vocabulary [0, {vocab_size})"
            raise InvalidRequest(message, field)


def _check_continuations(continuations: Sequence[str]) -> None:
    if isinstance(continuations, str) or not isinstance(continuations, Sequence):
        raise InvalidRequest("continuations must be a list of strings", "continuations")
    if not 1 <= len(continuations) <= MAX_CONTINUATIONS:
        raise InvalidRequest(
            f"continuations must hold 1 to {MAX_CONTINUATIONS} strings, got {len(continuations)}",
            "continuations",
        )
    for i, c in enumerate(continuations):
        if not isinstance(c, str) or not c:
            field = f"continuations.{i}"
            raise InvalidRequest(f"{field} must be a non-empty string", field)


def _checked_ids(input_ids: Sequence[int]) -> list[int]:
    ids = list(input_ids)
    if not ids:
        raise InvalidRequest("input_ids must hold at least one token id", "input_ids")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise InvalidRequest("input_ids must be a list of integer token ids", "input_ids")
    return ids


def _healed_span(prefix: list[int], ids: list[int]) -> Span:
    """The span of `ids` (prefix + continuation tokenized together) past its common prefix
    with the prefix's own tokens; at least the last token when they agree in full."""
    start = common_prefix_len(prefix, ids)
    return Span(ids, max(min(start, len(ids) - 1), 0))


def _prefill(ids: list[int], start: int, rid: str, lora_id: int) -> Req:
    """A prefill-only request with the input logprobs of `ids[start:]`."""
    expanded = expand_request(
        _no_text, None, SCORE_PARAMS, ids, True, start, rid=rid, lora_ids=lora_id
    )
    return expanded.reqs[0]


def _no_text(text: str) -> list[int]:
    raise AssertionError("a scoring request is given as token ids")


def _span_logprobs(meta: dict[str, Any], tokens: list[int]) -> list[float | None]:
    """The input logprobs of the span (the request's logprobs start at its span)."""
    triples = meta["input_token_logprobs"]
    assert [t[1] for t in triples] == tokens, "the logprobs are not the span's tokens"
    return [t[0] for t in triples]
