"""`radixserve run-batch -i requests.jsonl -o results.jsonl [server flags]`: a file of OpenAI
batch requests run offline, as vLLM's `run_batch` does. It serves the model on a private
port for the length of the run and sends the file through the server's Batch API: the
lines are checked here first (a line that is not a request of an endpoint served, or whose
custom_id an earlier line has, gets its error line and is not sent), then sent as batches,
one per url and within the Batch API's bounds (requests, bytes, embedding inputs) each.
Every line's result is written in the input's order, as the Batch API's output lines:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.

With --file-storage-path, a run stopped before its end (Ctrl-C, a kill) resumes when the
same command runs again: the server on the folder resumes its batches (server/batches.py),
and the run takes them up again instead of sending the input anew (they are named in
`<folder>/run-batch/<the input's sha256>.json` until the run ends well).

Exit code: 0 when every batch ran (a request's own error is in its line), 1 when one did
not (the reason is printed), 2 for a bad command line or an input with no requests."""

from __future__ import annotations

import hashlib
import json
import secrets
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx2

from radixserve.config import Config
from radixserve.server import batches
from radixserve.server import files as files_api
from radixserve.server import responses_api as rapi

POLL_S = 1.0
CLIENT_END_TIMEOUT_S = 30.0
PROGRESS_S = 10.0  # how often the progress line is printed


@dataclass
class Line:
    index: int  # among the input's non-blank lines
    number: int  # the line's number in the file
    url: str
    custom_id: str
    raw: bytes
    inputs: int  # sequences: embedding inputs count toward an embeddings batch's bound


def error_entry(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    error = {"code": code, "message": message}
    return {"id": rapi.new_id("batch_req"), "custom_id": custom_id, "response": None,
            "error": error}  # fmt: skip


def read_input(path: Path) -> tuple[list[Line], list[dict[str, Any] | None]]:
    """The lines to send, and a result slot for every non-blank line of the input (the
    error line of each that is not sent)."""
    lines: list[Line] = []
    results: list[dict[str, Any] | None] = []
    seen: set[str] = set()
    with path.open("rb") as source:
        for number, raw in enumerate(source, 1):
            if not raw.strip():
                continue
            index = len(results)
            results.append(None)
            try:
                entry = json.loads(raw)
            except (ValueError, RecursionError):
                entry = None
            given = entry.get("url") if isinstance(entry, dict) else None
            url = given if given in batches.ENDPOINTS else batches.ENDPOINTS[0]
            custom_id = entry.get("custom_id") if isinstance(entry, dict) else None
            try:
                if isinstance(entry, dict) and given not in batches.ENDPOINTS:
                    raise ValueError(
                        "invalid_url",
                        f"line {number}: url must be one of {', '.join(batches.ENDPOINTS)}, "
                        f"got {batches.shown(given)}",
                    )
                line = batches.parse_line(number, raw, url)  # the server's own check
                if line.custom_id in seen:
                    raise ValueError(
                        "duplicate_custom_id",
                        f"line {number}: custom_id {batches.shown(line.custom_id)} is used by "
                        "an earlier line",
                    )
            except ValueError as e:
                shown = custom_id if isinstance(custom_id, str) else None
                results[index] = error_entry(shown, e.args[0], e.args[1])
                continue
            inputs = batches.sequences(line.body, url)
            too_big = len(raw) + 1 > batches.MAX_INPUT_BYTES
            too_many = url == "/v1/embeddings" and inputs > batches.MAX_EMBEDDING_INPUTS
            if too_big or too_many:  # no batch could take it
                what = "bytes" if too_big else "embedding inputs"
                message = f"line {number}: more {what} than one batch takes"
                results[index] = error_entry(line.custom_id, "request_too_large", message)
                continue
            seen.add(line.custom_id)
            lines.append(Line(index, number, url, line.custom_id, raw.rstrip(b"\r\n"), inputs))
    return lines, results


def chunks(lines: list[Line]) -> list[list[Line]]:
    """The lines as batches: one url each, each within the Batch API's bounds."""
    made: list[list[Line]] = []
    for url in batches.ENDPOINTS:
        chunk: list[Line] = []
        size = inputs = 0
        for line in (x for x in lines if x.url == url):
            full = (
                len(chunk) >= batches.MAX_REQUESTS
                or size + len(line.raw) + 1 > batches.MAX_INPUT_BYTES
                or (url == "/v1/embeddings" and inputs + line.inputs > batches.MAX_EMBEDDING_INPUTS)
            )
            if full and chunk:
                made.append(chunk)
                chunk, size, inputs = [], 0, 0
            chunk.append(line)
            size += len(line.raw) + 1
            inputs += line.inputs
        if chunk:
            made.append(chunk)
    return made


class Client:
    """The run's side of the server: waits for it, then runs the batches (those of a run
    of the same input stopped earlier, named in `record`, taken up again)."""

    def __init__(
        self, url: str, api_key: str, server_up: threading.Event, record: Path | None = None
    ) -> None:
        self.server_up = server_up
        self.record = record
        self.http = httpx2.Client(
            base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=600
        )

    def wait_ready(self) -> None:
        """Until the server answers /health (a large model may take long to load), or
        stops (it could not start: the launcher says why)."""
        while self.server_up.is_set():
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server stopped before it was ready")

    def run(self, parts: list[list[Line]], results: list[dict | None]) -> list[str]:
        """Every batch run together, their results put in `results`; what went wrong with
        the batches that did not complete."""
        earlier = self.earlier_batches()
        started: list[str] = []
        for part in parts:
            again = earlier[len(started)] if len(started) < len(earlier) else None
            if again is not None and self.resumable(again):
                started.append(again)
                continue
            upload = self.http.post(
                "/v1/files",
                files={"file": ("input.jsonl", b"\n".join(line.raw for line in part))},
                data={"purpose": "batch"},
            )
            body = {"input_file_id": _ok(upload)["id"], "endpoint": part[0].url}
            started.append(
                _ok(self.http.post("/v1/batches", json=body | {"completion_window": "24h"}))["id"]
            )
            if self.record is not None:  # (whole or not at all)
                files_api.write_json_whole(self.record, {"batches": started})
        problems = []
        for part, batch in zip(parts, self.wait(started)):
            by_id = {line.custom_id: line for line in part}
            for key in ("output_file_id", "error_file_id"):
                if batch.get(key):
                    content = _ok(self.http.get(f"/v1/files/{batch[key]}/content"), False)
                    for raw in content.split(b"\n"):  # (not splitlines: U+2028 is text)
                        if raw.strip():
                            entry = json.loads(raw)
                            results[by_id[entry["custom_id"]].index] = entry
            if batch["status"] != "completed":
                problems.append(f"a batch of {part[0].url} ended {batch['status']}")
                _account_for(part, batch, results)
        if not problems and self.record is not None:  # done: a run again runs anew
            self.record.unlink(missing_ok=True)
        return problems

    def earlier_batches(self) -> list[str]:
        """The batches a run of this input stopped earlier made (none without a record)."""
        if self.record is None or not self.record.is_file():
            return []
        try:
            named = json.loads(self.record.read_text())["batches"]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        return [b for b in named if isinstance(b, str)] if isinstance(named, list) else []

    def resumable(self, batch_id: str) -> bool:
        """The server knows the batch, and it runs on or completed (one that failed, was
        cancelled or expired is made anew)."""
        response = self.http.get(f"/v1/batches/{batch_id}")
        if response.status_code != 200:
            return False
        status = response.json()["status"]
        if status in batches.ENDED and status != "completed":
            return False
        print(f"run-batch: taking up batch {batch_id} ({status}) again", file=sys.stderr)
        return True

    def wait(self, started: list[str]) -> list[dict]:
        last_said = time.monotonic()
        while True:
            batches_now = [_ok(self.http.get(f"/v1/batches/{b}")) for b in started]
            if all(b["status"] in batches.ENDED for b in batches_now):
                return batches_now
            if time.monotonic() - last_said >= PROGRESS_S:
                last_said = time.monotonic()
                counts = [b["request_counts"] for b in batches_now]
                done = sum(c["completed"] + c["failed"] for c in counts)
                total = sum(c["total"] for c in counts)
                print(f"run-batch: {done}/{total} requests done", file=sys.stderr, flush=True)
            time.sleep(POLL_S)


def _ok(response: httpx2.Response, json_body: bool = True) -> Any:
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.url.path}: {response.status_code} {response.text}")
    return response.json() if json_body else response.content


def _account_for(part: list[Line], batch: dict[str, Any], results: list) -> None:
    """The lines of a batch that did not complete and gave no result: each with the error
    the batch names for its line (numbered as in the input), or the batch's end."""
    by_number = {}
    for error in (batch.get("errors") or {}).get("data") or []:
        if isinstance(error.get("line"), int) and 1 <= error["line"] <= len(part):
            by_number[error["line"]] = error
    for n, line in enumerate(part, 1):
        if results[line.index] is not None:
            continue
        error = by_number.get(n)
        if error is not None:
            message = error["message"].replace(f"line {n}:", f"line {line.number}:", 1)
            results[line.index] = error_entry(line.custom_id, error["code"], message)
        else:
            message = f"its batch ended {batch['status']} before this request ran"
            results[line.index] = error_entry(line.custom_id, f"batch_{batch['status']}", message)


def run(config: Config, input_file: str, output_file: str, log_level: str) -> int:
    source, target = Path(input_file), Path(output_file)
    if not source.is_file():
        print(f"radixserve run-batch: error: no input file {source}", file=sys.stderr)
        return 2
    lines, results = read_input(source)
    if not results:
        print(f"radixserve run-batch: error: {source} has no requests", file=sys.stderr)
        return 2
    outcome: dict[str, Any] = {"problems": []}
    if lines:
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        outcome = serve_and_run(config, chunks(lines), results, log_level, digest)
    missing = [i for i, entry in enumerate(results) if entry is None]
    for i in missing:  # (the run stopped before these came back)
        results[i] = error_entry(None, "no_result", "the run ended before this request's result")
    with target.open("w") as out:
        for entry in results:
            out.write(json.dumps(entry, ensure_ascii=False) + "\n")
    failed = sum(1 for e in results if e and (e.get("error") or _status(e) >= 400))
    print(
        f"run-batch: {len(results)} requests, results in {target} ({failed} failed)",
        file=sys.stderr,
    )
    for problem in outcome["problems"]:
        print(f"radixserve run-batch: {problem}", file=sys.stderr)
    return 1 if outcome["problems"] or missing else 0


def serve_and_run(
    config: Config, parts: list[list[Line]], results: list, log_level: str, source_hash: str = ""
) -> dict[str, Any]:
    """Serve the model on a private port and key in this thread while a client thread runs
    the batches, then stops the server (SIGTERM: it drains and exits)."""
    from radixserve.server.children import bind_socket
    from radixserve.server.launch import launch_server

    with bind_socket("127.0.0.1", 0) as probe:  # a free port for the private server
        port = probe.getsockname()[1]
    api_key = secrets.token_hex(16)
    server = replace(config.server, host="127.0.0.1", port=port, api_key=api_key)
    server_up = threading.Event()  # set while the server runs
    launched: list[Any] = []  # the launcher, to stop it from the client's thread
    outcome: dict[str, Any] = {"problems": []}

    record = _record_of(config, source_hash)

    def client_side() -> None:
        try:
            client = Client(f"http://127.0.0.1:{port}", api_key, server_up, record)
            client.wait_ready()
            outcome["problems"] = client.run(parts, results)
        except Exception as e:
            outcome["problems"] = [f"error: {e}"]
        finally:
            launched[0].request_stop()  # drain and stop (nothing if it has stopped)

    count = sum(len(part) for part in parts)
    print(f"run-batch: starting the server for {count} requests", file=sys.stderr)
    server_up.set()
    client = threading.Thread(target=client_side, name="run-batch", daemon=True)

    def on_launch(launcher: Any) -> None:
        launched.append(launcher)
        client.start()

    try:
        code = launch_server(replace(config, server=server), log_level, launched=on_launch)
    finally:
        server_up.clear()
    if client.ident is not None:  # (its reads end once the server is gone)
        client.join(timeout=CLIENT_END_TIMEOUT_S)
    if code != 0 and not outcome["problems"]:
        outcome["problems"] = [f"the server stopped with exit code {code}"]
    return outcome


def _record_of(config: Config, source_hash: str) -> Path | None:
    """Where the batches of a run of this input are named while it runs (with a folder)."""
    folder = config.server.file_storage_path
    if folder is None or not source_hash:
        return None
    (Path(folder) / "run-batch").mkdir(parents=True, exist_ok=True)
    return Path(folder) / "run-batch" / f"{source_hash}.json"


def _status(entry: dict[str, Any]) -> int:
    return ((entry.get("response") or {}).get("status_code")) or 0
