"""End-to-end tests of the native API of `radixserve serve`, driven with raw HTTP exactly as
its real clients drive it (see the wire contract, §1 native API, §3 lm-eval, §4
bench_serving): the SGLang frontend's `gen` / `select` / `fork` / `run_batch`, SGLang's
bench_serving stream, lm-eval's tokenizer discovery and loglikelihood requests, aborts and
errors. One real server (SmolLM2-135M-Instruct, fp32 CPU) serves the whole module."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import requests

from radixserve.hardware import KernelPlan, cpu_info
from tests.conftest import FP32
from tests.server_utils import ServerProcess, positive_metric

TIMEOUT = 120  # seconds for any one HTTP call
CONTEXT_LEN = 8192  # SmolLM2's context (the KV pool of 20000 tokens is larger)

ERROR_KEYS = {"message", "type", "param", "code"}


# -- the server and HTTP helpers ------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("native-server") / "server.log"
    proc = ServerProcess("--max-total-tokens", "20000", log=log)
    try:
        # The port is bound (and accepts connections) before the HTTP app serves, so on a
        # busy machine an early /health may time out rather than be refused: retry then.
        for attempt in range(10):
            try:
                proc.wait_ready()
                break
            except requests.Timeout:
                if attempt == 9:
                    raise
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url


def post(url: str, path: str, body: Any, **kw: Any) -> requests.Response:
    return requests.post(url + path, json=body, timeout=TIMEOUT, **kw)


def generate(url: str, body: dict[str, Any]) -> Any:
    """POST /generate and the JSON answer, which must be a 200 (the frontend raises
    otherwise)."""
    r = post(url, "/generate", body)
    assert r.status_code == 200, f"/generate {body} -> {r.status_code}: {r.text[:500]}"
    return r.json()


def tokenize(url: str, text: str) -> list[int]:
    r = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def server_state(url: str) -> dict[str, Any]:
    r = requests.get(url + "/get_server_info", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["internal_states"][0]


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, Any]:
    """Poll until no request runs and no KV is held by requests; the last state seen."""
    deadline = time.monotonic() + timeout
    while True:
        state = server_state(url)
        idle = state["num_running"] == 0 and state["num_waiting"] == 0
        if (idle and state["kv_held_by_requests"] == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


class SSE:
    """A streaming response read the way bench_serving and the frontend read it: `data: `
    lines, JSON chunks until `data: [DONE]`."""

    def __init__(self, response: requests.Response) -> None:
        self.response = response
        self.lines = response.iter_lines(decode_unicode=False)
        self.chunks: list[dict[str, Any]] = []
        self.done = False

    def __iter__(self):
        for raw in self.lines:
            line = raw.decode("utf-8").strip()
            if not line:
                continue
            assert line.startswith("data: "), f"not an SSE data line: {line!r}"
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                self.done = True
                return
            assert not self.done, "a chunk after data: [DONE]"
            chunk = json.loads(payload)
            self.chunks.append(chunk)
            yield chunk

    def read_all(self) -> list[dict[str, Any]]:
        for _ in self:
            pass
        return self.chunks


def stream(url: str, body: dict[str, Any]) -> SSE:
    r = requests.post(url + "/generate", json=body, stream=True, timeout=TIMEOUT)
    assert r.status_code == 200, f"/generate (stream) -> {r.status_code}: {r.text[:500]}"
    assert r.headers["content-type"].startswith("text/event-stream"), r.headers
    return SSE(r)


def run_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # reported by the test that joins
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def joined(thread: threading.Thread, box: dict[str, Any], timeout: float = TIMEOUT) -> Any:
    thread.join(timeout)
    assert not thread.is_alive(), "the request did not finish in time"
    if "error" in box:
        raise box["error"]
    return box["result"]


def assert_error(r: requests.Response, status: int, *words: str) -> dict[str, Any]:
    """An error answer: the status, the OpenAI-shaped body, a message naming `words`
    (each item may be a tuple of alternatives)."""
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text[:500]}"
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) >= ERROR_KEYS, body
    message = body["error"]["message"]
    assert isinstance(message, str) and message, body
    for word in words:
        options = word if isinstance(word, tuple) else (word,)
        assert any(o in message for o in options), f"{options} not in {message!r}"
    return body["error"]


def check_result(result: dict[str, Any]) -> dict[str, Any]:
    """The shape every final native result has; its meta_info."""
    assert set(result) >= {"text", "output_ids", "meta_info"}, result
    meta = result["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"):
        assert key in meta, (key, meta)
    assert meta["finish_reason"] is not None, meta
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] >= 0, meta
    assert meta["completion_tokens"] == len(result["output_ids"]), result
    assert 0 <= meta["cached_tokens"] <= meta["prompt_tokens"], meta
    return meta


# A system prompt of well over 200 tokens, shared by the fork / run_batch tests.
def long_prefix(topic: str) -> str:
    rules = " ".join(
        f"Rule {i}: when asked about {topic} number {i}, answer briefly and politely."
        for i in range(1, 19)
    )
    return f"You are an assistant that knows everything about {topic}. {rules}"


# -- 1. info routes -------------------------------------------------------------------------
def test_health(url):
    assert requests.get(url + "/health", timeout=TIMEOUT).status_code == 200
    assert requests.get(url + "/health_generate", timeout=TIMEOUT).status_code == 200


def test_get_model_info(url):
    r = requests.get(url + "/get_model_info", timeout=TIMEOUT)
    assert r.status_code == 200
    info = r.json()
    for key in ("model_path", "tokenizer_path", "weight_version"):
        assert isinstance(info[key], str) and info[key], (key, info)
    assert info["is_generation"] is True
    assert "preferred_sampling_params" in info and info["preferred_sampling_params"] is None
    # the frontend picks its chat template by substring match on model_path
    assert "smollm" in info["model_path"].lower(), info
    # or reads the markers off the model's own template (radixserve/chat_roles.py)
    roles = info["chat_roles"]
    assert roles["roles"]["assistant"] == ["<|im_start|>assistant\n", "<|im_end|>\n"], roles
    assert roles["default_system_prompt"].startswith("You are a helpful AI assistant"), roles
    assert roles["stop_str"] == ["<|im_end|>"], roles
    assert requests.get(url + "/model_info", timeout=TIMEOUT).json() == info  # SGLang's new name


def test_get_server_info(url):
    r = requests.get(url + "/get_server_info", timeout=TIMEOUT)
    assert r.status_code == 200
    info = r.json()
    assert info["max_total_num_tokens"] == 20000, info
    assert isinstance(info["max_req_input_len"], int)
    assert 0 < info["max_req_input_len"] <= CONTEXT_LEN
    assert isinstance(info["version"], str) and info["version"]
    # every config field, e.g. the scheduler's
    assert info["schedule_policy"] == "fcfs"
    assert isinstance(info["chunked_prefill_size"], int)
    assert info["max_total_tokens"] == 20000
    states = info["internal_states"]
    assert isinstance(states, list) and states, states
    assert all(isinstance(s, dict) for s in states), states
    states[0].get("avg_spec_accept_length")  # what bench_serving reads: must not raise
    again = requests.get(url + "/server_info", timeout=TIMEOUT).json()  # SGLang's new name
    assert again["max_total_tokens"] == 20000 and again["internal_states"]
    for key in ("num_running", "num_waiting", "kv_held_by_requests"):
        assert isinstance(states[0][key], int), (key, states[0])
    # what the machine can do, and the dtypes and kernels chosen from it
    cpu = cpu_info()
    assert info["cpu"]["avx2"] == cpu.avx2 and info["cpu"]["amx_bf16"] == cpu.amx_bf16
    assert info["cpu"]["torch_capability"] == cpu.torch_capability
    assert info["dtype"] == "float32"  # what the tests' server is started with
    assert info["kv_cache_dtype"] == info["dtype"]
    assert set(info["kernel_plan"]) == {f.name for f in dataclasses.fields(KernelPlan)}


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_flush_cache_when_idle(url, method):
    wait_idle(url)
    r = requests.request(method, url + "/flush_cache", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.text.strip()


def test_tokenizer_info(url):
    r = requests.get(url + "/tokenizer_info", timeout=TIMEOUT)
    assert r.status_code == 200
    info = r.json()
    for key in ("eos_token", "bos_token", "pad_token", "chat_template"):
        assert key in info, (key, info)
    assert info["eos_token"] == "<|im_end|>"
    assert isinstance(info["chat_template"], str) and "im_start" in info["chat_template"]


def test_tokenize_detokenize_round_trip(url):
    text = "Hello world! The quick brown fox jumps over the lazy dog."
    r = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens)
    r = post(url, "/detokenize", {"tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == text


# -- 2. the frontend's gen ------------------------------------------------------------------
def frontend_gen_params(**overrides: Any) -> dict[str, Any]:
    """The sampling_params of the SGLang frontend's `gen` (RuntimeEndpoint.generate with
    SglSamplingParams.to_srt_kwargs()): every field with its default, some null."""
    params = {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "max_new_tokens": 128,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": [],
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
    }
    params.update(overrides)
    return params


def test_gen_exact_frontend_body(url):
    """The body sglang's RuntimeEndpoint sends for a plain `gen`: `stop_regex` is an EMPTY
    list by default (SglFunction.run turns None into []), `regex` and `json_schema` null.
    An empty stop_regex asks for nothing and must be accepted."""
    body = {
        "text": "The capital of France is",
        "sampling_params": frontend_gen_params(max_new_tokens=16, temperature=0),
    }
    result = generate(url, body)
    meta = check_result(result)
    reason = meta["finish_reason"]
    assert reason == {"type": "length", "length": 16} or reason["type"] == "stop", meta
    assert result["text"].startswith(" Paris"), result


def test_gen_all_fields_length(url):
    params = frontend_gen_params(max_new_tokens=16, temperature=0, ignore_eos=True)
    params["stop_regex"] = None  # (the empty-list case is test_gen_exact_frontend_body)
    params.update(
        repetition_penalty=None,
        no_stop_trim=None,
        logit_bias=None,
        sampling_seed=None,
        ebnf=None,
    )
    result = generate(
        url, {"text": "Once upon a time, in a small village,", "sampling_params": params}
    )
    meta = check_result(result)
    assert meta["finish_reason"] == {"type": "length", "length": 16}, meta
    assert meta["completion_tokens"] == 16
    assert len(result["output_ids"]) == 16
    assert meta["prompt_tokens"] == len(tokenize(url, "Once upon a time, in a small village,"))
    assert isinstance(meta["id"], str) and meta["id"]
    assert isinstance(result["text"], str) and result["text"]


def test_gen_stop_string_trimmed(url):
    prompt = "The capital of France is"
    base = generate(
        url, {"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    )
    assert "." in base["text"], base  # " Paris.\n\n..." for SmolLM2: a stop to hit
    params = frontend_gen_params(max_new_tokens=16, temperature=0, stop=["."])
    params["stop_regex"] = None
    result = generate(url, {"text": prompt, "sampling_params": params})
    meta = check_result(result)
    assert meta["finish_reason"] == {"type": "stop", "matched": "."}, meta
    assert "." not in result["text"]
    assert result["text"] == base["text"][: base["text"].index(".")]
    assert meta["completion_tokens"] < 16


def test_gen_stop_token_id(url):
    prompt = "The capital of France is"
    base = generate(
        url, {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    )
    stop_id = base["output_ids"][2]
    result = generate(
        url,
        {
            "text": prompt,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop_id]},
        },
    )
    meta = check_result(result)
    first = base["output_ids"].index(stop_id)
    assert meta["finish_reason"] == {"type": "stop", "matched": stop_id}, meta
    assert result["output_ids"] == base["output_ids"][: first + 1]


# -- 3. the frontend's select ---------------------------------------------------------------
def frontend_select(url: str, prefix: str, choices: list[str]) -> tuple[int, list[dict]]:
    """RuntimeEndpoint.select: cache the prefix, score each choice by the mean non-null
    input logprob (with its token-healing correction); (chosen index, the batch results)."""
    first = generate(url, {"text": prefix, "sampling_params": {"max_new_tokens": 0}})
    assert first["text"] == "", first
    assert first["meta_info"]["completion_tokens"] == 0
    assert first["output_ids"] == []
    prompt_len = first["meta_info"]["prompt_tokens"]
    assert prompt_len == len(tokenize(url, prefix))
    start = max(prompt_len - 2, 0)
    results = generate(
        url,
        {
            "text": [prefix + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": start,
        },
    )
    assert isinstance(results, list) and len(results) == len(choices), results
    scores = []
    for choice, result in zip(choices, results):
        meta = check_result(result)
        assert meta["completion_tokens"] == 0 and result["text"] == ""
        ids = tokenize(url, prefix + choice)
        triples = meta["input_token_logprobs"]
        assert meta["prompt_tokens"] == len(ids)
        assert len(triples) == len(ids) - start, (len(triples), len(ids), start)
        assert [t[1] for t in triples] == ids[start:]
        for logprob, token_id, text in triples:
            assert isinstance(logprob, float) and logprob <= 0, triples
            assert isinstance(text, str), triples
            assert (
                text
                == requests.post(
                    url + "/detokenize", json={"tokens": [token_id]}, timeout=TIMEOUT
                ).json()["prompt"]
            )
        values = [t[0] for t in triples if t[0]]
        score = sum(values) / len(values)
        if prefix.endswith(triples[0][-1]):  # no token healing happened
            score = (score * len(triples) - triples[0][0]) / (len(triples) - 1)
        scores.append(score)
    return max(range(len(choices)), key=scores.__getitem__), results


def test_select_picks_paris(url):
    choices = [" Paris", " banana", " the moon"]
    chosen, _ = frontend_select(url, "The capital of France is", choices)
    assert choices[chosen] == " Paris"


def test_select_picks_number(url):
    choices = [" purple", " 4", " Tuesday"]
    chosen, _ = frontend_select(url, "Question: what is 2 + 2?\nAnswer:", choices)
    assert choices[chosen] == " 4"


def test_input_logprobs_from_start(url):
    text = "The capital of France is Paris"
    ids = tokenize(url, text)
    result = generate(
        url,
        {
            "text": text,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        },
    )
    meta = check_result(result)
    triples = meta["input_token_logprobs"]
    assert [t[1] for t in triples] == ids
    assert triples[0][0] is None, triples[0]  # nothing predicts the very first token
    assert all(isinstance(t[0], float) for t in triples[1:]), triples
    assert meta["output_token_logprobs"] == []
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(ids)
    for top, triple in zip(tops[1:], triples[1:]):
        assert len(top) == 2, top
        assert top[0][0] >= top[1][0]
        assert triple[0] <= top[0][0] + 1e-5  # the best alternative is at least as likely


def test_token_ids_logprob_reports_the_named_tokens_at_every_position(url):
    """SGLang's token_ids_logprob: each position's logprobs of the named tokens, in their
    order, for the prompt from logprob_start_len (the first prompt token has none) and the
    output; the same numbers as the chosen token's logprob and the top alternatives."""
    text = "The capital of France is"
    ids = tokenize(url, text)
    named = tokenize(url, " Paris")[:1] + [ids[1], 0]
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 1,
        "token_ids_logprob": named,
        "return_text_in_logprobs": True,
    }
    meta = check_result(generate(url, body))
    inputs, outputs = meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"]
    assert len(inputs) == len(ids) and inputs[0] == []
    assert len(outputs) == len(meta["output_token_logprobs"]) == 4
    for entries in inputs[1:] + outputs:
        assert [e[1] for e in entries] == named and all(e[0] <= 0 for e in entries)
        assert entries[0][2] == " Paris"  # with return_text_in_logprobs
    # the prompt's second token, named: its entry is its own input logprob
    assert abs(inputs[1][1][0] - meta["input_token_logprobs"][1][0]) < 1e-4
    for entries, chosen, (top,) in zip(
        outputs, meta["output_token_logprobs"], meta["output_top_logprobs"]
    ):
        by_id = {e[1]: e[0] for e in entries}
        if chosen[1] in by_id:  # greedy: the chosen token is the top one
            assert abs(by_id[chosen[1]] - chosen[0]) < 1e-4 and chosen[1] == top[1]
    assert outputs[0][0][0] == max(e[0] for e in outputs[0])  # " Paris" leads the three
    # streamed: the same entries, chunk by chunk
    chunks = stream(url, {**body, "stream": True}).read_all()
    assert chunks[-1]["meta_info"]["output_token_ids_logprobs"] == outputs
    # a batch may name tokens per prompt; without return_logprob nothing is reported
    batch = generate(
        url,
        {
            "text": [text, "Hi"],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "token_ids_logprob": [named[:1], [5, 6]],
        },
    )
    assert [[e[1] for e in r["meta_info"]["output_token_ids_logprobs"][0]] for r in batch] == [
        named[:1],
        [5, 6],
    ]
    plain = generate(url, {**body, "return_logprob": False})["meta_info"]
    assert "output_token_ids_logprobs" not in plain


@pytest.mark.parametrize(
    ("named", "words"),
    [
        ([-1], "outside the vocabulary"),
        ([10**9], "outside the vocabulary"),
        (list(range(1025)), "at most 1024"),
        ([[1], [2]], "per prompt"),  # two lists for one prompt
    ],
)
def test_bad_token_ids_logprob_is_a_400(url, named, words):
    body = {"text": "Hi", "return_logprob": True, "token_ids_logprob": named}
    r = post(url, "/generate", body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "token_ids_logprob"


def test_score_continuations_picks_paris_and_heals(url):
    """/score_continuations does select's work in one call: SmolLM2 prefers " Paris", and a
    continuation whose first character merges with the prefix's last token ("(" + "(1)" →
    " ((") is scored from the merged token on."""
    choices = [" Paris", " banana", " the moon"]
    r = post(
        url, "/score_continuations", {"text": "The capital of France is", "continuations": choices}
    )
    assert r.status_code == 200, r.text
    means = [sum(c["logprobs"]) / len(c["logprobs"]) for c in r.json()["continuations"]]
    assert choices[max(range(len(choices)), key=means.__getitem__)] == " Paris", means
    r = post(url, "/score_continuations", {"text": "x = (", "continuations": ["(1)"]})
    assert r.status_code == 200, r.text
    entry = r.json()["continuations"][0]
    prefix, ids = tokenize(url, "x = ("), tokenize(url, "x = ((1)")
    assert entry["healed_tokens"] == 1, entry
    assert entry["token_ids"] == ids[len(prefix) - 1 :], (entry, ids)


def test_v1_score_gives_label_probabilities(url):
    """SGLang's /v1/score: a yes/no classifier made of SmolLM2. Each item's scores are its
    label tokens' next-token probabilities (as /generate's token_ids_logprob gives them),
    softmaxed over the labels on request; a bad field is a 400 naming it."""
    yes, no = tokenize(url, " Yes")[0], tokenize(url, " No")[0]
    query = "Question: is the following a fruit? Answer Yes or No.\nItem:"
    items = [" apple\nAnswer:", " hammer\nAnswer:"]
    body = {"query": query, "items": items, "label_token_ids": [yes, no]}
    r = post(url, "/v1/score", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "scoring" and len(answer["scores"]) == 2
    assert answer["usage"]["prompt_tokens"] == sum(len(tokenize(url, query + i)) for i in items)
    params = {"max_new_tokens": 1, "temperature": 0}
    for item, scores in zip(items, answer["scores"], strict=True):
        out = generate(
            url,
            {"text": query + item, "sampling_params": params, "return_logprob": True}
            | {"token_ids_logprob": [yes, no]},
        )
        expected = {
            t: math.exp(lp) for lp, t, _ in out["meta_info"]["output_token_ids_logprobs"][0]
        }
        assert scores == pytest.approx([expected[yes], expected[no]], rel=1e-4)
    softmaxed = post(url, "/v1/score", {**body, "apply_softmax": True}).json()["scores"]
    assert all(sum(s) == pytest.approx(1.0) for s in softmaxed)
    assert softmaxed[0][0] / softmaxed[0][1] == pytest.approx(
        answer["scores"][0][0] / answer["scores"][0][1], rel=1e-3
    )
    for bad, param in (
        ({**body, "label_token_ids": []}, "label_token_ids"),
        ({**body, "items": [[1, 2]]}, "items.0"),
        ({**body, "query": ""}, "query"),
        ({**body, "label_token_ids": [10**7]}, "label_token_ids"),
    ):
        error = assert_error(post(url, "/v1/score", bad), 400)
        assert error["param"] == param, error


# -- 4. fork and run_batch: the shared prefix comes from the radix cache ----------------------
def test_fork_shares_prefix(url):
    prefix = long_prefix("astronomy")
    prefix_len = len(tokenize(url, prefix))
    assert prefix_len >= 200, prefix_len
    params = {"max_new_tokens": 2, "temperature": 0}
    first = generate(
        url, {"text": prefix + "\n\nQuestion: what is a star?", "sampling_params": params}
    )
    check_result(first)
    questions = ["what is a planet?", "what is a comet?", "what is a moon?", "what is a galaxy?"]
    calls = [
        run_in_thread(
            lambda q=q: generate(
                url, {"text": f"{prefix}\n\nQuestion: {q}", "sampling_params": params}
            )
        )
        for q in questions
    ]
    results = [joined(*call) for call in calls]
    for result in results:
        meta = check_result(result)
        assert meta["completion_tokens"] >= 1
        assert meta["prompt_tokens"] > prefix_len
        assert meta["cached_tokens"] >= 190, meta


def test_run_batch_warmup_caches_prefix(url):
    prefix = long_prefix("botany")
    prefix_len = len(tokenize(url, prefix))
    assert prefix_len >= 200, prefix_len
    warm = generate(url, {"text": prefix, "sampling_params": {"max_new_tokens": 0}})
    assert warm["meta_info"]["completion_tokens"] == 0 and warm["text"] == ""
    assert warm["meta_info"]["prompt_tokens"] == prefix_len
    calls = [
        run_in_thread(
            lambda q=q: generate(
                url,
                {
                    "text": f"{prefix}\n\nQuestion: {q}",
                    "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                },
            )
        )
        for q in ("what is a leaf?", "what is a root?", "what is a seed?")
    ]
    for result in (joined(*call) for call in calls):
        meta = check_result(result)
        assert meta["cached_tokens"] >= min(190, prefix_len - 2), meta


# -- 5. bench_serving's streaming /generate ---------------------------------------------------
def bench_body(prompt_key: str, prompt: Any) -> dict[str, Any]:
    return {  # async_request_sglang_generate
        prompt_key: prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
    }


STREAM_PROMPT = "Write a short story about a robot who learns to paint."


@pytest.fixture(scope="module")
def plain_result(url) -> dict[str, Any]:
    """The non-streaming answer to bench_serving's request (shared by both prompt kinds)."""
    return generate(url, {**bench_body("text", STREAM_PROMPT), "stream": False})


@pytest.mark.parametrize("prompt_key", ["text", "input_ids"])
def test_stream_cumulative(url, plain_result, prompt_key):
    prompt = STREAM_PROMPT if prompt_key == "text" else tokenize(url, STREAM_PROMPT)
    sse = stream(url, bench_body(prompt_key, prompt))
    chunks = sse.read_all()
    assert sse.done, "the stream did not end with data: [DONE]"
    assert chunks, "no chunk"
    previous_text, previous_ids = "", []
    for chunk in chunks:
        assert "error" not in chunk, chunk
        assert chunk["text"].startswith(previous_text), (previous_text, chunk["text"])
        assert chunk["output_ids"][: len(previous_ids)] == previous_ids
        previous_text, previous_ids = chunk["text"], chunk["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    meta = check_result(last)
    assert meta["completion_tokens"] == 16
    assert meta["finish_reason"] == {"type": "length", "length": 16}
    assert len(chunks) >= 2, "a 16-token stream came in one chunk"
    assert last["text"] == plain_result["text"]
    assert last["output_ids"] == plain_result["output_ids"]


def test_stream_never_shows_stop_string(url):
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "stop": [".\n"]},
        "stream": True,
    }
    sse = stream(url, body)
    chunks = sse.read_all()
    assert sse.done
    for chunk in chunks:
        assert ".\n" not in chunk["text"], chunk
    plain = generate(url, {**body, "stream": False})
    assert chunks[-1]["text"] == plain["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]


@pytest.mark.parametrize(
    "stops",
    [
        {"stop_regex": ["5.*8"]},  # matches from a "5" streamed long before the "8"
        {"stop": [","], "min_new_tokens": 5},  # a "," within the first 5 tokens does not stop
    ],
)
def test_stream_grows_to_the_text_trimmed_where_the_stop_fired(url, stops):
    """The stream's cumulative text never shrinks and never shows what the end trims: text
    a stop regex could still match is held back, and the text is trimmed at the stop that
    fired (after min_new_tokens), not at an earlier occurrence of it."""
    params = {"max_new_tokens": 15, "temperature": 0, **stops}
    body = {"text": "1, 2, 3,", "sampling_params": params, "stream": True}
    sse = stream(url, body)
    chunks = sse.read_all()
    assert sse.done
    texts = [chunk["text"] for chunk in chunks]
    assert all(texts[-1].startswith(text) for text in texts), texts
    plain = generate(url, {**body, "stream": False})
    assert (texts[-1], chunks[-1]["meta_info"]["finish_reason"]) == (
        plain["text"],
        plain["meta_info"]["finish_reason"],
    )
    assert plain["meta_info"]["finish_reason"]["type"] == "stop", plain


# -- 6. batches -----------------------------------------------------------------------------
def test_batch_text_list(url):
    prompts = ["The sky is", "My favourite food is", "In 1492, Columbus"]
    results = generate(
        url, {"text": prompts, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    )
    assert isinstance(results, list) and len(results) == 3
    for prompt, result in zip(prompts, results):
        meta = check_result(result)
        assert meta["prompt_tokens"] == len(tokenize(url, prompt))
        assert 1 <= meta["completion_tokens"] <= 4
    assert len({r["meta_info"]["id"] for r in results}) == 3
    single = generate(
        url, {"text": prompts[1], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    )
    assert results[1]["text"] == single["text"]


def test_batch_sampling_params_list(url):
    results = generate(
        url,
        {
            "input_ids": [tokenize(url, "One, two,"), tokenize(url, "Red, green,")],
            "sampling_params": [
                {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
                {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            ],
        },
    )
    assert isinstance(results, list) and len(results) == 2
    assert [r["meta_info"]["completion_tokens"] for r in results] == [2, 5]
    assert [r["meta_info"]["finish_reason"] for r in results] == [
        {"type": "length", "length": 2},
        {"type": "length", "length": 5},
    ]


def test_n_samples(url):
    results = generate(
        url,
        {
            "text": "My three favourite animals are",
            "sampling_params": {"n": 2, "temperature": 0.7, "max_new_tokens": 3},
        },
    )
    assert isinstance(results, list) and len(results) == 2, results
    for result in results:
        meta = check_result(result)
        assert 1 <= meta["completion_tokens"] <= 3
    assert results[0]["meta_info"]["id"] != results[1]["meta_info"]["id"]


def test_batch_str_rid(url):
    rid = f"batch-{uuid.uuid4().hex[:8]}"
    results = generate(
        url,
        {
            "text": ["Apples are", "Bananas are", "Cherries are"],
            "rid": rid,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        },
    )
    assert [r["meta_info"]["id"] for r in results] == [f"{rid}_{i}" for i in range(3)]


def test_single_rid_kept(url):
    rid = f"one-{uuid.uuid4().hex[:8]}"
    result = generate(url, {"text": "Hello", "rid": rid, "sampling_params": {"max_new_tokens": 1}})
    assert result["meta_info"]["id"] == rid


# -- 7. lm-eval (local-completions) ---------------------------------------------------------
LM_EVAL_HEADERS = {"Authorization": "Bearer "}  # lm-eval sends an empty key when none is set


def test_lm_eval_loglikelihood(url):
    r = requests.get(url + "/tokenizer_info", headers=LM_EVAL_HEADERS, timeout=TIMEOUT)
    assert r.status_code == 200
    context = tokenize(url, "Question: What is the capital of France?\nAnswer:")
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    continuation = generate(url, {"input_ids": context, "sampling_params": greedy})["output_ids"]
    assert len(continuation) == 3
    other = tokenize(url, "The quick brown fox jumps over the lazy dog")
    prompts = [context + continuation, other]
    ctxlens = [len(context), 4]
    r = requests.post(
        url + "/v1/completions",
        headers=LM_EVAL_HEADERS,
        json={
            "model": "SmolLM2-135M-Instruct",
            "prompt": prompts,
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        },
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for prompt, ctxlen, choice in zip(prompts, ctxlens, choices):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1, lp
        assert len(lp["top_logprobs"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None
        assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
        tops = lp["top_logprobs"][ctxlen:-1]
        assert tops and all(isinstance(t, dict) and t for t in tops), tops
        # lm-eval's is_greedy: each token's logprob against the best alternative
        for tok, top in zip(lp["token_logprobs"][ctxlen:-1], tops):
            assert tok <= max(top.values()) + 1e-5
        # the prompt's logprobs equal the native API's for the same ids
        native = generate(
            url,
            {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
        )["meta_info"]["input_token_logprobs"]
        assert [t[1] for t in native] == prompt
        assert native[0][0] is None
        for a, b in zip(lp["token_logprobs"][1 : len(prompt)], native[1:]):
            assert abs(a - b[0]) < 1e-4, (a, b)
    # the continuation is the model's own greedy one: lm-eval's is_greedy holds
    lp0 = choices[0]["logprobs"]
    for tok, top in zip(
        lp0["token_logprobs"][ctxlens[0] : -1], lp0["top_logprobs"][ctxlens[0] : -1]
    ):
        assert tok == max(top.values()), (tok, top)


def test_lm_eval_generate_until(url):
    ids = tokenize(url, "Question: Name a colour.\nAnswer:")
    r = requests.post(
        url + "/v1/completions",
        headers=LM_EVAL_HEADERS,
        json={
            "prompt": [ids],
            "model": "SmolLM2-135M-Instruct",
            "max_tokens": 12,
            "temperature": 0,
            "stop": ["\n\n", "Question:"],
            "seed": 1234,
        },
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 1
    text = choices[0]["text"]
    assert isinstance(text, str)
    assert "\n\n" not in text and "Question:" not in text
    native = generate(
        url,
        {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 0,
                "stop": ["\n\n", "Question:"],
            },
        },
    )
    assert text == native["text"]


# -- 8. greedy output equals the offline Engine's ---------------------------------------------
GREEDY_PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]


def test_greedy_matches_offline_engine(url):
    from radixserve import Engine

    wait_idle(url)
    assert requests.post(url + "/flush_cache", timeout=TIMEOUT).status_code == 200
    params = {"temperature": 0, "max_new_tokens": 24}
    served = [generate(url, {"text": p, "sampling_params": params}) for p in GREEDY_PROMPTS]
    engine = Engine(max_total_tokens=20000, progress=False, dtype=FP32)
    try:
        offline = [engine.generate(p, dict(params)) for p in GREEDY_PROMPTS]
    finally:
        engine.shutdown()
    for prompt, s, o in zip(GREEDY_PROMPTS, served, offline):
        assert s["text"] == o["text"], (prompt, s["text"], o["text"])
        assert s["output_ids"] == o["output_ids"], prompt


# -- 9. aborts ------------------------------------------------------------------------------
def long_body(rid: str, stream_: bool) -> dict[str, Any]:
    return {
        "text": "Count from one to a thousand: one, two, three,",
        "rid": rid,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0},
        "stream": stream_,
    }


def test_abort_request_by_rid(url):
    rid = f"abort-{uuid.uuid4().hex[:8]}"
    sse = stream(url, long_body(rid, True))
    chunks = iter(sse)
    first = next(chunks)  # the request runs
    assert first["meta_info"]["id"] == rid
    assert first["meta_info"]["finish_reason"] is None
    # the cache cannot be flushed while a request runs
    r = post(url, "/flush_cache", None)
    assert r.status_code == 400, r.text
    r = post(url, "/abort_request", {"rid": rid})
    assert r.status_code == 200, r.text
    rest = list(chunks)
    assert sse.done, "the aborted stream did not end with data: [DONE]"
    last = (rest or [first])[-1]
    reason = last["meta_info"]["finish_reason"]
    assert reason is not None and reason["type"] == "abort", last["meta_info"]
    assert isinstance(reason.get("message"), str)
    assert last["meta_info"]["completion_tokens"] < 2000
    state = wait_idle(url)
    assert state["num_running"] == 0, state
    assert state["kv_held_by_requests"] == 0, state


def test_abort_by_the_rid_the_client_gave_ends_every_sequence_of_the_request(url):
    """n > 1 names the sequences `{rid}_{j}`, a batch `{rid}_{i}`: aborting the request's own
    rid ends all of them (as SGLang's abort does), and another request whose rid merely
    starts the same way is left running."""
    rid = f"par-{uuid.uuid4().hex[:8]}"
    both = long_body(rid, False)
    both["sampling_params"]["n"] = 2
    other = long_body(rid + "_x", False)  # named like a sequence of `rid`, but its own
    other["sampling_params"]["max_new_tokens"] = 40
    thread, box = run_in_thread(lambda: generate(url, both))
    neighbour, its_box = run_in_thread(lambda: generate(url, other))
    deadline = time.monotonic() + 60
    while server_state(url)["num_running"] < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    r = post(url, "/abort_request", {"rid": rid})
    assert r.status_code == 200, r.text
    results = joined(thread, box)
    assert [out["meta_info"]["id"] for out in results] == [f"{rid}_0", f"{rid}_1"]
    for out in results:
        assert out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
    survivor = joined(neighbour, its_box)
    assert survivor["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    state = wait_idle(url)
    assert state["num_running"] == 0 and state["kv_held_by_requests"] == 0, state


def test_get_load_counts_what_runs_and_the_kv_it_holds(url):
    """SGLang's /get_load, one entry per replica: a running request counts, and so do the
    KV tokens it holds; none once it has ended (the cache's evictable K/V do not count)."""
    rid = f"load-{uuid.uuid4().hex[:8]}"
    sse = stream(url, long_body(rid, True))
    chunks = iter(sse)
    next(chunks)
    (load,) = requests.get(url + "/get_load", timeout=30).json()
    assert load["dp_rank"] == 0 and load["num_reqs"] >= 1 and load["num_tokens"] > 0, load
    assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    post(url, "/abort_request", {"rid": rid})
    list(chunks)
    wait_idle(url)
    idle = requests.get(url + "/get_load", timeout=30).json()
    assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_v1_loads_reports_each_replica_as_sglang_does(url):
    """SGLang's /v1/loads (its model gateway polls it): a running request counts, with the
    KV tokens it holds; the queues section, the aggregate, the filters, the Prometheus
    form, and a 400 in the OpenAI shape for a replica or section that does not exist."""
    rid = f"loads-{uuid.uuid4().hex[:8]}"
    chunks = iter(stream(url, long_body(rid, True)))
    next(chunks)
    for _ in range(3):
        next(chunks)  # a few tokens out: the state counts them
    body = requests.get(url + "/v1/loads", timeout=30).json()
    assert body["dp_rank_count"] == 1 and body["version"] and body["timestamp"]
    (load,) = body["loads"]
    assert load["dp_rank"] == 0 and load["num_running_reqs"] >= 1, load
    assert load["num_total_reqs"] == load["num_running_reqs"] + load["num_waiting_reqs"]
    assert 0 < load["num_used_tokens"] <= load["num_total_tokens"], load
    assert load["max_total_num_tokens"] > 0 and 0 < load["token_usage"] <= 1, load
    assert load["max_running_requests"] > 0 and load["utilization"] > 0, load
    assert set(load["queues"]) == {"waiting", "grammar", "paused", "retracted"}
    aggregate = body["aggregate"]
    assert aggregate["total_running_reqs"] == load["num_running_reqs"]
    assert aggregate["total_used_tokens"] == load["num_used_tokens"]
    core = requests.get(url + "/v1/loads?include=core&dp_rank=0", timeout=30).json()
    assert "queues" not in core["loads"][0] and "lora" not in core["loads"][0]
    text = requests.get(url + "/v1/loads?format=prometheus", timeout=30)
    assert text.status_code == 200 and "# TYPE sglang_num_running_reqs gauge" in text.text
    assert 'sglang_queues_waiting{dp_rank="0"}' in text.text
    post(url, "/abort_request", {"rid": rid})
    list(chunks)
    wait_idle(url)
    after = requests.get(url + "/v1/loads", timeout=30).json()["loads"][0]
    assert after["num_running_reqs"] == 0 and after["num_used_tokens"] == 0, after
    assert after["gen_throughput"] > 0  # tokens came out within the last seconds
    rate, _ = positive_metric(url, "radixserve_gen_throughput ")
    assert rate is not None and rate > 0, rate
    for query, param in (
        ("dp_rank=7", "dp_rank"),
        ("include=core,gpu", "include"),
        ("format=xml", "format"),
    ):
        r = requests.get(url + "/v1/loads?" + query, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_abort_all(url):
    rid = f"abort-all-{uuid.uuid4().hex[:8]}"
    thread, box = run_in_thread(lambda: generate(url, long_body(rid, False)))
    deadline = time.monotonic() + 60
    while server_state(url)["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    r = post(url, "/abort_request", {"abort_all": True})
    assert r.status_code == 200, r.text
    result = joined(thread, box)
    assert result["meta_info"]["id"] == rid
    assert result["meta_info"]["finish_reason"]["type"] == "abort", result["meta_info"]
    state = wait_idle(url)
    assert state["num_running"] == 0 and state["kv_held_by_requests"] == 0, state


def test_client_disconnect_frees_kv(url):
    rid = f"gone-{uuid.uuid4().hex[:8]}"
    sse = stream(url, long_body(rid, True))
    next(iter(sse))
    sse.response.close()  # the client goes away mid-stream
    state = wait_idle(url)
    assert state["num_running"] == 0, state
    assert state["kv_held_by_requests"] == 0, state


def test_rid_reused_after_a_disconnect_gets_its_own_result(url):
    """A client that disconnects and at once sends a new request under the same rid gets
    either a 400 naming the rid (the old one is still being aborted) or the new request's
    own result: never the old request's ending, and nothing is left running."""
    body = {
        "text": "What is the capital of France?",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    }
    expected = generate(url, body)
    for attempt in range(4):
        rid = f"reused-{attempt}-{uuid.uuid4().hex[:8]}"
        sse = stream(url, long_body(rid, True))
        next(iter(sse))
        sse.response.close()
        deadline = time.monotonic() + 30
        while True:
            r = post(url, "/generate", {**body, "rid": rid})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            assert_error(r, 400, "rid")
            time.sleep(0.01)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["id"] == rid
        assert meta["finish_reason"] == expected["meta_info"]["finish_reason"], meta
        assert meta["prompt_tokens"] == expected["meta_info"]["prompt_tokens"], meta
        assert r.json()["text"] == expected["text"]
    state = wait_idle(url)
    assert state["num_running"] == 0 and state["kv_held_by_requests"] == 0, state


# -- 10. errors -----------------------------------------------------------------------------
BAD_REQUESTS = {
    "unknown_param": ({"text": "Hi", "sampling_params": {"foo": 1}}, ["foo"]),
    "temperature_type": (
        {"text": "Hi", "sampling_params": {"temperature": "hot"}},
        ["temperature"],
    ),
    "top_p_zero": ({"text": "Hi", "sampling_params": {"top_p": 0}}, ["top_p"]),
    "max_new_tokens_negative": (
        {"text": "Hi", "sampling_params": {"max_new_tokens": -1}},
        ["max_new_tokens"],
    ),
    "text_and_input_ids": ({"text": "Hi", "input_ids": [1, 2]}, ["text", "input_ids"]),
    "neither": ({"sampling_params": {"max_new_tokens": 1}}, [("text", "input_ids")]),
    "empty_text": ({"text": ""}, [("text", "empty")]),
    "id_out_of_vocab": ({"input_ids": [1, 49152]}, [("input_ids", "token ids"), "49152"]),
    "sampling_params_list_length": (
        {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]},
        ["sampling_params"],
    ),
    "stream_unknown_param": (
        {"text": "Hi", "sampling_params": {"foo": 1}, "stream": True},
        ["foo"],
    ),
    # SGLang's fields for what this server does not do: refused, not silently ignored
    "image_data": ({"text": "Hi", "image_data": "http://x/cat.png"}, ["image_data"]),
    "lora_path": ({"text": "Hi", "lora_path": "my-adapter"}, ["lora_path"]),
    "return_hidden_states": ({"text": "Hi", "return_hidden_states": True}, ["hidden_states"]),
}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": 5}, "text"),  # str | list[str]: pydantic says text.str
        ({"input_ids": [1, "a"]}, "input_ids.1"),  # input_ids.list[int].1
        ({"text": "Hi", "sampling_params": 3}, "sampling_params"),
    ],
)
def test_a_union_field_is_named_without_pydantics_member_tags(url, body, param):
    error = assert_error(post(url, "/generate", body), 400)
    assert error["param"] == param, error
    assert error["message"].startswith(f"Invalid type for '{param}': expected "), error


def test_unsupported_sglang_fields_at_their_defaults_are_accepted(url):
    defaults = {"image_data": None, "lora_path": None, "return_hidden_states": False}
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}, **defaults}
    assert generate(url, body)["meta_info"]["completion_tokens"] == 1


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request(url, case):
    body, words = BAD_REQUESTS[case]
    assert_error(post(url, "/generate", body), 400, *words)


def test_invalid_json(url):
    r = requests.post(
        url + "/generate",
        data=b'{"text": "Hi", "sampling_params": {',
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    assert_error(r, 400, "JSON")


def test_context_length_exceeded(url):
    body = {"input_ids": [504] * 8000, "sampling_params": {"max_new_tokens": 500}}
    error = assert_error(post(url, "/generate", body), 400, str(CONTEXT_LEN), "8500")
    assert error["code"] == "context_length_exceeded", error


@pytest.mark.parametrize(
    "kind, spec", [("regex", "[0-9"), ("json_schema", "{not json"), ("ebnf", "x")]
)
def test_an_invalid_constraint_is_a_400_naming_its_field(url, kind, spec):
    body = {"text": "A:", "sampling_params": {"max_new_tokens": 4, kind: spec}}
    error = assert_error(post(url, "/generate", body), 400, f"invalid {kind}")
    assert error["param"] == kind, error


def test_a_text_longer_than_any_context_is_refused_before_tokenizing(url):
    """SmolLM2's longest token stands for 81 characters: 8,192 of them hold at most ~663k
    characters, so 2M characters are refused outright, naming the count."""
    body = {"text": "hello world " * 170_000, "sampling_params": {"max_new_tokens": 1}}
    error = assert_error(post(url, "/generate", body), 400, str(CONTEXT_LEN), "2040000")
    assert error["code"] == "context_length_exceeded", error


def test_a_long_text_is_tokenized_off_the_event_loop(url):
    """A long prompt takes a while to tokenize (~1 s for these 1.18M characters of distinct
    words); meanwhile the server answers others: a /health sent after it is answered first."""
    text = " ".join(f"w{i * 7919 % 100003}x" for i in range(150_000))
    body = {"text": text, "sampling_params": {"max_new_tokens": 1}}

    def long_request() -> tuple[requests.Response, float]:
        r = post(url, "/generate", body)
        return r, time.monotonic()

    thread, box = run_in_thread(long_request)
    time.sleep(0.2)  # its body is in and being tokenized
    assert requests.get(url + "/health", timeout=TIMEOUT).status_code == 200
    health_answered = time.monotonic()
    r, long_answered = joined(thread, box)
    assert_error(r, 400, str(CONTEXT_LEN))
    assert health_answered < long_answered


def test_unknown_route(url):
    assert_error(requests.get(url + "/no_such_route", timeout=TIMEOUT), 404)
    assert_error(post(url, "/v1/no_such_route", {}), 404)


def test_still_serves_after_errors(url):
    for body, _ in BAD_REQUESTS.values():
        post(url, "/generate", body)
    result = generate(url, {"text": "Hello, my name is", "sampling_params": {"max_new_tokens": 3}})
    meta = check_result(result)
    assert 1 <= meta["completion_tokens"] <= 3
    state = wait_idle(url)
    assert state["num_running"] == 0 and state["kv_held_by_requests"] == 0, state
    assert requests.get(url + "/health", timeout=TIMEOUT).status_code == 200


def test_start_and_stop_profile_write_a_trace_of_the_steps(url, tmp_path):
    r = post(url, "/start_profile", {"output_dir": str(tmp_path), "profile_prefix": "t-"})
    assert r.status_code == 200, r.text
    r = post(url, "/start_profile", {"output_dir": str(tmp_path)})
    assert r.status_code == 400 and "already running" in r.json()["error"]["message"]
    generate(url, {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    r = requests.post(url + "/stop_profile", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    (trace,) = r.json()["traces"]
    assert trace.startswith(str(tmp_path / "t-")) and trace.endswith("-DP-0.trace.json.gz")
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == "aten::mm" or "linear" in str(e.get("name")) for e in events)
    r = requests.post(url + "/stop_profile", timeout=TIMEOUT)
    assert r.status_code == 400 and "no profile is running" in r.json()["error"]["message"]

    # with num_steps the trace is written by itself, and the next stop reports it
    r = post(url, "/start_profile", {"output_dir": str(tmp_path / "auto"), "num_steps": 2})
    assert r.status_code == 200, r.text
    generate(url, {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    (written,) = (tmp_path / "auto").glob("*.trace.json.gz")
    r = requests.post(url + "/stop_profile", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["traces"] == [str(written)], r.text
    assert requests.post(url + "/stop_profile", timeout=TIMEOUT).status_code == 400

    for body, param in (
        ({"activities": ["RPD"]}, None),
        ({"num_steps": 0}, None),
        ({"profile_by_stage": True}, "profile_by_stage"),
        ({"colour": 1}, "colour"),
        ({"num_steps": "2"}, "num_steps"),
        ({"profile_prefix": "a/b"}, None),
        ({"output_dir": "/tmp/a\u0000b"}, None),
    ):
        r = post(url, "/start_profile", {"output_dir": str(tmp_path), **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
