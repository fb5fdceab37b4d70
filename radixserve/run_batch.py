"""`radixserve run-batch -i requests.jsonl -o results.jsonl [server flags]`: a file of OpenAI
batch requests run offline, as vLLM's `run_batch` does. It serves the model on a private
port for the length of the run, sends the file through the server's Batch API (one batch
per url the lines name), and writes every line's result, in the input's order, as the
Batch API's output lines: `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`. The exit code is 0 when every batch ran (a request's own error is in its
line), 1 when one was refused whole (its errors are printed), 2 for a bad command line."""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx2

from radixserve.config import Config
from radixserve.server.batches import ENDPOINTS

POLL_S = 1.0
PROGRESS_S = 10.0  # how often the progress line is printed
READY_TIMEOUT_S = 900.0
ENDED = ("completed", "failed", "cancelled", "expired")


def group_by_url(path: Path) -> tuple[dict[str, list[bytes]], list[str]]:
    """The input's lines grouped by the url each names (a line that names none, or not a
    JSON object, goes with the first group: its batch's check reports it), and the
    custom_ids in the input's order."""
    groups: dict[str, list[bytes]] = defaultdict(list)
    order: list[str] = []
    for raw in path.read_bytes().splitlines():
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except ValueError:
            entry = None
        url = entry.get("url") if isinstance(entry, dict) else None
        if url not in ENDPOINTS:
            url = next(iter(groups), ENDPOINTS[0])
        groups[url].append(raw)
        if isinstance(entry, dict) and isinstance(entry.get("custom_id"), str):
            order.append(entry["custom_id"])
    return dict(groups), order


class Client:
    """The run's side of the server: waits for it, then runs each group as a batch."""

    def __init__(self, url: str, api_key: str) -> None:
        self.url = url
        self.http = httpx2.Client(
            base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=600
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not become ready within {READY_TIMEOUT_S:.0f} s")

    def run(self, groups: dict[str, list[bytes]]) -> tuple[dict[str, dict], list[str]]:
        """Every group's batch run together; each line's result by custom_id, and the
        errors of batches refused whole."""
        started = {}
        for url, lines in groups.items():
            upload = self.http.post(
                "/v1/files",
                files={"file": ("input.jsonl", b"\n".join(lines))},
                data={"purpose": "batch"},
            )
            file_id = _ok(upload)["id"]
            batch = self.http.post(
                "/v1/batches",
                json={"input_file_id": file_id, "endpoint": url, "completion_window": "24h"},
            )
            started[url] = _ok(batch)["id"]
        batches = self.wait(started)
        results: dict[str, dict] = {}
        refused: list[str] = []
        for url, batch in batches.items():
            for error in (batch.get("errors") or {}).get("data") or []:
                refused.append(f"{url}: {error['message']} ({error['code']})")
            for key in ("output_file_id", "error_file_id"):
                if batch.get(key):
                    content = self.http.get(f"/v1/files/{batch[key]}/content")
                    for raw in _content(content).splitlines():
                        entry = json.loads(raw)
                        results[entry["custom_id"]] = entry
        return results, refused

    def wait(self, started: dict[str, str]) -> dict[str, dict]:
        last_said = time.monotonic()
        while True:
            batches = {url: _ok(self.http.get(f"/v1/batches/{b}")) for url, b in started.items()}
            if all(b["status"] in ENDED for b in batches.values()):
                return batches
            if time.monotonic() - last_said >= PROGRESS_S:
                last_said = time.monotonic()
                counts = [b["request_counts"] for b in batches.values()]
                done = sum(c["completed"] + c["failed"] for c in counts)
                total = sum(c["total"] for c in counts)
                print(f"run-batch: {done}/{total} requests done", file=sys.stderr, flush=True)
            time.sleep(POLL_S)


def _ok(response: httpx2.Response) -> dict[str, Any]:
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.url.path}: {response.status_code} {response.text}")
    return response.json()


def _content(response: httpx2.Response) -> str:
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.url.path}: {response.status_code} {response.text}")
    return response.text


def write_results(path: Path, order: list[str], results: dict[str, dict]) -> None:
    """The results in the input's order (a custom_id the input gives twice once), then any
    the order did not name."""
    ordered = [c for c in dict.fromkeys(order) if c in results]
    ordered += [c for c in results if c not in set(ordered)]
    with path.open("w") as out:
        for custom_id in ordered:
            out.write(json.dumps(results[custom_id], ensure_ascii=False) + "\n")


def run(config: Config, input_file: str, output_file: str, log_level: str) -> int:
    from radixserve.server.launch import bind_socket, launch_server

    source, target = Path(input_file), Path(output_file)
    if not source.is_file():
        print(f"radixserve run-batch: error: no input file {source}", file=sys.stderr)
        return 2
    groups, order = group_by_url(source)
    if not groups:
        print(f"radixserve run-batch: error: {source} has no requests", file=sys.stderr)
        return 2
    with bind_socket("127.0.0.1", 0) as probe:  # a free port for the private server
        port = probe.getsockname()[1]
    api_key = secrets.token_hex(16)
    server = replace(config.server, host="127.0.0.1", port=port, api_key=api_key)
    config = replace(config, server=server)
    outcome: dict[str, Any] = {}

    def client_side() -> None:
        try:
            client = Client(f"http://127.0.0.1:{port}", api_key)
            client.wait_ready()
            outcome["results"], outcome["refused"] = client.run(groups)
        except Exception as e:  # reported after the server has stopped
            outcome["error"] = e
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # the server drains and stops

    print(f"run-batch: starting the server for {len(order)} requests", file=sys.stderr)
    threading.Thread(target=client_side, name="run-batch", daemon=True).start()
    code = launch_server(config, log_level)
    if "error" in outcome:
        print(f"radixserve run-batch: error: {outcome['error']}", file=sys.stderr)
        return 1
    if "results" not in outcome:
        print(f"radixserve run-batch: the server stopped (exit code {code})", file=sys.stderr)
        return 1
    results, refused = outcome["results"], outcome["refused"]
    write_results(target, order, results)
    for message in refused:
        print(f"radixserve run-batch: refused: {message}", file=sys.stderr)
    failed = sum(1 for entry in results.values() if entry.get("error") or _status(entry) >= 400)
    print(
        f"run-batch: {len(order)} requests, {len(results)} results in {target}"
        f" ({failed} failed)" + (f"; {len(refused)} errors refused a batch" if refused else ""),
        file=sys.stderr,
    )
    return 1 if refused else 0


def _status(entry: dict[str, Any]) -> int:
    return ((entry.get("response") or {}).get("status_code")) or 0
