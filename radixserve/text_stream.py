"""A request's output text, grown a few tokens at a time at a cost that depends only on the
new tokens: an incremental decoder (only a short window of ids is decoded each step) and the
stop rules on top of it. While a request runs, the text from where a stop could still end it
is held back; when it finishes, the text is trimmed where the stop that ended it begins. So
what a stream has shown is never taken back. Stop strings and stop regexes apply only to the
text after the first min_new_tokens tokens' (`OutputDecoder.stops_from`), in the scheduler
(scheduler/stop.py) and here alike.

Stop regexes go through the `regex` package (the `re` syntax, plus partial matching and a
time limit), compiled once per request (`SamplingParams.stop_patterns`): a pattern that
backtracks exponentially (`(a|a)+b` against "aaaa…"), or more patterns than a long output
can be searched with in time, raise `StopRegexTooSlow` once one check of them all has taken
STOP_REGEX_TIMEOUT_S, rather than stall every request."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import regex

from radixserve.core.output import FinishReason
from radixserve.core.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"  # what decoding gives for the bytes of an incomplete character

# One check of one request's output with all its stop regexes (a step's). A plain pattern
# searches 20k characters in ~0.1 ms.
STOP_REGEX_TIMEOUT_S = 0.01


class StopRegexTooSlow(Exception):
    def __init__(self, pattern: str) -> None:
        super().__init__(
            f"stop_regex {pattern!r}: searching the output with the stop regexes took over "
            f"{STOP_REGEX_TIMEOUT_S * 1000:g} ms (a pattern backtracks too much, or there are "
            "too many for an output this long), so the request was ended"
        )


def search_stop_regexes(
    patterns: list[regex.Pattern], text: str, pos: int = 0, partial: bool = False
) -> Iterator[regex.Match | None]:
    """Each pattern's leftmost match in `text` starting at or after `pos` (lookbehinds see
    the text before it), in order. With `partial`, a match the text ends inside counts too,
    but the `regex` package reports a complete match anywhere in preference to a partial
    one. The searches share one time limit, STOP_REGEX_TIMEOUT_S, so that one check costs
    at most that however many patterns there are."""
    deadline = time.perf_counter() + STOP_REGEX_TIMEOUT_S
    for pattern in patterns:
        left = max(deadline - time.perf_counter(), 0.0)  # 0: out of time at once
        try:
            match = pattern.search(text, pos=pos, partial=partial, timeout=left)
        except TimeoutError:
            raise StopRegexTooSlow(pattern.pattern) from None
        yield match


class IncrementalDecoder:
    """The text of a growing id sequence, decoding only a window of it per step.

        ids:  [ ....... shown ....... | prefix ... | read ... new ids ]
                                        └ context ┘└ text not yet aligned ┘

    Each step decodes ids[prefix:] and drops the text of ids[prefix:read]: the tokens before
    `read` give context, for tokenizers whose text of a token depends on what precedes it
    (SentencePiece drops the leading space of a window's first token). When the window's text
    ends on a complete character, `read` moves to the end and `prefix` to the old `read`.
    While it ends in U+FFFD (a character split across tokens), what precedes the incomplete
    character is returned and the rest waits; `final=True` returns everything."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.context_len = 0  # characters in the text of ids[prefix:read]
        self.returned = 0  # characters of the window after that context already returned

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """The text the new ids complete (all of what is left when `final`)."""
        self.ids += new_ids
        text = self._decode(self.ids[self.prefix :])
        stable = text if final else text.rstrip(REPLACEMENT)
        new = stable[self.context_len + self.returned :]
        if len(text) > self.context_len and not text.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            self.context_len = len(self._decode(self.ids[self.prefix : self.read]))
            self.returned = 0
        else:
            self.returned += len(new)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class OutputDecoder:
    """A request's output text (`IncrementalDecoder`), noting where its stops begin to apply:
    `stops_from`, the length of the text of its first min_new_tokens tokens (less a character
    they leave incomplete), None until those tokens are all here. An output that ends before
    them has no text where stops apply: `stops_from` is then its whole length."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.decoder = IncrementalDecoder(tokenizer, params.skip_special_tokens)
        self.min_new_tokens = params.min_new_tokens
        self.length = 0  # characters returned so far
        self.stops_from: int | None = 0 if params.min_new_tokens == 0 else None

    @property
    def num_ids(self) -> int:
        return len(self.decoder.ids)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """The text the new ids complete (all of what is left when `final`)."""
        text = ""
        first = self.min_new_tokens - self.num_ids  # ids still within the first min_new_tokens
        if self.stops_from is None and len(new_ids) >= first:
            text = self.decoder.push(new_ids[:first])
            self.stops_from = self.length + len(text)
            new_ids = new_ids[first:]
        if new_ids or final:  # (an empty push would drop the decoder's context)
            text += self.decoder.push(new_ids, final)
        self.length += len(text)
        if final and self.stops_from is None:
            self.stops_from = self.length
        return text


class TextStream:
    """The text a request may show. While it runs, the text from the first place where a
    stop could still end the request is held back: a stop string in it or beginning at its
    end, or a stop regex's match or partial match (one the text ends inside). The text of
    the first min_new_tokens tokens, where no stop applies, is never held. When it finishes,
    a matched stop token is left out and the text is trimmed where the stop that ended it
    begins (unless `no_stop_trim`). The text shown is always a prefix of the final text."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.params = params
        self.decoder = OutputDecoder(tokenizer, params)
        self.held = ""  # decoded text not shown yet: a stop may begin in it
        self.shown: list[str] = []  # the text shown so far, in pieces
        self.shown_len = 0
        self.done = False

    def advance(self, new_ids: list[int], reason: FinishReason | None) -> str:
        """What the shown text gains with these ids (`reason`: the request's finish reason
        when they are its last ones)."""
        if self.done:
            return ""
        if reason is None:
            pending = self.held + self.decoder.push(new_ids)
            keep = self._unstoppable_len(pending)
            self.held = pending[keep:]
            return self._show(pending[:keep])
        return self._finish(new_ids, reason)

    def _unstoppable_len(self, pending: str) -> int:
        """How much of `pending` (the text after what is shown) no stop can cut: up to where
        a stop string occurs or begins at its end, or a stop regex matches or could."""
        stops_from = self.decoder.stops_from
        if stops_from is None:
            return len(pending)  # all within the first min_new_tokens tokens
        start = max(stops_from - self.shown_len, 0)  # where stops apply in `pending`
        keep = stop_string_start(pending, self.params.stop, start)
        if self.params.stop_regex and start < len(pending):
            text = "".join(self.shown) + pending
            at = stop_regex_start(self.params.stop_patterns, text, self.shown_len + start)
            keep = min(keep, at - self.shown_len)
        return keep

    def _finish(self, new_ids: list[int], reason: FinishReason) -> str:
        self.done = True
        trim = not self.params.no_stop_trim
        if isinstance(reason.matched, int) and trim and new_ids:
            new_ids = new_ids[:-1]  # the stop token itself, left out of the text
        tail = self.held + self.decoder.push(new_ids, final=True)
        self.held = ""
        if isinstance(reason.matched, str) and trim:
            tail = tail[: self._stop_at(reason.matched, tail)]
        return self._show(tail)

    def _stop_at(self, matched: str, tail: str) -> int:
        """Where in `tail` (the text after what is shown) the stop that ended the request
        begins, among the text where stops apply: the stop string's first occurrence, or
        the start of the first stop regex's match that is `matched` (else the first
        pattern's match: a character completed by the last tokens may have lengthened
        it). Held-back text is all that can hold it: what is shown is never cut."""
        assert self.decoder.stops_from is not None, "final text decoded"
        start = max(self.decoder.stops_from - self.shown_len, 0)
        if matched in self.params.stop and (at := tail.find(matched, start)) >= 0:
            return at
        if not self.params.stop_regex:
            return len(tail)
        text = "".join(self.shown) + tail  # once per request
        searches = search_stop_regexes(self.params.stop_patterns, text, self.shown_len + start)
        matches = [m for m in searches if m and m.group(0)]
        if not matches:
            return len(tail)
        exact = [m for m in matches if m.group(0) == matched]
        return (exact or matches)[0].start() - self.shown_len

    def _show(self, text: str) -> str:
        if text:
            self.shown.append(text)
            self.shown_len += len(text)
        return text


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def stop_string_start(text: str, stops: list[str], start: int) -> int:
    """The first place in text[start:] where a stop string occurs, or begins at the end
    (len(text) if none does): the text from there on may still be cut."""
    begun = len(text) - min(partial_stop_len(text, stops), len(text) - start)
    found = [at for at in (text.find(stop, start) for stop in stops) if at >= 0]
    return min([begun, *found])


def stop_regex_start(patterns: list[regex.Pattern], text: str, pos: int) -> int:
    """The leftmost place at or after `pos` where a stop regex matches or could still match
    as the text grows (len(text) if none): the text from there on may still be cut. The
    `regex` package reports a complete match in preference to a partial one, and a partial
    match may begin before it, so a complete match (in running text one that cannot end the
    request, such as an empty one) holds back everything from `pos`."""
    at = len(text)
    for match in search_stop_regexes(patterns, text, pos, partial=True):
        if match is not None:
            at = min(at, match.start() if match.partial else pos)
    return at
