"""OpenAI's Responses API: POST /v1/responses (whole, streamed, in the background, or both:
a background response streamed, whose events are kept so that a client can read them again
from any point), and the stored responses' routes: GET /v1/responses/{id} (its events again
with ?stream=true&starting_after=N), its /input_items, POST .../cancel and DELETE. A request
becomes a chat request (`responses_api`) and runs as one; its output is built into items by
one `OutputBuilder`, whether streamed or not."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from radixserve.server import openai_api as oai
from radixserve.server import responses_api as rapi
from radixserve.server.body import JSONBodyRoute, off_the_loop_if_large
from radixserve.server.checks import (
    RESPONSES_FIELDS,
    check_sequences,
    constraint_error,
    renamed,
)
from radixserve.server.conversations import Conversation, ConversationStore
from radixserve.server.errors import ERROR_RESPONSES, APIError, bad_request
from radixserve.server.responses_api import OutputBuilder, ResponsesRequest, ResponseStore, Stored
from radixserve.server.routes_openai import chat_reasoning, token_bytes_of
from radixserve.server.state import ServerState, State
from radixserve.server.streaming import event_frame, replay, sse, until_disconnect
from radixserve.server.tokenizer_manager import Call

logger = logging.getLogger(__name__)
router = APIRouter(route_class=JSONBodyRoute, responses=ERROR_RESPONSES)


@dataclass
class _Run:
    """One response being made: its chat request's sequence and how its output is read."""

    response: dict[str, Any]  # the response object as created
    stored: Stored
    chat: oai.ChatCall
    builder: OutputBuilder
    tokenizer: Any
    constraint_field: str | None  # where a grammar the engine may refuse came from
    # the conversation it continues, and its store (its items are added there once it ends)
    conversation: Conversation | None = None
    conversations: ConversationStore | None = None
    lock: str | None = None  # its hold on the conversation while it runs

    def release(self) -> None:
        """Let the conversation take its next response (at once where it was not held)."""
        if self.conversation is not None and self.lock is not None:
            self.conversation.unlock(self.lock)

    def record(self) -> None:
        """A finished response's input and output items onto its conversation (not a
        failed or cancelled one's)."""
        status = self.stored.response["status"]
        if self.conversation is not None and status in ("completed", "incomplete"):
            assert self.conversations is not None
            items = self.stored.inputs + self.stored.response["output"]
            self.conversations.add(self.conversation, items)

    def named(self, e: APIError) -> APIError:
        """An error of the engine's about this request, in the Responses API's words."""
        return renamed(constraint_error(e, self.constraint_field), RESPONSES_FIELDS)

    def complete(self, result: dict[str, Any]) -> dict[str, Any]:
        """The finished response of a sequence not streamed, from its final result."""
        self.builder.feed(result["text"], result["meta_info"], final=True)
        self.builder.close(incomplete=_cut_short(result["meta_info"]))
        return self.finish(result)

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """The finished response, given the sequence's final result (its text all fed).
        Its reasoning tokens are counted by tokenizing the reasoning's text again."""
        meta = result["meta_info"]
        reasoning = "".join(
            p["text"] for i in self.builder.items if i["type"] == "reasoning" for p in i["content"]
        )
        tokens = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return rapi.finished(self.response, self.builder.items, meta, tokens)


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, state: State) -> Response:
    body.check()
    store = _store(request)
    if body.background and store.capacity == 0:
        raise bad_request(
            "background responses are stored, and this server stores none "
            "(--responses-store-size 0)",
            "background",
        )
    earlier = store.context(body.previous_response_id) if body.previous_response_id else []
    earlier_bytes = store.chain_bytes(body.previous_response_id)
    conversations: ConversationStore = request.app.state.conversations
    conversation, token = None, rapi.new_id("lock")
    if body.conversation_id is not None:
        conversation = conversations.get(body.conversation_id, param="conversation")
        earlier, earlier_bytes = list(conversation.items), conversations.sizes[conversation.id]
        conversation.lock(token)  # one response at a time adds to a conversation
    try:
        body.input = store.resolve(body.input, conversations.find_item)
        run = await off_the_loop_if_large(
            request, lambda: _prepare(body, earlier, state), extra_bytes=earlier_bytes
        )
        run.conversation, run.conversations, run.lock = conversation, conversations, token
        return await _respond(body, run, request, state, store)
    except BaseException:  # (a stream or a background task unlocks it once it ends)
        if conversation is not None:
            conversation.unlock(token)
        raise


async def _respond(
    body: ResponsesRequest, run: _Run, request: Request, state: ServerState, store: ResponseStore
) -> Response:
    """Submit the prepared response and answer: whole, streamed or in the background."""
    if body.wants_logprobs:
        run.builder.logprobs = rapi.output_logprobs(await token_bytes_of(request, state))
        # the special tokens the detokenizer leaves out of the text
        if all(req.params.skip_special_tokens for req in run.chat.reqs):  # (Mistral's
            # tool calls keep theirs)
            run.builder.skipped = frozenset(state.manager.tokenizer.all_special_ids)
    rid = run.response["id"]
    try:
        call = state.manager.submit(
            run.chat.reqs, stream=body.streams, rid=rid, service_tier=body.service_tier
        )
    except APIError as e:
        raise run.named(e) from None
    if body.background:
        run.stored.response = run.response | {"status": "queued"}
        if body.streams:
            run.stored.events = _queued_events(run.stored.response)
        store.put(run.stored)
        task = asyncio.ensure_future(_in_background(run, call))
        run.stored.task = task
        request.app.state.background.add(task)
        task.add_done_callback(request.app.state.background.discard)
        task.add_done_callback(lambda done: _background_done(run, call, store, done))
        if run.stored.events is not None:  # the client reads what the task logs
            return replay(run.stored.events.follow(0))
        return JSONResponse(run.stored.response)
    if body.streams:
        events = _events(run, call, store if body.stores else None)
        return await sse(request, events, call, typed=True)
    try:
        (result,) = await until_disconnect(request, call, call.results())
    except APIError as e:
        raise run.named(e) from None
    finally:
        run.release()
    run.stored.response = run.complete(result)
    run.record()
    if body.stores:
        store.put(run.stored)
    return JSONResponse(run.stored.response)


def _prepare(body: ResponsesRequest, earlier: list[dict[str, Any]], state: ServerState) -> _Run:
    """The chat request a Responses request asks for, after the `earlier` turns' items, ready
    to submit; 400s name the Responses fields."""
    items = rapi.input_items(body.input)
    rapi.check_unique_ids(earlier + items)
    tools = rapi.chat_tools(body.tools)
    choice, callable_tools = rapi.chat_tool_choice(body.tool_choice, tools)
    ask = _Ask(body, callable_tools, choice, rapi.new_id("resp"), state)
    messages = rapi.chat_messages(earlier + items)
    chat_body, plan, chat = ask.fitted(messages, new_start=len(rapi.chat_messages(earlier)))
    thinking = chat_reasoning(chat_body, chat, state)
    builder = OutputBuilder(thinking, plan)
    model = body.model or state.model_name
    defaults = state.manager.sampling_defaults
    response = rapi.response_object(ask.rid, body, model, tools, body.tool_choice, defaults)
    stored = Stored(response, items, body.previous_response_id)
    field = chat_body.constraint_field(chat.reqs)  # named by RESPONSES_FIELDS in its turn
    return _Run(response, stored, chat, builder, state.manager.tokenizer, field)


_LEADING = ("system", "developer")  # instructions among the input: never truncated


@dataclass(frozen=True)
class _Ask:
    """What a Responses request asks of the chat route, but its messages."""

    body: ResponsesRequest
    tools: list[dict[str, Any]]  # those it may call
    choice: Any  # the chat route's tool_choice
    rid: str  # the response's id
    state: ServerState

    def fitted(
        self, messages: list[dict[str, Any]], new_start: int
    ) -> tuple[oai.ChatCompletionRequest, Any, oai.ChatCall]:
        """The chat request, its tool plan and its sequences. With truncation `auto`, a
        conversation too long for the context loses its oldest turns (each from a user
        message to the next; leading system and developer messages stay; the request's own
        input, from `new_start`, is never cut into when it continues stored turns) until it
        fits, as OpenAI's does: the fewest turns that make it fit, in O(log turns) renders."""
        try:
            return self.chat(messages)
        except APIError as e:
            if self.body.truncation != "auto" or e.code != "context_length_exceeded":
                raise renamed(e, RESPONSES_FIELDS) from None
            error = e
        head = next((i for i, m in enumerate(messages) if m["role"] not in _LEADING), len(messages))
        # where the kept part may start: a user message after the first turn (before the
        # new input when it continues stored turns), or the new input
        end = new_start if new_start > head else len(messages)
        cuts = [i for i in range(head + 1, end) if messages[i]["role"] == "user"]
        cuts += [new_start] if new_start > head else []
        fits = None  # the chat of the fewest turns dropped that fit, so far
        low, high = 0, len(cuts) - 1
        while low <= high:
            middle = (low + high) // 2
            try:
                fits = self.chat(messages[:head] + messages[cuts[middle] :])
                high = middle - 1
            except APIError as e:
                if e.code != "context_length_exceeded":
                    raise renamed(e, RESPONSES_FIELDS) from None
                low = middle + 1
        if fits is None:
            raise renamed(error, RESPONSES_FIELDS) from None
        return fits

    def chat(
        self, messages: list[dict[str, Any]]
    ) -> tuple[oai.ChatCompletionRequest, Any, oai.ChatCall]:
        body, state = self.body, self.state
        tokenizer = state.manager.tokenizer
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        fields = {"messages": system + messages, "rid": self.rid}
        fields |= body.chat_fields(self.tools, self.choice)
        try:
            chat_body = oai.ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:  # what the Responses fields could not say apart
            reason = e.errors()[0]["msg"]
            raise bad_request(f"the request cannot be served as a chat: {reason}") from None
        try:
            parser_flag = state.config.server.tool_call_parser
            plan = chat_body.tool_plan(parser_flag, oai.template_source(tokenizer))
        except APIError as e:
            raise _flat_tool_error(e) from None
        max_context = state.model.max_seq_len
        lora_id = state.adapter_of(body.model)  # an adapter's name, or the base model
        defaults = state.manager.sampling_defaults
        chat = oai.chat_call(
            chat_body, tokenizer, max_context, plan, RESPONSES_FIELDS, lora_id, defaults
        )
        check_sequences(chat.reqs, state, RESPONSES_FIELDS)
        return chat_body, plan, chat


def _flat_tool_error(e: APIError) -> APIError:
    """The chat route's names for a tool's fields (tools[0].function.parameters) as the
    Responses API's flat tools name them (tools[0].parameters)."""
    param = _flat(e.param) if e.param else None
    return APIError(e.status, _flat(e.message), e.type, param, e.code)


def _flat(text: str) -> str:
    return re.sub(r"(tools\[\d+\])\.function\.", r"\1.", text)


def _cut_short(meta: dict[str, Any]) -> bool:
    return rapi.outcome(meta)[0] != "completed"


async def _events(
    run: _Run, call: Call, store: ResponseStore | None, created: int = 0
) -> AsyncIterator[dict]:
    """The stream: response.created and .in_progress once the sequence has started, the
    items' events as its text comes, then response.completed (or .incomplete, .failed).
    `created`: the events already sent (a background response's: created and queued); then
    its stream goes on from .in_progress, and fails in order if the engine refuses it."""
    numbers = itertools.count(created)

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(numbers), **fields}

    sent = 0
    opened = False
    try:
        async for _, out in call.stream():
            if not opened:  # after the first output, so a refused call gets its status
                opened = True
                if not created:
                    yield event("response.created", response=run.response)
                run.stored.response = run.response
                yield event("response.in_progress", response=run.response)
            text, sent = out.result["text"][sent:], len(out.result["text"])
            meta = out.result["meta_info"]
            news = run.builder.feed(text, meta, final=out.finished)
            if out.finished:
                news += run.builder.close(incomplete=_cut_short(meta))
            for news_event in news:
                yield event(news_event.pop("type"), **news_event)
            if out.finished:
                run.stored.response = run.finish(out.result)
                run.record()
    except Exception as e:  # the engine's error, or a bug: the response fails, in order
        if not opened and not created and isinstance(e, APIError):
            raise run.named(e) from None
        if not opened and not created:
            raise
        if isinstance(e, APIError):
            message = run.named(e).message
        else:
            logger.exception("a streamed response failed")
            message = f"internal error: {e!r}"
        try:
            closing = run.builder.close(incomplete=True)
        except Exception:  # the builder's own bug: its items stay as they are
            closing = []
        for news_event in closing:
            yield event(news_event.pop("type"), **news_event)
        error = {"code": "server_error", "message": message}
        run.stored.response = run.response | {"status": "failed", "error": error}
        run.stored.response["output"] = run.builder.items
    finally:
        run.release()  # a client gone mid-stream too: the call is aborted, its items kept out
    if store is not None:
        store.put(run.stored)
    final = run.stored.response
    yield event(_TERMINAL[final["status"]], response=final)


_TERMINAL = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


def _queued_events(queued: dict[str, Any]) -> rapi.EventLog:
    """A streamed background response's log, its first events in: created and queued."""
    log = rapi.EventLog()
    for number, kind in enumerate(("response.created", "response.queued")):
        event = {"type": kind, "sequence_number": number, "response": queued}
        log.append(event_frame(event, typed=True))
    return log


async def _in_background(run: _Run, call: Call) -> None:
    """A background response: in progress once it runs, then finished or failed, as GET
    /v1/responses/{id} reports it (`_background_done` settles the rest). A streamed one
    logs its events as they come, whether or not a client reads them."""
    stored = run.stored
    if stored.events is not None:
        log = stored.events
        async for event in _events(run, call, None, created=len(log.frames)):
            log.append(event_frame(event, typed=True))
            log.closed = event["type"] in _TERMINAL.values()
        return
    stored.response = run.response | {"status": "in_progress"}
    try:
        (result,) = await call.results()
    except APIError as e:
        error = {"code": "server_error", "message": run.named(e).message}
        stored.response = run.response | {"status": "failed", "error": error}
        return
    stored.response = run.complete(result)
    run.record()


def _background_done(run: _Run, call: Call, store: ResponseStore, task: asyncio.Task) -> None:
    """Whatever ended a background response (its end, a cancel or DELETE, even before it
    started, or a bug): its call closed, so nothing it ran holds KV, and its status final."""
    stored = run.stored
    stored.task = None
    try:
        call.close()
    finally:
        run.release()
        _settle(run, store, task)


def _settle(run: _Run, store: ResponseStore, task: asyncio.Task) -> None:
    stored = run.stored
    log = stored.events
    try:
        if stored.response["status"] in ("queued", "in_progress"):
            if task.cancelled() and stored.stopped:
                stored.response = run.response | {"status": "failed", "error": rapi.STOPPED}
            elif task.cancelled():
                stored.response = run.response | {"status": "cancelled"}
            else:
                logger.error("a background response failed", exc_info=task.exception())
                message = f"internal error: {task.exception()!r}"
                error = {"code": "server_error", "message": message}
                stored.response = run.response | {"status": "failed", "error": error}
        if log is not None and not log.closed and stored.response["status"] == "failed":
            event = {"type": "response.failed", "sequence_number": len(log.frames)}  # a bug's
            log.append(event_frame(event | {"response": stored.response}, typed=True))  # end
        store.refresh(stored)  # (kept on disk with its events, the last one in)
    finally:
        if log is not None:  # its readers stop (a cancelled one's with no last event)
            log.end()


async def stop_background(app: Any) -> None:
    """At the server's stop: the background responses still running fail (as a server
    started again on the folder reads them back), each written while the folder is still
    this server's."""
    for stored in app.state.responses.entries.values():
        if stored.task is not None:
            stored.stopped = True
    running = list(app.state.background)
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


# -- stored responses -----------------------------------------------------------------------
@router.get("/v1/responses/{response_id}")
async def get_response(
    response_id: str, request: Request, stream: bool = False, starting_after: int | None = None
) -> Response:
    """A stored response as it stands; with `stream`, a streamed background response's
    events (those after `starting_after`), following it until it ends."""
    stored = _store(request).get(response_id)
    if not stream:
        return JSONResponse(stored.response)
    log = stored.events
    if log is None:
        raise bad_request(
            f"{response_id!r} was not created with background and stream true: only such a "
            "response's events are kept to be streamed again (GET it without stream)",
            "stream",
        )
    start = 0 if starting_after is None else starting_after + 1
    if start < 0 or start > len(log.frames):  # (running or not: no client saw an event to come)
        raise bad_request(
            f"starting_after must be the sequence number of an event of {response_id!r} made "
            f"so far, from 0 to {len(log.frames) - 1}",
            "starting_after",
        )
    return replay(log.follow(start))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    stored = _store(request).get(response_id)
    if not stored.response["background"]:
        raise bad_request("only a background response can be cancelled", "response_id")
    task = stored.task
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    _store(request).delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    after: str | None = None,
    limit: int = 20,
    order: Literal["asc", "desc"] = "desc",
) -> Response:
    """The items the response was made from (earlier turns' too), a page at a time."""
    store = _store(request)
    stored = store.get(response_id)
    try:
        earlier = store.context(stored.previous) if stored.previous else []
    except APIError:
        message = (
            f"{response_id!r} continues a conversation whose earlier turns are no longer "
            "stored: its input items are not all there"
        )
        raise APIError(404, message, param="response_id", code="not_found") from None
    return JSONResponse(rapi.page(earlier + stored.inputs, after, limit, order, response_id))
