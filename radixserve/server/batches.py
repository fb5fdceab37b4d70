"""OpenAI's Batch API: a JSONL file of requests to one endpoint, run by the server while the
client waits elsewhere, the answers written to an output file (and the failures to an
error file) that the Files API (`files.py`) serves.

    POST /v1/batches              {input_file_id, endpoint, completion_window, metadata?,
                                   output_expires_after?} -> the batch
    GET  /v1/batches              a page of them, newest first (after, limit)
    GET  /v1/batches/{id}         the batch
    POST /v1/batches/{id}/cancel  -> the batch, cancelling

Each input line is `{"custom_id", "method": "POST", "url": <the endpoint>, "body"}`. The
endpoints are /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses and
SGLang's /v1/score.

A batch is first checked whole (`check_input`): any malformed line fails it with the
lines' errors and runs nothing. Then each body goes through the app itself, as an HTTP
request would (`call_route`: the same checks, errors and statuses), within a window
(`Window`) of twice the engine's running requests counted in sequences, shared by all
batches and at most half of --max-queued-requests, so the scheduler keeps full batches
and orders them by their shared prefixes. Lines run in OpenAI's "flex" service tier unless
they name another: the scheduler admits every other waiting request first, and takes a
flex request back to the queue (its KV kept in the tree) to give its row to one. A request
refused with 503 (the queue full of other clients' requests) is sent again after a wait. An
output line is OpenAI's:

    {"id": "batch_req_…", "custom_id", "response": {"status_code", "request_id", "body"},
     "error": null}

A request answered 2xx goes to the output file, any other to the error file. A request
that never ran (the batch cancelled or expired) goes to the error file with `response` null
and `error` {code: batch_cancelled | batch_expired, message}, so every line of the input is
in one of the two files.

A batch works in `<work folder>/<id>.{input,output,error}.jsonl`: its input linked there at
creation (a client deleting the file takes nothing from it), its answers appended line by
line, listed as files when it ends. With --file-storage-path, batches are kept there with
the files (`batches/<id>.json` and `batches/work/`), and a batch stopped with its server
(SIGTERM, or killed) resumes when a server starts again on the folder: the lines with an
answer in its files are not run again (a line cut off by the stop is), so each input line
is answered once. Without a folder, a stop ends the batch `failed`, its unrun lines in the
error file as `server_shutdown`.

The newest MAX_BATCHES batches are kept (in memory, and in the folder given one)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ConfigDict

from radixserve.server import files as files_api
from radixserve.server import openai_api as oai
from radixserve.server import responses_api as rapi
from radixserve.server.body import JSONBodyRoute, StrictBody, load_body, off_the_loop_if
from radixserve.server.errors import ERROR_RESPONSES, APIError, EngineUnavailable, bad_request
from radixserve.server.kept import write_bytes_whole

logger = logging.getLogger(__name__)
router = APIRouter(route_class=JSONBodyRoute, responses=ERROR_RESPONSES)

# OpenAI's served here, and SGLang's /v1/score (label probabilities: a classifier in batch)
ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/score",
)
COMPLETION_WINDOWS = {"24h": 86400}  # OpenAI's one window
MAX_REQUESTS = 50_000  # OpenAI's bounds on one batch's input
MAX_INPUT_BYTES = 200 << 20
MAX_EMBEDDING_INPUTS = 50_000  # across an embeddings batch's requests, as OpenAI's
MAX_ERRORS = 100  # a failed check lists up to this many lines
MAX_ACTIVE = 100  # batches not ended at once; past it a new one is a 429
RETRY_FOR_S = 600.0  # how long a request refused with 503 is sent again
YIELD_EVERY = 256  # lines read between two yields to the event loop
MAX_BATCHES = 10_000  # kept in memory; past it the oldest ended ones go
ENDED = ("completed", "failed", "expired", "cancelled")  # a batch's last statuses
DISCONNECTED = 499  # the status a route answers a request whose client left
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 8.0  # waits before a request refused with 503 goes again


@dataclass
class Batch:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    metadata: dict[str, str]
    output_lifetime_s: int | None  # the output and error files' (output_expires_after)
    status: str = "validating"
    times: dict[str, int] = field(default_factory=dict)  # "<status>_at" -> unix time
    errors: list[dict[str, Any]] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    model: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    ending: str | None = None  # the status it ends in, once it finalizes (kept for a resume)
    made_ns: int = field(default_factory=time.time_ns)  # (orders those made in one second)
    cancel: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    saved: Callable[[Batch], None] | None = field(default=None, repr=False)  # (the store's)

    def enter(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())
        if self.saved is not None:
            self.saved(self)

    def fields(self) -> dict[str, Any]:
        """What is kept of it on disk (all but the run's own state)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in UNSAVED}

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    def public(self) -> dict[str, Any]:
        times = {
            f"{s}_at": self.times.get(f"{s}_at")
            for s in ("in_progress", "finalizing", "completed", "failed", "expired")
            + ("cancelling", "cancelled")
        }
        usage = None
        if self.usage:
            usage = {
                "input_tokens": self.usage["input_tokens"],
                "input_tokens_details": {"cached_tokens": self.usage["cached_tokens"]},
                "output_tokens": self.usage["output_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.usage["reasoning_tokens"]},
                "total_tokens": self.usage["input_tokens"] + self.usage["output_tokens"],
            }
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": None if self.errors is None else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            **times,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
            "model": self.model,
            "usage": usage,
        }


UNSAVED = ("cancel", "saved")


class BatchStore:
    """The batches, oldest first; past MAX_BATCHES the oldest ended ones go. Each works in
    `folder`/work (its input linked there, its answers written there until it ends). When
    `kept` (the folder is in --file-storage-path), each batch is also kept in the folder as
    `<id>.json`, written at each change of status, and a server started again on the folder
    lists them again and resumes (`resume`) those that had not ended."""

    def __init__(self, folder: Path, kept: bool = False, capacity: int = MAX_BATCHES) -> None:
        self.folder = folder
        self.work = folder / "work"
        self.kept = kept
        self.capacity = capacity
        self.batches: OrderedDict[str, Batch] = OrderedDict()
        self.unfinished: list[Batch] = []  # loaded, to resume once the server is ready
        self.tasks: set[asyncio.Task] = set()
        self.window: Window | None = None  # made with the first run (the engine's size)
        self.work.mkdir(parents=True, exist_ok=True)
        if not kept:
            return
        loaded = []
        unreadable: set[str] = set()  # (their work files stay: nothing says they ended)
        for path in folder.glob("batch_*.json*"):
            if path.name.endswith(".partial"):  # a write the server did not finish
                path.unlink(missing_ok=True)
                continue
            try:
                batch = Batch(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as e:
                logger.warning("skipping %s: not a batch (%s)", path, e)
                unreadable.add(path.name.removesuffix(".json"))
                continue
            if f"{batch.id}.json" == path.name:
                loaded.append(batch)
        for batch in sorted(loaded, key=lambda b: b.made_ns):
            batch.saved = self.save
            self.batches[batch.id] = batch
            if batch.ended:
                continue
            if batch.status == "cancelling":
                batch.cancel.set()
            self.unfinished.append(batch)
        resuming = {batch.id for batch in self.unfinished} | unreadable
        for path in self.work.iterdir():  # what a kill left of batches that ended
            if path.name.split(".", 1)[0] not in resuming:
                path.unlink(missing_ok=True)

    def save(self, batch: Batch) -> None:
        if not self.kept:
            return
        try:
            files_api.write_json_whole(self.folder / f"{batch.id}.json", batch.fields())
        except OSError:  # (a full disk): the batch runs on, kept in memory
            logger.exception("batch %s could not be saved", batch.id)

    def add(self, batch: Batch) -> None:
        batch.saved = self.save
        self.batches[batch.id] = batch
        self.save(batch)
        for old in list(self.batches.values()):
            if len(self.batches) <= self.capacity:
                break
            if old.ended:
                del self.batches[old.id]
                if self.kept:
                    (self.folder / f"{old.id}.json").unlink(missing_ok=True)

    async def take_input(self, source: Path, batch_id: str) -> None:
        """The batch's own link to its input file (a copy where links cannot be made):
        what it reads, whatever becomes of the file. FileNotFoundError if it is gone."""
        target = work_path(self.work, batch_id, "input")
        target.unlink(missing_ok=True)
        await asyncio.to_thread(_link_or_copy, source, target)

    def start(self, app: FastAPI, batch: Batch) -> None:
        """Run the batch (again, if it resumes)."""
        if self.window is None:
            state = app.state.server
            size = state.manager.info.max_running_requests * state.manager.to_scheduler.size
            self.window = Window(
                min(2 * size, max(state.config.server.max_queued_requests // 2, 1))
            )
        runner = Runner(app, batch, self.work, self.window, resumable=self.kept)
        task = asyncio.create_task(runner.run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def resume(self, app: FastAPI) -> None:
        """Run on the batches a stopped server left unfinished (once this one is ready)."""
        for batch in self.unfinished:
            logger.info("resuming batch %s (%s)", batch.id, batch.status)
            self.start(app, batch)
        self.unfinished.clear()

    def active(self) -> int:
        return sum(1 for batch in self.batches.values() if not batch.ended)

    def get(self, batch_id: str) -> Batch:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise APIError(
                404, f"No batch found with id {batch_id!r}.", param="batch_id", code="not_found"
            )
        return batch


def work_path(work: Path, batch_id: str, kind: str) -> Path:
    """A batch's input (`kind` "input") or its output or error lines while it runs."""
    return work / f"{batch_id}.{kind}.jsonl"


class Window:
    """The sequences of batch requests in flight, shared by all batches: a request takes as
    many permits as it puts sequences in the scheduler's queue (at most all of them), first
    come first served, so batches together never fill the queue themselves."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = size
        self.waiting: deque[tuple[int, asyncio.Future]] = deque()

    async def take(self, wanted: int) -> int:
        """Wait for `wanted` permits (1 to size); the number taken, to give back."""
        wanted = min(max(wanted, 1), self.size)
        if not self.waiting and self.free >= wanted:
            self.free -= wanted
            return wanted
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append((wanted, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # granted as it was cancelled
                self.give(wanted)
            else:
                with contextlib.suppress(ValueError):  # (give may have dropped it)
                    self.waiting.remove((wanted, turn))
                self.give(0)  # those behind it may fit now
            raise
        return wanted

    def give(self, count: int) -> None:
        self.free += count
        while self.waiting:
            wanted, turn = self.waiting[0]
            if turn.done():  # cancelled while it waited
                self.waiting.popleft()
                continue
            if self.free < wanted:
                break
            self.waiting.popleft()
            self.free -= wanted
            turn.set_result(None)


# the batches' input checks, one at a time, on a thread of their own (not the default
# executor's, which large request bodies use)
_CHECKS = ThreadPoolExecutor(1, thread_name_prefix="batch-check")


# -- checking the input ---------------------------------------------------------------------
@dataclass
class Line:
    number: int  # 1-based, as OpenAI's errors count lines
    custom_id: str
    body: dict[str, Any]


def read_lines(source: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of an open file, from its start, numbered from 1."""
    source.seek(0)
    for number, raw in enumerate(source, 1):
        if raw.strip():
            yield number, raw


def parse_line(number: int, raw: bytes, endpoint: str) -> Line:
    """One input line, or a ValueError whose args are (code, message, param)."""

    def bad(code: str, message: str, param: str | None = None) -> ValueError:
        return ValueError(code, f"line {number}: {message}", param)

    try:  # the checks of a request's body: depth, lone surrogates, NaN, 64-bit integers
        entry = load_body(raw)
    except APIError as e:
        raise bad("invalid_json_line", e.message) from None
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise bad("missing_custom_id", "custom_id must be a non-empty string", "custom_id")
    if entry.get("method") != "POST":
        raise bad("invalid_method", "method must be 'POST'", "method")
    if entry.get("url") != endpoint:
        message = f"url must be the batch's endpoint {endpoint!r}, got {shown(entry.get('url'))}"
        raise bad("mismatched_url", message, "url")
    body = entry.get("body")
    if not isinstance(body, dict):
        raise bad("invalid_body", "body must be a JSON object (the request's body)", "body")
    unknown = sorted(set(entry) - {"custom_id", "method", "url", "body"})
    if unknown:
        names = ", ".join(shown(name) for name in unknown[:5])
        raise bad("invalid_request", f"unknown fields {names}", shown(unknown[0], quote=False))
    return Line(number, custom_id, body)


def shown(value: Any, quote: bool = True, limit: int = 100) -> str:
    """A value a client gave, as an error message echoes it: cut to `limit` characters (a
    batch's errors are kept, and a line may hold megabytes)."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= limit else text[:limit] + "…"


def sequences(body: dict[str, Any], endpoint: str) -> int:
    """How many sequences a line's request puts in the scheduler's queue (as its
    --max-queued-requests counts them): n per prompt; one per embedding input."""
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    if endpoint == "/v1/score":  # each item is a sequence
        items = body.get("items")
        return max(len(items), 1) if isinstance(items, list) else 1
    if endpoint == "/v1/responses":
        return 1
    given = body.get("input" if endpoint == "/v1/embeddings" else "prompt")
    many = isinstance(given, list) and bool(given) and not isinstance(given[0], int)
    prompts = len(given) if many else 1
    return max(prompts, 1) * (1 if endpoint == "/v1/embeddings" else max(n, 1))


@dataclass
class Checked:
    total: int
    model: str | None
    errors: list[dict[str, Any]]


def check_input(source: IO[bytes], endpoint: str) -> Checked:
    """Every line of a batch's input checked (run on a worker thread: reads the file)."""
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    total, model, inputs = 0, None, 0

    def error(code: str, message: str, param: str | None = None, line: int | None = None):
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": line})

    if source.seek(0, os.SEEK_END) > MAX_INPUT_BYTES:
        error("file_too_large", f"the input file is larger than {MAX_INPUT_BYTES >> 20} MiB")
        return Checked(0, None, errors)
    for number, raw in read_lines(source):
        total += 1
        try:
            line = parse_line(number, raw, endpoint)
        except ValueError as e:
            code, message, param = e.args
            error(code, message, param, number)
            continue
        if line.custom_id in seen:
            message = f"line {number}: custom_id {shown(line.custom_id)} is used by an earlier line"
            error("duplicate_custom_id", message, "custom_id", number)
        seen.add(line.custom_id)
        if endpoint == "/v1/embeddings":
            inputs += sequences(line.body, endpoint)
        if model is None and isinstance(line.body.get("model"), str):
            model = line.body["model"]
    if total == 0:
        error("empty_file", "the input file has no requests")
    elif total > MAX_REQUESTS:
        error("too_many_requests", f"a batch takes at most {MAX_REQUESTS} requests, got {total}")
    if inputs > MAX_EMBEDDING_INPUTS:
        message = f"an embeddings batch takes at most {MAX_EMBEDDING_INPUTS} inputs, got {inputs}"
        error("too_many_inputs", message)
    return Checked(total, model, errors)


# -- running it -----------------------------------------------------------------------------
async def call_route(
    app: FastAPI, path: str, body: bytes, headers: list[tuple[bytes, bytes]], gone: asyncio.Event
) -> tuple[int, bytes]:
    """POST `body` to the app's route `path` in this process, as a client would: the status
    and the body answered. Once `gone` is set, the request sees its client disconnect (the
    route aborts it and answers 499)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
        "client": ("batch", 0),
        "server": ("radixserve", 0),
    }
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    status = 500
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


class Runner:
    """One batch's run: check, dispatch through the app, write the two files, end. A
    `resumable` batch stopped with the server is left as it is, to resume (`recover`)."""

    def __init__(
        self, app: FastAPI, batch: Batch, work: Path, window: Window, resumable: bool = False
    ) -> None:
        self.app = app
        self.batch = batch
        self.work = work
        self.resumable = resumable
        self.files: files_api.FileStore = app.state.files
        self.outputs: dict[str, IO[bytes]] = {}  # "output"/"error" -> its lines so far
        self.manager = app.state.server.manager
        self.window = window
        self.running: set[asyncio.Task] = set()
        self.cut_short = False  # a line was written off, or left to resume, by a stop
        key = app.state.server.config.server.resolved_api_key
        self.headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode())]

    async def run(self) -> None:
        batch = self.batch
        source = None
        try:
            try:
                source = work_path(self.work, batch.id, "input").open("rb")
            except FileNotFoundError:  # (its work folder emptied under it)
                await self.recover()
                await self.close_outputs()  # what it answered stays
                message = f"its link to its input is gone from {self.work}: it cannot go on"
                error = {"code": "input_lost", "message": message, "param": None, "line": None}
                batch.errors = [error]
                batch.enter("failed")
                return
            answered = await self.recover()  # (first: a resumed batch's counts are its
            # files', not those last saved, before its input is checked again)
            loop = asyncio.get_running_loop()
            checked = await loop.run_in_executor(_CHECKS, check_input, source, batch.endpoint)
            batch.total, batch.model = checked.total, checked.model
            if checked.errors:
                batch.errors = checked.errors
                batch.enter("failed")
                return
            if batch.status == "validating":
                batch.enter("in_progress")
            stopped = await self.dispatch(source, answered)
            if stopped == "stopped":  # it resumes from its work files (its counts kept as
                # they are: they are read back from the files then)
                if batch.saved is not None:
                    batch.saved(batch)
                return
            ending = stopped or batch.ending or "completed"  # (a resumed finalize's own)
            batch.ending = ending  # saved with "finalizing": a kill now resumes to it
            batch.enter("finalizing")
            await self.close_outputs()
            batch.enter(ending)
        except Exception as e:  # a bug, or the disk full: the batch fails, the server goes on
            logger.exception("batch %s failed", batch.id)
            for task in self.running:  # nothing changes once the batch has ended
                task.cancel()
            await asyncio.gather(*self.running, return_exceptions=True)
            try:
                await self.close_outputs()
            except OSError:
                logger.exception("batch %s: its outputs could not be kept", batch.id)
            error = {"code": "internal_error", "message": repr(e), "param": None, "line": None}
            batch.errors = [error]
            batch.enter("failed")
        finally:
            for task in self.running:  # (the server stopping cancelled the run)
                task.cancel()
            if source is not None:
                source.close()
            for out in self.outputs.values():
                out.close()
            if batch.ended or not self.resumable:  # else (stopped, or the task cancelled as
                # the server went down) it resumes from them
                for kind in ("input", "output", "error"):
                    work_path(self.work, batch.id, kind).unlink(missing_ok=True)

    async def recover(self) -> set[str]:
        """The custom_ids answered in the batch's output and error files so far (a batch
        that resumes), its counts and usage taken from them; a line the stop cut off is
        dropped (the request runs again). Empty for a new batch. The files are read on a
        worker thread; the batch changes here, on the loop."""
        batch = self.batch
        self.unlist()  # (a finalize a kill cut short: the work files hold the lines)
        answered: set[str] = set()
        counts = {"output": 0, "error": 0}
        usage: dict[str, int] = {}
        for kind in ("output", "error"):
            path = work_path(self.work, batch.id, kind)
            if path.exists():
                read = asyncio.to_thread(
                    _answers_in, path, answered, usage if kind == "output" else None
                )
                counts[kind] = await read
                self.outputs[kind] = path.open("ab")
        batch.completed, batch.failed, batch.usage = counts["output"], counts["error"], usage
        if answered:
            logger.info("batch %s resumes with %d requests answered", batch.id, len(answered))
        return answered

    def stop_reason(self) -> str | None:
        if self.batch.cancel.is_set():
            return "cancelled"
        if time.time() >= self.batch.expires_at:
            return "expired"
        if self.manager.draining or self.manager.dead is not None:  # the server stopping
            # (or its engine gone): the batch resumes with the next one on the folder, or fails
            return "stopped" if self.resumable else "failed"
        return None

    async def dispatch(self, source: IO[bytes], answered: set[str]) -> str | None:
        """Run every line not `answered` yet within the shared window; the status the batch
        ends in if it stopped early (cancelled, expired, failed: the server stopping), or
        "stopped" (to resume), else None."""
        window = self.window
        stopped = None
        lines = read_lines(source)
        for i, (number, raw) in enumerate(lines):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)  # a long input read on without a wait: let others run
            line = await off_the_loop_if(len(raw), parse_line, number, raw, self.batch.endpoint)
            if line.custom_id in answered:
                continue
            weight = await self.take(sequences(line.body, self.batch.endpoint))
            stopped = self.stop_reason()
            if stopped is not None:
                window.give(weight)  # shared with the other batches
                self.unrun(line, stopped)
                break
            task = asyncio.create_task(self.guarded(line, len(raw)))
            self.running.add(task)
            task.add_done_callback(lambda t, w=weight: (self.running.discard(t), window.give(w)))
        await asyncio.gather(*self.running, return_exceptions=True)
        if self.cut_short and self.resumable:  # lines left for the next server, even if a
            # cancel or the expiry came meanwhile (the resumed run writes them off then)
            return "stopped"
        if stopped is None and self.cut_short:  # every line sent, then the stop came
            stopped = self.stop_reason() or "failed"
        if stopped in ("cancelled", "expired", "failed"):  # the lines never sent, written
            # off on a worker thread (a large input's rest would hold the loop): nothing
            # else writes the files now
            await asyncio.to_thread(self.unrun_rest, lines, answered, stopped)
        if stopped is None and self.batch.cancel.is_set():  # after the last was dispatched
            stopped = "cancelled"
        if stopped == "failed":
            message = "the server stopped before the batch ended"
            self.batch.errors = [
                {"code": "server_shutdown", "message": message, "param": None, "line": None}
            ]
        return stopped

    async def take(self, wanted: int) -> int:
        """Permits from the window, or none (0) once the batch is cancelled: a cancel does
        not wait for other batches' requests to give theirs back."""
        taking = asyncio.ensure_future(self.window.take(wanted))
        cancelled = asyncio.ensure_future(self.batch.cancel.wait())
        try:
            await asyncio.wait({taking, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if taking.done():
            return taking.result()
        taking.cancel()  # (Window.take gives back what it was granted meanwhile)
        with contextlib.suppress(asyncio.CancelledError):
            await taking
        return 0

    async def guarded(self, line: Line, size: int) -> None:
        """One line's run; a bug met by it fails that line alone (a 500 in the error file)."""
        try:
            await self.one(line, size)
        except Exception as e:
            logger.exception("batch %s: line %d failed", self.batch.id, line.number)
            try:
                self.write(line, 500, APIError(500, f"internal error in the batch: {e!r}").body())
            except Exception:
                logger.exception("batch %s: line %d is in neither file", self.batch.id, line.number)

    async def one(self, line: Line, size: int) -> None:
        refused = _refused_in_batch(line.body, self.batch.endpoint)
        if refused is not None:
            self.write(line, refused.status, refused.body())
            return
        # in the flex tier unless the line names one: interactive clients' requests first
        flex = line.body if "service_tier" in line.body else {**line.body, "service_tier": "flex"}
        body = await off_the_loop_if(size, lambda: json.dumps(flex).encode())
        wait_s, deadline = RETRY_FIRST_S, time.monotonic() + RETRY_FOR_S
        while True:
            if stopped := self.stop_reason():
                self.unrun(line, stopped)
                return
            status, answer = await call_route(
                self.app, self.batch.endpoint, body, self.headers, self.batch.cancel
            )
            # a 503: the scheduler's queue is full (other clients' requests fill it); wait,
            # then again, for up to RETRY_FOR_S (one that never fits ends as its 503)
            retry = time.monotonic() + wait_s < deadline and self.manager.dead is None
            if status != 503 or not retry:
                break
            until = time.monotonic() + wait_s
            while time.monotonic() < until and not self.stop_reason():  # a stop ends the wait
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self.batch.cancel.wait(), min(until - time.monotonic(), 0.25)
                    )
            wait_s = min(2 * wait_s, RETRY_MAX_S)
        if status == DISCONNECTED and self.batch.cancel.is_set():
            self.unrun(line, "cancelled")
            return
        if status == 503 and (stopped := self.stop_reason()):
            self.unrun(line, stopped)
            return
        try:
            parsed = json.loads(answer)
        except ValueError:
            parsed = APIError(status, answer.decode(errors="replace")).body()
        stopping = self.manager.draining or self.manager.dead is not None
        if stopping and (_aborted(parsed) or status >= 500):  # cut short by the stop
            self.cut_short = True
            if self.resumable:  # it runs again when the batch resumes
                return
            response = {"status_code": status, "request_id": None, "body": parsed}
            message = "the server stopped while this request ran: its answer is cut short"
            self.put("error", line, response, {"code": "server_shutdown", "message": message})
            self.batch.failed += 1
            return
        self.write(line, status, parsed)

    def write(self, line: Line, status: int, body: dict[str, Any]) -> None:
        ok = 200 <= status < 300
        request_id = body.get("id") if ok and isinstance(body.get("id"), str) else None
        response = {
            "status_code": status,
            "request_id": request_id or rapi.new_id("req"),
            "body": body,
        }
        usage = dict(self.batch.usage)
        if ok:
            _add_usage(usage, body.get("usage"))
        self.put("output" if ok else "error", line, response, None)  # the last that may fail
        self.batch.usage = usage
        if ok:
            self.batch.completed += 1
        else:
            self.batch.failed += 1

    def unrun_rest(self, lines: Iterator[tuple[int, bytes]], answered: set[str], why: str) -> None:
        for number, raw in lines:  # (checked already: each is a JSON object with its id)
            custom_id = json.loads(raw)["custom_id"]
            if custom_id not in answered:
                self.unrun(Line(number, custom_id, {}), why)

    def unrun(self, line: Line, why: str) -> None:
        """A line the batch will not run: written off, unless the batch resumes later."""
        if why in ("stopped", "failed"):
            self.cut_short = True
        if why == "stopped":
            return
        code = {"cancelled": "batch_cancelled", "expired": "batch_expired"}.get(
            why, "server_shutdown"
        )
        message = {
            "batch_cancelled": "the batch was cancelled before this request ended",
            "batch_expired": "the batch expired before this request ran",
            "server_shutdown": "the server stopped before this request ran",
        }[code]
        self.put("error", line, None, {"code": code, "message": message})
        self.batch.failed += 1

    def put(self, kind: str, line: Line, response: dict | None, error: dict | None) -> None:
        if kind not in self.outputs:
            self.outputs[kind] = work_path(self.work, self.batch.id, kind).open("ab")
        entry = {
            "id": rapi.new_id("batch_req"),
            "custom_id": line.custom_id,
            "response": response,
            "error": error,
        }
        try:
            text = json.dumps(entry, ensure_ascii=False).encode()
        except UnicodeEncodeError:  # a lone surrogate in an answer: escaped
            text = json.dumps(entry).encode()
        out = self.outputs[kind]
        out.write(text + b"\n")
        out.flush()  # (a server killed now loses no answer it wrote)

    def unlist(self) -> None:
        """Drop the output and error files the batch listed: their lines are still in its
        work files, listed again when it ends."""
        for file_id in (self.batch.output_file_id, self.batch.error_file_id):
            if file_id is not None:
                self.files.discard(file_id)
        self.batch.output_file_id = self.batch.error_file_id = None

    async def close_outputs(self) -> None:
        """List the output and error files written (each only if it has a line): their ids
        saved with the batch first, then each linked into the file store. The work files go
        once the batch has ended; a kill before that resumes from them (`recover` drops
        what this listed)."""
        batch = self.batch
        for out in self.outputs.values():
            out.close()
        self.outputs.clear()
        self.unlist()  # (a failed try's)
        made = {}
        for kind in ("output", "error"):
            path = work_path(self.work, batch.id, kind)
            if path.exists() and path.stat().st_size > 0:
                made[kind] = oai.new_id("file")
        batch.output_file_id, batch.error_file_id = made.get("output"), made.get("error")
        if batch.saved is not None:
            batch.saved(batch)
        for kind, file_id in made.items():
            source = work_path(self.work, batch.id, kind)
            await asyncio.to_thread(_link_or_copy, source, self.files.path(file_id))
            name = f"{batch.id}_{kind}.jsonl"
            self.files.add(file_id, name, "batch_output", batch.output_lifetime_s)


def _answers_in(path: Path, answered: set[str], usage: dict[str, int] | None) -> int:
    """The lines of a batch's output (with `usage` to add to) or error work file not cut
    off and not repeating a custom_id in `answered` (which they are added to): how many.
    The file is written again without the others."""
    data = path.read_bytes()
    kept = []
    for raw in data.split(b"\n"):  # (not splitlines: U+2028 may be in an answer)
        try:
            entry = json.loads(raw)
            custom_id = entry["custom_id"]
        except (ValueError, TypeError, KeyError):
            continue  # (an empty tail, or a line the stop cut off)
        if custom_id in answered:
            continue
        answered.add(custom_id)
        kept.append(raw + b"\n")
        if usage is not None:
            _add_usage(usage, ((entry.get("response") or {}).get("body") or {}).get("usage"))
    if b"".join(kept) != data:
        write_bytes_whole(path, b"".join(kept))
    return len(kept)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except (FileExistsError, FileNotFoundError):
        raise
    except OSError:  # (a file system without hard links)
        shutil.copyfile(source, target)


def _aborted(body: dict[str, Any]) -> bool:
    """An answer the server cut short (an abort): a choice that finished so, or a response
    that failed."""
    choices = body.get("choices")
    if isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices
    ):
        return True
    return body.get("object") == "response" and body.get("status") == "failed"


def _refused_in_batch(body: dict[str, Any], endpoint: str) -> APIError | None:
    """What a batch cannot run: a stream (there is no client reading it), or a response
    made in the background (the batch would end before it)."""
    if body.get("stream"):
        return bad_request("stream is not supported in a batch: leave it false", "stream")
    if endpoint == "/v1/responses" and body.get("background"):
        return bad_request("background is not supported in a batch: leave it false", "background")
    return None


def _add_usage(total: dict[str, int], usage: Any) -> None:
    """Add one answer's usage (chat/completions/embeddings' or the Responses API's)."""
    if not isinstance(usage, dict):
        return
    prompt_details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    output_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details")
    for key, value in (
        ("input_tokens", usage.get("prompt_tokens", usage.get("input_tokens"))),
        ("output_tokens", usage.get("completion_tokens", usage.get("output_tokens"))),
        ("cached_tokens", (prompt_details or {}).get("cached_tokens")),
        ("reasoning_tokens", (output_details or {}).get("reasoning_tokens")),
    ):
        total[key] = total.get(key, 0) + (value if isinstance(value, int) else 0)


# -- routes ---------------------------------------------------------------------------------
class ExpiresAfter(StrictBody):
    model_config = ConfigDict(extra="forbid")
    anchor: str
    seconds: int


class CreateBatch(StrictBody):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None


def _batches(request: Request) -> BatchStore:
    return request.app.state.batches


@router.post("/v1/batches")
async def create_batch(body: CreateBatch, request: Request) -> JSONResponse:
    files = files_api.store_of(request)
    if body.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
    if body.completion_window not in COMPLETION_WINDOWS:
        raise bad_request("completion_window must be '24h'", "completion_window")
    rapi.check_metadata(body.metadata)
    given = body.output_expires_after
    lifetime_s = files_api.lifetime(
        None if given is None else given.model_dump(), "output_expires_after"
    )
    stored = files.get(body.input_file_id, "input_file_id")
    if stored.purpose != "batch":
        raise bad_request(
            f"the input file {stored.id!r} was uploaded with purpose {stored.purpose!r}; a "
            "batch's input takes purpose 'batch'",
            "input_file_id",
        )
    now = int(time.time())
    batch = Batch(
        id=rapi.new_id("batch"),
        endpoint=body.endpoint,
        input_file_id=stored.id,
        completion_window=body.completion_window,
        created_at=now,
        expires_at=now + COMPLETION_WINDOWS[body.completion_window],
        metadata=body.metadata or {},
        output_lifetime_s=lifetime_s,
    )
    store = _batches(request)
    if request.app.state.server.manager.draining:
        raise EngineUnavailable("the server is shutting down and takes no new batches")
    if store.active() >= MAX_ACTIVE:
        raise APIError(
            429,
            f"{MAX_ACTIVE} batches are running or waiting: wait for one to end",
            type="rate_limit_error",
            code="too_many_batches",
        )
    try:
        await store.take_input(files.path(stored.id), batch.id)
    except FileNotFoundError:  # deleted meanwhile
        files.get(stored.id, "input_file_id")  # (the 404)
        raise
    store.add(batch)
    store.start(request.app, batch)
    return JSONResponse(batch.public())


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> JSONResponse:
    items = [b.public() for b in _batches(request).batches.values()]
    return JSONResponse(rapi.page(items, after, limit, "desc", "batches"))


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> JSONResponse:
    return JSONResponse(_batches(request).get(batch_id).public())


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    batch = _batches(request).get(batch_id)
    if batch.ended:
        raise APIError(
            409,
            f"Cannot cancel a batch with status {batch.status!r}.",
            param="batch_id",
            code="batch_not_cancellable",
        )
    if not batch.cancel.is_set():
        batch.cancel.set()
        batch.enter("cancelling")
    return JSONResponse(batch.public())
