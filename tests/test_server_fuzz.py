"""Every route of one real server (the tiny random-weight Llama) driven with generated bodies:
valid ones, boundary values and hostile ones (wrong types, huge and negative numbers, deep
nesting, lone surrogates, NaN, huge n and batches, out-of-vocabulary ids, bytes that are not
JSON). No answer may be a 5xx, the server's processes must all stay alive, and afterwards
the KV pool must be exactly accounted for.

Reproducible and bounded: `derandomize=True`, no example database, a fixed number of
examples per route (about 270 in all), and generations of at most a few tokens.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any
from urllib.parse import quote

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_utils import ServerProcess, tiny_model_server

VOCAB = 512  # the tiny model's (tests/conftest.py TINY_SHAPE)
CONTEXT = 2048  # its max_position_embeddings
TIMEOUT_S = 60  # no answer may take longer: a hang is a failure too
GENERATION_ROUTES = (
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/encode",
    "/v1/embeddings",
)
STATUSES: Counter[tuple[str, int]] = Counter()  # (route, status) of every fuzzed request


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


# -- the server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    yield from tiny_model_server(tiny_model_dirs["llama"], tmp_path_factory.mktemp("fuzz-server"))


def send(server: ServerProcess, method: str, path: str, body: Any = None) -> requests.Response:
    """One request; `body` is JSON-encoded (NaN and lone surrogates as Python writes them)
    unless it is bytes already. The answer must not be a 5xx and the server must live."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    r = requests.request(
        method, server.url + path, data=data, headers=headers, timeout=TIMEOUT_S, stream=True
    )
    content = r.content  # the whole answer, every SSE event of a stream included
    STATUSES[path, r.status_code] += 1
    assert r.status_code < 500, (path, body, r.status_code, content[:2000], server.logs())
    assert_alive(server)
    if r.status_code >= 400 and r.headers.get("content-type") == "application/json":
        error = json.loads(content)["error"]
        assert isinstance(error["message"], str) and error["message"], error
    return r


def assert_alive(server: ServerProcess) -> None:
    assert server.proc.poll() is None, server.logs()
    dead = [p.pid for p in server.children if not p.is_running()]
    assert not dead, (dead, server.logs())


# -- values -----------------------------------------------------------------------------------
BIG_INTS = [2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 2**70, 10**30]
BAD_TEXT = ["\ud800", "a\udfffb", "\udc00\ud800", "\x00", "\u202e", "\U0010ffff"]


def deep(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from(BIG_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(BAD_TEXT),
)
hostile = st.one_of(  # any JSON value at all, deep nesting and bad unicode included
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(st.text(max_size=6), scalars, max_size=3),
    st.integers(60, 120).map(deep),
)


@st.composite
def bodies(
    draw: st.DrawFn,
    required: dict[str, st.SearchStrategy],
    optional: dict[str, st.SearchStrategy],
    bad: dict[str, st.SearchStrategy],
) -> dict[str, Any]:
    """A valid body (required fields and some optional ones); then, as often, one field made
    boundary or hostile (its `bad` values, else any JSON value), or several at once."""
    body = draw(st.fixed_dictionaries(required, optional=optional))
    keys = sorted({*required, *optional, "unknown_field"})
    mode = draw(st.sampled_from(["valid", "valid", "one bad", "one bad", "one bad", "chaos"]))
    spoilt = {"valid": [], "one bad": [draw(st.sampled_from(keys))]}.get(mode)
    if spoilt is None:
        spoilt = draw(st.lists(st.sampled_from(keys), min_size=2, max_size=4))
    for key in spoilt:
        if draw(st.booleans()) and key in body and key not in required:
            del body[key]
        else:
            body[key] = draw(bad.get(key, hostile))
    return body


valid_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
bad_ids = st.one_of(
    st.lists(st.sampled_from([-1, VOCAB, VOCAB + 1, 2**31, 2**63 - 1, 0]), max_size=4),
    st.lists(st.lists(st.sampled_from([-1, 0, VOCAB]), max_size=3), max_size=3),
    st.just([]),
    st.just([7] * (CONTEXT + 1)),  # longer than the context
    st.just([[1, 2]] * 257),  # over the per-request cap of sequences
    hostile,
)
texts = st.one_of(st.text(min_size=1, max_size=16), st.sampled_from(["Hello", "a b c"]))
bad_texts = st.one_of(
    st.sampled_from(BAD_TEXT + ["", [""], ["a"] * 257]), st.lists(texts, max_size=4), hostile
)
few_tokens = st.integers(0, 3)
bad_few_tokens = st.sampled_from(  # never null: the default would be a long generation
    [-1, CONTEXT, CONTEXT + 1, 2**62, 2**63, 2**64, float("inf"), 2.5, "3", True, [], {}]
)
bad_n = st.sampled_from([0, -1, 128, 129, 10**6, 2**64, 1.5, "2", None])
stops = st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3)))
bias = st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3)
bad_bias = st.one_of(
    st.dictionaries(
        st.sampled_from(["-1", str(VOCAB), "x", "²", "-0", " 1", str(2**64)]),
        st.sampled_from([0.0, -101.0, 101.0, 1e308, float("nan")]),
        min_size=1,
        max_size=2,
    ),
    hostile,
)
seeds = st.integers(0, 2**63 - 1)
bad_seeds = st.one_of(st.sampled_from(BIG_INTS + [-1, -(2**63), "1", 1.5]), hostile)
regexes = st.sampled_from(["[0-9]+", "a|b", "[a-z]{1,3}"])
# (not "a{99999999}": the grammar backend takes ~13 s to give up on it, see the report)
bad_regexes = st.one_of(st.sampled_from(["(", "[", "(?P<x>", ""]), hostile)
schemas = st.sampled_from(['{"type": "object"}', '{"type": "integer"}', {"type": "string"}])
bad_schemas = st.one_of(st.sampled_from(["{not json", '{"type": 5}', "[]"]), hostile)
unit = st.sampled_from([0.0, 0.5, 1.0])
bad_unit = st.sampled_from([-0.1, 1.1, 1e-300, -1e308, 1e308, float("nan")])
penalty = st.floats(-2, 2)
bad_penalty = st.sampled_from([-2.1, 2.1, 1e9, float("-inf")])

native_sampling_valid = {
    "min_new_tokens": st.integers(0, 1),
    "temperature": st.sampled_from([0.0, 0.7, 1.0, 1e-7]),
    "top_p": st.sampled_from([1e-9, 0.5, 1.0]),
    "top_k": st.sampled_from([-1, 1, 5, VOCAB, 10**9]),
    "min_p": unit,
    "frequency_penalty": penalty,
    "presence_penalty": penalty,
    "repetition_penalty": st.sampled_from([0.5, 1.0, 2.0]),
    "stop": stops,
    "stop_token_ids": valid_ids,
    "stop_regex": st.lists(regexes, max_size=2),
    "ignore_eos": st.booleans(),
    "logit_bias": bias,
    "sampling_seed": seeds,
    "n": st.integers(1, 3),
    "regex": regexes,
    "json_schema": schemas,
}
native_sampling_bad = {
    "max_new_tokens": bad_few_tokens,
    "min_new_tokens": st.sampled_from([-1, 4, 2**63]),
    "temperature": st.sampled_from([-0.1, -1e308, 1e308, float("inf")]),
    "top_p": bad_unit,
    "top_k": st.sampled_from([0, -2, 2**63]),
    "min_p": bad_unit,
    "frequency_penalty": bad_penalty,
    "presence_penalty": bad_penalty,
    "repetition_penalty": st.sampled_from([0.0, -1.0, 2.1]),
    "stop": st.one_of(st.just(""), st.just([""]), hostile),
    "stop_token_ids": bad_ids,
    "stop_regex": st.lists(bad_regexes, max_size=2),
    "logit_bias": bad_bias,
    "sampling_seed": bad_seeds,
    "n": bad_n,
    "regex": bad_regexes,
    "json_schema": bad_schemas,
}
native_sampling = bodies({"max_new_tokens": few_tokens}, native_sampling_valid, native_sampling_bad)
generate_bodies = st.one_of(
    bodies(
        {  # sampling_params always: the default max_new_tokens (128) would take long here
            "text": st.one_of(texts, st.lists(texts, min_size=1, max_size=3)),
            "sampling_params": native_sampling,
        },
        {
            "return_logprob": st.booleans(),
            "logprob_start_len": st.integers(-1, 4),
            "top_logprobs_num": st.integers(0, 3),
            "token_ids_logprob": valid_ids,
            "return_text_in_logprobs": st.booleans(),
            "rid": st.uuids().map(str),
            "stream": st.booleans(),
            "priority": st.integers(-5, 5),
        },
        {
            "text": bad_texts,
            "input_ids": bad_ids,  # with text: both given
            "sampling_params": st.one_of(
                st.lists(native_sampling, max_size=3),
                hostile.filter(lambda v: v is not None and v != {}),
            ),
            "logprob_start_len": st.sampled_from([-2, 10**6, 2**63]),
            "top_logprobs_num": st.sampled_from([-1, 20, 21, VOCAB + 1, 2**63]),
            "rid": st.one_of(st.just(["a", "a"]), st.just(["a"]), hostile),
            "token_ids_logprob": bad_ids,
        },
    ),
    bodies(
        {
            "input_ids": st.one_of(valid_ids, st.lists(valid_ids, min_size=1, max_size=3)),
            "sampling_params": native_sampling,
        },
        {"stream": st.booleans()},
        {"input_ids": bad_ids, "sampling_params": st.lists(native_sampling, max_size=3)},
    ),
)

openai_valid = {
    "model": st.text(max_size=8),
    "temperature": st.sampled_from([0.0, 0.5, 2.0]),
    "top_p": st.sampled_from([0.5, 1.0]),
    "n": st.integers(1, 3),
    "stop": stops,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "seed": seeds,
    "frequency_penalty": penalty,
    "presence_penalty": penalty,
    "logit_bias": bias,
    "top_k": st.sampled_from([-1, 3]),
    "min_p": unit,
    "min_tokens": st.integers(0, 1),
    "repetition_penalty": st.sampled_from([1.0, 1.2]),
    "ignore_eos": st.booleans(),
    "stop_token_ids": valid_ids,
    "regex": regexes,
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        ]
    ),
}
openai_bad = {
    "max_tokens": bad_few_tokens,
    "temperature": st.sampled_from([-0.1, 1e308, float("inf"), "hot"]),
    "top_p": bad_unit,
    "n": bad_n,
    "stop": st.one_of(st.just([""]), hostile),
    "stream_options": st.one_of(st.just({"include_usage": "yes"}), st.just({"x": 1}), hostile),
    "seed": bad_seeds,
    "frequency_penalty": bad_penalty,
    "presence_penalty": bad_penalty,
    "logit_bias": bad_bias,
    "top_k": st.sampled_from([0, -2, 2**63]),
    "min_p": bad_unit,
    "min_tokens": st.sampled_from([-1, 5, 2**63]),
    "stop_token_ids": bad_ids,
    "regex": bad_regexes,
    "response_format": st.sampled_from(
        [{"type": "json_schema"}, {"type": "xml"}, {"type": "json_schema", "json_schema": {}}]
    ),
}
prompts = st.one_of(texts, st.lists(texts, min_size=1, max_size=3), valid_ids)
completion_bodies = bodies(
    {"prompt": prompts, "max_tokens": few_tokens},
    {
        **openai_valid,
        "echo": st.booleans(),
        "logprobs": st.integers(0, 3),
        "best_of": st.just(1),
    },
    {
        **openai_bad,
        "prompt": st.one_of(bad_texts, bad_ids),
        "logprobs": st.sampled_from([-1, 20, 21, 2**63]),
        "best_of": st.sampled_from([0, 2, 3]),
        "suffix": st.text(max_size=3),
    },
)

message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": texts}
)
bad_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["robot", "tool", None, 5])}),
    st.just({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
    st.just({"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "x"}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.sampled_from(BAD_TEXT)}),
    hostile,
)
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
}
BAD_TOOLS = [
    [{"type": "function", "function": {"name": "a b"}}],  # not a function name
    [{"type": "function"}],
    [{"type": "code_interpreter"}],
    [TOOL, TOOL],  # the same name twice
    [{"type": "function", "function": {"name": "g", "parameters": {"type": "wat"}}}],
    [{"type": "function", "function": {"name": "g", "parameters": []}}],
]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


chat_bodies = bodies(
    {"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": few_tokens},
    {
        **openai_valid,
        "max_completion_tokens": few_tokens,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 3),
        "continue_final_message": st.booleans(),
        "tools": st.just([TOOL]),
        "tool_choice": st.sampled_from(["auto", "none", "required", named("f")]),
        "parallel_tool_calls": st.booleans(),
    },
    {
        **openai_bad,
        "messages": st.one_of(st.just([]), st.lists(bad_message, min_size=1, max_size=3)),
        "max_completion_tokens": bad_few_tokens,
        "top_logprobs": st.sampled_from([-1, 21, 2**63]),
        "tools": st.sampled_from(BAD_TOOLS),
        "tool_choice": st.sampled_from(["always", {"type": "function"}, named("g")]),
        "parallel_tool_calls": st.sampled_from([None, 0, "yes"]),
    },
)

FLAT_TOOL = {"type": "function", **TOOL["function"]}
call_ids = st.sampled_from(["c1", "c2"])
response_item = st.one_of(
    message,
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": call_ids, "name": st.just("f")},
        optional={"arguments": st.sampled_from(["{}", '{"x": 1}', "not json"])},
    ).map(lambda item: {"arguments": "{}", **item}),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": call_ids, "output": texts}
    ),
    st.just({"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]}),
)
bad_response_item = st.one_of(
    bad_message,
    st.just({"type": "item_reference", "id": "msg_1"}),
    st.just({"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}),
    st.just({"role": "user", "content": [{"type": "input_text"}]}),
    st.just({"type": "function_call_output", "call_id": "c", "output": [{"type": {}}]}),
    st.just({"type": "function_call", "call_id": "c", "name": "f"}),
    st.just({"type": "reasoning", "id": "x"}),
    hostile,
)
responses_bodies = bodies(
    {
        "input": st.one_of(texts, st.lists(response_item, min_size=1, max_size=3)),
        "max_output_tokens": st.integers(1, 3),
    },
    {
        "model": st.text(max_size=8),
        "instructions": texts,
        "temperature": st.sampled_from([0.0, 0.5, 2.0]),
        "top_p": st.sampled_from([0.5, 1.0]),
        "tools": st.just([FLAT_TOOL]),
        "tool_choice": st.sampled_from(
            ["auto", "none", "required", {"type": "function", "name": "f"}]
        ),
        "parallel_tool_calls": st.booleans(),
        "store": st.booleans(),
        "stream": st.booleans(),
        "include": st.just(["message.output_text.logprobs"]),
        "top_logprobs": st.integers(0, 3),
        "text": st.just({"format": {"type": "json_object"}}),
        "truncation": st.sampled_from(["auto", "disabled"]),
        "metadata": st.just({"k": "v"}),
        "reasoning": st.just({"effort": "none"}),
    },
    {
        "input": st.one_of(bad_texts, st.lists(bad_response_item, min_size=1, max_size=3)),
        "max_output_tokens": bad_few_tokens,
        "tools": st.sampled_from(
            [[{"type": "web_search"}], [{"type": "function"}], [FLAT_TOOL, FLAT_TOOL], BAD_TOOLS[0]]
        ),
        "tool_choice": st.sampled_from(
            [
                "always",
                {"type": "function"},
                {"type": "allowed_tools", "tools": []},
                {"type": "mcp"},
            ]
        ),
        "text": st.sampled_from([{"format": {"type": "json_schema"}}, {"format": {"type": "xml"}}]),
        "include": st.just(["everything"]),
        "metadata": st.sampled_from([{"k": 1}, {str(i): "v" for i in range(17)}]),
        "previous_response_id": st.text(max_size=8),
        "background": st.sampled_from([True, "yes"]),
        "top_logprobs": st.sampled_from([-1, 21]),
    },
)

tokenize_bodies = bodies(
    {"prompt": st.one_of(texts, st.lists(texts, max_size=3))},
    {"add_special_tokens": st.booleans()},
    {"prompt": bad_texts},
)
detokenize_bodies = bodies({"tokens": valid_ids}, {}, {"tokens": bad_ids})
abort_bodies = bodies({}, {"rid": st.text(max_size=6)}, {"abort_all": st.just(False)})
embedding_inputs = st.one_of(texts, st.lists(texts, min_size=1, max_size=3), valid_ids)
embedding_bodies = bodies(
    {"input": embedding_inputs},
    {
        "model": st.text(max_size=6),
        "encoding_format": st.sampled_from(["float", "base64"]),
        "dimensions": st.sampled_from([256, 1, 0, -1]),
        "user": st.text(max_size=6),
    },
    {"input": st.one_of(bad_texts, bad_ids), "encoding_format": st.text(max_size=6)},
)
encode_bodies = bodies(
    {"text": st.one_of(texts, st.lists(texts, min_size=1, max_size=3))},
    {"rid": st.text(min_size=1, max_size=6)},
    {"text": bad_texts, "input_ids": bad_ids},
)
POST_ROUTES = [
    "/generate",
    "/encode",
    "/v1/embeddings",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
    "/abort_request",
    "/score_continuations",
]
raw_bodies = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"", b"null", b"[]", b"1", b'"x"', b'{"a":', b"\xff\xfe{}"]),
    st.integers(200, 3000).map(lambda d: b"[" * d + b"]" * d),
    st.sampled_from(['{"prompt": "\\ud800"}', '{"text": NaN}', '{"n": 1e400}']).map(str.encode),
)


# -- the tests --------------------------------------------------------------------------------
@fuzz_settings(80)
@given(body=generate_bodies)
def test_fuzz_generate(server, body):
    send(server, "POST", "/generate", body)


@fuzz_settings(60)
@given(body=completion_bodies)
def test_fuzz_completions(server, body):
    send(server, "POST", "/v1/completions", body)


@fuzz_settings(40)
@given(body=chat_bodies)
def test_fuzz_chat_completions(server, body):
    send(server, "POST", "/v1/chat/completions", body)


@fuzz_settings(40)
@given(body=responses_bodies)
def test_fuzz_responses(server, body):
    send(server, "POST", "/v1/responses", body)


@fuzz_settings(40)
@given(route=st.sampled_from(["/encode", "/v1/embeddings"]), data=st.data())
def test_fuzz_embeddings(server, route, data):
    strategy = embedding_bodies if route == "/v1/embeddings" else encode_bodies
    send(server, "POST", route, data.draw(strategy))


@fuzz_settings(30)
@given(
    route=st.sampled_from(["/tokenize", "/detokenize", "/abort_request"]),
    data=st.data(),
)
def test_fuzz_tokenizer_and_abort(server, route, data):
    strategy = {
        "/tokenize": tokenize_bodies,
        "/detokenize": detokenize_bodies,
        "/abort_request": abort_bodies,
    }[route]
    send(server, "POST", route, data.draw(strategy))


@fuzz_settings(40)
@given(route=st.sampled_from(POST_ROUTES), body=raw_bodies)
def test_fuzz_raw_bodies(server, route, body):
    r = send(server, "POST", route, body)
    assert r.status_code == 400, (route, body, r.text)


@fuzz_settings(20)
@given(
    path=st.one_of(
        st.sampled_from(
            ["/health", "/get_model_info", "/get_server_info", "/v1/models", "/tokenizer_info"]
        ),
        st.text(max_size=10).map(lambda s: "/v1/models/" + quote(s)),
        st.text(max_size=10).map(lambda s: "/" + quote(s)),
    )
)
def test_fuzz_get_routes(server, path):
    send(server, "GET", path)


def test_openapi_describes_every_body(server):
    """What the fuzzers above and client generators read: every POST route's body."""
    spec = requests.get(server.url + "/openapi.json", timeout=TIMEOUT_S).json()
    for path in POST_ROUTES:
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"], path
        assert "422" not in spec["paths"][path]["post"]["responses"], path


def test_kv_accounting_is_exact_after_the_fuzzing(server):
    """Runs last in this module: whatever the requests above did, no KV slot leaked. And
    the fuzzing reached the engine: each generation route it drove also answered 200s."""
    print("statuses of the fuzzed requests:", dict(sorted(STATUSES.items())))
    for route in GENERATION_ROUTES:
        if any(path == route for path, _ in STATUSES):
            assert STATUSES[route, 200] >= 5, (route, STATUSES)
    state = wait_idle(server)
    assert state["kv_held_by_requests"] == 0, state
    r = requests.post(server.url + "/flush_cache", timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    state = server_state(server)
    assert state["kv_free"] == state["kv_total"], state
    assert_alive(server)


def server_state(server: ServerProcess) -> dict[str, Any]:
    r = requests.get(server.url + "/get_server_info", timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["internal_states"][0]


def wait_idle(server: ServerProcess, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state = server_state(server)
        if state["num_running"] == 0 and state["num_waiting"] == 0:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
