"""The Files API's store and the Batch API's input checks, without a server: files kept in
a given folder are served again by a new store, expired ones are deleted, a temporary
folder goes with the store; a batch's input is checked line by line within OpenAI's bounds;
usage adds up from every endpoint's shape."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import time
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from radixserve import run_batch
from radixserve.server import batches, files
from radixserve.server import openai_api as oai
from radixserve.server.errors import APIError


def put(store: files.FileStore, data: bytes, lifetime_s: int | None = None) -> str:
    file_id = oai.new_id("file")
    store.path(file_id).write_bytes(data)
    store.add(file_id, "in.jsonl", "batch", lifetime_s)
    return file_id


def test_files_in_a_given_folder_outlive_the_store(tmp_path):
    store = files.FileStore(str(tmp_path))
    kept = put(store, b"abc")
    store.close()  # the user's folder stays
    again = files.FileStore(str(tmp_path))
    assert again.get(kept) == store.files[kept]
    assert again.path(kept).read_bytes() == b"abc"
    assert again.listed("batch", None, 10, "asc")["data"] == [store.files[kept].public()]
    assert again.listed("user_data", None, 10, "asc")["data"] == []


def test_expired_files_are_deleted_and_bad_descriptions_skipped(tmp_path):
    store = files.FileStore(str(tmp_path))
    short = put(store, b"x", lifetime_s=3600)
    long = put(store, b"y", lifetime_s=7200)
    described = store.path(short).with_suffix(".json")
    description = json.loads(described.read_text())
    described.write_text(json.dumps({**description, "expires_at": int(time.time()) - 1}))
    (tmp_path / "file-broken.json").write_text("{")
    store.close()
    again = files.FileStore(str(tmp_path))
    assert list(again.files) == [long]
    assert not again.path(short).exists() and not described.exists()

    again.files[long].expires_at = int(time.time()) - 1  # expires while served
    with pytest.raises(APIError) as e:
        again.get(long)
    assert e.value.status == 404 and not again.path(long).exists()


def test_a_temporary_folder_goes_with_the_store():
    store = files.FileStore(None)
    put(store, b"z")
    assert store.folder.is_dir()
    store.close()
    assert not store.folder.exists()


@pytest.mark.parametrize(
    "given, param",
    [
        ({"anchor": "last_active_at", "seconds": 3600}, "x.anchor"),
        ({"anchor": "created_at", "seconds": "soon"}, "x.seconds"),
        ({"anchor": "created_at", "seconds": True}, "x.seconds"),
        ({"anchor": "created_at", "seconds": 3599}, "x.seconds"),
        ({"anchor": "created_at", "seconds": 30 * 86400 + 1}, "x.seconds"),
    ],
)
def test_lifetimes_outside_openais_bounds_are_refused(given, param):
    with pytest.raises(APIError) as e:
        files.lifetime(given, "x")
    assert e.value.status == 400 and e.value.param == param
    assert files.lifetime({"anchor": "created_at", "seconds": "3600"}, "x") == 3600
    assert files.lifetime(None, "x") is None


def source(*lines: object) -> io.BytesIO:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
    return io.BytesIO(text.encode())


def request(custom_id: str, **extra: object) -> dict:
    entry = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions"}
    return {**entry, "body": {"model": "m", "prompt": "hi"}, **extra}


def test_the_input_check_counts_lines_and_names_the_model():
    checked = batches.check_input(source(request("a"), "", request("b")), "/v1/completions")
    assert (checked.total, checked.model, checked.errors) == (2, "m", [])
    checked = batches.check_input(source(request("a", colour=1)), "/v1/completions")
    assert [(e["code"], e["param"], e["line"]) for e in checked.errors] == [
        ("invalid_request", "colour", 1)
    ]


def test_the_input_check_keeps_openais_bounds(monkeypatch):
    monkeypatch.setattr(batches, "MAX_REQUESTS", 3)
    checked = batches.check_input(source(*(request(f"r{i}") for i in range(4))), "/v1/completions")
    assert [e["code"] for e in checked.errors] == ["too_many_requests"]
    monkeypatch.setattr(batches, "MAX_ERRORS", 2)
    checked = batches.check_input(source("[]", "1", "x", request("ok")), "/v1/completions")
    assert checked.total == 4 and [e["line"] for e in checked.errors] == [1, 2]
    monkeypatch.setattr(batches, "MAX_INPUT_BYTES", 10)
    checked = batches.check_input(source(request("big")), "/v1/completions")
    assert [e["code"] for e in checked.errors] == ["file_too_large"]


def test_usage_adds_up_from_every_endpoints_shape():
    total: dict[str, int] = {}
    chat = {"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {}}
    chat["prompt_tokens_details"]["cached_tokens"] = 6
    responses = {"input_tokens": 5, "output_tokens": 3}
    responses["input_tokens_details"] = {"cached_tokens": 1}
    responses["output_tokens_details"] = {"reasoning_tokens": 2}
    for usage in (chat, responses, {"prompt_tokens": 7, "total_tokens": 7}, None):
        batches._add_usage(total, usage)
    expected = {"input_tokens": 22, "output_tokens": 7, "cached_tokens": 7, "reasoning_tokens": 2}
    assert total == expected


class Engine:
    """A stand-in for the engine behind a small real app: a route that refuses the first
    `refusals` calls with 503 (a full queue), then answers, counting how many run at once."""

    def __init__(self, refusals: int = 0) -> None:
        self.refusals = refusals
        self.calls = self.running = self.most = 0
        self.release = asyncio.Event()
        self.release.set()

    def app(self, folder) -> FastAPI:
        app = FastAPI()
        manager = SimpleNamespace(dead=None, draining=False)
        config = SimpleNamespace(server=SimpleNamespace(resolved_api_key=None))
        app.state.server = SimpleNamespace(manager=manager, config=config)
        app.state.files = files.FileStore(str(folder))

        @app.post("/v1/completions")
        async def complete(request: Request) -> JSONResponse:
            self.calls += 1
            if self.refusals:
                self.refusals -= 1
                return JSONResponse({"error": {"message": "full"}}, status_code=503)
            prompt = (await request.json())["prompt"]  # the body first, as the routes read it
            self.running += 1
            self.most = max(self.most, self.running)
            await asyncio.sleep(0.01)  # long enough for the window to fill
            while not self.release.is_set():  # as the real routes, a disconnect aborts
                if await request.is_disconnected():
                    self.running -= 1
                    return JSONResponse({"error": {"message": "gone"}}, status_code=499)
                await asyncio.sleep(0.01)
            self.running -= 1
            return JSONResponse({"id": f"cmpl-{prompt}", "usage": {"prompt_tokens": 1}})

        return app


def a_batch(
    app: FastAPI, count: int, window: batches.Window, resumable: bool = False
) -> batches.Runner:
    now = int(time.time())
    batch = batches.Batch(
        oai.new_id("batch"), "/v1/completions", "file-t", "24h", now, now + 60, {}, None
    )
    lines = [{**request(f"r{i}"), "body": {"prompt": str(i)}} for i in range(count)]
    work = app.state.files.folder / "batches" / "work"
    work.mkdir(parents=True, exist_ok=True)
    batches.work_path(work, batch.id, "input").write_bytes(source(*lines).getvalue())
    return batches.Runner(app, batch, work, window, resumable)


def test_a_full_queue_is_waited_out(tmp_path, monkeypatch):
    monkeypatch.setattr(batches, "RETRY_FIRST_S", 0.01)
    engine = Engine(refusals=2)
    runner = a_batch(engine.app(tmp_path), 1, batches.Window(4))
    asyncio.run(runner.run())
    assert runner.batch.status == "completed" and engine.calls == 3
    assert (runner.batch.completed, runner.batch.failed) == (1, 0)


def test_batches_share_one_window_and_give_it_back(tmp_path):
    engine = Engine()
    app = engine.app(tmp_path)

    async def main() -> tuple[batches.Runner, ...]:
        window = batches.Window(3)
        runners = (a_batch(app, 5, window), a_batch(app, 4, window))
        await asyncio.gather(*(r.run() for r in runners))
        assert engine.most == 3

        engine.release.clear()  # the next batch's requests hang until cancelled
        cancelled = a_batch(app, 6, window)
        run = asyncio.ensure_future(cancelled.run())
        while engine.running < 3:
            await asyncio.sleep(0.01)
        cancelled.batch.cancel.set()
        await run
        engine.release.set()
        assert window.free == 3 and not window.waiting  # every permit back
        return (*runners, cancelled)

    first, second, cancelled = asyncio.run(main())
    assert first.batch.completed == 5 and second.batch.completed == 4
    assert cancelled.batch.status == "cancelled" and cancelled.batch.failed == 6
    errors = app.state.files.path(cancelled.batch.error_file_id).read_text().splitlines()
    assert {json.loads(e)["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_a_wait_for_the_queue_ends_with_a_cancel(tmp_path, monkeypatch):
    monkeypatch.setattr(batches, "RETRY_FIRST_S", 30.0)
    engine = Engine(refusals=100)
    runner = a_batch(engine.app(tmp_path), 1, batches.Window(4))

    async def main() -> None:
        run = asyncio.ensure_future(runner.run())
        while engine.calls == 0:
            await asyncio.sleep(0.01)
        runner.batch.cancel.set()
        await asyncio.wait_for(run, 10)  # not the 30 s wait

    asyncio.run(main())
    assert runner.batch.status == "cancelled" and engine.calls == 1
    assert (runner.batch.completed, runner.batch.failed) == (0, 1)


def test_the_window_is_weighed_in_sequences_first_come_first_served():
    async def main() -> list[str]:
        window = batches.Window(4)
        order: list[str] = []

        async def take(name: str, wanted: int) -> int:
            taken = await window.take(wanted)
            order.append(name)
            return taken

        assert await window.take(3) == 3
        big = asyncio.ensure_future(take("big", 9))  # at most the whole window
        small = asyncio.ensure_future(take("small", 1))  # fits now, but waits its turn
        gone = asyncio.ensure_future(take("gone", 1))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert order == [] and window.free == 1
        window.give(3)
        assert await big == 4
        window.give(4)
        assert await small == 1
        window.give(1)
        assert window.free == 4 and not window.waiting
        return order

    assert asyncio.run(main()) == ["big", "small"]


@pytest.mark.parametrize(
    "endpoint, body, count",
    [
        ("/v1/chat/completions", {"n": 3}, 3),
        ("/v1/completions", {"prompt": ["a", "b", "c", "d"], "n": 2}, 8),
        ("/v1/completions", {"prompt": [1, 2, 3]}, 1),
        ("/v1/completions", {"prompt": [[1, 2], [3]]}, 2),
        ("/v1/embeddings", {"input": ["a"] * 5}, 5),
        ("/v1/embeddings", {"input": "a"}, 1),
        ("/v1/responses", {"input": ["x", "y"]}, 1),
        ("/v1/score", {"query": "q", "items": ["a", "b", "c"]}, 3),
    ],
)
def test_a_requests_sequences(endpoint, body, count):
    assert batches.sequences(body, endpoint) == count


def test_lines_are_checked_as_request_bodies_are():
    entry = request("a")
    deep = json.dumps({**entry, "body": {"x": []}}).replace("[]", "[" * 100 + "]" * 100)
    surrogate = json.dumps(entry).replace('"a"', '"\\ud800"', 1)
    long_url = json.dumps({**entry, "url": "/v1/" + "x" * 10_000})
    checked = batches.check_input(source(deep, surrogate, long_url), "/v1/completions")
    codes = [(e["line"], e["code"]) for e in checked.errors]
    assert codes == [(1, "invalid_json_line"), (2, "invalid_json_line"), (3, "mismatched_url")]
    assert all(len(e["message"]) < 300 for e in checked.errors)


def test_an_embeddings_batch_is_bounded_in_inputs(monkeypatch):
    monkeypatch.setattr(batches, "MAX_EMBEDDING_INPUTS", 5)
    lines = [
        {"custom_id": str(i), "method": "POST", "url": "/v1/embeddings", "body": body}
        for i, body in enumerate([{"input": ["a"] * 3}] * 2)
    ]
    checked = batches.check_input(source(*lines), "/v1/embeddings")
    assert [e["code"] for e in checked.errors] == ["too_many_inputs"]


def test_bytes_no_description_lists_are_removed(tmp_path):
    store = files.FileStore(str(tmp_path))
    kept = put(store, b"a")
    stray = tmp_path / oai.new_id("file")
    stray.write_bytes(b"left by a crash")
    store.close()
    files.FileStore(str(tmp_path))
    assert not stray.exists() and store.path(kept).exists()


def test_one_server_to_a_folder(tmp_path):
    store = files.FileStore(str(tmp_path))
    with pytest.raises(ValueError, match=rf"in use by another server \(pid {os.getpid()}\)"):
        files.FileStore(str(tmp_path))
    store.close()
    files.FileStore(str(tmp_path)).close()  # free again


def test_an_upload_without_a_length_stops_at_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_FILE_BYTES", 1000)
    app = FastAPI()
    app.state.files = files.FileStore(str(tmp_path))
    app.include_router(files.router)
    app.add_exception_handler(APIError, lambda _, e: JSONResponse(e.body(), e.status))
    boundary = b"b0undary"
    head = b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    head += b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; '
    head += b'filename="a.jsonl"\r\n\r\n'
    chunks = [head] + [b"x" * 65536] * 48  # 3 MiB, in chunks, no Content-Length
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks[1:])}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/files",
        "query_string": b"",
        "headers": [(b"content-type", b"multipart/form-data; boundary=" + boundary)],
    }
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413, sent
    assert len(chunks) > 24  # it stopped reading past the limit (and its 1 MiB of form)
    assert not app.state.files.files and not list(tmp_path.glob("file-*"))


def test_a_cancel_does_not_wait_for_another_batchs_permits(tmp_path):
    engine = Engine()
    app = engine.app(tmp_path)

    async def main() -> tuple[batches.Runner, batches.Runner]:
        window = batches.Window(1)
        engine.release.clear()
        holder, waiter = a_batch(app, 1, window), a_batch(app, 3, window)
        holding = asyncio.ensure_future(holder.run())
        while engine.running < 1:
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(waiter.run())
        while waiter.batch.status != "in_progress":
            await asyncio.sleep(0.01)
        waiter.batch.cancel.set()
        await asyncio.wait_for(waiting, 10)  # while the holder still runs
        assert not holding.done() and window.free == 0
        engine.release.set()
        await holding
        assert window.free == 1 and not window.waiting
        return holder, waiter

    holder, waiter = asyncio.run(main())
    assert waiter.batch.status == "cancelled" and waiter.batch.failed == 3
    assert holder.batch.status == "completed" and holder.batch.completed == 1


def test_run_batch_checks_lines_first_and_sends_them_within_the_bounds(tmp_path, monkeypatch):
    given = tmp_path / "in.jsonl"
    good = [request(f"r{i}") for i in range(5)]
    embed = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings"}
    embed["body"] = {"input": ["a", "b", "c"]}
    rows = [*good[:2], "not json", {**good[2], "url": "/v2/x"}, good[0], *good[2:], embed]
    given.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n\n")
    lines, results = run_batch.read_input(given)
    assert len(results) == 9 and [x.custom_id for x in lines] == [
        "r0",
        "r1",
        *"r2 r3 r4".split(),
        "e",
    ]
    errors = {i: r["error"]["code"] for i, r in enumerate(results) if r is not None}
    assert errors == {2: "invalid_json_line", 3: "invalid_url", 4: "duplicate_custom_id"}
    assert [x.number for x in lines] == [1, 2, 6, 7, 8, 9] and lines[-1].inputs == 3

    monkeypatch.setattr(batches, "MAX_REQUESTS", 2)
    parts = run_batch.chunks(lines)
    assert [[x.custom_id for x in part] for part in parts] == [
        ["r0", "r1"],
        ["r2", "r3"],
        ["r4"],
        ["e"],
    ]
    monkeypatch.setattr(batches, "MAX_REQUESTS", 50)
    monkeypatch.setattr(batches, "MAX_INPUT_BYTES", 2 * len(lines[0].raw) + 2)
    assert [len(part) for part in run_batch.chunks(lines)] == [2, 2, 1, 1]


def test_batches_kept_in_a_folder_are_listed_again(tmp_path):
    store = batches.BatchStore(tmp_path, kept=True, capacity=3)
    now = int(time.time())

    def made(batch_id: str) -> batches.Batch:
        batch = batches.Batch(batch_id, "/v1/completions", "file-x", "24h", now, now + 60, {}, None)
        store.add(batch)
        return batch

    done, running = made("batch_done"), made("batch_running")
    done.total, done.completed, done.output_file_id = 3, 3, "file-out"
    done.enter("completed")
    running.enter("in_progress")
    cancelling = made("batch_cancelling")
    cancelling.enter("cancelling")
    again = batches.BatchStore(tmp_path, kept=True, capacity=3)
    assert list(again.batches) == ["batch_done", "batch_running", "batch_cancelling"]
    assert again.get("batch_done").public() == done.public()
    # the server stopped under the others: they resume, the cancel goes on
    assert [b.id for b in again.unfinished] == ["batch_running", "batch_cancelling"]
    assert again.get("batch_running").public() == running.public()
    assert again.get("batch_cancelling").cancel.is_set()
    assert not batches.BatchStore(tmp_path).batches  # (not kept: a temporary folder's)

    made("batch_new")  # past the capacity: the oldest ended one goes, from disk too
    assert "batch_done" not in store.batches and not (tmp_path / "batch_done.json").exists()


def test_a_batch_stopped_with_its_server_resumes_and_answers_each_line_once(tmp_path):
    """Stopped (the server draining), a resumable batch leaves its files as they are and
    stays in progress; run again, it reads back what it answered (a line whose write the
    stop cut off runs again) and runs the rest: each input line answered once."""
    engine = Engine()
    app = engine.app(tmp_path)
    runner = a_batch(app, 6, batches.Window(1), resumable=True)
    batch, work = runner.batch, runner.work

    async def stop_after(answered: int) -> None:
        run = asyncio.ensure_future(runner.run())
        while batch.completed < answered:
            await asyncio.sleep(0.005)
        app.state.server.manager.draining = True
        await run

    asyncio.run(stop_after(3))
    assert batch.status == "in_progress" and batch.output_file_id is None
    written = batches.work_path(work, batch.id, "output")
    lines = written.read_bytes().split(b"\n")[:-1]
    assert 3 <= len(lines) < 6 and engine.calls == len(lines)
    written.write_bytes(b"\n".join(lines[:-1]) + b"\n" + lines[-1][:20])  # a cut-off write

    app.state.server.manager.draining = False
    again = batches.Runner(app, batch, work, batches.Window(1), resumable=True)
    asyncio.run(again.run())
    assert batch.status == "completed" and (batch.completed, batch.failed) == (6, 0)
    assert engine.calls == 7  # the cut-off line once more
    out = app.state.files.path(batch.output_file_id).read_text().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in out) == [f"r{i}" for i in range(6)]
    assert batch.usage["input_tokens"] == 6  # (recounted from the lines kept)
    assert not list(work.iterdir())  # its work files gone: the input link too


def test_a_batch_that_cannot_resume_ends_failed_with_its_lines_written_off(tmp_path):
    engine = Engine()
    app = engine.app(tmp_path)
    runner = a_batch(app, 4, batches.Window(1))  # (no folder kept: nothing to resume from)
    app.state.server.manager.draining = True
    asyncio.run(runner.run())
    assert runner.batch.status == "failed" and runner.batch.failed == 4 and engine.calls == 0
    errors = app.state.files.path(runner.batch.error_file_id).read_text().splitlines()
    assert {json.loads(e)["error"]["code"] for e in errors} == {"server_shutdown"}


def test_a_failed_batchs_lines_are_accounted_for_in_the_inputs_numbers():
    part = [
        run_batch.Line(index=i, number=n, url="/v1/completions", custom_id=c, raw=b"{}", inputs=1)
        for i, (n, c) in enumerate([(3, "a"), (7, "b"), (9, "c")])
    ]
    results: list = [None, {"custom_id": "b", "response": {"status_code": 200}}, None]
    error = {"code": "invalid_body", "message": "line 3: body must be an object", "line": 3}
    batch = {"status": "failed", "errors": {"data": [error]}}
    run_batch._account_for(part, batch, results)
    assert results[0]["custom_id"] == "a" and results[0]["error"]["code"] == "batch_failed"
    assert results[1]["response"]["status_code"] == 200  # its own result stays
    assert results[2]["error"] == {
        "code": "invalid_body",
        "message": "line 9: body must be an object",
    }


def test_a_batch_cancelled_while_checked_accounts_for_every_line(tmp_path):
    engine = Engine()
    app = engine.app(tmp_path)
    runner = a_batch(app, 3, batches.Window(4))
    runner.batch.cancel.set()  # before its check ends
    asyncio.run(runner.run())
    assert runner.batch.status == "cancelled" and engine.calls == 0
    assert (runner.batch.total, runner.batch.failed) == (3, 3)
    errors = app.state.files.path(runner.batch.error_file_id).read_text().splitlines()
    assert [json.loads(e)["error"]["code"] for e in errors] == ["batch_cancelled"] * 3


def test_a_files_content_is_sent_whole_even_if_it_is_deleted_meanwhile(tmp_path):
    store = files.FileStore(str(tmp_path))
    data = b"x" * (files.READ_CHUNK + 5)
    file_id = put(store, data)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(files=store)))

    async def read() -> tuple[bytes, dict]:
        response = await files.file_content(file_id, request)
        store.delete(file_id)  # after the lookup, before the bytes are read
        sent = b"".join([chunk async for chunk in response.body_iterator])
        return sent, dict(response.headers)

    sent, headers = asyncio.run(read())
    assert sent == data and headers["content-length"] == str(len(data))
    assert headers["content-disposition"] == 'attachment; filename="in.jsonl"'
    with pytest.raises(APIError) as e:
        asyncio.run(files.file_content(file_id, request))
    assert e.value.status == 404


async def drain_with_all_in_flight(engine: Engine, app: FastAPI, runner: batches.Runner) -> None:
    """Run the batch; once its 3 lines are all in flight, the server drains, then they end."""
    run = asyncio.ensure_future(runner.run())
    while engine.running < 3:
        await asyncio.sleep(0.005)
    app.state.server.manager.draining = True
    engine.release.set()
    await run


@pytest.mark.parametrize("resumable", [True, False])
def test_a_stop_after_the_last_line_was_sent_leaves_no_line_unaccounted(
    tmp_path, monkeypatch, resumable
):
    """Every line in flight when the server drains, then cut short by it: a resumable batch
    stays in progress (the lines run again on resuming), another fails with each line
    written off; neither ends "completed" with lines in neither file."""
    engine = Engine()
    engine.release.clear()
    app = engine.app(tmp_path)
    runner = a_batch(app, 3, batches.Window(8), resumable=resumable)
    monkeypatch.setattr(batches, "_aborted", lambda body: True)  # the drain's aborts

    asyncio.run(drain_with_all_in_flight(engine, app, runner))
    batch = runner.batch
    if resumable:
        assert batch.status == "in_progress" and (batch.completed, batch.failed) == (0, 0)
        assert batches.work_path(runner.work, batch.id, "input").exists()
    else:
        assert batch.status == "failed" and batch.failed == 3
        assert batch.errors[0]["code"] == "server_shutdown"


def test_a_resumable_batch_keeps_its_work_when_its_task_is_cancelled_or_the_engine_dies(
    tmp_path,
):
    engine = Engine()
    app = engine.app(tmp_path)
    runner = a_batch(app, 6, batches.Window(2), resumable=True)

    async def cancel_after(answered: int) -> None:  # (what the server's teardown does)
        run = asyncio.ensure_future(runner.run())
        while runner.batch.completed < answered:
            await asyncio.sleep(0.005)
        engine.release.clear()
        await asyncio.sleep(0.05)
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run

    asyncio.run(cancel_after(2))
    kept = batches.work_path(runner.work, runner.batch.id, "output").read_text().splitlines()
    assert 2 <= len(kept) < 6 and runner.batch.status == "in_progress"

    engine.release.set()
    app.state.server.manager.dead = "the scheduler0 process exited with code -9"
    calls = engine.calls
    again = batches.Runner(app, runner.batch, runner.work, batches.Window(2), resumable=True)
    asyncio.run(again.run())  # nothing runs, nothing is written off: it waits to resume
    assert runner.batch.status == "in_progress" and runner.batch.failed == 0
    assert engine.calls == calls and runner.batch.completed == len(kept)


def test_a_finalize_cut_short_is_undone_on_resuming(tmp_path):
    """Killed while listing its files: the listings go, the batch resumes from its work
    files and lists them once it ends."""
    engine = Engine()
    app = engine.app(tmp_path)
    store = app.state.files
    runner = a_batch(app, 3, batches.Window(2), resumable=True)
    asyncio.run(runner.run())
    batch = runner.batch
    listed = batch.output_file_id
    content = store.path(listed).read_bytes()
    batch.status = "finalizing"  # as a kill after the listing left it
    batches.work_path(runner.work, batch.id, "output").write_bytes(content)
    batches.work_path(runner.work, batch.id, "input").write_bytes(
        source(*[{**request(f"r{i}"), "body": {"prompt": str(i)}} for i in range(3)]).getvalue()
    )
    again = batches.Runner(app, batch, runner.work, batches.Window(2), resumable=True)
    asyncio.run(again.run())
    assert batch.status == "completed" and engine.calls == 3  # no line ran again
    assert listed not in store.files and not store.path(listed).exists()
    assert store.path(batch.output_file_id).read_bytes() == content
    assert not list(runner.work.iterdir())


def test_stale_work_files_go_and_a_lost_input_fails_the_batch(tmp_path):
    store = batches.BatchStore(tmp_path, kept=True)
    now = int(time.time())
    batch = batches.Batch("batch_lost", "/v1/completions", "file-x", "24h", now, now + 60, {}, None)
    store.add(batch)
    batch.enter("in_progress")
    batches.work_path(store.work, "batch_lost", "output").write_text(
        json.dumps({"custom_id": "a", "response": {"status_code": 200, "body": {}}}) + "\n"
    )
    batches.work_path(store.work, "batch_gone", "input").write_text("left by a kill")
    again = batches.BatchStore(tmp_path, kept=True)
    assert [p.name for p in again.work.iterdir()] == ["batch_lost.output.jsonl"]

    engine = Engine()
    app = engine.app(tmp_path / "files")
    lost = again.get("batch_lost")
    asyncio.run(batches.Runner(app, lost, again.work, batches.Window(2), resumable=True).run())
    assert lost.status == "failed" and lost.errors[0]["code"] == "input_lost"
    assert lost.completed == 1 and lost.output_file_id in app.state.files.files  # kept


def test_an_embedding_aborted_before_it_ran_is_a_503():
    from radixserve.server.embeddings import embedding_response

    aborted = {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "stop"}}}
    with pytest.raises(APIError) as e:
        embedding_response([aborted], "float", "m")
    assert e.value.status == 503 and "aborted" in e.value.message


class Killed(BaseException):
    """The process killed (nothing after it runs)."""


@pytest.mark.parametrize("ending", ["cancelled", "expired"])
def test_a_batch_killed_while_it_finalizes_ends_as_it_was_ending(tmp_path, monkeypatch, ending):
    engine = Engine()
    app = engine.app(tmp_path / "files")
    store = batches.BatchStore(app.state.files.folder / "batches", kept=True)
    now = int(time.time())
    expires = now + 60 if ending == "cancelled" else now - 1
    batch = batches.Batch(
        f"batch_{ending}", "/v1/completions", "file-t", "24h", now, expires, {}, None
    )
    store.add(batch)
    lines = [{**request(f"r{i}"), "body": {"prompt": str(i)}} for i in range(3)]
    batches.work_path(store.work, batch.id, "input").write_bytes(source(*lines).getvalue())
    if ending == "cancelled":
        batch.cancel.set()
        batch.enter("cancelling")

    def killed(*args: object, **kwargs: object) -> None:
        raise Killed

    with monkeypatch.context() as patched:
        patched.setattr(files.FileStore, "add", killed)
        runner = batches.Runner(app, batch, store.work, batches.Window(2), resumable=True)
        with pytest.raises(Killed):
            asyncio.run(runner.run())
    app.state.files.close()
    app = engine.app(tmp_path / "files")  # a server again on the folder
    again = batches.BatchStore(app.state.files.folder / "batches", kept=True)
    resumed = again.get(batch.id)
    assert resumed.status == "finalizing"
    asyncio.run(batches.Runner(app, resumed, again.work, batches.Window(2), True).run())
    assert resumed.status == ending and (resumed.completed, resumed.failed) == (0, 3)


def test_a_cancel_during_the_drain_leaves_the_lines_it_cut_short_to_the_resume(
    tmp_path, monkeypatch
):
    engine = Engine()
    engine.release.clear()
    app = engine.app(tmp_path)
    runner = a_batch(app, 3, batches.Window(8), resumable=True)
    batch = runner.batch

    def aborted(body: dict) -> bool:  # the drain's abort, then a cancel right after
        if not batch.cancel.is_set():
            batch.cancel.set()
            batch.enter("cancelling")
        return True

    monkeypatch.setattr(batches, "_aborted", aborted)

    asyncio.run(drain_with_all_in_flight(engine, app, runner))
    assert batch.status == "cancelling"  # not ended: the next server writes the rest off
    app.state.server.manager.draining = False
    asyncio.run(batches.Runner(app, batch, runner.work, batches.Window(8), True).run())
    assert batch.status == "cancelled" and batch.completed + batch.failed == 3
    written = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            text = app.state.files.path(file_id).read_text()
            written += [json.loads(x)["custom_id"] for x in text.splitlines()]
    assert sorted(written) == ["r0", "r1", "r2"]  # each once
