"""radixserve workers behind the field's router: two workers (the tiny model) and the
`sglang-router` binary with its cache-aware policy on loopback, driven by the `openai`
client and raw /generate. What the router needs from a worker (health, model info, the
native and OpenAI routes, streaming, the SGLang extras it forwards) works, and when a worker
dies the router's retries lose no non-streaming request."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import openai
import pytest
import requests

from tests.server_utils import ServerProcess, free_port, state

TIMEOUT = 120
PROMPTS = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]


class Router:
    """`python -m sglang_router.launch_router` over the workers; `url` once it routes."""

    def __init__(self, workers: list[ServerProcess], log) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            *(sys.executable, "-m", "sglang_router.launch_router"),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--worker-urls", *(w.url for w in workers)),
            *("--policy", "cache_aware", "--prometheus-port", str(free_port())),
            *("--log-level", "warn"),
            # a dead worker is out of rotation after one failed check (~1 s), and retries
            # (0.2, 0.4, 0.8, 1.6 s apart) outlast that, so none lands on it again
            *("--health-check-interval-secs", "1", "--health-failure-threshold", "1"),
            *("--retry-initial-backoff-ms", "200"),
        ]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, workers: int) -> Router:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the router exited"
            try:
                listed = requests.get(self.url + "/workers", timeout=5).json()["workers"]
                models = requests.get(self.url + "/v1/models", timeout=5)
                if len(listed) == workers and models.status_code == 200:
                    return self
            except (requests.RequestException, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise RuntimeError("the router did not list its workers in time")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    flags = ("--model-path", str(tiny_model_dirs["llama"]), "--max-total-tokens", "4000")
    workers = [ServerProcess(*flags, log=logs / f"worker{i}.log") for i in range(2)]
    router = None
    try:
        for w in workers:
            w.wait_ready()
        router = Router(workers, open(logs / "router.log", "w")).wait_ready(2)  # noqa: SIM115
        yield router, workers
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    url = cluster[0].url + "/v1"
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def model(client) -> str:
    (card,) = client.models.list().data
    return card.id


def direct(worker: ServerProcess, prompt: str, tokens: int = 8) -> str:
    """Greedy text straight from one worker, for comparing with the router's answer."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}
    return requests.post(worker.url + "/generate", json=body, timeout=TIMEOUT).json()["text"]


def test_the_openai_routes_work_through_the_router(cluster, client, model):
    chat = dict(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    whole = client.chat.completions.create(temperature=0, **chat)
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    pieces = client.chat.completions.create(temperature=0, stream=True, **chat)
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same on either worker
    done = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert done.choices[0].text == direct(cluster[1][0], PROMPTS[0])
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    called = client.chat.completions.create(
        **{**chat, "max_tokens": 40},
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert called.choices[0].message.tool_calls[0].function.name == "f"


def test_generate_and_its_stream_work_through_the_router(cluster):
    router, workers = cluster
    body = {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    r = requests.post(router.url + "/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == direct(workers[0], PROMPTS[1])
    streamed = requests.post(
        router.url + "/generate", json={**body, "stream": True}, timeout=TIMEOUT, stream=True
    )
    events = [line for line in streamed.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and len(events) >= 2
    texts = [json.loads(e.removeprefix(b"data: "))["text"] for e in events[:-1]]
    # cumulative texts, the last the whole answer (a fast stream may come in one chunk: the
    # updates its reader had not read yet are sent as one)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == r.json()["text"]


def test_a_dead_worker_loses_no_request(cluster, client, model):
    """A worker killed mid-stream: each in-flight stream either completes (the other
    worker's) or ends with an error (the dead one's: the router cannot resume a stream),
    none hangs; requests after it all succeed, the router retrying on the live worker."""
    router, workers = cluster
    outcomes: dict[int, tuple[int, str | None]] = {}
    received = [0] * 4  # chunks each of the 4 streams has had

    def stream(i: int) -> None:
        text, error = "", None
        try:
            chunks = client.completions.create(
                model=model,
                prompt=PROMPTS[i],
                max_tokens=900,  # seconds of streaming, within each worker's 4000 tokens
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in chunks:
                if chunk.choices:
                    text += chunk.choices[0].text
                    received[i] += 1
        except openai.APIError as e:
            error = type(e).__name__
        outcomes[i] = (len(text), error)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # the victim is a worker holding streams under way: wait until the router's choices
    # show and tokens flow (no fixed pause: on a busy machine the streams may not have
    # started after one, on an idle one they may have ended)
    deadline = time.monotonic() + TIMEOUT
    while True:
        live = [state(w) for w in workers]
        running = [s["num_running"] + s["num_waiting"] for s in live]
        if (any(running) and any(received)) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    victim, survivor = (workers[0], workers[1]) if running[0] else (workers[1], workers[0])
    victim.proc.kill()  # no drain: the worker serving the streams is gone at once
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a stream hung on the dead worker"
    print(f"in-flight streams (running per worker {running}) when one died:", outcomes)
    assert any(error for _, error in outcomes.values()), "no stream was on the dead worker"
    victim.stop()
    answers = [
        client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0)
        for p in PROMPTS
    ]
    assert all(a.choices[0].text for a in answers)
    expected = [direct(survivor, p, tokens=4) for p in PROMPTS[:2]]
    assert [a.choices[0].text for a in answers[:2]] == expected
