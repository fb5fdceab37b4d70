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

DISCONNECT_POLL_S = 0.25
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
    tokenizer = manager.tokenizer

    # -- errors and auth ------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code)

    @app.middleware("http")
    async def check_ready(request: Request, call_next):
        if not manager.ready and request.url.path not in ("/health", "/metrics"):
            e = EngineUnavailable("the server is starting: the model is still loading")
            return JSONResponse(e.body(), status_code=503)
        return await call_next(request)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path not in UNAUTHENTICATED:
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), api_key.encode()
            ):
                e = APIError(401, "invalid or missing API key", code="invalid_api_key")
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    # -- health and information -----------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if manager.dead is not None or manager.draining or not manager.ready:
            reason = manager.dead or ("shutting down" if manager.draining else "starting")
            return JSONResponse(APIError(503, reason).body(), status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        ids = tokenizer.encode("ping") or [0]
        reqs = expand_request(tokenizer.encode, None, {"max_new_tokens": 1}, ids).reqs
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
        tokens = [tokenizer.encode(p, add_special_tokens=body.add_special_tokens) for p in prompts]
        out = tokens[0] if isinstance(body.prompt, str) else tokens
        return {"tokens": out, "count": sum(map(len, tokens)), "max_model_len": manager.context_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse(request, DetokenizeRequest)
        bad = [t for t in body.tokens if not 0 <= t < manager.model_info["vocab_size"]]
        if bad:
            raise bad_request(f"tokens outside the vocabulary: {bad[:8]}", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return {
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "chat_template": tokenizer.chat_template,
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
                text = tokenizer.decode(req.input_ids) + text
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
        return JSONResponse(
            {
                "id": oai.new_id("cmpl"),
                "object": "text_completion",
                "created": oai.now(),
                "model": body.model or model_name,
                "choices": choices,
                "usage": oai.usage(results, body.n),
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, oai.ChatCompletionRequest)
        reqs = oai.chat_reqs(body, tokenizer, manager.context_len)
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
        return JSONResponse(
            {
                "id": oai.new_id("chatcmpl"),
                "object": "chat.completion",
                "created": oai.now(),
                "model": body.model or model_name,
                "choices": choices,
                "usage": oai.usage(results, body.n),
            }
        )

    # -- streams --------------------------------------------------------------------------
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    async def native_stream(call: Call, batch: bool) -> AsyncIterator[dict[str, Any]]:
        async for index, out in call.stream():
            chunk = out.result
            if batch:
                chunk = {**chunk, "index": index}
            yield chunk

    async def completion_stream(
        call: Call, body: oai.CompletionRequest
    ) -> AsyncIterator[dict[str, Any]]:
        cid, created = oai.new_id("cmpl"), oai.now()
        model = body.model or model_name
        sent_text = [0] * len(call.reqs)
        sent_lp = [0] * len(call.reqs)
        finals: list[dict[str, Any]] = [{}] * len(call.reqs)
        async for index, out in call.stream():
            result = out.result
            text = result["text"][sent_text[index] :]
            if body.echo and sent_text[index] == 0 and sent_lp[index] == 0:
                text = tokenizer.decode(call.reqs[index].input_ids) + text
            logprobs = None
            if body.logprobs is not None:
                meta = result["meta_info"]
                logprobs = oai.completion_logprobs(
                    meta, decode, body.echo and sent_lp[index] == 0, sent_lp[index]
                )
                sent_lp[index] = len(meta["output_token_logprobs"])
            sent_text[index] = len(result["text"])
            fields = oai.finish_fields(result["meta_info"])
            if not text and fields["finish_reason"] is None:
                continue
            if out.finished:
                finals[index] = result
            choice = {"index": index, "text": text, "logprobs": logprobs, **fields}
            yield {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
            }
        if body.include_usage:
            yield {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": oai.usage(finals, body.n),
            }

    async def chat_stream(
        call: Call, body: oai.ChatCompletionRequest
    ) -> AsyncIterator[dict[str, Any]]:
        cid, created = oai.new_id("chatcmpl"), oai.now()
        model = body.model or model_name

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }

        sent_role = False
        sent_text = [0] * len(call.reqs)
        sent_lp = [0] * len(call.reqs)
        finals: list[dict[str, Any]] = [{}] * len(call.reqs)
        async for index, out in call.stream():
            if not sent_role:  # after the first output, so a refused request gets its status
                sent_role = True
                for i in range(len(call.reqs)):
                    role = {"role": "assistant", "content": ""}
                    yield chunk(
                        [{"index": i, "delta": role, "logprobs": None, "finish_reason": None}]
                    )
            result = out.result
            text = result["text"][sent_text[index] :]
            sent_text[index] = len(result["text"])
            logprobs = None
            if body.logprobs:
                logprobs = oai.chat_logprobs(result["meta_info"], decode, sent_lp[index])
                sent_lp[index] = len(result["meta_info"]["output_token_logprobs"])
            fields = oai.finish_fields(result["meta_info"])
            if not text and fields["finish_reason"] is None:
                continue
            if out.finished:
                finals[index] = result
            delta = {"content": text} if text else {}
            yield chunk([{"index": index, "delta": delta, "logprobs": logprobs, **fields}])
        if body.include_usage:
            yield chunk([], usage=oai.usage(finals, body.n))

    return app


STARTED = oai.now()


def check_token_ids(ids: list[int], manager: TokenizerManager) -> None:
    vocab = manager.model_info["vocab_size"]
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:8]}")


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
    call is closed when done, unless None is given (the caller keeps it open)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client disconnected")
    finally:
        if not task.done():
            task.cancel()
        if call is not None:
            call.close()


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
