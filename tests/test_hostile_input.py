"""One test per class of hostile input, on both APIs of one real server (the tiny Llama):
each is a 400 in the OpenAI error shape whose message and `param` name the field, and the
server goes on serving. The fuzz test (test_server_fuzz.py) mixes them at random; these pin
the answer to each."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

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
