"""OpenAI's Responses API (/v1/responses), on top of the chat route's parts: a request's
input items (messages, function calls and their outputs) become chat messages, its flat
function tools and `text.format` the chat route's tools and response_format; the output
text is split into reasoning, message text and function calls by the same parsers, and
becomes the response's output items.

One `OutputBuilder` turns the text as it arrives into output items and the stream events
that build them (`response.output_item.added`, `...output_text.delta`, `...done`), so a
streamed response and a whole one are the same items:

    reasoning item (rs_)   --reasoning parser-->  <think>…</think>
    message item (msg_)    --tool parser------->  text outside calls
    function_call (fc_)    --tool parser------->  each call, its arguments streamed

Stored responses (`store`, the default) are kept in memory by `ResponseStore`, each with its
own input items and a link to the response it continues (`previous_response_id`), so a
conversation is the chain of its turns and each turn is stored once; with
--file-storage-path on disk too (radixserve/server/kept.py)."""

from __future__ import annotations

import asyncio
import bisect
import codecs
import copy
import itertools
import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from radixserve.server import openai_api as oai
from radixserve.server import tool_calls
from radixserve.server.body import ServiceTier, StrictBody, tier_served, union_member
from radixserve.server.errors import APIError, bad_request
from radixserve.server.kept import ResponseFiles
from radixserve.server.reasoning import ReasoningPlan, ReasoningStream
from radixserve.server.streaming import event_frame

# What `include` may ask for (OpenAI's list). Only the output text's logprobs change the
# response here: the others are about hosted tools or encrypted reasoning, which a local
# engine does not have, so they are accepted and add nothing.
INCLUDABLE = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "web_search_call.action.sources",
    "web_search_call.results",
    "code_interpreter_call.outputs",
]
LOGPROBS = "message.output_text.logprobs"
# the most stored responses may hold, as JSON, whatever --responses-store-size says: a body
# can be 64 MiB (reasoning items and ids are stored whole, though never replayed)
MAX_STORED_BYTES = 1 << 30
logger = logging.getLogger(__name__)
# the error of a background response its server stopped before it ended
STOPPED = {"code": "server_error", "message": "the server stopped before the response ended"}
MAX_METADATA_KEYS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


# -- the request ----------------------------------------------------------------------------
class TextFormat(StrictBody):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """The chat route's response_format for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.name is None or self.schema_ is None:
            raise bad_request(
                "text.format of type json_schema needs a name and a schema", "text.format"
            )
        inner = {"name": self.name, "schema": self.schema_, "strict": self.strict}
        if self.description is not None:
            inner["description"] = self.description
        return {"type": "json_schema", "json_schema": inner}


class TextConfig(StrictBody):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint this engine ignores


class ReasoningConfig(StrictBody):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # its old name


class ConversationRef(StrictBody):
    model_config = ConfigDict(extra="forbid")
    id: str


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits on `metadata` (a response's, a conversation's)."""
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_KEYS:
        raise bad_request(f"metadata has more than {MAX_METADATA_KEYS} keys", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise bad_request(
                f"metadata keys are at most {MAX_METADATA_KEY} characters and values at "
                f"most {MAX_METADATA_VALUE}",
                "metadata",
            )


class StreamOptions(StrictBody):
    model_config = ConfigDict(extra="forbid")
    # OpenAI's random padding of deltas against side channels; a local server sends none
    include_obfuscation: bool | None = None


class ResponsesRequest(StrictBody):
    """OpenAI's fields, then the sampling extras the chat route takes too (SGLang's)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    # a conversation (`/v1/conversations`) it starts from and adds its items to
    conversation: str | ConversationRef | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[INCLUDABLE] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's counts calls of its built-in tools only: with function tools alone it limits
    # nothing, there or here (echoed)
    max_tool_calls: int | None = Field(None, ge=1)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = None
    background: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: ServiceTier | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    priority: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    regex: str | None = None  # SGLang's constraints besides text.format
    ebnf: str | None = None
    # with --reasoning-parser, a constraint applies after the reasoning (None: so by default)
    require_reasoning: bool | None = None

    @property
    def stores(self) -> bool:
        return self.store is not False  # OpenAI's default: stored

    @property
    def streams(self) -> bool:
        return bool(self.stream)

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    def check(self) -> None:
        """What one field's type cannot say."""
        if self.background and not self.stores:
            raise bad_request("background responses must be stored: leave store true", "store")
        if self.input == "" or self.input == []:
            raise bad_request("input is empty", "input")
        if self.conversation is not None and self.previous_response_id is not None:
            raise bad_request(
                "a response continues either a conversation or a previous response, not both",
                "conversation",
            )
        check_metadata(self.metadata)

    @property
    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation

    def chat_fields(self, tools: list[dict[str, Any]], choice: Any) -> dict[str, Any]:
        """The chat request's fields other than its messages."""
        fields = {
            "model": self.model,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "logprobs": self.wants_logprobs,
            "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
            "tools": tools or None,
            # auto without tools is Responses' default (the chat route refuses any choice
            # without tools, as OpenAI's chat API does)
            "tool_choice": None if choice == "auto" and not tools else choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
            **{name: getattr(self, name) for name in _EXTRAS},
            "chat_template_kwargs": self._template_kwargs(),
        }
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.response_format()
        return {k: v for k, v in fields.items() if v is not None}

    def _template_kwargs(self) -> dict[str, Any] | None:
        """`reasoning.effort` as templates read it: `none` turns thinking off (Qwen3's
        enable_thinking), the others are passed as `reasoning_effort` (gpt-oss')."""
        effort = self.reasoning.effort if self.reasoning else None
        kwargs: dict[str, Any] = {}
        if effort == "none":
            kwargs = {"enable_thinking": False, "thinking": False}
        elif effort is not None:
            kwargs = {"reasoning_effort": effort}
        return {**kwargs, **(self.chat_template_kwargs or {})} or None


_EXTRAS = (
    *("top_k", "min_p", "min_tokens", "repetition_penalty", "frequency_penalty"),
    *("presence_penalty", "seed", "stop", "ignore_eos", "logit_bias", "priority"),
    *("regex", "ebnf", "require_reasoning"),
)


# -- input items ----------------------------------------------------------------------------
class _MessageItem(StrictBody):
    model_config = ConfigDict(extra="ignore")  # an output item sent back has more fields
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class _FunctionCallItem(StrictBody):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str


class _FunctionOutputItem(StrictBody):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[dict[str, Any]]


class _ReasoningItem(StrictBody):
    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None


_ITEMS: dict[str, type[StrictBody]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "function_call_output": _FunctionOutputItem,
    "reasoning": _ReasoningItem,
}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(given: str | list[dict[str, Any]], field: str = "input") -> list[dict[str, Any]]:
    """The request's input (or a conversation's items: `field`) as items in one shape, each
    with an id (as /input_items lists them): a string is one user message; a message's
    content becomes text parts. A 400 names the item (and part) that is not one this
    engine serves."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    return [_item(raw, f"{field}[{i}]") for i, raw in enumerate(given)]


def check_unique_ids(items: list[dict[str, Any]], field: str = "input") -> None:
    """Each item of a conversation once (as OpenAI's check): the earlier turns' items and the
    new input (or items: `field`) together. A client that continues a stored response
    sends only what is new."""
    seen: set[str] = set()
    for item in items:
        if item["id"] in seen:
            raise bad_request(f"Duplicate item found with id {item['id']}", field)
        seen.add(item["id"])


def _item(raw: dict[str, Any], where: str) -> dict[str, Any]:
    kind = raw.get("type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise bad_request(
            f"{where}.type: items of type {kind!r} are not supported here (message, "
            "function_call, function_call_output and reasoning are)",
            f"{where}.type",
        )
    try:
        item = model.model_validate(raw).model_dump(exclude_none=True)
    except ValidationError as e:
        raise _field_error(e, where) from None
    if kind == "message":
        part_type = "output_text" if item["role"] == "assistant" else "input_text"
        parts = enumerate(_parts(item["content"]))
        item["content"] = [_part(p, part_type, f"{where}.content", j) for j, p in parts]
        item.setdefault("status", "completed")
    elif kind == "function_call_output":
        item["output"] = _text(item["output"], f"{where}.output")
    item.setdefault("id", new_id(_ID_PREFIXES[kind]))
    return item


# the ids items get where the client gave none
_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def _field_error(e: ValidationError, where: str) -> APIError:
    """A part of the body that failed its model, as a 400 naming the field in it."""
    error = e.errors()[0]
    loc = [p for p in error["loc"] if not union_member(p)]
    path = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
    return bad_request(f"{path}: {error['msg'].removeprefix('Value error, ')}", path)


def _parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "input_text", "text": content}] if isinstance(content, str) else content


def _part(part: dict[str, Any], part_type: str, where: str, index: int) -> dict[str, Any]:
    text = _text([part], where, index)
    out: dict[str, Any] = {"type": part_type, "text": text}
    return out | {"annotations": []} if part_type == "output_text" else out


def _text(content: str | list[dict[str, Any]], where: str, first: int = 0) -> str:
    """The text of a content (a string, or text parts joined by newlines, as the chat route
    joins them); other parts (images, files, audio) are a 400."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content, first):
        kind = part.get("type")
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise bad_request(
                f"{where}[{j}]: only text parts (input_text, output_text) are supported, got "
                f"type {kind!r}",
                f"{where}[{j}]",
            )
        if not isinstance(part.get(key), str):
            raise bad_request(
                f"{where}[{j}].{key}: a {kind} part needs its {key}, a string",
                f"{where}[{j}].{key}",
            )
        texts.append(part[key])
    return "\n".join(texts)


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as the chat route's messages: a function call joins the assistant turn before
    it (or opens one), its output is a tool message; reasoning is not replayed (chat
    templates drop earlier turns' reasoning)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "\n".join(p["text"] for p in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item["arguments"]}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages


# -- tools ----------------------------------------------------------------------------------
class _FunctionTool(StrictBody):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=tool_calls.FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The flat function tools as the chat route's; other tool types (hosted search, code,
    MCP...) are a 400."""
    out = []
    for i, raw in enumerate(tools or ()):
        if raw.get("type") != "function":
            raise bad_request(
                f"tools[{i}].type: only function tools are supported, got {raw.get('type')!r}",
                f"tools[{i}].type",
            )
        try:
            tool = _FunctionTool.model_validate(raw)
        except ValidationError as e:
            raise _field_error(e, f"tools[{i}]") from None
        function = tool.model_dump(exclude={"type"}, exclude_none=True)
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(
    choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]
) -> tuple[Any, list[dict[str, Any]]]:
    """(the chat route's tool_choice, the tools it may call): a function by name, or
    `allowed_tools` (a subset of the tools, under auto or required)."""
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type")
    if (
        kind == "function"
        and isinstance(choice.get("name"), str)
        and set(choice) <= {"type", "name"}
    ):
        return {"type": "function", "function": {"name": choice["name"]}}, tools
    if kind == "allowed_tools":
        mode, allowed = choice.get("mode", "auto"), choice.get("tools")
        names = _allowed_names(allowed)
        if mode not in ("auto", "required") or names is None:
            raise bad_request(
                "tool_choice allowed_tools needs mode auto or required and tools, a list of "
                '{"type": "function", "name": ...}',
                "tool_choice",
            )
        known = {t["function"]["name"] for t in tools}
        if not names <= known:
            missing = sorted(names - known)
            raise bad_request(
                f"tool_choice allows {missing}, which are not in tools", "tool_choice"
            )
        return mode, [t for t in tools if t["function"]["name"] in names]
    raise bad_request(
        'tool_choice must be none, auto, required, {"type": "function", "name": ...} or '
        f"allowed_tools (hosted tools are not served here), got type {kind!r}",
        "tool_choice",
    )


def _allowed_names(allowed: Any) -> set[str] | None:
    if not isinstance(allowed, list) or not allowed:
        return None
    names = set()
    for tool in allowed:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return None
        if not isinstance(tool.get("name"), str):
            return None
        names.add(tool["name"])
    return names


def flat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat tools as a response echoes them (Responses' flat shape)."""
    return [
        {"type": "function", "strict": None, "description": None, "parameters": None}
        | t["function"]
        for t in tools
    ]


# -- the output -----------------------------------------------------------------------------
@dataclass
class _Segment:
    """One piece of the parsed output (a text outside calls, or a call) and its item."""

    item: dict[str, Any] | None = None  # None: nothing of it sent yet
    sent: int = 0  # how much of its text (or arguments) is sent
    span: tuple[int, int] = (0, 0)  # a text's place in the content, as trimmed


@dataclass
class OutputBuilder:
    """A response's output items, built from its text as it arrives: a reasoning item,
    then in the order the text has them, messages (text outside calls) and function
    calls. `feed` returns the stream events for what is new (without sequence numbers);
    `close` those that finish the last item. Fed whole or in any pieces, the items are the
    same: each piece of the parsed output only grows until the next one begins.

    Logprobs (when given) are the tokens' of each message's text: a token belongs to the
    message whose text it overlaps, placed by where it starts in the output's text. Without
    tool calls a stream sends them with the text; with them, once the message has ended
    (in a last delta of its own), when it is known which tokens were its text."""

    thinking: ReasoningPlan | None
    tools: tool_calls.ToolPlan
    logprobs: Callable[[dict[str, Any], int], list[dict[str, Any]]] | None = None
    items: list[dict[str, Any]] = field(default_factory=list)
    open: dict[str, Any] | None = None  # the item being written
    content: str = ""  # the text after the reasoning, so far
    segments: list[_Segment] = field(default_factory=list)
    parsed: tool_calls.Parsed | None = None  # the content as last parsed
    # logprobs not placed yet: (where the token starts and ends in the output's text, entry)
    pending: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)
    skipped: frozenset[int] = frozenset()  # special tokens the text leaves out
    chars: int = 0  # the characters of the output's tokens so far
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    taken_logprobs: int = 0
    thought: ReasoningStream | None = field(init=False)
    parser: tool_calls.ToolParser | None = field(init=False)

    def __post_init__(self) -> None:
        self.thought = self.thinking.stream() if self.thinking is not None else None
        self.parser = self.tools.parser() if self.tools.active else None

    @property
    def content_start(self) -> int | None:
        """Where the content starts in the output's text (None: still in the reasoning)."""
        return 0 if self.thought is None else self.thought.content_start

    def feed(self, text: str, meta: dict[str, Any], final: bool) -> list[dict[str, Any]]:
        self._take_logprobs(meta)
        events: list[dict[str, Any]] = []
        reasoning, content = "", text
        if self.thought is not None:
            reasoning, content = self.thought.feed(text, final)
        if reasoning:
            events += self._reasoning(reasoning)
        self.content += content
        if self.content_start is None and not final:
            return events  # no call or message can start inside the reasoning
        if self.parser is None:
            return events + self._piece(0, self.content, (0, len(self.content)))
        if not self.content and not final:
            return events  # (a named function's parser would open its call at once)
        self.parsed = self.parser.parse(self.content, final)
        pieces = self.parsed.segments()
        at = 0
        for j, piece in enumerate(pieces):
            if isinstance(piece, tool_calls.ParsedCall):
                events += self._piece(j, piece, None)
                continue
            # text between calls is trimmed where it meets them
            trimmed = piece.lstrip() if j > 0 else piece
            start = at + len(piece) - len(trimmed)
            trimmed = trimmed.rstrip() if j < len(pieces) - 1 else trimmed
            events += self._piece(j, trimmed, (start, start + len(trimmed)))
            at += len(piece)
        return events

    def close(self, incomplete: bool) -> list[dict[str, Any]]:
        """The events that finish the output's last item; `incomplete`: it was cut short."""
        return self._close(incomplete, last=True)

    def _close(self, incomplete: bool, last: bool) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        item = self.open
        events = []
        if item["type"] == "message":
            owed = self._owed(self.segments.index(self._segment_of(item)), last)
            if owed:  # its tokens, now that it is known which were its text
                events += self._text_delta("", owed)
        self.open = None
        item["status"] = "incomplete" if incomplete else "completed"
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            events.append(
                {"type": "response.function_call_arguments.done", **at}
                | {"arguments": item["arguments"], "name": item["name"]}
            )
        else:
            part = item["content"][0]
            if item["type"] == "message":
                done = {"type": "response.output_text.done", "logprobs": part["logprobs"]}
            else:
                done = {"type": "response.reasoning_text.done"}
            events.append({**done, **at, "content_index": 0, "text": part["text"]})
            part_done = {"content_index": 0, "part": copy.deepcopy(part)}
            events.append({"type": "response.content_part.done", **at, **part_done})
        item_done = {"output_index": at["output_index"], "item": copy.deepcopy(item)}
        events.append({"type": "response.output_item.done", **item_done})
        return events

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close(incomplete=False, last=False)
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        # added without its parts: content_part.added adds them (as OpenAI's stream)
        shown = {**item, "content": []} if "content" in item else item
        added = {"output_index": index, "item": copy.deepcopy(shown)}
        events.append({"type": "response.output_item.added", **added})
        if item["type"] != "function_call":
            part = copy.deepcopy(item["content"][0])
            events.append(
                {"type": "response.content_part.added", "item_id": item["id"]}
                | {"output_index": index, "content_index": 0, "part": part}
            )
        return events

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._open(_new_item("reasoning"))
        assert self.open is not None
        self.open["content"][0]["text"] += text
        at = {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        return [*events, {"type": "response.reasoning_text.delta", **at, "delta": text}]

    def _piece(
        self, j: int, piece: str | tool_calls.ParsedCall, span: tuple[int, int] | None
    ) -> list[dict[str, Any]]:
        """The events of the parsed output's j-th piece: a text (its trimmed `span` in the
        content) or a call."""
        if j == len(self.segments):
            self.segments.append(_Segment())
        segment = self.segments[j]
        if span is not None:
            segment.span = span
        grown = piece if isinstance(piece, str) else piece.arguments
        new = grown[segment.sent :]
        events = []
        if segment.item is None and (new or not isinstance(piece, str)):
            if isinstance(piece, str):
                events += self._open(_new_item("message"))
            else:
                item = {"type": "function_call", "id": new_id("fc")}
                item |= {"call_id": tool_calls.new_call_id(), "name": piece.name}
                events += self._open(item | {"arguments": "", "status": "in_progress"})
            segment.item = self.open
        if not new or segment.item is not self.open:  # a piece before a later one is done
            return events
        segment.sent = len(grown)
        if isinstance(piece, str):
            return events + self._text_delta(new, None if self.parser is None else [])
        segment.item["arguments"] += new
        return events + [
            {"type": "response.function_call_arguments.delta", "item_id": segment.item["id"]}
            | {"output_index": len(self.items) - 1, "delta": new}
        ]

    def _segment_of(self, item: dict[str, Any]) -> _Segment:
        return next(s for s in self.segments if s.item is item)

    def _text_delta(
        self, text: str, logprobs: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """More of the open message's text; its logprobs: those given, else (without tool
        calls) the tokens of the content so far."""
        assert self.open is not None and self.open["type"] == "message"
        part = self.open["content"][0]
        part["text"] += text
        if logprobs is None:
            logprobs = self._owed(0, last=False)
        part["logprobs"] += logprobs
        at = {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        return [{"type": "response.output_text.delta", **at, "delta": text, "logprobs": logprobs}]

    def _take_logprobs(self, meta: dict[str, Any]) -> None:
        """The new tokens' entries, each with where it is in the output's text: a token
        that holds part of a character overlaps that character; a special token the text
        leaves out (`skipped`) has no width."""
        if self.logprobs is None:
            return
        entries = self.logprobs(meta, self.taken_logprobs)
        given = meta.get("output_token_logprobs") or ()
        ids = [t[1] for t in given[self.taken_logprobs : self.taken_logprobs + len(entries)]]
        self.taken_logprobs += len(entries)
        for entry, token in itertools.zip_longest(entries, ids):
            start = self.chars
            if token not in self.skipped:
                self.chars += len(self.decoder.decode(bytes(entry["bytes"])))
            held = 1 if self.decoder.getstate()[0] else 0  # a character begun, not complete
            self.pending.append((start, self.chars + held, entry))

    def _owed(self, j: int, last: bool) -> list[dict[str, Any]]:
        """The pending logprobs of the j-th piece's text, taken; those of the tokens before
        its end that are not its own (the reasoning's, a call's, whitespace no message
        shows) are dropped; the rest wait (`last`: none do). Each token is looked at once
        it is settled, so this is linear in the tokens over the whole output."""
        start = self.content_start
        if start is None:
            return []
        end = None if last else self._source_end(j)
        spans = [
            (s.span[0], s.span[1], k)
            for k, s in enumerate(self.segments)
            if s.item is not None and s.item["type"] == "message"
        ]
        owed = []
        settled = 0
        for t0, t1, entry in self.pending:
            if end is not None and t0 - start >= end:
                break
            settled += 1
            if self._owner(t0 - start, t1 - start, spans) == j:
                owed.append(entry)
        del self.pending[:settled]
        return owed

    def _source_end(self, j: int) -> int:
        """Where the j-th piece's text ends in the content's text (what the parser read)."""
        if self.parsed is None:
            return len(self.content)
        s, e = self.segments[j].span
        return self.parsed.text_position(e - 1) + 1 if e > s else s

    def _owner(self, c0: int, c1: int, spans: list[tuple[int, int, int]]) -> int | None:
        """The piece whose message a token in the content's text [c0, c1) belongs to (None:
        no message's): the first whose text it overlaps."""
        if c1 <= 0:
            return None
        if self.parsed is None:  # no tool calls: the content is one message
            return 0 if c0 < len(self.content) else None
        span = self.parsed.content_span(max(c0, 0), c1)
        if span is None:
            return None
        i = max(bisect.bisect_right(spans, (span[0], math.inf, 0)) - 1, 0)
        for s, e, k in spans[i:]:
            if s >= span[1]:
                break
            if span[0] < e and s < span[1]:
                return k
        return None


def _new_item(kind: str) -> dict[str, Any]:
    if kind == "reasoning":
        part = {"type": "reasoning_text", "text": ""}
        return {
            "type": "reasoning",
            "id": new_id("rs"),
            "summary": [],
            "content": [part],
            "status": "in_progress",
        }
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": new_id("msg"),
        "role": "assistant",
        "status": "in_progress",
        "content": [part],
    }


def output_logprobs(token_bytes: oai.TokenBytes) -> Callable[[dict[str, Any], int], list[dict]]:
    """Logprob entries of the output tokens from a start, as output_text parts carry them
    (the chat route's entries: token, logprob, bytes, top_logprobs)."""

    def entries(meta: dict[str, Any], start: int) -> list[dict[str, Any]]:
        return oai.chat_logprobs(meta, token_bytes, start)["content"]

    return entries


# -- the response ---------------------------------------------------------------------------
def outcome(meta: dict[str, Any]) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(status, incomplete_details, error) of a finished output."""
    reason = meta["finish_reason"] or {}
    if reason.get("type") == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if reason.get("type") == "abort":
        error = {"code": "server_error", "message": reason.get("message") or "aborted"}
        return "failed", None, error
    return "completed", None, None


def response_usage(meta: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    prompt, output = meta["prompt_tokens"], meta["completion_tokens"]
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": meta["cached_tokens"], "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + output,
    }


def response_object(
    response_id: str,
    body: ResponsesRequest,
    model: str,
    tools: list[dict[str, Any]],
    tool_choice: Any,
    defaults: Mapping[str, Any] = MappingProxyType({}),
) -> dict[str, Any]:
    """A response as created: in progress, no output yet; the request's settings echoed as
    OpenAI's responses echo them (the resolved sampling defaults among them: `defaults`,
    the model's, else the API's)."""
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
    reasoning = body.reasoning.model_dump(include={"effort", "summary"}) if body.reasoning else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": bool(body.background),
        "conversation": {"id": body.conversation_id} if body.conversation_id else None,
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None} | reasoning,
        "service_tier": tier_served(body.service_tier),
        "store": body.stores,
        "temperature": _given(body.temperature, defaults.get("temperature"), 1.0),
        "text": {"format": {"type": "text"}} | text,
        "tool_choice": tool_choice if tool_choice is not None else "auto",
        "tools": flat_tools(tools),
        "top_logprobs": body.top_logprobs or 0,
        "top_p": _given(body.top_p, defaults.get("top_p"), 1.0),
        "truncation": body.truncation or "disabled",
        "usage": None,
        "user": body.user,
    }


def finished(
    response: dict[str, Any],
    items: list[dict[str, Any]],
    meta: dict[str, Any],
    reasoning_tokens: int,
) -> dict[str, Any]:
    status, incomplete, error = outcome(meta)
    return response | {
        "status": status,
        "incomplete_details": incomplete,
        "error": error,
        "output": items,
        "usage": response_usage(meta, reasoning_tokens),
        "completed_at": int(time.time()) if status == "completed" else None,
    }


# -- stored responses -----------------------------------------------------------------------
class EventLog:
    """A streamed background response's events as they were sent (server-sent event frames;
    frame i is the event of sequence number i), kept with the response so that a client can
    read them again from any point (GET /v1/responses/{id}?stream=true&starting_after=N):
    while it runs, following the new ones as they come, and after it has ended."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.bytes = 0
        self.ended = False
        self.closed = False  # its last event (completed, incomplete, failed) is in
        self._grown = asyncio.Event()  # set (and replaced) when a frame comes or it ends

    def append(self, frame: bytes) -> None:
        self.frames.append(frame)
        self.bytes += len(frame)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._grown.set()
        self._grown = asyncio.Event()

    async def follow(self, start: int) -> AsyncIterator[bytes]:
        """The frames from sequence number `start` on, until the response has ended."""
        at = start
        while True:
            grown = self._grown  # taken before reading: a frame added meanwhile has set it
            while at < len(self.frames):
                yield self.frames[at]
                at += 1
            if self.ended:
                return
            await grown.wait()


@dataclass
class Stored:
    response: dict[str, Any]  # as last reported (a background one changes as it runs)
    inputs: list[dict[str, Any]]  # its own input items (the turns before it: `previous`)
    previous: str | None
    task: asyncio.Task | None = None  # a background response's, while it runs
    events: EventLog | None = None  # a streamed background response's events
    stopped: bool = False  # its server stopped it (a background one): it failed

    def size(self) -> int:
        """Its bytes as JSON, and its events'."""
        events = self.events.bytes if self.events is not None else 0
        return len(json.dumps([self.inputs, self.response])) + events


def page(
    items: list[dict[str, Any]],
    after: str | None,
    limit: int,
    order: str,
    owner: str,
    max_limit: int = 100,
) -> dict[str, Any]:
    """A list route's page of `items` (oldest first): `limit` of them (1 to `max_limit`)
    after the item `after`, in `order` (asc, desc), as OpenAI's cursor pages."""
    if not 1 <= limit <= max_limit:
        raise bad_request(f"limit must be between 1 and {max_limit}", "limit")
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [i.get("id") for i in items]
        if after not in ids:
            raise bad_request(f"after names no item of {owner!r}", "after")
        items = items[ids.index(after) + 1 :]
    chosen = items[:limit]
    return {
        "object": "list",
        "data": chosen,
        "first_id": chosen[0]["id"] if chosen else None,
        "last_id": chosen[-1]["id"] if chosen else None,
        "has_more": len(items) > limit,
    }


def _is_reference(raw: Any) -> bool:
    return isinstance(raw, dict) and raw.get("type") == "item_reference"


def _held_items(stored: Stored | None) -> list[dict[str, Any]]:
    """A stored response's own items, input then output (none for None)."""
    if stored is None:
        return []
    return stored.inputs + stored.response["output"]


class ResponseStore:
    """Stored responses in memory, the least recently used dropped past `capacity` or past
    `max_bytes` of their JSON, but never one still running in the background nor the
    newest (so those may go past the bounds for a while). A conversation is a chain: each
    response keeps only its own input and the id of the one it continues. With a `folder`
    (in --file-storage-path) each is also kept on disk (`kept.ResponseFiles`), so one
    dropped from memory, or stored by a server since restarted on the folder, is read back
    when it is next asked for (continued, fetched, its input items listed, deleted, or an
    item of it referenced)."""

    def __init__(
        self, capacity: int, max_bytes: int = MAX_STORED_BYTES, folder: Path | None = None
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.sizes: dict[str, int] = {}
        # an item's id → the stored response that holds it (its input or output; the latest
        # where several do), for `item_reference` inputs
        self.holders: dict[str, str] = {}
        self.files = ResponseFiles(folder) if folder is not None and capacity > 0 else None

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())

    def put(self, stored: Stored) -> None:
        if self.capacity == 0:
            return
        if self.files is not None:
            ids = [item["id"] for item in _held_items(stored)]
            self.files.write(_record(stored), ids)
        self._hold(stored)

    def _hold(self, stored: Stored) -> None:
        response_id = stored.response["id"]
        self.entries[response_id] = stored
        self.entries.move_to_end(response_id)
        self.sizes[response_id] = stored.size()
        for item in _held_items(stored):
            self.holders[item["id"]] = response_id
        total = self.bytes
        for oldest in list(self.entries)[:-1]:  # the newest stays, whatever its size
            if len(self.entries) <= self.capacity and total <= self.max_bytes:
                break
            if self.entries[oldest].task is None:  # not running in the background
                total -= self.sizes.pop(oldest)
                self._forget(self.entries.pop(oldest))

    def refresh(self, stored: Stored) -> None:
        """Measure a response again once it has changed (a background one has finished),
        unless it has been deleted meanwhile."""
        if stored.response["id"] in self.entries:
            self.put(stored)

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        stored = self.entries.get(response_id) or self._read(response_id)
        if stored is None:
            raise APIError(
                404, f"Response with id {response_id!r} not found.", param=param, code="not_found"
            )
        self.entries.move_to_end(response_id)
        return stored

    def _read(self, response_id: str) -> Stored | None:
        """A response kept on disk, back in memory (None: not kept there). One a stopped
        server left queued or running in the background has failed."""
        record = self.files.read(response_id) if self.files is not None else None
        if record is None:
            return None
        response = record["response"]
        inputs, previous = record.get("inputs"), record.get("previous")
        output = response.get("output")
        if not (_items_with_ids(inputs) and _items_with_ids(output)):
            logger.warning("response %s on disk lacks its items", response_id)
            return None
        stored = Stored(response, inputs, previous if isinstance(previous, str) else None)
        frames = record.get("events")
        if isinstance(frames, list):
            stored.events = EventLog()
            for frame in frames:
                stored.events.append(str(frame).encode())
        if response.get("status") in ("queued", "in_progress"):
            stored.response = response | {"status": "failed", "error": STOPPED}
            log = stored.events
            if log is not None:  # (its replay ends as a stream that failed does)
                event = {"type": "response.failed", "sequence_number": len(log.frames)}
                log.append(event_frame(event | {"response": stored.response}, typed=True))
            self.put(stored)  # (so it reads back failed from now on)
        else:
            self._hold(stored)
        if stored.events is not None:
            stored.events.closed = True
            stored.events.end()
        return stored

    def delete(self, response_id: str) -> None:
        stored = self.get(response_id)
        if stored.task is not None:
            stored.task.cancel()
        del self.entries[response_id]
        del self.sizes[response_id]
        self._forget(stored)
        if self.files is not None:
            self.files.remove(response_id)

    def _forget(self, stored: Stored) -> None:
        """Drop a response's items from the index (those it is the holder of)."""
        response_id = stored.response["id"]
        for item in _held_items(stored):
            if self.holders.get(item["id"]) == response_id:
                del self.holders[item["id"]]

    def resolve(
        self,
        given: str | list[Any],
        elsewhere: Callable[[str], dict[str, Any] | None] | None = None,
    ) -> str | list[Any]:
        """The input with each `item_reference` replaced by the stored item it names (a
        copy: an input or output item of any stored response, as OpenAI's resolve them, or
        one `elsewhere` finds: a conversation's); a 404 names the reference whose item is
        not stored."""
        if isinstance(given, str) or not any(_is_reference(raw) for raw in given):
            return given
        resolved = []
        for i, raw in enumerate(given):
            if not _is_reference(raw):
                resolved.append(raw)
                continue
            item_id = raw.get("id")
            if not isinstance(item_id, str):
                raise bad_request(
                    f"input[{i}].id: an item_reference needs the id of an item",
                    f"input[{i}].id",
                )
            item = self._item(item_id)
            if item is None and elsewhere is not None:
                item = elsewhere(item_id)
            if item is None:
                raise APIError(
                    404,
                    f"Item with id {item_id!r} not found (input[{i}]).",
                    param=f"input[{i}].id",
                    code="not_found",
                )
            resolved.append(copy.deepcopy(item))
        return resolved

    def _item(self, item_id: str) -> dict[str, Any] | None:
        """An input or output item of a stored response (in memory, else on disk)."""
        holder = self.entries.get(self.holders.get(item_id, ""))
        if holder is None and self.files is not None:
            kept = self.files.items.get(item_id)
            holder = None if kept is None else self.entries.get(kept) or self._read(kept)
        return next((x for x in _held_items(holder) if x["id"] == item_id), None)

    def chain_bytes(self, response_id: str | None) -> int:
        """The stored bytes of a response and of those it continues (as far as they are
        stored): about what continuing it renders and tokenizes again."""
        total = 0
        seen = set()
        while response_id is not None and response_id in self.entries:
            if response_id in seen:  # (files edited by hand into a loop)
                break
            seen.add(response_id)
            total += self.sizes[response_id]
            response_id = self.entries[response_id].previous
        return total

    def context(self, response_id: str) -> list[dict[str, Any]]:
        """The items a response continuing `response_id` starts from: every earlier turn's
        input and output, oldest first. A 404 when a link of the chain is gone."""
        chain: list[Stored] = []
        seen: set[str] = set()
        at: str | None = response_id
        while at is not None:
            if at in seen:  # (files edited by hand into a loop)
                message = f"Response with id {at!r} continues itself: its chain is broken."
                raise APIError(404, message, param="previous_response_id", code="not_found")
            try:
                stored = self.get(at, param="previous_response_id")
            except APIError as e:
                if at != response_id:
                    e.message = (
                        f"Response with id {at!r}, which {response_id!r} continues, is no "
                        "longer stored."
                    )
                raise
            status = stored.response["status"]
            if status in ("queued", "in_progress"):
                raise bad_request(
                    f"Response {at!r} is still {status}: continue it once it has finished",
                    "previous_response_id",
                )
            chain.append(stored)
            seen.add(at)
            at = stored.previous
        items: list[dict[str, Any]] = []
        for stored in reversed(chain):
            items += stored.inputs + stored.response["output"]
        return items


def _given(*values: Any) -> Any:
    """The first of `values` that is not None."""
    return next(v for v in values if v is not None)


def _items_with_ids(items: Any) -> bool:
    return isinstance(items, list) and all(
        isinstance(item, dict) and isinstance(item.get("id"), str) for item in items
    )


def _record(stored: Stored) -> dict[str, Any]:
    """A stored response as `kept.ResponseFiles` writes it."""
    record = {"response": stored.response, "inputs": stored.inputs, "previous": stored.previous}
    if stored.events is not None:
        record["events"] = [frame.decode() for frame in stored.events.frames]
    return record
