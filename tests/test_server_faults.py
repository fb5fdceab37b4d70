"""Fault tolerance of the real server (`radixserve serve`, three processes), end to end:
client disconnects, a dying scheduler, SIGTERM drain, overload, API keys, startup failures
and a killed main process. Every scenario ends with no process of the server left.

The tiny random-weight Llama keeps each server start to seconds; requests are made long
with `ignore_eos` and a large `max_new_tokens`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import requests

from tests.server_utils import ServerProcess, alive, assert_all_gone, free_port

KV_TOKENS = "8192"  # a small KV pool: the default on CPU is a quarter of the machine's RAM
LONG = 2000  # tokens of a request that runs for many seconds (context 2048)
CLIENT_TIMEOUT_S = 60  # no request of these tests may hang longer than this
EXIT_DEADLINE_S = 20  # "does not hang": generous, never a performance claim
DRAIN_TIMEOUT_S = 90  # 4 x 200 tokens take a few seconds; a loaded 2-core machine, far more


class Server(ServerProcess):
    """ServerProcess plus the scheduler's state and the list of every process it runs."""

    def wait_ready(self, headers: dict[str, str] | None = None) -> Server:
        super().wait_ready(headers)
        return self

    def state(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        info = requests.get(self.url + "/get_server_info", headers=headers, timeout=10)
        assert info.status_code == 200, info.text
        return info.json()["internal_states"][0]

    def processes(self) -> list[psutil.Process]:
        """Every process of this server: the main one and all its descendants, now and at
        ready (a child that already died still counts: it must stay dead)."""
        procs = {p.pid: p for p in self.children}
        try:
            main = psutil.Process(self.proc.pid)
            procs[main.pid] = main
            procs.update({p.pid: p for p in main.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
        return list(procs.values())


@pytest.fixture
def tiny(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llama"])


@pytest.fixture
def launch(tmp_path, tiny) -> Iterator[Callable[..., Server]]:
    """Start a ready server on the tiny model; every one is stopped at the end."""
    servers: list[Server] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> Server:
        log = tmp_path / f"server{len(servers)}.log"
        server = Server("--model-path", tiny, "--max-total-tokens", KV_TOKENS, *flags,
                        env=env, log=log)  # fmt: skip
        servers.append(server)
        return server.wait_ready()

    yield start
    for server in servers:
        server.stop()


# -- helpers --------------------------------------------------------------------------------
def assert_server_gone(server: Server, procs: list[psutil.Process]) -> None:
    assert server.proc.poll() is not None, "the main process still runs"
    assert_all_gone(procs)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def generated_tokens(server: Server) -> float | None:
    """The generated tokens that reached the main process (/metrics answers even while
    draining); None once the server no longer answers."""
    try:
        text = requests.get(server.url + "/metrics", timeout=5).text
    except requests.RequestException:
        return None
    for line in text.splitlines():
        if line.startswith("radixserve_generation_tokens_total "):
            return float(line.split()[1])
    return None


def generate_body(max_new_tokens: int, stream: bool = False, text: str = "hello") -> dict:
    return {
        "text": text,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        "stream": stream,
    }


def post_generate(server: Server, max_new_tokens: int, **kwargs: Any) -> requests.Response:
    body = generate_body(max_new_tokens, text=kwargs.pop("text", "hello"))
    kwargs.setdefault("timeout", CLIENT_TIMEOUT_S)
    return requests.post(server.url + "/generate", json=body, **kwargs)


def open_stream(server: Server, max_new_tokens: int) -> tuple[requests.Response, Iterator[str]]:
    """A streaming /generate; returns the response and an iterator over its SSE data."""
    r = requests.post(server.url + "/generate", json=generate_body(max_new_tokens, stream=True),
                      stream=True, timeout=CLIENT_TIMEOUT_S)  # fmt: skip
    assert r.status_code == 200, r.text

    def data() -> Iterator[str]:
        for line in r.iter_lines(decode_unicode=True):
            if line and line.startswith("data: "):
                yield line.removeprefix("data: ")

    return r, data()


def error_body(r: requests.Response) -> dict[str, Any]:
    """The OpenAI error shape every failure must have: {"error": {message, type, param, code}}."""
    body = r.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]


def assert_kv_all_free(server: Server) -> None:
    """No request holds KV; free + cached == total; a flush empties the cache entirely."""
    wait_until(lambda: server.state()["num_running"] == 0, 10, "num_running == 0")
    s = server.state()
    assert s["num_running"] == 0 and s["num_waiting"] == 0, s
    assert s["kv_held_by_requests"] == 0, s
    assert s["kv_free"] + s["kv_tree_evictable"] + s["kv_tree_protected"] == s["kv_total"], s
    assert s["kv_tree_protected"] == 0, f"a finished request still locks tree nodes: {s}"
    r = requests.post(server.url + "/flush_cache", timeout=10)
    assert r.status_code == 200, r.text
    s = server.state()
    assert s["kv_free"] == s["kv_total"], s


# -- 1. client disconnects ------------------------------------------------------------------
def test_closed_stream_frees_kv_and_killed_main_takes_children_along(launch):
    server = launch()
    before = server.state()["generated_tokens"]
    r, chunks = open_stream(server, LONG)
    first = [json.loads(next(chunks)) for _ in range(3)]
    assert all(c["meta_info"]["finish_reason"] is None for c in first), first
    assert server.state()["num_running"] == 1
    r.close()
    wait_until(lambda: server.state()["num_running"] == 0, 10,
               "the disconnected stream's abort")  # fmt: skip
    generated = server.state()["generated_tokens"] - before
    assert generated < LONG, f"the stream ran to its end ({generated} tokens) after the client left"
    assert_kv_all_free(server)

    r = post_generate(server, 8)  # the server still serves
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8, r.text

    # 7. SIGKILL of the main process while the scheduler is busy decoding: the children die
    # with it (PR_SET_PDEATHSIG), nothing is left.
    r, chunks = open_stream(server, LONG)
    json.loads(next(chunks))
    procs = server.processes()
    assert len(procs) >= 3, procs  # main, scheduler, detokenizer (+ resource tracker)
    server.proc.kill()
    server.proc.wait(10)
    r.close()
    assert_all_gone(procs, timeout=10)


def test_client_timeout_aborts_a_non_streaming_request(launch):
    server = launch("--shutdown-timeout", "2")  # the stop must not wait for a leaked request
    procs = server.processes()
    before = server.state()["generated_tokens"]
    with pytest.raises(requests.exceptions.ReadTimeout):
        post_generate(server, LONG, timeout=1.5)  # the client gives up and closes its socket
    deadline = time.monotonic() + 10
    while server.state()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    s = server.state()
    assert s["num_running"] == 0, (
        "a non-streaming request whose client disconnected was not aborted: 10s after the "
        f"disconnect it still runs ({s['generated_tokens'] - before} tokens generated so far, "
        f"{s['kv_held_by_requests']} KV slots held)"
    )
    assert s["generated_tokens"] - before < LONG, s
    assert_kv_all_free(server)
    assert server.stop() == 0, server.logs()
    assert_server_gone(server, procs)


# -- 2. the scheduler dies ------------------------------------------------------------------
def test_killed_scheduler_fails_inflight_requests_and_the_server_exits(launch):
    server = launch()
    procs = server.processes()
    scheduler = server.scheduler_pid()
    assert scheduler in {p.pid for p in procs}

    r, chunks = open_stream(server, LONG)
    json.loads(next(chunks))
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post_generate, server, LONG)
        wait_until(lambda: server.state()["num_running"] == 2, 10, "both requests running")
        os.kill(scheduler, signal.SIGKILL)

        # The stream ends with an error chunk, never with success.
        rest: list[str] = []
        try:
            rest = list(chunks)
        except (requests.exceptions.ChunkedEncodingError, requests.ConnectionError):
            pass
        events = [json.loads(x) for x in rest if x != "[DONE]"]
        assert not any(
            "meta_info" in e and e["meta_info"]["finish_reason"] is not None for e in events
        ), events[-1:]
        errors = [e for e in events if "error" in e]
        assert errors, f"the stream ended without an error chunk: {rest[-2:]}"
        assert errors[-1]["error"]["message"], errors

        response = pending.result(CLIENT_TIMEOUT_S + 5)
    assert response.status_code == 503, response.text
    assert "scheduler" in error_body(response)["message"]

    try:
        assert requests.get(server.url + "/health", timeout=5).status_code == 503
    except requests.ConnectionError:
        pass  # already gone
    try:
        code = server.proc.wait(EXIT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the main process still runs {EXIT_DEADLINE_S}s after the scheduler died")
    assert code != 0, server.logs()
    assert "scheduler" in server.logs()
    assert_server_gone(server, procs)


# -- 3. SIGTERM -----------------------------------------------------------------------------
def test_sigterm_drains_running_requests_then_exits_cleanly(launch):
    server = launch("--shutdown-timeout", str(DRAIN_TIMEOUT_S + 30))
    procs = server.processes()
    n, tokens = 4, 200
    with ThreadPoolExecutor(n) as pool:
        running = [
            pool.submit(post_generate, server, tokens, text=f"request {i}", timeout=None)
            for i in range(n)
        ]
        wait_until(lambda: server.state()["num_running"] == n, 20, f"{n} requests running")
        server.proc.send_signal(signal.SIGTERM)

        wait_until(lambda: draining(server), 10, "/health to turn 503 after SIGTERM")
        try:  # a new request during the drain is refused
            late = post_generate(server, 4, timeout=10)
            assert late.status_code == 503, late.text
            assert "shutting down" in error_body(late)["message"]
        except requests.ConnectionError:
            pass  # the server already closed its socket

        # Wait for them, noting the tokens that reach the main process: if they do not finish,
        # the message tells a stall (no progress) from a merely slow machine.
        progress = []
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not all(f.done() for f in running) and time.monotonic() < deadline:
            progress.append(generated_tokens(server))
            time.sleep(2)
        assert all(f.done() for f in running), (
            f"requests unfinished {DRAIN_TIMEOUT_S}s into the drain; tokens that reached the "
            f"main process, every 2s: {progress}; processes alive: "
            f"{[(p.pid, alive(p)) for p in procs]}\n{server.logs()}"
        )
        for future in running:
            r = future.result()
            assert r.status_code == 200, r.text
            meta = r.json()["meta_info"]
            assert meta["completion_tokens"] == tokens, meta
            assert meta["finish_reason"]["type"] == "length", meta
    try:
        code = server.proc.wait(EXIT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the main process did not exit after draining")
    assert code == 0, server.logs()
    assert_server_gone(server, procs)


def draining(server: Server) -> bool:
    try:
        return requests.get(server.url + "/health", timeout=5).status_code == 503
    except requests.ConnectionError:
        return True  # already closed


def _abort_or_error(future: Future) -> str:
    """How a request cut by a shutdown ended: 'abort', 'error' or 'disconnected'."""
    try:
        r = future.result(CLIENT_TIMEOUT_S + 5)
    except requests.ConnectionError:
        return "disconnected"
    if r.status_code == 200:
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", meta
        assert meta["completion_tokens"] < LONG, meta
        return "abort"
    assert r.status_code == 503, r.text
    error_body(r)
    return "error"


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(launch):
    server = launch("--shutdown-timeout", "1")
    procs = server.processes()
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(post_generate, server, LONG)
        wait_until(lambda: server.state()["num_running"] == 1, 10, "the request running")
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail("the main process did not exit 15s after SIGTERM (shutdown timeout 1s)")
        outcome = _abort_or_error(long)
    assert outcome in ("abort", "error"), "the aborted request got no answer"
    assert code == 0, server.logs()
    assert_server_gone(server, procs)


def test_scheduler_death_during_the_drain_fails_requests_at_once(launch):
    """The drain must not hide a dead child: what still runs fails with 503 at once, and the
    server exits non-zero without waiting out --shutdown-timeout."""
    server = launch("--shutdown-timeout", "60")
    procs = server.processes()
    scheduler = server.scheduler_pid()
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(post_generate, server, LONG, timeout=EXIT_DEADLINE_S)
        wait_until(lambda: server.state()["num_running"] == 1, 10, "the request running")
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: draining(server), 10, "/health to turn 503 after SIGTERM")
        os.kill(scheduler, signal.SIGKILL)
        error = long.exception(EXIT_DEADLINE_S + 5)
    assert not isinstance(error, requests.ReadTimeout), (
        f"the scheduler died during the drain, yet the in-flight request got no answer within "
        f"{EXIT_DEADLINE_S}s (the launcher ignores a dead child while draining)"
    )
    r = long.result()
    assert r.status_code == 503, (r.status_code, r.text[:300])
    assert "scheduler" in error_body(r)["message"]
    try:
        code = server.proc.wait(EXIT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the main process did not exit after its scheduler died during the drain")
    assert code != 0, "the scheduler crashed, yet the server exited 0"
    assert_server_gone(server, procs)


# -- 4. overload ----------------------------------------------------------------------------
def test_full_queue_is_503_and_the_server_recovers(launch):
    server = launch("--max-queued-requests", "1", "--max-running-requests", "1")
    procs = server.processes()
    with ThreadPoolExecutor(6) as pool:
        # One request running, one waiting: the queue is full.
        first = pool.submit(post_generate, server, 300, text="first")
        wait_until(lambda: server.state()["num_running"] == 1, 10, "the first request running")
        second = pool.submit(post_generate, server, 20, text="second")
        wait_until(lambda: server.state()["num_waiting"] == 1, 10, "the second request queued")
        # Four more, streaming and not: each refused at once with 503.
        refused = []
        for i in range(4):
            body = generate_body(20, stream=bool(i % 2), text=f"extra {i}")
            refused.append(pool.submit(requests.post, server.url + "/generate", json=body,
                                       timeout=CLIENT_TIMEOUT_S))  # fmt: skip
        for future in refused:
            r = future.result(CLIENT_TIMEOUT_S + 5)
            assert r.status_code == 503, (r.status_code, r.text[:300])
            message = error_body(r)["message"].lower()
            assert "overloaded" in message or "queue" in message, message
        for future, tokens in ((first, 300), (second, 20)):
            r = future.result(CLIENT_TIMEOUT_S + 5)
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["completion_tokens"] == tokens
    r = post_generate(server, 8)
    assert r.status_code == 200, r.text

    # A burst of six at once: some refused, the others served in full, nothing else.
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post_generate, server, 50, text=f"burst {i}") for i in range(6)]
        responses = [f.result(CLIENT_TIMEOUT_S * 2) for f in futures]
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
    for r in responses:
        if r.status_code == 200:
            assert r.json()["meta_info"]["completion_tokens"] == 50
        else:
            assert "overloaded" in error_body(r)["message"]
    assert post_generate(server, 8).status_code == 200
    assert_kv_all_free(server)
    assert server.stop() == 0, server.logs()
    assert_server_gone(server, procs)


# -- 5. API keys ----------------------------------------------------------------------------
def _check_auth(server: Server, key: str) -> None:
    good = {"Authorization": f"Bearer {key}"}
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    wrong_headers = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer "},
        {"Authorization": key},  # no scheme
        {"Authorization": f"Basic {key}"},
    ]
    for headers in wrong_headers:
        for method, path, body in (
            ("GET", "/v1/models", None),
            ("POST", "/generate", generate_body(2)),
            ("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}),
            ("GET", "/get_server_info", None),
        ):
            r = requests.request(method, server.url + path, json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers, r.status_code, r.text)
            error = error_body(r)
            assert error["type"] == "authentication_error", error
    r = requests.get(server.url + "/v1/models", headers=good, timeout=10)
    assert r.status_code == 200 and r.json()["data"], r.text
    r = requests.post(server.url + "/generate", json=generate_body(3), headers=good, timeout=30)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3, r.text

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    model = client.models.list().data[0].id
    done = client.completions.create(
        model=model, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert done.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt="hi", max_tokens=3)


def test_api_key_flag(launch):
    server = launch("--api-key", "secret")
    procs = server.processes()
    _check_auth(server, "secret")
    assert server.stop() == 0, server.logs()
    assert_server_gone(server, procs)


def test_api_key_from_the_environment(launch):
    server = launch(env={"RADIXSERVE_API_KEY": "k2"})
    procs = server.processes()
    _check_auth(server, "k2")
    info = requests.get(server.url + "/get_server_info", timeout=10,
                        headers={"Authorization": "Bearer k2"})  # fmt: skip
    assert "k2" not in info.text, "the API key leaks through /get_server_info"
    assert server.stop() == 0, server.logs()
    assert_server_gone(server, procs)


# -- 6. startup failures --------------------------------------------------------------------
def run_until_exit(cmd: list[str], timeout: float) -> tuple[int, str, list[psutil.Process]]:
    """Run the command to its end, noting every descendant it ever had."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, psutil.Process] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                for p in psutil.Process(proc.pid).children(recursive=True):
                    seen.setdefault(p.pid, p)
            except psutil.NoSuchProcess:
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        done.set()
        assert_all_gone(list(seen.values()), 0)
        pytest.fail(f"still running after {timeout:.0f}s: {output[-2000:]}")
    done.set()
    watcher.join()
    return proc.returncode, output, list(seen.values())


def serve_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "radixserve", "serve", *flags]


def test_missing_model_path_fails_fast(tmp_path):
    missing = str(tmp_path / "nonexistent")
    port = str(free_port())
    code, output, children = run_until_exit(serve_cmd("--port", port, "--model-path", missing), 60)
    assert code != 0, output
    assert missing in output and "Traceback" not in output, output[-2000:]
    assert_all_gone(children)


def test_busy_port_fails_fast(tiny):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, output, children = run_until_exit(
            serve_cmd("--port", str(port), "--model-path", tiny, "--max-total-tokens", KV_TOKENS),
            60,
        )
    assert code != 0, output
    assert str(port) in output and "in use" in output.lower(), output[-2000:]
    assert "Traceback" not in output, output[-2000:]
    assert_all_gone(children)


@pytest.mark.parametrize(
    "flags, said",
    [
        (("--served-model-name", "m", "--lora-paths", "m=/nowhere"), "the served model's name"),
        (("--chat-template", "no template here"), "--chat-template"),
    ],
)
def test_bad_flags_of_the_main_process_fail_before_any_child_starts(tiny, flags, said):
    """The scheduler starts before the main process imports the HTTP side
    (server/children.prestart): what main checks must fail before it, not after."""
    port = str(free_port())
    cmd = serve_cmd("--port", port, "--model-path", tiny, *flags)
    code, output, children = run_until_exit(cmd, 60)
    assert code == 2 and said in output and "Traceback" not in output, output[-2000:]
    assert not children, children


def test_scheduler_that_cannot_load_the_model_fails_the_server(tmp_path, tiny):
    """config.json and tokenizer are fine (the main process loads them), the weights are not:
    the scheduler fails to start, and the whole server must exit non-zero."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in Path(tiny).iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    port = str(free_port())
    cmd = serve_cmd("--port", port, "--model-path", str(broken), "--max-total-tokens", KV_TOKENS)
    code, output, children = run_until_exit(cmd, 90)
    assert code != 0, output[-2000:]
    assert "scheduler failed to start" in output and "model.safetensors" in output, output[-2000:]
    assert "Traceback" not in output, output[-2000:]
    assert_all_gone(children)
