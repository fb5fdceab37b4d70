"""A request's output text, grown a few tokens at a time at a cost that depends only on the
new tokens: an incremental decoder (only a short window of ids is decoded each step) and the
stop-string rules on top of it (a partial stop string held back while running, the text
trimmed at the stop string's first occurrence when finished)."""

from __future__ import annotations

from typing import Any, NamedTuple

from radixserve.core.output import FinishReason
from radixserve.core.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"  # what decoding gives for the bytes of an incomplete character


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


class TextDelta(NamedTuple):
    text: str  # appended to the text shown so far
    cut: int | None = None  # when set, the shown text is first cut to this many characters


class TextStream:
    """The text a request may show: while it runs, any tail that could still become a stop
    string is held back (only the tail is examined, so a step costs what its new text costs);
    when it finishes, a matched stop token is left out and a matched stop string trimmed at
    its first occurrence (unless `no_stop_trim`)."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.params = params
        self.decoder = IncrementalDecoder(tokenizer, params.skip_special_tokens)
        self.held = ""  # decoded text held back: it may begin a stop string
        self.shown: list[str] = []  # the text shown so far, in pieces
        self.shown_len = 0
        self.done = False

    def advance(self, new_ids: list[int], reason: FinishReason | None) -> TextDelta:
        """What the shown text gains with these ids (`reason`: the request's finish reason
        when they are its last ones)."""
        if self.done:
            return TextDelta("")
        if reason is None:
            pending = self.held + self.decoder.push(new_ids)
            keep = len(pending) - partial_stop_len(pending, self.params.stop)
            self.held = pending[keep:]
            return self._show(pending[:keep])
        return self._finish(new_ids, reason)

    def _finish(self, new_ids: list[int], reason: FinishReason) -> TextDelta:
        self.done = True
        trim = not self.params.no_stop_trim
        if isinstance(reason.matched, int) and trim and new_ids:
            new_ids = new_ids[:-1]  # the stop token itself, left out of the text
        tail = self.held + self.decoder.push(new_ids, final=True)
        self.held = ""
        if isinstance(reason.matched, str) and trim:
            return self._trim_at(reason.matched, tail)
        return self._show(tail)

    def _trim_at(self, stop: str, tail: str) -> TextDelta:
        """Show the text up to the first occurrence of `stop`. It is nearly always in the
        tail; it lies in text already shown only where a stop string appeared before
        min_new_tokens or a stop regex matched a long span: the text is cut back then."""
        text = "".join(self.shown) + tail  # once per request
        at = text.find(stop)
        if at < 0:
            return self._show(tail)
        if at >= self.shown_len:
            return self._show(tail[: at - self.shown_len])
        self.shown, self.shown_len = [text[:at]], at
        return TextDelta("", cut=at)

    def _show(self, text: str) -> TextDelta:
        if text:
            self.shown.append(text)
            self.shown_len += len(text)
        return TextDelta(text)


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
