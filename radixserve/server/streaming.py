"""Waiting on a call while watching the client: a disconnect aborts the call (its KV is
freed), and a stream goes out as server-sent events: chunks ending with `data: [DONE]`
(completions, chat), or typed events each named by an `event:` line (the Responses API)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from radixserve.server.errors import APIError
from radixserve.server.tokenizer_manager import Call

logger = logging.getLogger(__name__)


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


async def sse(
    request: Request, chunks: AsyncIterator[dict[str, Any]], call: Call, typed: bool = False
) -> Response:
    """Server-sent events. The first chunk is awaited before the response starts, so a
    request refused by the scheduler (full queue, too long) still gets its 4xx/503 status.
    `typed`: each chunk is an event with a `type`, sent as OpenAI sends the Responses API's:
    named by an `event:` line, and no `[DONE]` after the last."""
    try:
        first = await until_disconnect(request, None, anext(chunks))
    except BaseException:
        call.close()
        raise

    async def events() -> AsyncIterator[bytes]:
        try:
            yield event_frame(first, typed)
            async for chunk in chunks:
                yield event_frame(chunk, typed)
        except APIError as e:
            yield event_frame(e.body())
        except Exception as e:  # a bug met by this stream: it ends with an error event
            logger.exception("a stream failed")
            yield event_frame(APIError(500, f"internal error in the stream: {e!r}").body())
        finally:
            call.close()  # a disconnect cancels this generator: abort what still runs
        if not typed:
            yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def replay(frames: AsyncIterator[bytes]) -> Response:
    """Server-sent events already framed (a background response's, read again): a client
    that goes away stops only its own reading."""
    return StreamingResponse(frames, media_type="text/event-stream")


def event_frame(chunk: dict[str, Any], typed: bool = False) -> bytes:
    """One chunk as a server-sent event (`typed`: named by an `event:` line)."""
    data = b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
    return f"event: {chunk['type']}\n".encode() + data if typed else data
