"""One test per class of hostile input, on both APIs of one real server (the tiny Llama):
each is a 400 in the OpenAI error shape whose message and `param` name the field, and the
server goes on serving. The fuzz test (test_server_fuzz.py) mixes them at random; these pin
the answer to each."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import requests

from radixserve.core.sampling_params import (
    MAX_STOP_LENGTH,
    MAX_STOP_REGEX_ITEMS,
    MAX_STOP_REGEX_LENGTH,
    MAX_STOP_REGEXES,
    MAX_STOPS,
)
from radixserve.server.body import MAX_JSON_DEPTH
from radixserve.server.checks import MAX_SEQUENCES_PER_REQUEST, MAX_TOP_LOGPROBS
from tests.server_utils import ServerProcess, tiny_model_server

VOCAB = 512  # the tiny model's
CONTEXT = 2048  # its max_position_embeddings
TIMEOUT_S = 60
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    yield from tiny_model_server(
        tiny_model_dirs["llama"], tmp_path_factory.mktemp("hostile-server")
    )


def post_raw(server: ServerProcess, path: str, data: bytes) -> requests.Response:
    headers = {"Content-Type": "application/json"}
    return requests.post(server.url + path, data=data, headers=headers, timeout=TIMEOUT_S)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> requests.Response:
    return post_raw(server, path, json.dumps(body).encode())  # NaN, \ud800 written as is


def assert_400(r: requests.Response, field: str) -> dict[str, Any]:
    """A 400 in the OpenAI shape whose message and param both name `field`."""
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert field in error["message"], error
    assert error["param"] is not None and field in error["param"], error
    return error


def deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


# -- deep JSON ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/generate", {"text": "hi", "sampling_params": {"stop": deep(100)}}, "stop"),
        ("/v1/completions", {"prompt": deep(MAX_JSON_DEPTH + 1), "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": CHAT, "metadata": {"a": deep(80)}}, "metadata"),
    ],
)
def test_too_deep_json_is_400_naming_the_field(server, path, body, field):
    assert_400(post(server, path, body), field)


def test_json_too_deep_for_the_parser_is_400(server):
    r = post_raw(server, "/generate", b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert r.status_code == 400, r.text
    assert "deeper" in r.json()["error"]["message"]


def test_depth_at_the_limit_is_accepted(server):
    # the body is level 1, sampling_params 2, logit_bias 3: well within the limit
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "logit_bias": {}}}
    assert post(server, "/generate", body).status_code == 200


# -- invalid unicode ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/generate", {"text": "a\ud800b"}, "text"),
        ("/generate", {"text": "hi", "sampling_params": {"stop": ["\udfff"]}}, "stop"),
        ("/v1/completions", {"prompt": ["ok", "\ud83d"], "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]}, "content"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(server, path, body, field):
    assert_400(post(server, path, body), field)


def test_bytes_that_are_not_utf8_are_400(server):
    r = post_raw(server, "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 1}')
    assert r.status_code == 400, r.text
    assert "utf-8" in r.json()["error"]["message"].lower()


def test_a_body_over_the_size_cap_is_413_and_the_server_goes_on(server):
    from radixserve.server.body import MAX_BODY_BYTES

    padding = "x" * (MAX_BODY_BYTES + 1)
    raw = json.dumps({"prompt": "hi", "max_tokens": 1, "user": padding}).encode()
    r = post_raw(server, "/v1/completions", raw)
    assert r.status_code == 413, (r.status_code, r.text[:200])
    error = r.json()["error"]
    assert "MiB" in error["message"] and error["code"] == "request_too_large", error

    def chunked():  # no Content-Length: the cap applies while the body streams in
        yield b'{"text": "hi", "sampling_params": {"max_new_tokens": 1}, "x": "'
        for _ in range(MAX_BODY_BYTES >> 20):
            yield b"y" * (1 << 20)
        yield b'yy"}'

    r = requests.post(server.url + "/generate", data=chunked(), timeout=TIMEOUT_S)
    assert r.status_code == 413, (r.status_code, r.text[:200])
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


# -- numbers out of range -------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, raw, field",
    [
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1, "seed": %d}' % 2**70, "seed"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e400}', "max_tokens"),
        ("/generate", b'{"text": "hi", "sampling_params": {"sampling_seed": %d}}' % 2**64, "seed"),
        ("/generate", b'{"text": "hi", "priority": -%d}' % (2**63 + 1), "priority"),
        ("/v1/chat/completions", b'{"messages": [], "temperature": -1e999}', "temperature"),
    ],
)
def test_numbers_outside_64_bits_are_400_naming_the_field(server, path, raw, field):
    assert_400(post_raw(server, path, raw), field)


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
        ("/generate", {"text": "hi", "sampling_params": {"min_p": 1.5}}, "min_p"),
        ("/generate", {"text": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "min_tokens": 2}, "min_tokens"),
        ("/generate", {"text": "hi", "logprob_start_len": -2}, "logprob_start_len"),
        (
            "/generate",
            {"text": "hi", "return_logprob": True, "top_logprobs_num": MAX_TOP_LOGPROBS + 1},
            "top_logprobs_num",
        ),
    ],
)
def test_sampling_values_out_of_range_are_400_naming_the_field(server, path, body, field):
    assert_400(post(server, path, body), field)


def test_nan_is_not_json(server):
    r = post_raw(server, "/generate", b'{"text": "hi", "sampling_params": {"temperature": NaN}}')
    assert r.status_code == 400, r.text
    assert "NaN" in r.json()["error"]["message"]


# -- n and batch caps -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 129}, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "n": 10**6}, "n"),
        ("/generate", {"text": "hi", "sampling_params": {"n": 129}}, "n"),
    ],
)
def test_n_over_128_is_400(server, path, body, field):
    assert_400(post(server, path, body), field)


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/generate", {"text": ["a"] * (MAX_SEQUENCES_PER_REQUEST + 1)}, "text"),
        ("/generate", {"input_ids": [[1]] * 100, "sampling_params": {"n": 3}}, "input_ids"),
        ("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1, "n": 100}, "prompt"),
    ],
)
def test_prompts_times_n_over_the_cap_is_400(server, path, body, field):
    error = assert_400(post(server, path, body), field)
    assert str(MAX_SEQUENCES_PER_REQUEST) in error["message"], error


# -- out-of-vocabulary token ids ------------------------------------------------------------
@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/generate", {"input_ids": [1, VOCAB]}, "input_ids"),
        ("/generate", {"input_ids": [[1], [-1]]}, "input_ids"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"stop_token_ids": [VOCAB]}},
            "stop_token_ids",
        ),
        ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"-3": 1}}}, "logit_bias"),
        ("/v1/completions", {"prompt": [[1, 2], [2**31]], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": CHAT, "stop_token_ids": [9999]}, "stop_token_ids"),
        ("/detokenize", {"tokens": [VOCAB + 7]}, "tokens"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_400(server, path, body, field):
    error = assert_400(post(server, path, body), field)
    assert str(VOCAB) in error["message"], error


# -- context overflow -----------------------------------------------------------------------
def native(ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens}}


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/generate", native([5] * 100, 2000), "max_new_tokens"),
        ("/generate", native([5] * (CONTEXT + 1), 0), "input_ids"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**62}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_completion_tokens": CONTEXT},
            "max_tokens",
        ),
    ],
)
def test_context_overflow_is_400_naming_the_field(server, path, body, field):
    error = assert_400(post(server, path, body), field)
    assert error["code"] == "context_length_exceeded", error
    assert str(CONTEXT) in error["message"], error


# -- values of the wrong JSON type ----------------------------------------------------------
def completions(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"prompt": "hi", **fields}


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"messages": CHAT, **fields}


def generate(**sampling_params: Any) -> tuple[str, dict[str, Any]]:
    return "/generate", {"text": "hi", "sampling_params": sampling_params}


STRICT_TOOL = {"type": "function", "function": {"name": "f", "strict": "yes"}}


@pytest.mark.parametrize(
    "call, field, expected, got",
    [
        (completions(max_tokens=True), "max_tokens", "an integer", "a boolean"),
        (completions(max_tokens=1.0), "max_tokens", "an integer", "a decimal number"),
        (completions(n="2"), "n", "an integer", "a string"),
        (completions(stream=0), "stream", "a boolean", "an integer"),
        (completions(temperature=True), "temperature", "a number", "a boolean"),
        (completions(echo="yes"), "echo", "a boolean", "a string"),
        (completions(prompt=5), "prompt", "a string or an array", "an integer"),
        (chat(logprobs=1), "logprobs", "a boolean", "an integer"),
        (chat(tools=[STRICT_TOOL]), "tools.0.function.strict", "a boolean", "a string"),
        (
            ("/v1/embeddings", {"input": "hi", "dimensions": "8"}),
            "dimensions",
            "an integer",
            "a string",
        ),
        (
            ("/generate", {"input_ids": ["1", True]}),
            "input_ids.0",
            "an integer or an array",
            "a string",
        ),
        (
            ("/generate", {"text": "hi", "return_logprob": "on"}),
            "return_logprob",
            "a boolean",
            "a string",
        ),
        (("/generate", {"text": "hi", "stream": None}), "stream", "a boolean", "null"),
        (
            ("/tokenize", {"prompt": "hi", "add_special_tokens": "no"}),
            "add_special_tokens",
            "a boolean",
            "a string",
        ),
        (("/detokenize", {"tokens": [1, True]}), "tokens.1", "an integer", "a boolean"),
        (("/abort_request", {"abort_all": 1}), "abort_all", "a boolean", "an integer"),
    ],
)
def test_a_value_of_the_wrong_type_is_400_saying_which_type_each_field_takes(
    server, call, field, expected, got
):
    """As OpenAI's API answers it: no coercion of true to 1, "2" to 2 or "yes" to true."""
    error = assert_400(post(server, *call), field)
    assert error["param"] == field, error
    message = f"Invalid type for '{field}': expected {expected}, but got {got} instead"
    assert error["message"] == message, error


def test_an_integer_is_a_number_where_a_float_is_expected(server):
    body = {"prompt": "hi", "max_tokens": 1, "temperature": 1, "top_p": 1, "logit_bias": {"5": 1}}
    assert post(server, "/v1/completions", body).status_code == 200
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "temperature": 1}}
    assert post(server, "/generate", body).status_code == 200


@pytest.mark.parametrize(
    "call, field",
    [
        (completions(suffix="!"), "suffix"),
        (completions(best_of=3), "best_of"),
        (completions(stream_options={"include_usage": True}), "stream_options"),
        (chat(stream=False, stream_options={}), "stream_options"),
        (chat(tools=[]), "tools"),
        (generate(regex=0), "regex"),
        (generate(json_schema=[]), "json_schema"),
        (generate(ebnf=False), "ebnf"),
        (generate(stop_regex=[""]), "stop_regex"),
        (completions(stop_regex=["a", ""]), "stop_regex"),
    ],
)
def test_a_field_openai_refuses_or_that_would_be_ignored_is_400_naming_it(server, call, field):
    """suffix and best_of (not supported), stream_options without a stream and an empty
    tools array (OpenAI refuses both); a constraint that is no string (0 and [] were taken
    as no constraint) and an empty stop regex (it was taken, and never matched)."""
    assert_400(post(server, *call), field)


def test_the_empty_string_still_means_no_constraint_and_stream_options_go_with_a_stream(
    server,
):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1, "regex": ""}}
    assert post(server, "/generate", body).status_code == 200
    body = {"prompt": "hi", "max_tokens": 1, "stream": True, "stream_options": None}
    assert post(server, "/v1/completions", body).status_code == 200
    body["stream_options"] = {"include_usage": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200 and '"usage"' in r.text, r.text


# -- stop strings and regexes: what one request may make every step cost ---------------------
@pytest.mark.parametrize(
    "call, field, limit",
    [
        (generate(stop_regex=[r"a\d"] * (MAX_STOP_REGEXES + 1)), "stop_regex", MAX_STOP_REGEXES),
        (completions(stop_regex=["(?:x0|y)+z0$"] * 3000), "stop_regex", MAX_STOP_REGEXES),
        (completions(stop_regex="x" * 257), "stop_regex", MAX_STOP_REGEX_LENGTH),
        (generate(stop_regex="(?:a{1000}){1000}"), "stop_regex", MAX_STOP_REGEX_ITEMS),
        (generate(stop=["s"] * (MAX_STOPS + 1)), "stop", MAX_STOPS),
        (chat(stop="y" * (MAX_STOP_LENGTH + 1)), "stop", MAX_STOP_LENGTH),
    ],
)
def test_too_many_or_too_long_stops_are_400_naming_the_limit(server, call, field, limit):
    """(The 17-character repeat unrolls to a million items: 0.4 s to compile, in the HTTP
    process and again in the scheduler's, before anything is generated.)"""
    error = assert_400(post(server, *call), field)
    assert str(limit) in error["message"], error


def test_stops_at_the_limits_are_accepted(server):
    params = {"max_new_tokens": 2, "stop": ["s" * MAX_STOP_LENGTH] * MAX_STOPS}
    params["stop_regex"] = [r"\d{2}-\d{2}"] * MAX_STOP_REGEXES
    r = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": params})
    assert r.status_code == 200, r.text


# -- the tokenizer routes: held to what /generate takes --------------------------------------
def test_a_text_too_long_for_any_context_is_400_on_every_route_that_tokenizes(server):
    """The tiny tokenizer's longest token is 13 characters: a context of 2048 tokens holds
    at most ~53k characters. 3 MB of text is refused before it is tokenized (it took 1.4 s
    on the event loop, and 360 MB, when /tokenize took it)."""
    text = "hello world " * 250_000
    for path, body, field in [
        ("/generate", {"text": text}, "text"),
        ("/v1/completions", {"prompt": ["hi", text]}, "prompt"),
        ("/tokenize", {"prompt": text}, "prompt"),
        ("/tokenize", {"prompt": ["hi", text], "add_special_tokens": False}, "prompt"),
        ("/score_continuations", {"text": text, "continuations": [" a"]}, "text"),
    ]:
        error = assert_400(post(server, path, body), field)
        assert error["code"] == "context_length_exceeded", (path, error)
        assert str(CONTEXT) in error["message"] and str(len(text)) in error["message"], error
    r = post(server, "/tokenize", {"prompt": "hello world " * 4000})
    assert r.status_code == 200 and r.json()["count"] > CONTEXT, r.text[:200]


def test_the_tokenizer_routes_cap_their_batch_and_ids(server):
    body = {"prompt": ["a"] * (MAX_SEQUENCES_PER_REQUEST + 1)}
    error = assert_400(post(server, "/tokenize", body), "prompt")
    assert str(MAX_SEQUENCES_PER_REQUEST) in error["message"], error
    error = assert_400(post(server, "/detokenize", {"tokens": [5] * 1_000_000}), "tokens")
    assert str(CONTEXT) in error["message"], error
    r = post(server, "/detokenize", {"tokens": [5] * CONTEXT})
    assert r.status_code == 200 and r.json()["prompt"], r.text[:200]


def test_a_large_body_is_parsed_off_the_event_loop(server):
    """Parsing and checking a body takes ~0.25 s a million token ids: past 64 kB it is done
    on a worker thread, so a /health sent meanwhile is answered first. (The 3M ids are then
    refused, more than the context; one outside the vocabulary makes the answer as short
    where they would not be.)"""
    raw = json.dumps({"tokens": [5] * 3_000_000 + [VOCAB]}).encode()
    answered: dict[str, Any] = {}

    def long_request() -> None:
        answered["response"] = post_raw(server, "/detokenize", raw)
        answered["at"] = time.monotonic()

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.2)  # its body is in and being parsed
    assert requests.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
    health_answered = time.monotonic()
    thread.join()
    assert_400(answered["response"], "tokens")
    assert health_answered < answered["at"]


# -- bodies that are not JSON objects, and the server afterwards -----------------------------
@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b"null", b'"text"', b"{", b"{'a': 1}"])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/tokenize"])
def test_a_body_that_is_not_a_json_object_is_400(server, path, raw):
    r = post_raw(server, path, raw)
    assert r.status_code == 400, r.text
    assert "JSON" in r.json()["error"]["message"], r.text


def test_a_json_body_with_a_form_content_type_is_still_read(server):
    """curl -d sends application/x-www-form-urlencoded; the body is JSON all the same."""
    body = b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}'
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    r = requests.post(server.url + "/generate", data=body, headers=headers, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text


def test_the_server_still_serves(server):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    assert server.proc.poll() is None
