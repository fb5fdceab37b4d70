"""The reasoning formats of thinking models (`--reasoning-parser`): their tags, where a block
opens, and the `ThinkBlock` a request gets when its constraint comes after its reasoning
(require_reasoning). The server splits outputs with them (server/reasoning.py); the server
and the Engine both give requests their block here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.core.sampling_params import ThinkBlock

if TYPE_CHECKING:
    from radixserve.core.req import Req

PROMPT_TAIL = 64  # the prompt's last tokens, decoded, show whether it opens a block


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    always_inside: bool = False  # the model reasons from its first token, start tag or not
    # text that closes the block without its end tag and begins the content (Qwen3 may open
    # a tool call straight from its reasoning)
    closed_by: tuple[str, ...] = ()

    def opened_by(self, prompt: str) -> bool:
        """Whether the output starts inside a block: the format says so, or the prompt (the
        rendered chat template) leaves one open."""
        if self.always_inside:
            return True
        opened = prompt.rfind(self.start)
        return opened >= 0 and opened > prompt.rfind(self.end)


REASONING_FORMATS = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>", always_inside=True),
    "qwen3": ReasoningFormat("<think>", "</think>", closed_by=("<tool_call>",)),
    "qwen3-thinking": ReasoningFormat(
        "<think>", "</think>", always_inside=True, closed_by=("<tool_call>",)
    ),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷"),
}


def think_block(parser: str, prompt: str) -> ThinkBlock | None:
    """The block of reasoning a request's output has before its constraint applies: one the
    output starts inside where its prompt (or the format) opened one, and may open itself
    otherwise; None where the prompt ends with a block closed (Qwen3's template with
    thinking off closes an empty one): then the constraint applies to the whole output."""
    fmt = REASONING_FORMATS[parser]
    if prompt.rstrip().endswith(fmt.end):
        return None
    return ThinkBlock(fmt.start, fmt.end, fmt.opened_by(prompt))


def give_think_blocks(reqs: Sequence[Req], parser: str, decode: Callable[[list[int]], str]) -> None:
    """require_reasoning for `reqs`: each gets its `think_block`, read off the decoded end of
    its prompt (`decode`: the tokenizer's)."""
    for req in reqs:
        req.think = think_block(parser, decode(req.input_ids[-PROMPT_TAIL:]))
