"""When a request ends: every stop rule in one place, returning a typed finish reason.

Order: once past min_new_tokens, a stop token (eos unless ignored, stop_token_ids), a stop
string or a stop regex (for a constrained request only where the text before it is a
complete document, whatever state the grammar is in after it); else a grammar whose
document is complete; else the length limit (max_new_tokens, or the context). Stop
strings and regexes match only in the text after the first min_new_tokens tokens'
(text_stream.OutputDecoder.stops_from), so that the detokenizer trims the text where the
stop that fired begins.

The output's text is kept per request and grown by the new tokens' text alone (`OutputText`,
the detokenizer's decoding), so a step decodes a few tokens, not the whole output. Stop
strings are looked for where that text grew (one brought by the step ends there); stop
regexes over the whole output, every step (a match may span any length). A pattern that
backtracks exponentially would stall every request, so a step's search with all of a
request's patterns that takes longer than text_stream.STOP_REGEX_TIMEOUT_S ends that
request alone, with an abort naming the pattern it had reached.
"""

from __future__ import annotations

from typing import Any

from radixserve.constrained.grammars import Grammars
from radixserve.core.output import FinishReason, ModelInfo
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.text_stream import (
    OutputDecoder,
    StopRegexTooSlow,
    search_stop_regexes,
)


class OutputText:
    """A request's output text for its stop regexes, grown by each step's new tokens
    (text_stream.OutputDecoder: a character split across tokens joins when complete), and
    where its stops begin to apply (`stops_from`)."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer, self.params = tokenizer, params
        self.decoder = OutputDecoder(tokenizer, params)
        self.text = ""
        self.grown_from = 0  # the text's length before the latest call's ids added to it
        # where a stop was found to follow no complete document (the text before a place
        # does not change while the text grows, so each place is checked once)
        self.incomplete_before: set[int] = set()

    def of(self, output_ids: list[int]) -> str:
        """The text of `output_ids`, which extend the ids seen so far."""
        if len(output_ids) < self.decoder.num_ids:  # not an extension: start again
            self.decoder = OutputDecoder(self.tokenizer, self.params)
            self.text = ""
            self.incomplete_before.clear()
        self.grown_from = len(self.text)
        self.text += self.decoder.push(output_ids[self.decoder.num_ids :])
        return self.text

    @property
    def stops_from(self) -> int:
        """Where stops apply in the text (asked once min_new_tokens tokens are all here)."""
        assert self.decoder.stops_from is not None, "fewer than min_new_tokens tokens"
        return self.decoder.stops_from


class StopChecker:
    def __init__(self, tokenizer: Any, eos_ids: set[int], info: ModelInfo, grammars: Grammars):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.context_len = info.context_length
        self.grammars = grammars

    def check(self, req: Req) -> FinishReason | None:
        """Why `req` ends after its latest tokens, or None if it goes on."""
        p = req.params
        n = len(req.output_ids)
        grammar = req.grammar
        reason = None
        if n >= p.min_new_tokens:
            try:
                if grammar is None:
                    reason = self._stop_hit(req)
                else:
                    reason = self._grammar_stop_hit(req)
            except StopRegexTooSlow as e:
                return FinishReason.abort(str(e))
        if reason is None and grammar is not None and grammar.is_finished:
            token = req.output_ids[-1]
            return FinishReason.stop(token if token in req.stop_ids(self.eos_ids) else None)
        if reason is None and (n >= p.max_new_tokens or len(req.all_ids) >= self.context_len):
            reason = FinishReason.of_length(n)
        return reason

    def _output_text(self, req: Req) -> OutputText:
        """The request's output text, grown by the latest tokens' (`OutputText`)."""
        if req.stop_text is None:
            req.stop_text = OutputText(self.tokenizer, req.params)
        req.stop_text.of(req.output_ids)
        return req.stop_text

    def _decode(self, req: Req, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)

    def _stop_hit(self, req: Req) -> FinishReason | None:
        """A stop token last, or a stop string brought by the latest tokens, or a stop regex
        match anywhere in the output (strings and regexes after the first min_new_tokens
        tokens' text)."""
        p = req.params
        token = req.output_ids[-1]
        if token in req.stop_ids(self.eos_ids):
            return FinishReason.stop(token)
        if not (p.stop or p.stop_regex):
            return None
        output = self._output_text(req)  # the text the detokenizer trims, grown by the step
        if p.stop:  # one the latest tokens brought ends in the text they added
            start = max(output.stops_from, output.grown_from - max(map(len, p.stop)) + 1)
            for stop in p.stop:
                if output.text.find(stop, start) >= 0:
                    return FinishReason.stop(stop)
        if p.stop_regex:  # a match may span any length: search the whole output
            for match in search_stop_regexes(p.stop_patterns, output.text, output.stops_from):
                if match and match.group(0):
                    return FinishReason.stop(match.group(0))
        return None

    def _grammar_stop_hit(self, req: Req) -> FinishReason | None:
        """`_stop_hit` for a constrained request: a stop token, string or regex ends it only
        where the text before it is a complete document. (Stop strings are trimmed at their
        first occurrence, so that occurrence is the one that must follow a document.)"""
        p = req.params
        output = None
        if req.output_ids[-1] in req.stop_ids(self.eos_ids):
            text = self._decode(req, req.output_ids[:-1])
            at, matched = len(text), req.output_ids[-1]
        elif not (p.stop or p.stop_regex):
            return None
        else:
            output = self._output_text(req)
            text, stops_from = output.text, output.stops_from
            found = [(text.find(s, stops_from), s) for s in p.stop]
            hits: list[tuple[int, str]] = [(at, s) for at, s in found if at >= 0]
            for match in search_stop_regexes(p.stop_patterns, text, stops_from):
                if match and match.group(0):
                    hits.append((match.start(), match.group(0)))
            if not hits:
                return None
            at, matched = min(hits)
            if at in output.incomplete_before:
                return None
        if not self.grammars.completes(req, text[:at]):
            if output is not None:
                output.incomplete_before.add(at)
            return None
        return FinishReason.stop(matched)
