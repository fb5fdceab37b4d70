"""Reasoning on /v1/chat/completions: a thinking model's block of reasoning, split out of its
text into `reasoning_content` (DeepSeek's API, which SGLang and vLLM follow), with the rest as
`content`, when the server runs with `--reasoning-parser`.

    <think>reasoning</think>answer        reasoning_content "reasoning", content "answer"
    reasoning</think>answer               the same where the block opened in the prompt
                                          (a template that adds <think>) or the format always
                                          starts inside one (DeepSeek-R1)
    <think>reasoning                      reasoning only: cut short by max_tokens
    answer                                content only: no block (Qwen3 with thinking off)

A block opens only at the start of the output; the text after it is the content that tool
calls are parsed from. The whitespace around the reasoning and before the content (Qwen3
writes a newline after <think> and two after </think>) is left out of both. Like the tool
parsers, `split` reads the whole text so far and returns what is certain of it, growing
monotonically as the text grows, so a stream sends the difference (`ReasoningStream`) and
reassembles to the non-streamed message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.core.reasoning import REASONING_FORMATS, ReasoningFormat, give_think_blocks
from radixserve.core.req import Req
from radixserve.server.errors import bad_request
from radixserve.text_stream import partial_stop_len


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the output has no block of reasoning (so far)
    content: str
    closed: bool  # the block has ended (or there is none): no more reasoning can come


def split(fmt: ReasoningFormat, text: str, inside: bool, final: bool) -> Split:
    """What is certain of `text`'s reasoning and content; `inside`: the output starts in a
    block. Before the output is `final`, text that may yet turn out to be a marker is held
    back from both."""
    if not inside:
        body = text.lstrip()
        if body.startswith(fmt.start):
            return split(fmt, body[len(fmt.start) :], inside=True, final=final)
        if not final and fmt.start.startswith(body):  # a start tag may be coming
            return Split(None, "", closed=False)
        return Split(None, text, closed=True)
    if text.startswith(fmt.start):  # DeepSeek-R1-0528 writes the tag the prompt opened
        text = text[len(fmt.start) :]
    ends = [(at, m) for m in (fmt.end, *fmt.closed_by) if (at := text.find(m)) >= 0]
    if ends:
        at, marker = min(ends)
        after = at + len(marker) if marker == fmt.end else at
        return Split(text[:at].strip(), text[after:].lstrip(), closed=True)
    if final:  # cut short: all of it is reasoning
        return Split(text.strip(), "", closed=True)
    if fmt.start.startswith(text):  # the tag written again may be coming
        return Split("", "", closed=False)
    held = partial_stop_len(text, [fmt.end, *fmt.closed_by])
    # trailing whitespace is held too: it is sent once more reasoning follows it
    return Split(text[: len(text) - held].strip(), "", closed=False)


class ReasoningStream:
    """What a stream has sent of one choice's reasoning and content; `feed` returns the
    news of each. With `stream_reasoning` off the reasoning comes in one piece, once its
    block has ended."""

    def __init__(self, fmt: ReasoningFormat, inside: bool, stream_reasoning: bool) -> None:
        self.fmt = fmt
        self.inside = inside
        self.stream_reasoning = stream_reasoning
        self.text = ""
        self.reasoning_sent = 0
        self.content_sent = 0
        # where the content starts in the text (None: not known yet, the block goes on)
        self.content_start: int | None = None

    def feed(self, new_text: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content) after `new_text`."""
        self.text += new_text
        now = split(self.fmt, self.text, self.inside, final)
        if now.closed:  # the content is the text's end
            self.content_start = len(self.text) - len(now.content)
        reasoning = ""
        if now.reasoning is not None and (self.stream_reasoning or now.closed):
            reasoning = now.reasoning[self.reasoning_sent :]
            self.reasoning_sent = len(now.reasoning)
        content = now.content[self.content_sent :]
        self.content_sent = len(now.content)
        return reasoning, content


@dataclass(frozen=True)
class ReasoningPlan:
    """How one chat request's outputs are split."""

    fmt: ReasoningFormat
    inside: bool  # each output starts inside a block
    stream_reasoning: bool

    def split(self, text: str) -> Split:
        """A finished output's reasoning and content."""
        return split(self.fmt, text, self.inside, final=True)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.fmt, self.inside, self.stream_reasoning)


def reasoning_plan(
    parser: str | None,
    separate: bool,
    stream_reasoning: bool,
    prompt: str,
    end_tag_only: bool = False,
) -> ReasoningPlan | None:
    """The split a chat request asks for: None without a parser, or with separate_reasoning
    off. `prompt` is the rendered chat template. With `end_tag_only` (the output's
    constraint applies after the reasoning, whose grammar ends the block at its end tag
    alone), the format's `closed_by` text does not end it either: a `<tool_call>` inside
    the block is reasoning, not a call the constraint never checked."""
    if parser is None or not separate:
        return None
    fmt = REASONING_FORMATS[parser]
    if end_tag_only:
        fmt = dataclasses.replace(fmt, closed_by=())
    return ReasoningPlan(fmt, fmt.opened_by(prompt), stream_reasoning)


def think_first(reqs: list[Req], parser: str | None, decode: Callable[[list[int]], str]) -> None:
    """require_reasoning: each request's constraint applies after a block of reasoning
    (`core/reasoning.give_think_blocks`); a 400 without a parser."""
    if parser is None:
        raise bad_request(
            "require_reasoning needs a server started with --reasoning-parser (it names the "
            "model's reasoning tags)",
            "require_reasoning",
        )
    give_think_blocks(reqs, parser, decode)
