"""OpenAI's Files API, for the Batch API's input and output files (`batches.py`):

    POST   /v1/files                  multipart: file, purpose[, expires_after] -> the file
    GET    /v1/files                  a page of them (purpose, after, limit, order)
    GET    /v1/files/{id}             the file object
    GET    /v1/files/{id}/content     its bytes
    DELETE /v1/files/{id}             -> {"id", "object": "file", "deleted": true}

Files live on disk in --file-storage-path (each as `<id>` with its description beside it in
`<id>.json`, read back when the server starts again), or by default in a temporary folder
removed when the server stops. A file past its `expires_at` is gone: it is deleted the next
time the store is used."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect
from starlette.types import Message

from radixserve.server import openai_api as oai
from radixserve.server import responses_api as rapi
from radixserve.server.errors import ERROR_RESPONSES, APIError, bad_request
from radixserve.server.kept import write_bytes_whole

logger = logging.getLogger(__name__)
router = APIRouter(responses=ERROR_RESPONSES)

MAX_FILE_BYTES = 512 << 20  # OpenAI's bound on one file
PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")  # uploadable
BATCH_FILE_LIFETIME_S = 30 * 86400  # OpenAI's default for purpose batch
MIN_LIFETIME_S, MAX_LIFETIME_S = 3600, 30 * 86400  # OpenAI's bounds on expires_after
MAX_LIST_LIMIT = 10_000
READ_CHUNK = 1 << 20  # bytes of a file sent at a time
FILE_ID = re.compile(r"file-[0-9a-f]{32}")


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


def lifetime(expires_after: dict[str, Any] | None, param: str) -> int | None:
    """Seconds a file lives from `expires_after` ({anchor: created_at, seconds}), as OpenAI
    bounds it; None for none given. A 400 names `param`."""
    if expires_after is None:
        return None
    if expires_after.get("anchor") != "created_at":
        raise bad_request(f"{param}.anchor must be 'created_at'", f"{param}.anchor")
    seconds = expires_after.get("seconds")
    if isinstance(seconds, str):  # a multipart form's value
        with contextlib.suppress(ValueError):
            seconds = int(seconds, 10)
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        raise bad_request(f"{param}.seconds must be an integer", f"{param}.seconds")
    if not MIN_LIFETIME_S <= seconds <= MAX_LIFETIME_S:
        raise bad_request(
            f"{param}.seconds must be between {MIN_LIFETIME_S} and {MAX_LIFETIME_S}, got {seconds}",
            f"{param}.seconds",
        )
    return seconds


def write_json_whole(path: Path, value: Any) -> None:
    """`value` as JSON at `path`, whole or not at all."""
    write_bytes_whole(path, json.dumps(value).encode())


class FileStore:
    """Files on disk under one folder, their descriptions in memory (and beside each file,
    so that a folder given by the user serves them again after a restart)."""

    def __init__(self, folder: str | None) -> None:
        self.owned = folder is None  # a temporary folder, removed by close()
        self.folder = Path(folder or tempfile.mkdtemp(prefix="radixserve-files-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.lock = None if self.owned else _hold(self.folder)
        self.files: dict[str, StoredFile] = {}
        for described in sorted(self.folder.glob("file-*.json")):
            try:
                stored = StoredFile(**json.loads(described.read_text()))
            except (OSError, ValueError, TypeError) as e:
                logger.warning("skipping %s: not a file description (%s)", described, e)
                continue
            if stored.id != described.stem or not FILE_ID.fullmatch(stored.id):
                logger.warning("skipping %s: it describes another file", described)
            elif self.path(stored.id).is_file():
                self.files[stored.id] = stored
            else:  # its bytes are gone
                described.unlink(missing_ok=True)
        for path in self.folder.glob("file-*"):  # what a crash left: bytes undescribed,
            # a description half written (one server to a folder: another's upload in
            # progress would look the same)
            stray = FILE_ID.fullmatch(path.name) and path.name not in self.files
            if stray or path.name.endswith(".json.partial"):
                path.unlink(missing_ok=True)
        self.purge()

    def path(self, file_id: str) -> Path:
        return self.folder / file_id

    def purge(self) -> None:
        """Delete the files past their expiry."""
        now = time.time()
        for stored in list(self.files.values()):
            if stored.expires_at is not None and stored.expires_at <= now:
                self.discard(stored.id)

    def get(self, file_id: str, param: str = "file_id") -> StoredFile:
        self.purge()
        stored = self.files.get(file_id)
        if stored is None:
            raise APIError(404, f"No such File object: {file_id}", param=param, code="not_found")
        return stored

    def listed(
        self, purpose: str | None, after: str | None, limit: int, order: str
    ) -> dict[str, Any]:
        self.purge()
        chosen = [f for f in self.files.values() if purpose is None or f.purpose == purpose]
        chosen.sort(key=lambda f: f.created_at)  # stable: ties stay in the order made
        items = [f.public() for f in chosen]
        return rapi.page(items, after, limit, order, "files", max_limit=MAX_LIST_LIMIT)

    def add(self, file_id: str, filename: str, purpose: str, lifetime_s: int | None) -> StoredFile:
        """List a file whose bytes are at `path(file_id)`."""
        created = int(time.time())
        expires = None if lifetime_s is None else created + lifetime_s
        size = self.path(file_id).stat().st_size
        stored = StoredFile(file_id, filename, purpose, size, created, expires)
        write_json_whole(self.path(file_id).with_suffix(".json"), asdict(stored))
        self.files[file_id] = stored
        return stored

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        self.discard(file_id)

    def discard(self, file_id: str) -> None:
        """A file gone, listed or not (its bytes and its description); an open reader (a
        response sending its content) keeps reading what it opened."""
        if not FILE_ID.fullmatch(file_id):
            return
        self.files.pop(file_id, None)
        self.path(file_id).unlink(missing_ok=True)
        self.path(file_id).with_suffix(".json").unlink(missing_ok=True)

    def close(self) -> None:
        if self.owned:
            shutil.rmtree(self.folder, ignore_errors=True)
        if self.lock is not None:
            self.lock.close()  # (the lock goes with it)
            self.lock = None


def _hold(folder: Path) -> IO[str]:
    """The folder's lock, held by this process until the store closes (or the process
    ends): a second server on the folder would delete the first's uploads in progress and
    resume its batches too. A ValueError naming the holder if another process has it."""
    handle = (folder / ".lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise ValueError(
            f"--file-storage-path {folder} is in use by another server (pid {holder}): "
            "give each server a folder of its own"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def store_of(request: Request) -> FileStore:
    return request.app.state.files


def _copy_upload(source: IO[bytes], out: IO[bytes]) -> int:
    """Copy an upload, refusing it once it passes MAX_FILE_BYTES."""
    copied = 0
    while chunk := source.read(1 << 20):
        copied += len(chunk)
        if copied > MAX_FILE_BYTES:
            raise _too_large()
        out.write(chunk)
    return copied


def _too_large() -> APIError:
    return APIError(
        413,
        f"the file is larger than {MAX_FILE_BYTES >> 20} MiB",
        param="file",
        code="file_too_large",
    )


@router.post("/v1/files")
async def upload_file(request: Request) -> JSONResponse:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request(
            "POST /v1/files takes a multipart/form-data body with the fields `file` and `purpose`"
        )
    if int(request.headers.get("content-length") or 0) > MAX_FILE_BYTES + (1 << 20):
        raise _too_large()
    store = store_of(request)
    async with _form(request) as form:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise bad_request("file: give the file's content as a form file field", "file")
        purpose = form.get("purpose")
        if purpose not in PURPOSES:
            raise bad_request(f"purpose must be one of {', '.join(PURPOSES)}", "purpose")
        given = {
            key.removeprefix("expires_after[").removesuffix("]"): value
            for key, value in form.items()
            if key.startswith("expires_after[")
        }
        lifetime_s = lifetime(given or None, "expires_after")
        if lifetime_s is None and purpose == "batch":
            lifetime_s = BATCH_FILE_LIFETIME_S
        filename = os.path.basename(upload.filename or "") or "upload"
        file_id = oai.new_id("file")
        path = store.path(file_id)
        try:
            with path.open("wb") as out:
                await asyncio.to_thread(_copy_upload, upload.file, out)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
    return JSONResponse(store.add(file_id, filename, str(purpose), lifetime_s).public())


@contextlib.asynccontextmanager
async def _form(request: Request) -> AsyncIterator[FormData]:
    """The upload's form, parsed as it arrives: a 413 once it passes MAX_FILE_BYTES (with
    no Content-Length to tell it first), a 400 for a malformed one, a 499 for a client that
    left."""
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await request.receive()
        received += len(message.get("body", b""))
        if received > MAX_FILE_BYTES + (1 << 20):
            raise _too_large()
        return message

    try:
        async with Request(request.scope, counted).form(max_files=1, max_fields=8) as form:
            yield form
    except MultiPartException as e:
        raise bad_request(f"the upload is not a form this route reads: {e.message}") from None
    except ClientDisconnect:
        raise APIError(499, "the client disconnected") from None


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = MAX_LIST_LIMIT,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    return JSONResponse(store_of(request).listed(purpose, after, limit, order))


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request) -> JSONResponse:
    return JSONResponse(store_of(request).get(file_id).public())


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> StreamingResponse:
    """The bytes, read from the file opened here: a delete while they are sent takes
    nothing from them, and one just before is a 404."""
    store = store_of(request)
    stored = store.get(file_id)
    try:
        handle = store.path(file_id).open("rb")
    except FileNotFoundError:  # deleted since it was looked up
        store.get(file_id)
        raise
    size = os.fstat(handle.fileno()).st_size
    quoted = quote(stored.filename)
    named = (
        f'filename="{stored.filename}"'
        if quoted == stored.filename
        else f"filename*=utf-8''{quoted}"
    )
    headers = {"content-length": str(size), "content-disposition": f"attachment; {named}"}
    return StreamingResponse(_read(handle), media_type="application/octet-stream", headers=headers)


def _read(handle: IO[bytes]) -> Iterator[bytes]:
    """A file's bytes in chunks (read on a worker thread: the response iterates it so)."""
    with handle:
        while chunk := handle.read(READ_CHUNK):
            yield chunk


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    store_of(request).delete(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
