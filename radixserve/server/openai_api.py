"""The OpenAI-compatible API: request models (validated by pydantic, unknown fields refused
as OpenAI does), their translation into native sequences, and the response and stream-chunk
shapes of /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import codecs
import json
import time
import typing
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import llguidance.hf
from jinja2 import TemplateError
from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from radixserve.core.req import Req
from radixserve.core.sampling_params import MAX_N
from radixserve.native import expand_request
from radixserve.server.body import ServiceTier, StrictBody
from radixserve.server.checks import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_SEQUENCES_PER_REQUEST,
    Fields,
    call_error,
)
from radixserve.server.errors import bad_request
from radixserve.server.tool_calls import (
    AssistantToolCall,
    Tool,
    ToolChoice,
    ToolFieldError,
    ToolPlan,
    closed_objects,
    parser_family,
    template_messages,
    tool_mode,
)


class StreamOptions(StrictBody):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(StrictBody):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class StructureFormat(StrictBody):
    model_config = ConfigDict(extra="forbid")
    begin: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    end: str


class ResponseFormat(StrictBody):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # type structural_tag (SGLang's): free text whose tagged parts follow schemas, or
    # xgrammar's format tree (vLLM's and newer SGLang's form; core/structural_tag.py)
    structures: list[StructureFormat] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is json_schema")
        tagged = self.type == "structural_tag"
        if tagged and self.json_schema is not None:
            raise ValueError("json_schema goes with type json_schema, not structural_tag")
        listed = self.structures is not None or self.triggers is not None
        if not tagged and (listed or self.format is not None):
            raise ValueError("structures, triggers and format go with type structural_tag")
        if tagged and (self.format is not None) == listed:
            raise ValueError("type structural_tag needs format, or structures and triggers")
        if tagged and listed and (self.structures is None or self.triggers is None):
            raise ValueError("type structural_tag needs structures and triggers")
        return self

    def constraint(self) -> dict[str, str]:
        """The sampling parameter that constrains the output: a JSON schema (any JSON object
        for json_object) or a structural tag; none for text."""
        if self.type == "json_object":
            return {"json_schema": json.dumps({"type": "object"})}
        if self.type == "json_schema":
            assert self.json_schema is not None
            schema = self.json_schema.schema_ or {}
            if self.json_schema.strict:  # OpenAI's strict mode: no undeclared keys
                schema = closed_objects(schema)
            return {"json_schema": json.dumps(schema)}
        if self.type == "structural_tag":
            given = {"format"} if self.format is not None else {"structures", "triggers"}
            tag = self.model_dump(include={"type", *given}, by_alias=True)
            return {"structural_tag": json.dumps(tag)}
        return {}


def _accepts_none(annotation: Any) -> bool:
    return annotation is None or type(None) in typing.get_args(annotation)


class _SamplingFields(StrictBody):
    """Fields both endpoints share: OpenAI's, then the extras SGLang accepts."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """`null` for a field that has a default but no None (n, stream, echo, logprobs...)
        means that default, as OpenAI's API and the official clients read it."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or cls._nullable(k)}

    @classmethod
    def _nullable(cls, key: str) -> bool:
        field = cls.model_fields.get(key) or next(
            (f for f in cls.model_fields.values() if f.alias == key), None
        )
        return field is None or field.is_required() or _accepts_none(field.annotation)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | dict | None = None
    ebnf: str | None = None
    rid: str | None = None
    priority: int | None = None
    # OpenAI's: "flex" runs after the other tiers' requests (core/req.py); the rest alike
    service_tier: ServiceTier | None = None
    lora_path: str | None = None  # a loaded LoRA adapter's name (SGLang's; or `model`)
    # SGLang's extras that sglang-router forwards at their defaults on every request
    return_hidden_states: Literal[False] = False  # hidden states: not served by these routes

    @field_validator("stream_options")
    @classmethod
    def _only_with_stream(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        """Options of a stream, refused without one as OpenAI's API (and vLLM) refuse them."""
        if options is not None and info.data.get("stream") is not True:
            raise ValueError("only allowed when stream is true")
        return options

    def sampling_params(
        self, max_new_tokens: int, defaults: Mapping[str, Any] = MappingProxyType({})
    ) -> dict[str, Any]:
        """The native sampling parameters; `defaults` (the model's recommended sampling,
        --sampling-defaults) for those of temperature, top_p, top_k, min_p and
        repetition_penalty the request leaves unset."""
        formatted = self.response_format.constraint() if self.response_format else {}
        if formatted and self.has_own_constraint:
            raise bad_request(
                "response_format cannot be combined with json_schema, regex or ebnf",
                param="response_format",
            )
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        return {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens,
            **{k: defaults.get(k) if v is None else v for k, v in given.items()},
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "stop_regex": self.stop_regex,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "logit_bias": self.logit_bias,
            "sampling_seed": self.seed,
            "n": self.n,
            "json_schema": self.json_schema,
            "regex": self.regex,
            "ebnf": self.ebnf,
            **formatted,
        }

    @property
    def has_own_constraint(self) -> bool:
        return bool(self.json_schema or self.regex or self.ebnf)

    @property
    def constrained(self) -> bool:
        """The request constrains its output itself (a response_format other than text, or
        SGLang's json_schema, regex or ebnf)."""
        return self.has_own_constraint or bool(
            self.response_format and self.response_format.constraint()
        )

    def constraint_field(self, reqs: list[Req]) -> str | None:
        """The field the output's constraint came from, as the client named it, for the
        errors of a grammar the engine refuses (which it names by its own kind): None when
        it is SGLang's json_schema, regex or ebnf, named so already; `tools` where the
        request's sequences (`reqs`) are constrained otherwise (tool_choice required or
        named, strict tools under auto)."""
        if self.has_own_constraint:
            return None
        if self.constrained:  # by its response_format
            return "response_format"
        params = reqs[0].params if reqs else None
        constrained = params is not None and (params.json_schema or params.structural_tag)
        return "tools" if constrained else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk too (vLLM's stream_options.continuous_usage_stats, which it
        also reads only with include_usage): that sequence's counts so far."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _one_sample_per_choice(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of not in (None, 1) and best_of != info.data.get("n", 1):
            raise ValueError(f"only 1 or n (one sample per choice) is supported, got {best_of}")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("not supported (a completion only follows its prompt)")
        return suffix


class ChatMessage(StrictBody):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message of role tool needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message can have tool_calls")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if isinstance(getattr(self, "name", None), str):
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "\n".join(parts)  # as vLLM joins them (SGLang with a space): parts stay apart


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True  # vLLM's; continuing the final message leaves it out
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    # SGLang's reasoning fields: with --reasoning-parser, split the reasoning out of the
    # content (else it stays in the content); stream it as it comes, or in one piece
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # a constraint (response_format, tool_choice, regex...) applies after the reasoning;
    # None: so whenever the server has a reasoning parser and separate_reasoning is on
    # (false: to the whole output)
    require_reasoning: bool | None = None

    @field_validator("tools")
    @classmethod
    def _not_empty(cls, tools: list[Tool] | None) -> list[Tool] | None:
        """An empty array is refused, as OpenAI's API refuses it (leave tools out instead)."""
        if tools == []:
            raise ValueError("an empty array: give at least one tool, or leave tools out")
        return tools

    def tool_plan(self, parser_flag: str | None, chat_template: str | None) -> ToolPlan:
        """What the tools fields ask for, or a 400 naming the field that is inconsistent."""
        try:
            family = parser_family(chat_template, parser_flag)
            mode = tool_mode(self.tools, self.tool_choice, family)
        except ToolFieldError as e:
            raise bad_request(str(e), param=e.param) from None
        if mode in ("required", "named") and self.constrained:
            raise bad_request(
                f"tool_choice {'required' if mode == 'required' else 'naming a function'} "
                "constrains the output to the tools' arguments; it cannot be combined with "
                "response_format, json_schema, regex or ebnf",
                param="tool_choice",
            )
        named = self.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        return ToolPlan(
            mode,
            tuple(self.tools or ()),
            named,
            parallel=self.parallel_tool_calls is not False,
            family=family,
        )


# -- requests → native sequences ------------------------------------------------------------
def completion_reqs(
    body: CompletionRequest,
    encode: Callable[[str], list[int]],
    lora_id: int = 0,
    defaults: Mapping[str, Any] = MappingProxyType({}),
) -> list[Req]:
    prompt = body.prompt
    if prompt == [] or prompt == "":
        raise bad_request("prompt is empty", param="prompt")
    texts = prompt if isinstance(prompt, str) or isinstance(prompt[0], str) else None
    ids = None if texts is not None else prompt
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    lp = body.logprobs
    try:
        return expand_request(
            encode,
            texts,
            body.sampling_params(max_tokens, defaults),
            ids,
            return_logprob=lp is not None,
            logprob_start_len=0 if (body.echo and lp is not None) else -1,
            top_logprobs_num=lp or 0,
            rid=body.rid,
            priority=body.priority,
            max_sequences=MAX_SEQUENCES_PER_REQUEST,
            lora_ids=lora_id,
        ).reqs
    except ValueError as e:
        raise call_error(e, COMPLETION_FIELDS) from None


def chat_prompt(
    body: ChatCompletionRequest, tokenizer: Any, plan: ToolPlan, fields: Fields = CHAT_FIELDS
) -> str:
    try:
        messages = [m.template_dict() for m in body.messages]
    except ValueError as e:
        raise bad_request(str(e), param=fields.prompt) from None
    if tokenizer.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions")
    source = template_source(tokenizer)
    if "developer" not in (source or ""):  # OpenAI's newer name of the system role
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    messages, tools = template_messages(messages, plan, source)
    last_is_assistant = messages[-1]["role"] == "assistant" and body.continue_final_message
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt and not last_is_assistant,
            continue_final_message=last_is_assistant,
            **_template_kwargs(body.chat_template_kwargs),
        )
    except (TemplateError, ValueError) as e:  # e.g. roles out of the template's order
        message = f"the chat template refused the {fields.prompt}: {e}"
        raise bad_request(message, fields.prompt) from None
    except Exception as e:  # the template's own fault on these messages (a TypeError of
        # `content + 1`...): this request fails, as its messages are what it cannot render
        message = f"the chat template failed on the {fields.prompt}: {type(e).__name__}: {e}"
        raise bad_request(message, fields.prompt) from None
    return text


# apply_chat_template's own parameters (transformers 5.24), and what templates are given
RESERVED_TEMPLATE_ARGS = frozenset(
    {
        *("conversation", "messages", "tools", "documents", "chat_template"),
        *("add_generation_prompt", "continue_final_message", "tokenize"),
        *("sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors"),
        *("return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"),
    }
)


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs (e.g. Qwen3's enable_thinking), minus what the route sets."""
    taken = sorted(RESERVED_TEMPLATE_ARGS & set(kwargs or ()))
    if taken:
        raise bad_request(
            f"chat_template_kwargs cannot set {', '.join(taken)}", param="chat_template_kwargs"
        )
    return kwargs or {}


def template_source(tokenizer: Any) -> str | None:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: transformers uses "default"
        template = template.get("default")
    return template if isinstance(template, str) else None


@dataclass(frozen=True)
class ChatCall:
    prompt: str  # the rendered chat template
    reqs: list[Req]


def chat_call(
    body: ChatCompletionRequest,
    tokenizer: Any,
    max_context: int,
    plan: ToolPlan,
    fields: Fields = CHAT_FIELDS,
    lora_id: int = 0,
    defaults: Mapping[str, Any] = MappingProxyType({}),
) -> ChatCall:
    """The sequences of a chat request (run with LoRA adapter `lora_id`, 0: none);
    `fields`: how the API that took it names its fields in errors (/v1/responses builds a
    chat request from its own); `defaults`: the sampling the model recommends."""
    if body.top_logprobs and not body.logprobs:  # as OpenAI: refused, not ignored
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    prompt = chat_prompt(body, tokenizer, plan, fields)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    if max_tokens is None:  # OpenAI's default: whatever the context leaves
        max_tokens = max(max_context - len(ids), 0)
    try:
        reqs = expand_request(
            tokenizer.encode,
            None,
            {**body.sampling_params(max_tokens, defaults), **_tool_constraint(plan, body)},
            ids,
            return_logprob=body.logprobs,
            top_logprobs_num=body.top_logprobs or 0,
            rid=body.rid,
            priority=body.priority,
            max_sequences=MAX_SEQUENCES_PER_REQUEST,
            lora_ids=lora_id,
        ).reqs
    except ValueError as e:
        raise call_error(e, fields) from None
    return ChatCall(prompt, reqs)


def _tool_constraint(plan: ToolPlan, body: ChatCompletionRequest) -> dict[str, Any]:
    """What the tools constrain the output to. Under `auto`, a constraint of the request's
    own (response_format...) comes first: its strict tools' arguments go unchecked. Under
    `auto` with Mistral's parser, the text keeps the special [TOOL_CALLS] token it reads
    (unless the request says otherwise)."""
    keep: dict[str, Any] = {}
    if plan.mode == "auto" and plan.family == "mistral" and body.skip_special_tokens is None:
        keep = {"skip_special_tokens": False}
    if plan.mode == "auto" and body.constrained:
        return keep
    return {**plan.constraint(), **keep}


# -- responses ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """finish_reason and SGLang's matched_stop; an abort also says why in `abort_message`
    (an extra field: OpenAI's finish reasons carry no message)."""
    reason = meta["finish_reason"]
    if reason is None:
        return {"finish_reason": None, "matched_stop": None}
    fields = {"finish_reason": reason["type"], "matched_stop": reason.get("matched")}
    if reason["type"] == "abort":
        fields["abort_message"] = reason.get("message")
    return fields


def usage(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Prompt and cached tokens counted once per prompt (not n times)."""
    metas = [r["meta_info"] for r in results]
    prompt = sum(m["prompt_tokens"] for m in metas[::n])
    completion = sum(m["completion_tokens"] for m in metas)
    details: dict[str, Any] = {"cached_tokens": sum(m["cached_tokens"] for m in metas[::n])}
    by_tier = [m["cached_tokens_details"] for m in metas[::n] if m.get("cached_tokens_details")]
    if by_tier:  # the hierarchical cache: where the cached tokens came from
        details["cached_tokens_details"] = {
            tier: sum(d[tier] for d in by_tier) for tier in by_tier[0]
        }
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }


class TokenBytes:
    """Each token's raw bytes, which OpenAI's logprobs report: a token may hold part of a
    multi-byte character, which the tokenizer decodes to U+FFFD. llguidance's wrapper of
    the tokenizer knows them (about 0.4 s to build for a 49k vocabulary; 0.3 us a token)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, slices=[])  # no mask slices

    def __call__(self, token_id: int) -> bytes:
        return self.tokenizer.decode_bytes([token_id])


def token_text(raw: bytes) -> str:
    """A token's text in logprobs: its bytes decoded, or where they are not UTF-8 on their
    own OpenAI's `bytes:\\xe3\\x81` (so tokens holding different parts of characters keep
    distinct top_logprobs keys)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """OpenAI's text_offset: where each token starts in the text, over one sequence's tokens
    as they come (a stream's chunks continue its count). A character split over tokens
    counts once complete, so every offset is an index into the decoded text."""

    def __init__(self) -> None:
        self.chars = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, token_bytes: list[bytes]) -> list[int]:
        offsets = []
        for raw in token_bytes:
            offsets.append(self.chars)
            self.chars += len(self.decoder.decode(raw))
        return offsets


def completion_logprobs(
    meta: dict[str, Any], token_bytes: TokenBytes, echo: bool, offsets: TextOffsets, start: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object (tokens, token_logprobs, top_logprobs, text_offset)
    for the output from token `start` on, led by the prompt's when echoing."""
    entries = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:] or [[]] * len(entries)
    if echo and start == 0:
        prompt = meta.get("input_token_logprobs", [])
        entries = prompt + entries
        tops = (meta.get("input_top_logprobs") or [[]] * len(prompt)) + tops
    raw = [token_bytes(tid) for _, tid, _ in entries]
    tokens = [token_text(b) for b in raw]
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _, _ in entries],
        # as OpenAI's: the chosen token's logprob and then its alternatives' (up to
        # logprobs + 1 entries); the first prompt token has no logprob and no alternatives
        "top_logprobs": [
            None if lp is None else {text: lp} | {token_text(token_bytes(x[1])): x[0] for x in t}
            for (lp, _, _), text, t in zip(entries, tokens, tops)
        ],
        "text_offset": offsets.take(raw),
    }


def chat_logprobs(meta: dict[str, Any], token_bytes: TokenBytes, start: int = 0) -> dict[str, Any]:
    entries = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:] or [[] for _ in entries]

    def token(tid: int, lp: float | None) -> dict[str, Any]:
        raw = token_bytes(tid)
        return {"token": token_text(raw), "logprob": lp, "bytes": list(raw)}

    return {
        "content": [
            {**token(tid, lp), "top_logprobs": [token(t[1], t[0]) for t in top]}
            for (lp, tid, _), top in zip(entries, tops)
        ]
    }


def now() -> int:
    return int(time.time())
