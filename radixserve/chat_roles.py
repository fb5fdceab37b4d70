"""A chat template's role markers, read off the template itself: for each role the text
that goes before a message's content (prefix) and after it (suffix), so a frontend can build
a chat prompt piece by piece (`prefix + content + suffix` per message) and get exactly what
`apply_chat_template` renders.

The markers are found by rendering growing conversations of sentinel contents, each of which
must extend the previous rendering:

    [S]          → system prefix ·S· system suffix
    [S, U]       → first rendering + user prefix ·U· user suffix
    [S, U, A]    → second rendering + assistant prefix ·A· assistant suffix
    [S, U] + generation prompt → the assistant prefix again (its tail wins if they differ)

A template that refuses a system message (it raises, or does not render [S, U] as an
extension of [S]) is read without one, from [U], [U, A] and [U, A, U] (the user's markers
from the second user turn), and the system role gets the user's markers: a system prompt
then goes in as a user turn, a turn the model was trained on, rather than as text outside
any turn. `system_supported` says which case it is. With a system message, whatever the
template writes once before the conversation (a BOS) is part of the system prefix; without
one, it is part of no marker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

# Contents no template rewrites (no spaces to trim, no markup, no case to change) and that
# no marker contains.
SYSTEM = "RADIXSERVESYSTEMSENTINEL"
USER = "RADIXSERVEUSERSENTINEL"
ASSISTANT = "RADIXSERVEASSISTANTSENTINEL"

Markers = tuple[str, str]  # (prefix, suffix)


class TemplateShapeError(ValueError):
    """The template's renderings are not the per-message concatenation the markers need."""


@dataclass(frozen=True)
class ChatRoles:
    system: Markers
    user: Markers
    assistant: Markers
    default_system_prompt: str | None  # what the template inserts when no system is given
    system_supported: bool  # False: the template refuses a system message (see above)

    @property
    def stop_str(self) -> list[str]:
        """What ends the model's turn: the assistant suffix without its whitespace."""
        stop = self.assistant[1].strip()
        return [stop] if stop else []

    def as_dict(self) -> dict[str, Any]:
        return {
            "roles": {
                "system": list(self.system),
                "user": list(self.user),
                "assistant": list(self.assistant),
            },
            "default_system_prompt": self.default_system_prompt,
            "stop_str": self.stop_str,
            "system_supported": self.system_supported,
        }


def chat_roles(tokenizer: Any) -> dict[str, Any] | None:
    """The role markers of the tokenizer's chat template as a JSON-ready dict:
    `{"roles": {role: [prefix, suffix]}, "default_system_prompt", "stop_str",
    "system_supported"}`; None if it has no chat template or the markers cannot be read."""
    roles = derive_chat_roles(tokenizer)
    return roles.as_dict() if roles is not None else None


def derive_chat_roles(tokenizer: Any) -> ChatRoles | None:
    """The markers as a `ChatRoles`; None if there is no chat template, it fails to render,
    or its renderings do not grow message by message."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    render = _Renderer(tokenizer)
    try:
        return _with_system(render)
    except (TemplateError, TemplateShapeError):
        pass
    try:
        return _without_system(render)
    except (TemplateError, TemplateShapeError):
        return None


class _Renderer:
    """The tokenizer's chat template as text, for conversations of sentinel contents."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, roles: list[str], add_generation_prompt: bool = False) -> str:
        contents = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
        messages = [{"role": role, "content": contents[role]} for role in roles]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except TemplateError:
            raise
        except Exception as e:  # transformers' refusals (no template, bad messages), or
            # the template's own fault (a TypeError of `tools | length` on None...)
            raise TemplateShapeError(f"{type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise TemplateShapeError(f"the template rendered a {type(text).__name__}")
        return text


def _with_system(render: _Renderer) -> ChatRoles:
    first = render(["system"])
    system = _split(first, SYSTEM)
    second = render(["system", "user"])
    user = _split(_extension(first, second), USER)
    assistant = _assistant(render, ["system", "user"], second)
    default = _default_system_prompt(render(["user"]), system, user)
    return ChatRoles(system, user, assistant, default, system_supported=True)


def _without_system(render: _Renderer) -> ChatRoles:
    """The user's markers from a second user turn: the first one may carry what the
    template puts once before the whole conversation (a BOS), which is no marker."""
    first = render(["user"])
    assistant = _assistant(render, ["user"], first)
    second = render(["user", "assistant"])
    user = _split(_extension(second, render(["user", "assistant", "user"])), USER)
    return ChatRoles(user, user, assistant, None, system_supported=False)


def _assistant(render: _Renderer, before: list[str], rendered: str) -> Markers:
    """The assistant's markers after the conversation `before` (rendered as `rendered`);
    the generation prompt's tail is the prefix when it differs from the rendered one."""
    prefix, suffix = _split(_extension(rendered, render([*before, "assistant"])), ASSISTANT)
    prompt = render(before, add_generation_prompt=True)
    if prompt.startswith(rendered) and len(prompt) > len(rendered):
        prefix = prompt[len(rendered) :]
    return prefix, suffix


def _default_system_prompt(alone: str, system: Markers, user: Markers) -> str | None:
    """The system message the template inserts in a conversation of one user message,
    if it inserts one (rendered with the system markers, before the user's message)."""
    prefix, suffix = system
    tail = user[0] + USER + user[1]
    if not alone.startswith(prefix) or not alone.endswith(suffix + tail):
        return None
    content = alone[len(prefix) : len(alone) - len(suffix + tail)]
    return content or None


def _extension(shorter: str, longer: str) -> str:
    """What `longer` adds after `shorter`, which it must begin with."""
    if not longer.startswith(shorter):
        raise TemplateShapeError("a longer conversation does not extend the shorter one")
    return longer[len(shorter) :]


def _split(text: str, sentinel: str) -> Markers:
    """(before, after) the one occurrence of the sentinel content in `text`."""
    if text.count(sentinel) != 1:
        raise TemplateShapeError("the message content is not rendered exactly once")
    before, _, after = text.partition(sentinel)
    return before, after
