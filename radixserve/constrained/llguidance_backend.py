"""The default grammar backend, on llguidance: JSON schemas compile in milliseconds, masks
are computed in Rust without the GIL (several requests in parallel), and it reports the
bytes a grammar forces, which jump-forward appends."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import PreTrainedTokenizerBase

from radixserve.constrained.base import Constraint, GrammarBackend, GrammarError, GrammarMatcher

COMPILED_CACHE_SIZE = 1024  # distinct constraints kept compiled
# JSON is written as json.dumps writes it: one space after ":" and ",", no other whitespace.
# With fixed separators the grammar forces keys and punctuation, which jump-forward appends
# at once; a schema's own "x-guidance" options override these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MASK_THREADS = 2


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.m = matcher

    def accept(self, tokens: Sequence[int]) -> bool:
        tokens = list(tokens)
        if self.m.validate_tokens(tokens) != len(tokens):
            return False
        return self.m.consume_tokens(tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return self.m.validate_tokens(list(tokens))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed")

    def forced_bytes(self) -> bytes:
        return self.m.compute_ff_bytes()

    @property
    def is_finished(self) -> bool:
        return self.m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self.m.is_accepting()

    @property
    def error(self) -> str:
        return _one_line(self.m.get_error()) if self.m.is_error() else ""


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=MASK_THREADS)

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        return LLGuidanceMatcher(self._compiled(constraint).deep_copy())

    @functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)  # noqa: B019 (one backend per engine)
    def _compiled(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A matcher at the start of the grammar, validated; requests get copies."""
        try:
            if constraint.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    constraint.spec, defaults=JSON_DEFAULTS
                )
            else:
                grammar = llguidance.grammar_from(constraint.kind, constraint.spec)
        except ValueError as e:  # the JSON schema is not JSON, or the EBNF does not convert
            raise GrammarError(f"invalid {constraint.kind}: {e}", constraint.kind) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            message = _one_line(messages[0])
            raise GrammarError(f"invalid {constraint.kind}: {message}", constraint.kind)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            message = _one_line(matcher.get_error())
            raise GrammarError(f"invalid {constraint.kind}: {message}", constraint.kind)
        return matcher

    def fill_masks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        pairs = [(m.m, i) for i, m in enumerate(matchers)]  # type: ignore[attr-defined]
        llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def token_bytes(self, tokens: Sequence[int]) -> bytes:
        return self.tokenizer.decode_bytes(list(tokens))

    def tokenize_bytes(self, data: bytes) -> list[int]:
        return self.tokenizer.tokenize_bytes(data)


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance errors span lines (with a source excerpt); one line for an HTTP 400."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."
