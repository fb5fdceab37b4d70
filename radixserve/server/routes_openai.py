"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions and
/v1/embeddings.

Both generation routes run the same way (`_serve`): submit, then either one JSON response
or a stream of chunks built by one builder (`_chunks`). What differs between them, the
shape of a choice, is one small `_Shape` per endpoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixserve.core.req import Req
from radixserve.lora.registry import LoraRef
from radixserve.server import openai_api as oai
from radixserve.server import tool_calls
from radixserve.server.body import JSONBodyRoute, off_the_loop_if_large, tier_served
from radixserve.server.checks import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    check_sequences,
    constraint_error,
)
from radixserve.server.embeddings import EmbeddingRequest, embedding_reqs, embedding_response
from radixserve.server.errors import ERROR_RESPONSES, APIError
from radixserve.server.reasoning import (
    ReasoningPlan,
    ReasoningStream,
    reasoning_plan,
    think_first,
)
from radixserve.server.state import ServerState, State
from radixserve.server.streaming import sse, until_disconnect
from radixserve.server.tokenizer_manager import Call

router = APIRouter(route_class=JSONBodyRoute, responses=ERROR_RESPONSES)


# -- models ---------------------------------------------------------------------------------
def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "radixserve",
        "root": state.model.path,
        "max_model_len": state.model.max_seq_len,
    }


def _adapter_card(state: ServerState, ref: LoraRef) -> dict[str, Any]:
    """A LoRA adapter as vLLM lists one: its name for `model`, its folder, the base model."""
    return {**_model_card(state), "id": ref.name, "root": ref.path, "parent": state.model_name}


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    adapters = [_adapter_card(state, ref) for ref in state.loras.refs.values()]
    return {"object": "list", "data": [_model_card(state), *adapters]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: State) -> dict[str, Any]:
    if model_id == state.model_name:
        return _model_card(state)
    if model_id in state.loras.refs:
        return _adapter_card(state, state.loras.refs[model_id])
    message = f"The model {model_id!r} does not exist"
    raise APIError(404, message, param="model", code="model_not_found")


# -- generation -----------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(body: oai.CompletionRequest, request: Request, state: State) -> Response:
    lora_id = state.adapter_of(body.model, body.lora_path)  # 0: the base model
    reqs = await off_the_loop_if_large(
        request,
        lambda: oai.completion_reqs(
            body, state.manager.encode, lora_id, state.manager.sampling_defaults
        ),
    )
    check_sequences(reqs, state, COMPLETION_FIELDS)
    token_bytes = await token_bytes_of(request, state) if body.logprobs is not None else None
    shape = _Completion(body, state.manager.tokenizer.decode, token_bytes)
    return await _serve(request, state, body, reqs, shape, body.constraint_field(reqs))


@router.post("/v1/chat/completions")
async def chat_completions(
    body: oai.ChatCompletionRequest, request: Request, state: State
) -> Response:
    tokenizer = state.manager.tokenizer
    parser_flag = state.config.server.tool_call_parser
    plan = await off_the_loop_if_large(  # compiles each tool's parameters to check them
        request, lambda: body.tool_plan(parser_flag, oai.template_source(tokenizer))
    )
    lora_id = state.adapter_of(body.model, body.lora_path)
    context = state.model.max_seq_len
    chat = await off_the_loop_if_large(
        request,
        lambda: oai.chat_call(
            body,
            tokenizer,
            context,
            plan,
            lora_id=lora_id,
            defaults=state.manager.sampling_defaults,
        ),  # fmt: skip
    )
    check_sequences(chat.reqs, state, CHAT_FIELDS)
    thinking = chat_reasoning(body, chat, state)
    token_bytes = await token_bytes_of(request, state) if body.logprobs else None
    shape = _Chat(token_bytes, plan, thinking)
    field = body.constraint_field(chat.reqs)
    return await _serve(request, state, body, chat.reqs, shape, field)


def chat_reasoning(
    body: oai.ChatCompletionRequest, chat: oai.ChatCall, state: ServerState
) -> ReasoningPlan | None:
    """How the output's reasoning is split out (None: it is not), with the constraint of
    each request moved after its reasoning where the request asks for that."""
    parser = state.config.server.reasoning_parser
    # by default with a parser that splits the reasoning out (else the whole text would reach
    # the tool parsers, reasoning and all)
    default = parser is not None and body.separate_reasoning
    if body.require_reasoning or (body.require_reasoning is None and default):
        think_first(chat.reqs, parser, state.manager.tokenizer.decode)
    return reasoning_plan(
        parser,
        body.separate_reasoning,
        body.stream_reasoning,
        chat.prompt,
        end_tag_only=any(r.think is not None for r in chat.reqs),
    )


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, state: State) -> Response:
    reqs = await off_the_loop_if_large(request, lambda: embedding_reqs(body, state))
    call = state.manager.submit(reqs, service_tier=body.service_tier)
    results = await until_disconnect(request, call, call.results())
    model = body.model or state.model_name
    return JSONResponse(embedding_response(results, body.encoding_format, model))


async def token_bytes_of(request: Request, state: ServerState) -> oai.TokenBytes:
    """The tokens' raw bytes for logprobs, built once per server process on first use, on a
    worker thread (it takes about 0.4 s); shielded, so a client that leaves while it is
    built does not cancel it for the others."""
    app = request.app.state
    if getattr(app, "token_bytes", None) is None:
        build = asyncio.to_thread(oai.TokenBytes, state.manager.tokenizer)
        app.token_bytes = asyncio.ensure_future(build)
    return await asyncio.shield(app.token_bytes)


async def _serve(
    request: Request,
    state: ServerState,
    body: Any,
    reqs: list[Req],
    shape: _Shape,
    constraint_field: str | None,  # the field a refused grammar came from
) -> Response:
    call = state.manager.submit(
        reqs, stream=body.stream, rid=body.rid, service_tier=body.service_tier
    )
    head = {"id": oai.new_id(shape.id_prefix), "object": shape.object, "created": oai.now()}
    head["model"] = body.model or state.model_name
    if body.service_tier is not None:  # the tier it ran in, as OpenAI's answers say
        head["service_tier"] = tier_served(body.service_tier)
    if body.stream:
        head["object"] = shape.chunk_object
        chunks = _chunks(call, body, shape, head, constraint_field)
        return await sse(request, chunks, call)
    try:
        results = await until_disconnect(request, call, call.results())
    except APIError as e:
        raise constraint_error(e, constraint_field) from None
    choices = [
        {"index": i, **oai.finish_fields(result["meta_info"]), **shape.choice(req, result)}
        for i, (req, result) in enumerate(zip(reqs, results))
    ]
    return JSONResponse({**head, "choices": choices, "usage": oai.usage(results, body.n)})


async def _chunks(
    call: Call, body: Any, shape: _Shape, head: dict[str, Any], constraint_field: str | None
) -> AsyncIterator[dict[str, Any]]:
    """The stream of either endpoint: per sequence only what is new, exactly one chunk
    with a finish_reason per index, then the usage chunk when asked."""
    sent = _Sent(len(call.reqs))
    finals: list[dict[str, Any]] = [{}] * len(call.reqs)
    opened = False
    async for index, out in _constraint_named(call.stream(), constraint_field):
        if not opened:  # after the first output, so a refused call gets its status
            opened = True
            for choice in shape.opening(len(call.reqs)):
                yield {**head, "choices": [choice]}
        delta = sent.advance(index, out.result, shape.wants_logprobs, shape.echo)
        if delta is None:
            continue
        meta = out.result["meta_info"]
        if out.finished:
            finals[index] = out.result
        choice = shape.chunk_choice(index, call.reqs[index], delta, meta)
        if choice is None:
            continue
        chunk = {**head, "choices": [{"index": index, **oai.finish_fields(meta), **choice}]}
        if body.continuous_usage:
            chunk["usage"] = oai.usage([out.result], 1)
        yield chunk
    if body.include_usage:
        yield {**head, "choices": [], "usage": oai.usage(finals, body.n)}


async def _constraint_named(outputs: AsyncIterator[Any], field: str | None) -> AsyncIterator[Any]:
    try:
        async for output in outputs:
            yield output
    except APIError as e:
        raise constraint_error(e, field) from None


# -- what differs between the two endpoints -------------------------------------------------
@dataclass
class _Delta:
    text: str  # new text since the last chunk of this sequence
    logprob_start: int  # its first output-logprob entry not sent yet
    first: bool  # the sequence's first chunk


class _Shape(Protocol):
    id_prefix: str
    object: str  # of the whole response
    chunk_object: str  # of a stream chunk
    wants_logprobs: bool
    echo: bool

    def choice(self, req: Req, result: dict[str, Any]) -> dict[str, Any]:
        """A response choice's own fields (index and finish fields are added; a
        finish_reason here overrides the engine's)."""

    def opening(self, n: int) -> list[dict[str, Any]]:
        """Choices streamed once, before any output."""

    def chunk_choice(
        self, index: int, req: Req, delta: _Delta, meta: dict[str, Any]
    ) -> dict[str, Any] | None:
        """A stream chunk choice's own fields for this news; None: nothing to send yet."""


class _Completion:
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(
        self,
        body: oai.CompletionRequest,
        decode: Callable[[list[int]], str],
        token_bytes: oai.TokenBytes | None,  # given when logprobs are asked for
    ):
        self.decode = decode
        self.token_bytes = token_bytes
        self.wants_logprobs = token_bytes is not None
        self.echo = body.echo
        self.offsets: dict[int, oai.TextOffsets] = {}  # a stream's, per sequence

    def choice(self, req: Req, result: dict[str, Any]) -> dict[str, Any]:
        meta = result["meta_info"]
        return self._fields(req, result["text"], meta, self.echo, 0, oai.TextOffsets())

    def opening(self, n: int) -> list[dict[str, Any]]:
        return []

    def chunk_choice(
        self, index: int, req: Req, delta: _Delta, meta: dict[str, Any]
    ) -> dict[str, Any] | None:
        echo = self.echo and delta.first
        offsets = self.offsets.setdefault(index, oai.TextOffsets())
        return self._fields(req, delta.text, meta, echo, delta.logprob_start, offsets)

    def _fields(
        self,
        req: Req,
        text: str,
        meta: dict[str, Any],
        echo: bool,
        start: int,
        offsets: oai.TextOffsets,
    ) -> dict[str, Any]:
        if echo:
            text = self.decode(req.input_ids) + text
        logprobs = None
        if self.token_bytes is not None:
            logprobs = oai.completion_logprobs(meta, self.token_bytes, echo, offsets, start)
        return {"text": text, "logprobs": logprobs}


class _Chat:
    """A chat choice; with a reasoning plan, its text is first split into reasoning and
    content; with tools, the content goes through the plan's parser (whole, or a stream per
    sequence when streaming)."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"
    echo = False

    def __init__(
        self,
        token_bytes: oai.TokenBytes | None,  # given when logprobs are asked for
        plan: tool_calls.ToolPlan,
        thinking: ReasoningPlan | None,
    ):
        self.token_bytes = token_bytes
        self.wants_logprobs = token_bytes is not None
        self.plan = plan
        self.thinking = thinking
        self.streams: dict[int, tool_calls.ToolStream] = {}
        self.thoughts: dict[int, ReasoningStream] = {}

    def choice(self, req: Req, result: dict[str, Any]) -> dict[str, Any]:
        meta = result["meta_info"]
        fields: dict[str, Any] = {"logprobs": self._logprobs(meta, 0)}
        text, reasoning = result["text"], {}
        if self.thinking is not None:
            part = self.thinking.split(text)
            text, reasoning = part.content, {"reasoning_content": part.reasoning}
        if not self.plan.active:
            return {"message": {"role": "assistant", "content": text, **reasoning}, **fields}
        message = tool_calls.message(self.plan.parser(), text)
        reason = oai.finish_fields(meta)["finish_reason"]
        reason = tool_calls.finish_reason(reason, "tool_calls" in message)
        return {"message": {**message, **reasoning}, **fields, "finish_reason": reason}

    def opening(self, n: int) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [
            {"index": i, "delta": role, "logprobs": None, "finish_reason": None} for i in range(n)
        ]

    def chunk_choice(
        self, index: int, req: Req, delta: _Delta, meta: dict[str, Any]
    ) -> dict[str, Any] | None:
        logprobs = self._logprobs(meta, delta.logprob_start)
        reason = oai.finish_fields(meta)["finish_reason"]
        text, news = delta.text, {}
        if self.thinking is not None:
            thought = self.thoughts.setdefault(index, self.thinking.stream())
            reasoning, text = thought.feed(text, final=reason is not None)
            if reasoning:
                news["reasoning_content"] = reasoning
        if not self.plan.active:
            news |= {"content": text} if text else {}
        else:
            stream = self.streams.setdefault(index, tool_calls.ToolStream(self.plan.parser()))
            news |= stream.feed(text, final=reason is not None)
            reason = tool_calls.finish_reason(reason, stream.has_calls)
        if not news and reason is None and logprobs is None:
            return None  # a parser holds the text back for now
        return {"delta": news, "logprobs": logprobs, "finish_reason": reason}

    def _logprobs(self, meta: dict[str, Any], start: int) -> dict[str, Any] | None:
        if self.token_bytes is None:
            return None
        return oai.chat_logprobs(meta, self.token_bytes, start)


class _Sent:
    """What an OpenAI stream has sent of each sequence, so each chunk carries only news: new
    text (the growth of the cumulative text, so held-back stop prefixes never leak) and new
    logprob entries (sent even when their text is still held back)."""

    def __init__(self, n: int) -> None:
        self.text = [0] * n
        self.logprobs = [0] * n
        self.started = [False] * n

    def advance(
        self, index: int, result: dict[str, Any], logprobs: bool, echo: bool
    ) -> _Delta | None:
        meta = result["meta_info"]
        text = result["text"][self.text[index] :]
        start = self.logprobs[index]
        end = len(meta.get("output_token_logprobs", ())) if logprobs else start
        first = not self.started[index]
        if not (text or end > start or meta["finish_reason"] is not None or (echo and first)):
            return None
        self.text[index] = len(result["text"])
        self.logprobs[index] = end
        self.started[index] = True
        return _Delta(text, start, first)
