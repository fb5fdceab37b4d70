"""The HTTP routes: the SGLang-native API, the OpenAI-compatible API, health and metrics.

Every error leaves as `{"error": {...}}` (OpenAI's shape): 400 for any invalid request
(never FastAPI's 422), 401 for a bad key, 404 for unknown routes and models, 503 when the
engine is down, draining or full. A client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve import __version__
from radixserve.config import Config
from radixserve.native import expand_request
from radixserve.server import openai_api as oai
from radixserve.server.errors import APIError, EngineUnavailable, bad_request
from radixserve.server.tokenizer_manager import Call, TokenizerManager

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
UNAUTHENTICATED = ("/health",)


class GenerateRequest(BaseModel):
    """The native /generate body (unknown top-level fields are ignored, as SGLang does)."""

    model_config = ConfigDict(extra="ignore")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    priority: int | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str | None = None
    abort_all: bool = False


def build_app(manager: TokenizerManager, config: Config, model_name: str) -> FastAPI:
    app = FastAPI(title="radixserve", version=__version__, docs_url=None, redoc_url=None)
    api_key = config.server.resolved_api_key

    # -- errors and auth ------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code)

    app.add_middleware(Gate, manager=manager, api_key=api_key)

    # -- health and information -----------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if manager.dead is not None or manager.draining or not manager.ready:
            reason = manager.dead or ("shutting down" if manager.draining else "starting")
            return JSONResponse(APIError(503, reason).body(), status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        ids = manager.tokenizer.encode("ping") or [0]
        reqs = expand_request(manager.tokenizer.encode, None, {"max_new_tokens": 1}, ids).reqs
        call = manager.submit(reqs)
        try:
            await asyncio.wait_for(call.results(), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            raise APIError(503, "a 1-token generation did not finish in time") from None
        finally:
            call.close()
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": manager.model_info["model_path"],
            "tokenizer_path": manager.model_info["model_path"],
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "served_model_name": model_name,
        }

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        state = await manager.control("get_state")
        return {
            **config.to_flat(),
            **manager.model_info,
            "served_model_name": model_name,
            "version": __version__,
            "internal_states": [state],
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await manager.control("flush_cache"):
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(
            "Cache not flushed: requests are still running; retry when the server is idle.\n",
            status_code=400,
        )

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await parse(request, AbortRequest)
        if not body.abort_all and body.rid is None:
            raise bad_request("give rid or abort_all: true", param="rid")
        manager.send_abort(None if body.abort_all else body.rid)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(manager.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- tokenizer ------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse(request, TokenizeRequest)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        tokens = [
            manager.tokenizer.encode(p, add_special_tokens=body.add_special_tokens) for p in prompts
        ]
        out = tokens[0] if isinstance(body.prompt, str) else tokens
        return {"tokens": out, "count": sum(map(len, tokens)), "max_model_len": manager.context_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse(request, DetokenizeRequest)
        check_token_ids(body.tokens, manager, "tokens")
        return {"prompt": manager.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return {
            "eos_token": manager.tokenizer.eos_token,
            "bos_token": manager.tokenizer.bos_token,
            "pad_token": manager.tokenizer.pad_token,
            "eos_token_id": manager.tokenizer.eos_token_id,
            "bos_token_id": manager.tokenizer.bos_token_id,
            "chat_template": manager.tokenizer.chat_template,
            "vocab_size": manager.model_info["vocab_size"],
        }

    # -- native generation ----------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await parse(request, GenerateRequest)
        if body.token_ids_logprob:
            raise bad_request("token_ids_logprob is not supported yet", "token_ids_logprob")
        try:
            expanded = expand_request(
                manager.encode,
                body.text,
                body.sampling_params,
                body.input_ids,
                body.return_logprob,
                body.logprob_start_len,
                body.top_logprobs_num,
                body.rid,
                body.priority,
            )
        except ValueError as e:
            raise bad_request(str(e)) from None
        for req in expanded.reqs:
            check_token_ids(req.input_ids, manager)
        call = manager.submit(expanded.reqs, body.return_text_in_logprobs, body.stream)
        if body.stream:
            return await sse(request, native_stream(call, batch=not expanded.single), call)
        results = await until_disconnect(request, call, call.results())
        return JSONResponse(results[0] if expanded.single else results)

    # -- OpenAI ---------------------------------------------------------------------------
    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": STARTED,
            "owned_by": "radixserve",
            "root": manager.model_info["model_path"],
            "max_model_len": manager.context_len,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(
                404, f"The model {model_id!r} does not exist", param="model", code="model_not_found"
            )
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request, oai.CompletionRequest)
        reqs = oai.completion_reqs(body, manager.encode)
        for req in reqs:
            check_token_ids(req.input_ids, manager)
        call = manager.submit(reqs, return_text_in_logprobs=False, stream=body.stream)
        if body.stream:
            return await sse(request, completion_stream(call, body), call)
        results = await until_disconnect(request, call, call.results())
        choices = []
        for index, (req, result) in enumerate(zip(reqs, results)):
            text = result["text"]
            if body.echo:
                text = manager.tokenizer.decode(req.input_ids) + text
            logprobs = None
            if body.logprobs is not None:
                logprobs = oai.completion_logprobs(result["meta_info"], decode, body.echo)
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    **oai.finish_fields(result["meta_info"]),
                }
            )
        return response("cmpl", "text_completion", body, choices, results)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, oai.ChatCompletionRequest)
        reqs = oai.chat_reqs(body, manager.tokenizer, manager.context_len)
        call = manager.submit(reqs, return_text_in_logprobs=False, stream=body.stream)
        if body.stream:
            return await sse(request, chat_stream(call, body), call)
        results = await until_disconnect(request, call, call.results())
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": result["text"]},
                "logprobs": oai.chat_logprobs(result["meta_info"], decode)
                if body.logprobs
                else None,
                **oai.finish_fields(result["meta_info"]),
            }
            for index, result in enumerate(results)
        ]
        return response("chatcmpl", "chat.completion", body, choices, results)

    def response(prefix: str, kind: str, body: Any, choices: list, results: list) -> Response:
        return JSONResponse(
            {
                "id": oai.new_id(prefix),
                "object": kind,
                "created": oai.now(),
                "model": body.model or model_name,
                "choices": choices,
                "usage": oai.usage(results, body.n),
            }
        )

    # -- streams --------------------------------------------------------------------------
    def decode(ids: list[int]) -> str:
        return manager.tokenizer.decode(ids)

    async def native_stream(call: Call, batch: bool) -> AsyncIterator[dict[str, Any]]:
        async for index, out in call.stream():
            chunk = out.result
            if batch:
                chunk = {**chunk, "index": index}
            yield chunk

    async def completion_stream(
        call: Call, body: oai.CompletionRequest
    ) -> AsyncIterator[dict[str, Any]]:
        head = {"id": oai.new_id("cmpl"), "object": "text_completion", "created": oai.now()}
        head["model"] = body.model or model_name
        sent = _Sent(len(call.reqs))
        finals: list[dict[str, Any]] = [{}] * len(call.reqs)
        async for index, out in call.stream():
            delta = sent.advance(index, out.result, body.logprobs is not None, body.echo)
            if delta is None:
                continue
            text, meta = delta.text, out.result["meta_info"]
            echo = body.echo and delta.first
            if echo:
                text = decode(call.reqs[index].input_ids) + text
            logprobs = None
            if body.logprobs is not None:
                logprobs = oai.completion_logprobs(meta, decode, echo, delta.logprob_start)
            if out.finished:
                finals[index] = out.result
            choice = {"index": index, "text": text, "logprobs": logprobs}
            yield {**head, "choices": [{**choice, **oai.finish_fields(meta)}]}
        if body.include_usage:
            yield {**head, "choices": [], "usage": oai.usage(finals, body.n)}

    async def chat_stream(
        call: Call, body: oai.ChatCompletionRequest
    ) -> AsyncIterator[dict[str, Any]]:
        head = {"id": oai.new_id("chatcmpl"), "object": "chat.completion.chunk"}
        head |= {"created": oai.now(), "model": body.model or model_name}
        sent = _Sent(len(call.reqs))
        finals: list[dict[str, Any]] = [{}] * len(call.reqs)
        roles_sent = False
        async for index, out in call.stream():
            if not roles_sent:  # after the first output, so a refused call gets its status
                roles_sent = True
                for i in range(len(call.reqs)):
                    role = {"role": "assistant", "content": ""}
                    choice = {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
                    yield {**head, "choices": [choice]}
            delta = sent.advance(index, out.result, body.logprobs, echo=False)
            if delta is None:
                continue
            meta = out.result["meta_info"]
            logprobs = None
            if body.logprobs:
                logprobs = oai.chat_logprobs(meta, decode, delta.logprob_start)
            if out.finished:
                finals[index] = out.result
            content = {"content": delta.text} if delta.text else {}
            choice = {"index": index, "delta": content, "logprobs": logprobs}
            yield {**head, "choices": [{**choice, **oai.finish_fields(meta)}]}
        if body.include_usage:
            yield {**head, "choices": [], "usage": oai.usage(finals, body.n)}

    return app


STARTED = oai.now()


@dataclass
class _Delta:
    text: str  # new text since the last chunk of this sequence
    logprob_start: int  # its first output-logprob entry not sent yet
    first: bool  # the sequence's first chunk


class _Sent:
    """What an OpenAI stream has sent of each sequence, so each chunk carries only news: new
    text (the growth of the cumulative text, so held-back stop prefixes never leak) and new
    logprob entries (sent even when their text is still held back)."""

    def __init__(self, n: int) -> None:
        self.text = [0] * n
        self.logprobs = [0] * n
        self.started = [False] * n

    def advance(self, index: int, result: dict[str, Any], logprobs: bool, echo: bool):
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


class Gate:
    """Readiness and API-key checks as plain ASGI middleware (Starlette's BaseHTTPMiddleware
    would hide client disconnects from the routes, so aborts on disconnect would not work)."""

    def __init__(self, app: Any, manager: TokenizerManager, api_key: str | None) -> None:
        self.app = app
        self.manager = manager
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            error = self.check(scope)
            if error is not None:
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope: dict) -> APIError | None:
        path = scope["path"]
        if self.api_key is not None and path not in UNAUTHENTICATED:
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                return APIError(401, "invalid or missing API key", code="invalid_api_key")
        if not self.manager.ready and path not in ("/health", "/metrics"):
            return EngineUnavailable("the server is starting: the model is still loading")
        return None


def check_token_ids(ids: list[int], manager: TokenizerManager, param: str | None = None) -> None:
    vocab = manager.model_info["vocab_size"]
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        name = param or "prompt token ids"
        raise bad_request(f"{name} outside the vocabulary [0, {vocab}): {bad[:8]}", param=param)


async def parse(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body validated against `model`; any problem is a 400 naming the field."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {field}"
        else:
            message = f"{field}: {first['msg']}" if field else first["msg"]
        raise bad_request(message, param=field) from None


async def until_disconnect(request: Request, call: Call | None, work: Awaitable[Any]) -> Any:
    """Await `work`; if the client goes away first, abort the call (its KV is freed). The
    call is closed when done, unless None is given (the caller keeps it open).

    The body has been read, so the next ASGI message can only be `http.disconnect`: waiting
    for it costs nothing, where polling `is_disconnected()` woke the loop per request."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "the client disconnected")
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        if call is not None:
            call.close()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def sse(request: Request, chunks: AsyncIterator[dict[str, Any]], call: Call) -> Response:
    """Server-sent events. The first chunk is awaited before the response starts, so a
    request refused by the scheduler (full queue, too long) still gets its 4xx/503 status."""
    try:
        first = await until_disconnect(request, None, anext(chunks))
    except BaseException:
        call.close()
        raise

    async def events() -> AsyncIterator[bytes]:
        try:
            yield _event(first)
            async for chunk in chunks:
                yield _event(chunk)
        except APIError as e:
            yield _event(e.body())
        finally:
            call.close()  # a disconnect cancels this generator: abort what still runs
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
