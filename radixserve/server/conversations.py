"""OpenAI's Conversations API: a conversation is a list of items (messages, function calls
and their outputs, reasoning) kept by the server, which a response continues
(`/v1/responses` with `conversation`: its items are the context, and the response's input
and output items are added to it once it ends), and which a client can read and edit:

    POST   /v1/conversations                      {items?, metadata?} -> the conversation
    GET    /v1/conversations/{id}                 the conversation (id, created_at, metadata)
    POST   /v1/conversations/{id}                 {metadata} -> updated
    DELETE /v1/conversations/{id}                 -> conversation.deleted
    POST   /v1/conversations/{id}/items           {items} -> the items added, as a list
    GET    /v1/conversations/{id}/items           a page of them (after, limit, order)
    GET    /v1/conversations/{id}/items/{item}    one item
    DELETE /v1/conversations/{id}/items/{item}    -> the conversation

Conversations live in this server's memory (`ConversationStore`), the least recently used
dropped past --responses-store-size of them or past 1 GiB of their items' JSON, as stored
responses are. With --file-storage-path they are also kept on disk there
(`conversations/<id>.jsonl`) until deleted: one dropped from memory, or made before the
server restarted, is read back when it is next asked for, or when an `item_reference` names
one of its items (`conversations/items.jsonl` says which holds it)."""

from __future__ import annotations

import copy
import json
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ConfigDict

from radixserve.server import responses_api as rapi
from radixserve.server.body import JSONBodyRoute, StrictBody
from radixserve.server.errors import ERROR_RESPONSES, APIError, bad_request
from radixserve.server.kept import ItemIndex, json_line, write_bytes_whole

logger = logging.getLogger(__name__)
router = APIRouter(route_class=JSONBodyRoute, responses=ERROR_RESPONSES)
MAX_ITEMS_AT_ONCE = 20  # OpenAI's bound on the items one call adds
CONVERSATION_ID = re.compile(r"conv_[0-9a-f]{32}")  # (rapi.new_id's)


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)
    running: str | None = None  # the lock of the response running in it, if one is
    synced: bool = False  # its file on disk holds all of it, whole lines: added items append

    def lock(self, token: str) -> None:
        """Hold it for one response (its items are added when it ends); a second one
        meanwhile is refused, as OpenAI's conversations refuse it."""
        self.check_free("conversation")
        self.running = token

    def unlock(self, token: str) -> None:
        if self.running == token:
            self.running = None

    def check_free(self, param: str) -> None:
        if self.running is not None:
            raise APIError(
                400,
                f"Another response is in progress in conversation {self.id!r}: wait for it "
                "to end before adding to the conversation.",
                param=param,
                code="conversation_locked",
            )

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }

    def item(self, item_id: str) -> dict[str, Any]:
        found = next((i for i in self.items if i["id"] == item_id), None)
        if found is None:
            raise APIError(
                404,
                f"Item with id {item_id!r} not found in conversation {self.id!r}.",
                param="item_id",
                code="not_found",
            )
        return found


class ConversationStore:
    """Conversations in memory, the least recently used dropped past `capacity` or past
    `max_bytes` of their items' JSON (never the one just used, nor one a response is
    running in). With a `folder` (in --file-storage-path), each is also kept there as
    `<id>.jsonl` (its description, then an item a line: added items are appended, other
    changes write it whole), so one dropped from memory, or from a server since restarted
    on the folder, is read back when it is next asked for."""

    def __init__(
        self, capacity: int, max_bytes: int = rapi.MAX_STORED_BYTES, folder: Path | None = None
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.folder = folder
        self.entries: OrderedDict[str, Conversation] = OrderedDict()
        self.sizes: dict[str, int] = {}
        self.holders: dict[str, str] = {}  # item id -> the conversation holding it
        self.items: ItemIndex | None = None  # which conversation on disk holds an item
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            for partial in folder.glob("*.partial"):  # a write the server did not finish
                partial.unlink()
            if capacity > 0:
                self.items = ItemIndex(folder / "items.jsonl", self._on_disk)

    def put(self, conversation: Conversation, added: list[dict[str, Any]] | None = None) -> None:
        """Keep a conversation, the most recently used now: measured (and kept on disk)
        whole, or (`added`: the items just added to it) by what grew."""
        if self.capacity == 0:
            return
        self._write(conversation, added)
        self._hold(conversation, added)

    def _hold(self, conversation: Conversation, added: list[dict[str, Any]] | None) -> None:
        self.entries[conversation.id] = conversation
        self.entries.move_to_end(conversation.id)
        if added is not None and conversation.id in self.sizes:
            self.sizes[conversation.id] += len(json.dumps(added))
        else:
            self.sizes[conversation.id] = len(json.dumps(conversation.items))
        for item in conversation.items if added is None else added:
            self.holders[item["id"]] = conversation.id
        total = sum(self.sizes.values())
        for oldest in list(self.entries)[:-1]:
            if len(self.entries) <= self.capacity and total <= self.max_bytes:
                break
            if self.entries[oldest].running is None:  # not one a response is adding to
                total -= self.sizes[oldest]
                self._drop(oldest)

    def _on_disk(self, conversation_id: str) -> bool:
        path = self._path(conversation_id)
        return path is not None and path.is_file()

    def _path(self, conversation_id: str) -> Path | None:
        if self.folder is None or not CONVERSATION_ID.fullmatch(conversation_id):
            return None
        return self.folder / f"{conversation_id}.jsonl"

    def _write(self, conversation: Conversation, added: list[dict[str, Any]] | None) -> None:
        path = self._path(conversation.id)
        if path is None:
            return
        try:
            if added is not None and conversation.synced:
                with path.open("ab") as out:
                    out.write(b"".join(json_line(item) for item in added))
            else:
                head = {"id": conversation.id, "created_at": conversation.created_at}
                head["metadata"] = conversation.metadata
                lines = [json_line(head)] + [json_line(item) for item in conversation.items]
                write_bytes_whole(path, b"".join(lines))
            conversation.synced = True
            if self.items is not None:
                written = conversation.items if added is None else added
                self.items.add([item["id"] for item in written], conversation.id)
        except OSError:  # (a full disk): it is served on from memory, written whole next
            conversation.synced = False
            logger.exception("conversation %s could not be kept on disk", conversation.id)

    def _read(self, conversation_id: str) -> Conversation | None:
        """A conversation kept on disk (the lines a stop cut off dropped)."""
        path = self._path(conversation_id)
        if path is None or not path.is_file():
            return None
        data = path.read_bytes()
        lines = []
        whole = data.endswith(b"\n")
        for raw in data.split(b"\n")[:-1] if whole else data.split(b"\n"):
            try:
                line = json.loads(raw)
            except ValueError:
                line = None  # (a line a kill cut off)
            if isinstance(line, dict):
                lines.append(line)
            else:
                whole = False
        head = lines[0] if lines else {}
        created, metadata = head.get("created_at"), head.get("metadata")
        if head.get("id") != conversation_id or not isinstance(created, int):
            logger.warning("%s: not a conversation", path)
            return None
        metadata = metadata if isinstance(metadata, dict) else {}
        items = [item for item in lines[1:] if isinstance(item.get("id"), str)]
        conversation = Conversation(conversation_id, created, metadata, items)
        conversation.synced = whole and len(items) == len(lines) - 1  # else written whole next
        return conversation

    def _drop(self, conversation_id: str) -> None:
        for item in self.entries.pop(conversation_id).items:
            if self.holders.get(item["id"]) == conversation_id:
                del self.holders[item["id"]]
        del self.sizes[conversation_id]

    def find_item(self, item_id: str) -> dict[str, Any] | None:
        """An item of any conversation (a copy), by its id: what an `item_reference` names.
        The index names the conversation in memory that last took that id; where it no
        longer holds it (two conversations may hold items of one id), every one in memory is
        looked in, then the one on disk that the folder's index names."""
        holder = self.entries.get(self.holders.get(item_id, ""))
        for conversation in ([holder] if holder else []) + list(self.entries.values()):
            found = next((i for i in conversation.items if i["id"] == item_id), None)
            if found is not None:
                self.holders[item_id] = conversation.id
                return copy.deepcopy(found)
        self.holders.pop(item_id, None)
        kept = self.items.get(item_id) if self.items is not None else None
        if kept is None or kept in self.entries:
            return None
        try:
            conversation = self.get(kept)
        except APIError:  # (deleted since)
            return None
        found = next((i for i in conversation.items if i["id"] == item_id), None)
        return copy.deepcopy(found) if found is not None else None

    def get(self, conversation_id: str, param: str = "conversation_id") -> Conversation:
        conversation = self.entries.get(conversation_id)
        if conversation is None and self.capacity > 0:
            conversation = self._read(conversation_id)
            if conversation is not None:
                self._hold(conversation, None)
        if conversation is None:
            raise APIError(
                404,
                f"Conversation with id {conversation_id!r} not found.",
                param=param,
                code="not_found",
            )
        self.entries.move_to_end(conversation_id)
        return conversation

    def add(self, conversation: Conversation, items: list[dict[str, Any]]) -> None:
        """Items onto a conversation (a response's, once it has ended), unless it has been
        deleted meanwhile."""
        if self.entries.get(conversation.id) is conversation:
            conversation.items += items
            self.put(conversation, added=items)
        else:
            logger.info("conversation %s is gone: %d items not added", conversation.id, len(items))

    def delete(self, conversation_id: str) -> None:
        self.get(conversation_id)
        self._drop(conversation_id)
        path = self._path(conversation_id)
        if path is not None:
            path.unlink(missing_ok=True)


def _store(request: Request) -> ConversationStore:
    return request.app.state.conversations


class CreateConversation(StrictBody):
    model_config = ConfigDict(extra="forbid")
    items: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None


class UpdateConversation(StrictBody):
    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, str] | None


class AddItems(StrictBody):
    model_config = ConfigDict(extra="forbid")
    items: list[dict[str, Any]]


def _new_items(conversation: Conversation | None, given: list[dict[str, Any]]) -> list[dict]:
    """Items as a conversation keeps them (`rapi.input_items`: ids given where missing);
    a 400 names the one this engine cannot serve, or an id the conversation has already."""
    if len(given) > MAX_ITEMS_AT_ONCE:
        raise bad_request(
            f"items: at most {MAX_ITEMS_AT_ONCE} items may be added at a time, got {len(given)}",
            "items",
        )
    items = rapi.input_items(given, field="items") if given else []
    rapi.check_unique_ids((conversation.items if conversation else []) + items, "items")
    return items


@router.post("/v1/conversations")
async def create_conversation(body: CreateConversation, request: Request) -> JSONResponse:
    store = _store(request)
    if store.capacity == 0:
        raise bad_request(
            "conversations are stored, and this server stores none (--responses-store-size 0)"
        )
    rapi.check_metadata(body.metadata)
    items = _new_items(None, body.items or [])
    conversation = Conversation(rapi.new_id("conv"), int(time.time()), body.metadata or {}, items)
    store.put(conversation)
    return JSONResponse(conversation.public())


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, request: Request) -> JSONResponse:
    return JSONResponse(_store(request).get(conversation_id).public())


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(
    conversation_id: str, body: UpdateConversation, request: Request
) -> JSONResponse:
    conversation = _store(request).get(conversation_id)
    rapi.check_metadata(body.metadata)
    conversation.metadata = body.metadata or {}
    _store(request).put(conversation)
    return JSONResponse(conversation.public())


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request) -> JSONResponse:
    _store(request).delete(conversation_id)
    body = {"id": conversation_id, "object": "conversation.deleted", "deleted": True}
    return JSONResponse(body)


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(conversation_id: str, body: AddItems, request: Request) -> JSONResponse:
    store = _store(request)
    conversation = store.get(conversation_id)
    conversation.check_free("conversation_id")
    if not body.items:
        raise bad_request("items: give at least one item to add", "items")
    items = _new_items(conversation, body.items)
    store.add(conversation, items)
    return JSONResponse(rapi.page(items, None, max(len(items), 1), "asc", conversation_id))


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(
    conversation_id: str,
    request: Request,
    after: str | None = None,
    limit: int = 20,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    conversation = _store(request).get(conversation_id)
    return JSONResponse(rapi.page(conversation.items, after, limit, order, conversation_id))


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(conversation_id: str, item_id: str, request: Request) -> JSONResponse:
    return JSONResponse(_store(request).get(conversation_id).item(item_id))


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, request: Request) -> JSONResponse:
    store = _store(request)
    conversation = store.get(conversation_id)
    conversation.items.remove(conversation.item(item_id))
    if store.holders.get(item_id) == conversation.id:
        del store.holders[item_id]
    store.put(conversation)
    return JSONResponse(conversation.public())
