"""The HTTP app: the native routes (`routes_native`) and the OpenAI-compatible routes
(`routes_openai`, and `routes_responses` for the Responses API) as routers, behind one gate
(readiness and the API key).

Every error leaves as `{"error": {...}}` (OpenAI's shape): 400 for any invalid request
(never FastAPI's 422), 401 for a bad key, 404 for unknown routes and models, 503 when the
engine is down, draining or full, 500 naming the exception for a bug. A client that
disconnects aborts its request.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve import __version__
from radixserve.config import Config
from radixserve.lora.registry import LoraRegistry
from radixserve.server import (
    batches,
    conversations,
    files,
    routes_native,
    routes_openai,
    routes_responses,
)
from radixserve.server import openai_api as oai
from radixserve.server.body import validation_error
from radixserve.server.errors import APIError, EngineUnavailable
from radixserve.server.metrics import BatchCollector
from radixserve.server.responses_api import ResponseStore
from radixserve.server.state import ServerState
from radixserve.server.tokenizer_manager import TokenizerManager

UNAUTHENTICATED = frozenset({"/health"})  # answered without an API key
BEFORE_READY = frozenset({"/health", "/metrics"})  # answered while the model still loads
STARTED = oai.now()


def build_app(manager: TokenizerManager, config: Config, model_name: str) -> FastAPI:
    app = FastAPI(title="radixserve", version=__version__, docs_url=None, redoc_url=None)
    loras = LoraRegistry(config.lora, reserved=(model_name,))
    app.state.server = ServerState(manager, config, model_name, STARTED, loras)
    app.state.background = set()  # the tasks of /v1/responses made in the background
    app.state.files = files.FileStore(config.server.file_storage_path)
    kept = config.server.file_storage_path is not None  # batches, conversations and stored
    # responses kept with the files, if the folder is the user's (and the next server on it
    # serves them again)
    app.state.responses = ResponseStore(
        config.server.responses_store_size,
        folder=app.state.files.folder / "responses" if kept else None,
    )
    app.state.batches = batches.BatchStore(app.state.files.folder / "batches", kept)
    app.state.conversations = conversations.ConversationStore(
        config.server.responses_store_size,
        folder=app.state.files.folder / "conversations" if kept else None,
    )
    manager.metrics.registry.register(BatchCollector(app.state.batches))
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(Gate, manager=manager, api_key=config.server.resolved_api_key)
    app.include_router(routes_native.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_responses.router)
    app.include_router(conversations.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    return app


async def _api_error(_: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, APIError)
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, StarletteHTTPException)
    message = f"{request.method} {request.url.path}: {e.detail}"
    return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code)


async def _validation_error(_: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, RequestValidationError)
    error = validation_error(e)
    return JSONResponse(error.body(), status_code=error.status)


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    """A bug met by one request: a 500 in the same shape (Starlette logs the traceback)."""
    message = f"internal error in {request.method} {request.url.path}: {e!r}"
    return JSONResponse(APIError(500, message).body(), status_code=500)


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
        if not self.manager.ready and path not in BEFORE_READY:
            return EngineUnavailable("the server is starting: the model is still loading")
        return None
