"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice`, how they
reach the prompt, the constraint they put on the output, and the parsers that turn the
model's text back into OpenAI `tool_calls`.

    tool_choice   prompt gets the tools   output constrained to            parsed by
    none          no                      nothing                          nothing
    auto          yes                     nothing; with a strict tool,     the family's parser
                                          its Hermes <tool_call> blocks
    required      yes                     [{"name", "arguments"}, ...]     RequiredParser
    {function}    yes                     that function's parameters       NamedParser

A template that renders `tools` itself (Qwen 2.5, Llama 3.1, Hermes) receives them as
transformers' `apply_chat_template(tools=...)` passes them. A template that does not (the
default SmolLM2's plain ChatML) gets them in a system message (`TOOLS_PROMPT`) that asks for
the Hermes format, and earlier assistant tool calls are written into its content the same
way, so the model sees its own calls in the format it is asked to use.

Every parser reads the whole text so far: `parse(text, final)` returns what is certain of
the output (the content, and the calls), and grows monotonically as the text grows, so a
stream sends the difference (`ToolStream`) and reassembles to the non-streamed message.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import ConfigDict, Field

from radixserve.constrained.schema import json_schema_problem
from radixserve.server.body import StrictBody

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function name
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


# -- the request's fields -------------------------------------------------------------------
class FunctionDefinition(StrictBody):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictBody):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition

    def schema(self) -> dict[str, Any]:
        """The arguments' schema as the output is constrained to it. A function takes no
        argument it does not declare: an object schema that leaves additionalProperties
        open gets it closed (as OpenAI's strict mode asks clients to write); with `strict`,
        every object schema in it (OpenAI's strict mode)."""
        schema = self.function.parameters or EMPTY_PARAMETERS
        if self.function.strict:
            return closed_objects(schema)
        if _closable(schema):
            schema = {**schema, "additionalProperties": False}
        return schema


class FunctionName(StrictBody):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(StrictBody):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(StrictBody):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(StrictBody):
    """A tool call of an earlier assistant turn, sent back in `messages`."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_COMPOSITIONS = ("anyOf", "oneOf", "allOf")


def _closable(schema: dict[str, Any]) -> bool:
    """An object schema that leaves undeclared keys open and that closing cannot make
    unsatisfiable: additionalProperties sees only its own `properties`, so one whose keys
    may be declared in anyOf / oneOf / allOf branches stays as it is."""
    kinds = schema.get("type")
    is_object = kinds == "object" or (isinstance(kinds, list) and "object" in kinds)
    composed = any(key in schema for key in _COMPOSITIONS)
    return (
        (is_object or "properties" in schema)
        and "additionalProperties" not in schema
        and (not composed)
    )


def closed_objects(schema: Any, closable: bool = True) -> Any:
    """`schema` with every object schema in it that leaves additionalProperties open closed,
    as OpenAI's strict mode reads a schema (keys it does not declare are not allowed).
    Where closing could refuse keys declared elsewhere it is left open: an object with
    branches, the branches of allOf, and those of anyOf / oneOf next to properties."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    declares = "properties" in out or "patternProperties" in out
    for key in _COMPOSITIONS:
        if isinstance(out.get(key), list):
            whole = key != "allOf" and not declares  # each branch stands for the object
            out[key] = [closed_objects(sub, whole) for sub in out[key]]
    if isinstance(out.get("prefixItems"), list):
        out["prefixItems"] = [closed_objects(sub) for sub in out["prefixItems"]]
    for key in (*_SCHEMA_VALUES, "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if closable and _closable(out):
        out["additionalProperties"] = False
    return out


class ToolFieldError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def strict_calls_tagged(mode: str, family: str) -> bool:
    """Whether strict tools constrain their calls' arguments: under `auto`, where the
    family's calls are tagged text in the output (Hermes' <tool_call> blocks)."""
    return mode == "auto" and family == "hermes"


def tool_mode(
    tools: list[Tool] | None, choice: ToolChoice | None, family: str = "hermes"
) -> Literal["none", "auto", "required", "named"]:
    """The mode the request asks for; ToolFieldError names what is inconsistent. `family`:
    the `auto` parser's (where it is Hermes, strict tools constrain their arguments)."""
    if not tools:
        if choice not in (None, "none"):
            raise ToolFieldError("tool_choice is only allowed when tools are given", "tool_choice")
        return "none"
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolFieldError("tools: two functions have the same name", "tools")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and named not in names:
        raise ToolFieldError(f"tool_choice names {named!r}, which is not in tools", "tool_choice")
    mode = "named" if named is not None else choice or "auto"
    for i, tool in enumerate(tools):
        if mode == "required" or tool.function.name == named:
            why: str | None = "tool_choice constrains the arguments to it"
        elif tool.function.strict and strict_calls_tagged(mode, family):
            why = "strict: each call's arguments are constrained to it"
        else:
            why = None
        _check_parameters(tool, i, why)
    return mode


def _check_parameters(tool: Tool, index: int, constrained: str | None) -> None:
    """Refuse a function's parameters as OpenAI does, whatever tool_choice is: not an object
    schema, or not a valid JSON schema. A valid schema that constrained decoding cannot
    follow is refused only where the output is `constrained` to it (which says why). None
    or {} declare no parameters (`Tool.schema` reads both as an empty object)."""
    parameters = tool.function.parameters
    if not parameters:
        return
    param = f"tools[{index}].function.parameters"
    prefix = f"Invalid schema for function {tool.function.name!r}"
    if parameters.get("type") != "object":
        got = json.dumps(parameters.get("type"))
        message = f'{prefix}: it must be a JSON schema of type "object", got type {got}'
        raise ToolFieldError(message, param)
    problem = json_schema_problem(tool.schema())
    if problem is None or (problem.unsupported and not constrained):
        return
    reason = f" ({constrained})" if problem.unsupported else ""
    raise ToolFieldError(f"{prefix}: {problem.message}{reason}", param)


# -- what the request does with them --------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[Tool, ...] = ()
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: False keeps at most one call
    family: str = "hermes"  # the --tool-call-parser for `auto`

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them (transformers' JSON-schema shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint(self) -> dict[str, str]:
        """The sampling parameter that constrains the output: a JSON schema for `required`
        and a named function; under `auto` with a strict tool, a structural tag (as
        SGLang's), where the family's calls are tagged text (Hermes)."""
        if self.mode == "named":
            return {"json_schema": json.dumps(self._tool(self.named).schema())}
        if self.mode == "required":
            return {"json_schema": json.dumps(self._required_schema())}
        if strict_calls_tagged(self.mode, self.family):
            if any(t.function.strict for t in self.tools):
                return {"structural_tag": json.dumps(self._hermes_tag())}
        return {}

    def _required_schema(self) -> dict[str, Any]:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": t.schema(),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return array

    def _hermes_tag(self) -> dict[str, Any]:
        """Text, in which every <tool_call> block is a call of one of the tools, written as
        TOOLS_PROMPT asks: a strict tool's arguments follow its schema, the others' are an
        object."""
        structures = [
            {
                "begin": f'{HermesParser.OPEN}\n{{"name": {json.dumps(t.function.name)}, '
                '"arguments": ',
                "schema": t.schema() if t.function.strict else {"type": "object"},
                "end": f"}}\n{HermesParser.CLOSE}",
            }
            for t in self.tools
        ]
        return {"type": "structural_tag", "structures": structures, "triggers": [HermesParser.OPEN]}

    def parser(self) -> ToolParser:
        names = frozenset(t.function.name for t in self.tools)
        if self.mode == "named":
            assert self.named is not None
            return NamedParser(self.named)
        if self.mode == "required":
            return RequiredParser(names, self.parallel)
        if self.family == "llama3":
            return Llama3JsonParser(names, self.parallel)
        if self.family == "mistral":
            return MistralParser(names, self.parallel)
        return HermesParser(names, self.parallel)

    def _tool(self, name: str | None) -> Tool:
        return next(t for t in self.tools if t.function.name == name)


def parser_family(chat_template: str | None, flag: str | None) -> str:
    """The `auto` parser: the flag, else read off the template (Llama 3's python tag or
    ipython role, Mistral's [TOOL_CALLS]), else Hermes, the format TOOLS_PROMPT asks
    for."""
    if flag is not None:
        return "hermes" if flag == "qwen25" else flag
    if chat_template and ("<|python_tag|>" in chat_template or "ipython" in chat_template):
        return "llama3"
    if chat_template and MistralParser.TAG in chat_template:
        return "mistral"
    return "hermes"


# -- the prompt -----------------------------------------------------------------------------
TOOLS_PROMPT = (
    "You can call functions. To call one, answer with a JSON object inside "
    "<tool_call></tool_call> tags, one per call:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>\n'
    "The functions, as JSON schemas:\n{tools}"
)


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def template_messages(
    messages: list[dict[str, Any]], plan: ToolPlan, chat_template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for apply_chat_template. Earlier calls' arguments become objects
    (templates write them with `tojson`); for a template that knows no tools, the tools go
    into the system message and earlier calls into their turn's text."""
    if template_renders_tools(chat_template):
        rendered = [_with_parsed_arguments(m) for m in messages]
        if plan.family == "mistral":  # (its templates take ids of 9 letters and digits)
            rendered = [_mistral_ids(m) for m in rendered]
        return rendered, (plan.tool_dicts() if plan.active else None)
    out = [_calls_as_text(m) for m in messages]
    if plan.active:
        listing = "\n".join(json.dumps(t) for t in plan.tool_dicts())
        prompt = TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


# What json.loads may raise on model output: a syntax error (JSONDecodeError, a ValueError),
# an integer of more than 4,300 digits (ValueError), nesting deeper than the interpreter's
# recursion limit (RecursionError).
JSON_ERRORS = (ValueError, RecursionError)


def _loads(text: str) -> Any:
    """The JSON value of `text`, or None where it is not one Python can read."""
    try:
        return json.loads(text)
    except JSON_ERRORS:
        return None


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function["arguments"])
        except JSON_ERRORS:
            pass  # not JSON Python reads: the template gets the text as the client sent it
        parsed.append({**call, "function": function})
    return {**message, "tool_calls": parsed}


def mistral_call_id(call_id: str) -> str:
    """A call id as Mistral's templates require it (9 letters and digits, else they
    refuse the messages), the same for a call and the tool message answering it: its last 9
    letters and digits, or where it has fewer, 9 hex digits of its hash."""
    kept = re.sub(r"[^A-Za-z0-9]", "", call_id)
    return kept[-9:] if len(kept) >= 9 else hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _mistral_ids(message: dict[str, Any]) -> dict[str, Any]:
    if isinstance(message.get("tool_call_id"), str):
        message = {**message, "tool_call_id": mistral_call_id(message["tool_call_id"])}
    calls = message.get("tool_calls")
    if calls:
        fixed = [{**c, "id": mistral_call_id(c["id"])} if isinstance(c.get("id"), str) else c
                 for c in calls]  # fmt: skip
        message = {**message, "tool_calls": fixed}
    return message


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = message.get("content") or ""
    for call in calls:
        f = call["function"]
        text += f'<tool_call>\n{{"name": {json.dumps(f["name"])}, "arguments": {f["arguments"]}}}'
        text += "\n</tool_call>"
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": text}


# -- parsing the output ---------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text; while streaming, possibly the part generated so far


@dataclass(frozen=True)
class Parsed:
    content: str  # the text outside calls
    calls: list[ParsedCall] = field(default_factory=list)
    # where each call sits in the content: the number of its characters before the call
    # (given by parsers whose calls may have text on both sides; else all after it)
    at: list[int] = field(default_factory=list)
    # where the content comes from in the text: runs of (text offset, content offset,
    # length); None: the content is the text's start
    runs: list[tuple[int, int, int]] | None = None

    def content_span(self, start: int, end: int) -> tuple[int, int] | None:
        """The part of the content that the text's [start, end) became (None: none of it,
        e.g. a token inside a call). The runs are in text order: found by bisection."""
        runs = self.runs if self.runs is not None else [(0, 0, len(self.content))]
        first = max(bisect.bisect_right(runs, (start, math.inf)) - 1, 0)
        hits = []
        for t, c, n in itertools.islice(runs, first, None):
            if t >= end:
                break
            if max(start, t) < min(end, t + n):
                hits.append((c + max(start, t) - t, c + min(end, t + n) - t))
        if not hits:
            return None
        return hits[0][0], hits[-1][1]

    def text_position(self, at: int) -> int:
        """Where the content's character `at` is in the text."""
        if self.runs is None:
            return at
        i = bisect.bisect_right(self.runs, at, key=lambda run: run[1]) - 1
        t, c, _ = self.runs[max(i, 0)]
        return t + at - c

    def segments(self) -> list[str | ParsedCall]:
        """The output in order: pieces of text outside calls (some empty) and the calls,
        text first and between calls and last."""
        out: list[str | ParsedCall] = []
        start = 0
        for i, call in enumerate(self.calls):
            end = min(self.at[i], len(self.content)) if i < len(self.at) else len(self.content)
            out += [self.content[start:end], call]
            start = max(start, end)
        return [*out, self.content[start:]]


class ToolParser(Protocol):
    def parse(self, text: str, final: bool) -> Parsed:
        """What is certain of the output given its text so far (all of it when `final`).
        Monotone: as text grows, content and each call's arguments only grow, and calls
        are only appended."""


class NamedParser:
    """The output is the named function's arguments (grammar-constrained)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [ParsedCall(self.name, text)])


def _call_of(obj: Any, names: frozenset[str]) -> ParsedCall | None:
    """A call from a decoded JSON object {"name", "arguments" (or Llama's "parameters")},
    None unless it names a known function with an object of arguments."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    try:
        return ParsedCall(name, json.dumps(args, ensure_ascii=False))
    except (ValueError, RecursionError):
        return None


def _json_values(text: str, pos: int, separators: str) -> tuple[list[Any], int]:
    """The complete JSON values from `pos` on, separated by whitespace and `separators`,
    and where the first incomplete one (or the end) begins."""
    decoder = json.JSONDecoder()
    values = []
    while True:
        pos = _skip(text, pos, separators)
        if pos == len(text):
            return values, pos
        try:
            value, pos = decoder.raw_decode(text, pos)
        except JSON_ERRORS:
            return values, pos
        values.append(value)


class RequiredParser:
    """The output is a JSON array of {"name", "arguments"} (grammar-constrained); each call
    is reported once its object is complete."""

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        self.names = names
        self.parallel = parallel

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find("[")
        if start < 0:
            return Parsed("")
        values, _ = _json_values(text, start + 1, ",")
        calls = [c for c in (_call_of(v, self.names) for v in values) if c is not None]
        if final and not calls:  # cut short before its first call was complete
            return Parsed(text)
        return Parsed("", calls if self.parallel else calls[:1])


def _without_partial(text: str, tag: str) -> str:
    """`text` less a tail that could be the start of `tag` (held back until known)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


def _content(pieces: list[str], calls: list[ParsedCall], final: bool) -> str:
    """Text outside calls. Trailing whitespace is held back while the text grows (a call
    may follow it) and dropped when the output has calls."""
    text = "".join(pieces)
    return text.rstrip() if calls or not final else text


class HermesParser:
    """Hermes / Qwen 2.5 format: calls as JSON objects inside <tool_call>...</tool_call>,
    anywhere in the text. A block that is not a valid call stays in the content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        self.names = names
        self.parallel = parallel
        # the calls of the closed blocks read so far, by their text: a stream's text is
        # parsed again at every token, its blocks decoded once
        self.blocks: dict[str, ParsedCall | None] = {}

    def parse(self, text: str, final: bool) -> Parsed:
        pieces: list[str] = []
        runs: list[tuple[int, int, int]] = []  # where each piece is in the text
        calls: list[ParsedCall] = []
        at: list[int] = []
        length = 0  # of the pieces so far

        def piece(start: int, chunk: str) -> None:
            nonlocal length
            runs.append((start, length, len(chunk)))
            pieces.append(chunk)
            length += len(chunk)

        pos = 0
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:
                tail = text[pos:]
                piece(pos, tail if final else _without_partial(tail, self.OPEN))
                break
            piece(pos, text[pos:start])
            end = text.find(self.CLOSE, start)
            if end < 0 and not final:
                break  # an open block: held back until it closes
            block_end = len(text) if end < 0 else end + len(self.CLOSE)
            body = text[start + len(self.OPEN) : len(text) if end < 0 else end]
            if end < 0:
                call = self._call(body)
            elif body in self.blocks:
                call = self.blocks[body]
            else:
                call = self.blocks[body] = self._call(body)
            if call is None:
                piece(start, text[start:block_end])
            elif self.parallel or not calls:
                calls.append(call)
                at.append(length)
            pos = block_end
            if end < 0:
                break
        return Parsed(_content(pieces, calls, final), calls, at, runs)

    def _call(self, body: str) -> ParsedCall | None:
        return _call_of(_loads(body), self.names)


class Llama3JsonParser:
    """Llama 3.x JSON format: the whole answer is one call or several separated by `;`,
    {"name": ..., "parameters": {...}}, optionally after <|python_tag|>. Text that could
    still become such an answer is held back; at the end it is calls or it is content."""

    TAG = "<|python_tag|>"

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        self.names = names
        self.parallel = parallel

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        tagged = body.startswith(self.TAG)
        body = body.removeprefix(self.TAG).lstrip()
        # a call may follow: `{` has begun one, or the text is (the start of) the tag, or
        # the tag and whitespace so far
        maybe_call = (
            body.startswith("{") or self.TAG.startswith(text.lstrip()) or (tagged and not body)
        )
        if not final:
            return Parsed("" if maybe_call else _content([text], [], final))
        if body.startswith("{"):
            values, end = _json_values(body, 0, ";")
            calls = [_call_of(v, self.names) for v in values]
            if values and end == len(body) and None not in calls:
                found = [c for c in calls if c is not None]
                return Parsed("", found if self.parallel else found[:1])
        return Parsed(text)


class MistralParser:
    """Mistral's format: after the control token [TOOL_CALLS], either a JSON array of
    {"name", "arguments"} objects (Mistral 7B v0.3, Nemo, Small 3.0/3.1) or `name[ARGS]
    {arguments}` (the later tokenizers: Small 3.2, Magistral), each call after its own
    [TOOL_CALLS]. The text before the first [TOOL_CALLS] is content; each call is reported
    once complete; at the end, what does not read as calls after them stays content (all
    of it, where nothing does). The control tokens are special: the chat route keeps them
    in the text for this parser (skip_special_tokens false)."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        self.names = names
        self.parallel = parallel

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.TAG)
        if start < 0:
            shown = text if final else _without_partial(text, self.TAG)
            return Parsed(_content([shown], [], final))
        calls, stop = self._calls(text, start)
        calls = calls if self.parallel else calls[:1]
        pieces, runs = [text[:start]], [(0, 0, start)]
        if final and stop < len(text):  # (what does not read as calls)
            pieces.append(text[stop:])
            runs.append((stop, start, len(text) - stop))
        return Parsed(_content(pieces, calls, final), calls, [start] * len(calls), runs)

    def _calls(self, text: str, pos: int) -> tuple[list[ParsedCall], int]:
        """The complete calls from the [TOOL_CALLS] at `pos` on, and where the text stops
        reading as calls (its end where all of it does)."""
        calls: list[ParsedCall] = []
        while text.startswith(self.TAG, pos):
            at = _skip(text, pos + len(self.TAG), "")
            if text.startswith("[", at) or text.startswith("{", at):  # (calls, or one)
                bare = text.startswith("{", at)
                found, end, closed = self._array(text, at if bare else at + 1, bare)
                calls += found
                if not closed:  # (none of it a call: from its [TOOL_CALLS] on, text)
                    return calls, end if found else pos
            else:
                call, end = self._named(text, at)
                if call is None:
                    return calls, pos
                calls.append(call)
            pos = _skip(text, end, "")
        return calls, pos

    def _array(self, text: str, pos: int, bare: bool = False) -> tuple[list[ParsedCall], int, bool]:
        """The calls of a JSON array from `pos` (after its `[`), or (`bare`) of one object
        at `pos`; where reading stopped, and whether the array (the object) closed."""
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        while True:
            pos = _skip(text, pos, ",")
            if text.startswith("]", pos) or (bare and calls):
                return calls, pos + (not bare), True
            try:
                value, end = decoder.raw_decode(text, pos)
            except JSON_ERRORS:
                return calls, pos, False
            call = _call_of(value, self.names)
            if call is None:
                return calls, pos, False
            calls.append(call)
            pos = end

    def _named(self, text: str, pos: int) -> tuple[ParsedCall | None, int]:
        """A `name[ARGS]{arguments}` call at `pos`, and where it ends."""
        name_end = text.find(self.ARGS, pos)
        if name_end < 0:
            return None, pos
        at = _skip(text, name_end + len(self.ARGS), "")
        try:
            arguments, end = json.JSONDecoder().raw_decode(text, at)
        except JSON_ERRORS:
            return None, pos
        name = text[pos:name_end].strip()
        return _call_of({"name": name, "arguments": arguments}, self.names), end


def _skip(text: str, pos: int, separators: str) -> int:
    """`pos` past whitespace and `separators`."""
    while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
        pos += 1
    return pos


# -- responses ------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_dict(call: ParsedCall, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def message(parser: ToolParser, text: str) -> dict[str, Any]:
    """The assistant message of a finished output."""
    parsed = parser.parse(text, final=True)
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}
    calls = [call_dict(c, new_call_id()) for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's `tool_calls` when the output ended on its own with calls in it."""
    return "tool_calls" if has_calls and reason == "stop" else reason


class ToolStream:
    """What a stream has sent of one choice: the content's length, and per call its id and
    how much of its arguments; `feed` returns the delta fields of the next chunk."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []
        self.arguments_sent: list[int] = []

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, new_text: str, final: bool) -> dict[str, Any]:
        self.text += new_text
        parsed = self.parser.parse(self.text, final)
        delta: dict[str, Any] = {}
        content = parsed.content[self.content_sent :]
        if content:
            delta["content"] = content
            self.content_sent = len(parsed.content)
        calls = [d for i, c in enumerate(parsed.calls) if (d := self._call_delta(i, c))]
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _call_delta(self, index: int, call: ParsedCall) -> dict[str, Any] | None:
        if index == len(self.ids):  # a new call: its header, with what arguments there are
            self.ids.append(new_call_id())
            self.arguments_sent.append(len(call.arguments))
            return {"index": index, **call_dict(call, self.ids[index])}
        more = call.arguments[self.arguments_sent[index] :]
        if not more:
            return None
        self.arguments_sent[index] = len(call.arguments)
        return {"index": index, "function": {"arguments": more}}
