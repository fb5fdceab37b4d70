"""When a request ends: every stop rule in one place, returning a typed finish reason.

Order: a grammar whose document is complete ends the request; else, once past
min_new_tokens, a stop token (eos unless ignored, stop_token_ids), a stop string or a stop
regex (for a constrained request only where the text before it is a complete document);
else the length limit (max_new_tokens, or the context).

Stop regexes run in the scheduler loop, over the whole output, every step (a match may span
any length). The output's text is kept per request and grown by the new tokens' text alone
(`OutputText`), so a step decodes a few tokens, not the whole output. A pattern that
backtracks exponentially (`(a|a)+b` against "aaaa…") would stall every request. So they go
through the `regex` package (the `re` syntax, plus a time limit): a search that takes
longer than STOP_REGEX_TIMEOUT_S ends its request alone, with an abort naming the pattern.
"""

from __future__ import annotations

from typing import Any

import regex

from radixserve.constrained import Grammars
from radixserve.core.output import FinishReason, ModelInfo
from radixserve.core.req import Req
from radixserve.text_stream import IncrementalDecoder

# One search of one request's output. A plain pattern searches 20k characters in ~0.1 ms.
STOP_REGEX_TIMEOUT_S = 0.01


class StopRegexTooSlow(Exception):
    def __init__(self, pattern: str) -> None:
        super().__init__(
            f"stop_regex {pattern!r} took over {STOP_REGEX_TIMEOUT_S * 1000:g} ms to search the "
            "output (the pattern backtracks too much), so the request was ended"
        )


def search_stop_regex(pattern: str, text: str) -> regex.Match | None:
    try:
        return regex.search(pattern, text, timeout=STOP_REGEX_TIMEOUT_S)
    except TimeoutError:
        raise StopRegexTooSlow(pattern) from None


class OutputText:
    """A request's output text for its stop regexes, grown by each step's new tokens
    (text_stream.IncrementalDecoder: a character split across tokens joins when complete)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self.text = ""

    def of(self, output_ids: list[int]) -> str:
        """The text of `output_ids`, which extend the ids seen so far."""
        if len(output_ids) < len(self.decoder.ids):  # not an extension: start again
            self.decoder = IncrementalDecoder(self.tokenizer, self.skip_special_tokens)
            self.text = ""
        self.text += self.decoder.push(output_ids[len(self.decoder.ids) :])
        return self.text


class StopChecker:
    def __init__(self, tokenizer: Any, eos_ids: set[int], info: ModelInfo, grammars: Grammars):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.context_len = info.context_length
        self.grammars = grammars

    def check(self, req: Req, num_new: int = 1) -> FinishReason | None:
        """Why `req` ends after its latest `num_new` tokens, or None if it goes on."""
        p = req.params
        n = len(req.output_ids)
        grammar = req.grammar
        if grammar is not None and grammar.is_finished:
            token = req.output_ids[-1]
            return FinishReason.stop(token if token in req.stop_ids(self.eos_ids) else None)
        reason = None
        if n >= p.min_new_tokens:
            try:
                if grammar is None:
                    reason = self._stop_hit(req, num_new)
                elif grammar.is_accepting:
                    reason = self._grammar_stop_hit(req)
            except StopRegexTooSlow as e:
                return FinishReason.abort(str(e))
        if reason is None and (n >= p.max_new_tokens or len(req.all_ids) >= self.context_len):
            reason = FinishReason.of_length(n)
        return reason

    def _output_text(self, req: Req) -> str:
        """The request's output text, grown by the latest tokens' (`OutputText`)."""
        if req.stop_text is None:
            req.stop_text = OutputText(self.tokenizer, req.params.skip_special_tokens)
        return req.stop_text.of(req.output_ids)

    def _decode(self, req: Req, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)

    def _stop_hit(self, req: Req, num_new: int) -> FinishReason | None:
        """A stop token last, or a stop string brought by the latest tokens, or a stop regex
        match anywhere in the output."""
        p = req.params
        token = req.output_ids[-1]
        if token in req.stop_ids(self.eos_ids):
            return FinishReason.stop(token)
        if p.stop:  # a character is at most 4 byte-level tokens: this tail must hold it
            longest = max(len(s.encode()) for s in p.stop)
            tail = self._decode(req, req.output_ids[-(longest + num_new) :])
            for stop in p.stop:
                if stop in tail:
                    return FinishReason.stop(stop)
        if p.stop_regex:  # a match may span any length: search the whole output
            text = self._output_text(req)
            for pattern in p.stop_regex:
                match = search_stop_regex(pattern, text)
                if match and match.group(0):
                    return FinishReason.stop(match.group(0))
        return None

    def _grammar_stop_hit(self, req: Req) -> FinishReason | None:
        """`_stop_hit` for a constrained request: a stop token, string or regex ends it only
        where the text before it is a complete document. (Stop strings are trimmed at their
        first occurrence, so that occurrence is the one that must follow a document.)"""
        p = req.params
        if req.output_ids[-1] in req.stop_ids(self.eos_ids):
            text = self._decode(req, req.output_ids[:-1])
            at, matched = len(text), req.output_ids[-1]
        else:
            text = self._output_text(req)
            hits: list[tuple[int, str]] = [(text.find(s), s) for s in p.stop if s in text]
            for pattern in p.stop_regex:
                match = search_stop_regex(pattern, text)
                if match and match.group(0):
                    hits.append((match.start(), match.group(0)))
            if not hits:
                return None
            at, matched = min(hits)
        if not self.grammars.completes(req, text[:at]):
            return None
        return FinishReason.stop(matched)
