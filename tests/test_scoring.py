"""The frontend's runtime support on the tiny Llama, end to end: `POST /score_continuations`
on one real server and `Engine.score_continuations` in process (logprobs equal to what
/generate gives for the same tokens, token healing, the unconditional scores, the radix
cache serving the shared prefix, 400s naming the field, KV clean afterwards), and the chat
template's role markers in /get_model_info and `Engine.chat_roles`."""

from __future__ import annotations

import time
from typing import Any

import pytest
import requests
from transformers import AutoTokenizer

from radixserve import Engine
from radixserve.chat_roles import chat_roles
from radixserve.native import InvalidRequest
from radixserve.scoring import MAX_CONTINUATIONS
from tests.conftest import FP32, TINY_TOKENIZER
from tests.server_utils import ServerProcess, tiny_model_server

TIMEOUT_S = 60
CONTEXT = 2048  # the tiny model's max_position_embeddings
TOLERANCE = 1e-4
FRANCE = "The capital of France is"
HEALING_PREFIX = "The capital of France "  # its last token, " ", merges with "is" → " is"
HEALING_CONTINUATION = "is Paris"


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    yield from tiny_model_server(tiny_model_dirs["llama"], tmp_path_factory.mktemp("score"))


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    with Engine(
        str(tiny_model_dirs["llama"]), progress=False, dtype=FP32, max_total_tokens=8192
    ) as engine:
        yield engine


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=TIMEOUT_S)


def score(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    r = post(server, "/score_continuations", body)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(server: ServerProcess, text: str, add_special_tokens: bool = True) -> list[int]:
    body = {"prompt": text, "add_special_tokens": add_special_tokens}
    return post(server, "/tokenize", body).json()["tokens"]


def generate_logprobs(server: ServerProcess, ids: list[int], start: int) -> list[float | None]:
    """The plain /generate input logprobs of ids[start:]."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": start,
    }
    meta = post(server, "/generate", body).json()["meta_info"]
    assert [t[1] for t in meta["input_token_logprobs"]] == ids[start:]
    return [t[0] for t in meta["input_token_logprobs"]]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def assert_close(got: list[float | None], want: list[float | None]) -> None:
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None), (got, want)
        if g is not None:
            assert abs(g - w) < TOLERANCE, (got, want)


def assert_400(r: requests.Response, param: str) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error", error
    assert error["param"] == param, error
    return error


def server_state(server: ServerProcess) -> dict[str, Any]:
    r = requests.get(server.url + "/get_server_info", timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["internal_states"][0]


def long_prefix(topic: str) -> str:
    """A prefix of well over IN_BATCH_PREFIX_MIN (32) tokens, unique to `topic`."""
    return f"A long note on {topic}. " + " ".join(f"{topic} fact {i}." for i in range(30))


# -- the route ------------------------------------------------------------------------------
def test_logprobs_equal_those_of_generate(server):
    continuations = [" Paris", " Berlin", " the moon"]
    out = score(server, {"text": FRANCE, "continuations": continuations})
    prefix = tokenize(server, FRANCE)
    assert out["prompt_tokens"] == len(prefix)
    assert len(out["continuations"]) == len(continuations)
    for c, entry in zip(continuations, out["continuations"]):
        ids = tokenize(server, FRANCE + c)
        start = common_prefix_len(prefix, ids)
        assert entry["token_ids"] == ids[start:]
        assert entry["healed_tokens"] == len(prefix) - start
        assert "".join(entry["tokens"]).endswith(c) and len(entry["tokens"]) == len(ids) - start
        assert entry["unconditional_logprobs"] is None
        assert all(isinstance(lp, float) and lp <= 0 for lp in entry["logprobs"]), entry
        assert_close(entry["logprobs"], generate_logprobs(server, ids, start))


def test_token_healing_scores_the_merged_token(server):
    prefix = tokenize(server, HEALING_PREFIX)
    ids = tokenize(server, HEALING_PREFIX + HEALING_CONTINUATION)
    start = len(prefix) - 1
    # the pair really merges: the prefix's last token is replaced, the rest is kept
    assert ids[:start] == prefix[:start] and ids[start] != prefix[-1], (prefix, ids)
    body = {"text": HEALING_PREFIX, "continuations": [HEALING_CONTINUATION, "was Rome"]}
    entry = score(server, body)["continuations"][0]
    assert entry["healed_tokens"] == 1, entry
    assert entry["token_ids"] == ids[start:], (entry, ids)
    assert_close(entry["logprobs"], generate_logprobs(server, ids, start))


def test_input_ids_prefix_is_never_retokenized(server):
    prefix = tokenize(server, HEALING_PREFIX)
    out = score(server, {"input_ids": prefix, "continuations": [HEALING_CONTINUATION]})
    entry = out["continuations"][0]
    tokens = tokenize(server, HEALING_CONTINUATION, add_special_tokens=False)
    assert out["prompt_tokens"] == len(prefix)
    assert entry["healed_tokens"] == 0
    assert entry["token_ids"] == tokens
    assert_close(entry["logprobs"], generate_logprobs(server, prefix + tokens, len(prefix)))


def test_unconditional_scores_each_span_alone(server):
    body = {"text": FRANCE, "continuations": [" Paris", " a big city"], "unconditional": True}
    out = score(server, body)
    for entry in out["continuations"]:
        alone = entry["unconditional_logprobs"]
        assert alone[0] is None, entry  # nothing precedes the span's first token
        assert len(alone) == len(entry["token_ids"])
        assert_close(alone, generate_logprobs(server, entry["token_ids"], 0))
        assert all(isinstance(lp, float) for lp in entry["logprobs"]), entry


def test_the_batch_shares_the_prefix_through_the_cache(server):
    text = long_prefix("geology")
    prefix = tokenize(server, text)
    body = {"text": text, "continuations": [" Rocks", " Stones", " Sand and clay"]}
    first = score(server, body)["continuations"]
    # the first sequence computes the prefix; the others, held back a round by the
    # scheduler's in-batch sharing rule, take it from the cache up to the token before
    # their span (whose logits they need)
    starts = [len(prefix) - e["healed_tokens"] for e in first]
    assert first[0]["cached_tokens"] == 0, first
    for entry, start in zip(first[1:], starts[1:]):
        assert entry["cached_tokens"] == start - 1, first
    again = score(server, body)["continuations"]
    for entry, start, before in zip(again, starts, first):
        assert entry["cached_tokens"] == start - 1, again
        assert_close(entry["logprobs"], before["logprobs"])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": FRANCE, "continuations": []}, "continuations"),
        ({"text": FRANCE, "continuations": [" Paris", ""]}, "continuations.1"),
        # as /generate names it: the prompt field that was given as token ids
        ({"text": FRANCE, "input_ids": [1, 2], "continuations": [" Paris"]}, "input_ids"),
        ({"continuations": [" Paris"]}, "text"),
        ({"text": "", "continuations": [" Paris"]}, "text"),
        ({"input_ids": [], "continuations": [" Paris"]}, "input_ids"),
        ({"input_ids": [1, 100_000], "continuations": [" Paris"]}, "input_ids"),
        ({"text": FRANCE}, "continuations"),
        ({"text": FRANCE, "continuations": [" Paris"], "max_new_tokens": 1}, "max_new_tokens"),
        ({"text": FRANCE, "continuations": [" x"] * (MAX_CONTINUATIONS + 1)}, "continuations"),
        ({"text": FRANCE, "continuations": [7]}, "continuations.0"),
        ({"input_ids": [5] * CONTEXT, "continuations": [" Paris"]}, "input_ids"),
        ({"input_ids": [5] * (CONTEXT - 2), "continuations": [" Paris is far"]}, "continuations.0"),
    ],
)
def test_invalid_calls_are_400_naming_the_field(server, body, param):
    assert_400(post(server, "/score_continuations", body), param)


def test_context_overflow_says_so(server):
    body = {"input_ids": [5] * (CONTEXT - 2), "continuations": [" Paris", " Paris is far"]}
    error = assert_400(post(server, "/score_continuations", body), "continuations.1")
    assert "context length" in error["message"], error
    assert error["code"] == "context_length_exceeded", error


def test_get_model_info_reports_the_chat_roles(server):
    info = requests.get(server.url + "/get_model_info", timeout=TIMEOUT_S).json()
    assert info["chat_roles"] == chat_roles(AutoTokenizer.from_pretrained(TINY_TOKENIZER))
    assert info["chat_roles"]["roles"]["user"] == ["<|im_start|>user\n", "<|im_end|>\n"]


# -- the Engine -----------------------------------------------------------------------------
def test_engine_gives_the_route_s_answer(engine, server):
    continuations = [HEALING_CONTINUATION, "was Rome", "has many museums"]
    ours = engine.score_continuations(HEALING_PREFIX, continuations, unconditional=True)
    body = {"text": HEALING_PREFIX, "continuations": continuations, "unconditional": True}
    theirs = score(server, body)
    assert ours["prompt_tokens"] == theirs["prompt_tokens"]
    for a, b in zip(ours["continuations"], theirs["continuations"], strict=True):
        assert a["token_ids"] == b["token_ids"]
        assert a["healed_tokens"] == b["healed_tokens"]
        assert_close(a["logprobs"], b["logprobs"])
        assert_close(a["unconditional_logprobs"], b["unconditional_logprobs"])
    assert ours["continuations"][0]["healed_tokens"] == 1
    engine.check_kv_accounting()


def test_engine_input_ids_prefix_and_cache(engine):
    text = long_prefix("botany")
    prefix = engine.tokenizer.encode(text)
    first = engine.score_continuations(input_ids=prefix, continuations=[" Leaf", " Root"])
    again = engine.score_continuations(input_ids=prefix, continuations=[" Leaf", " Root"])
    for entry in first["continuations"][1:] + again["continuations"]:
        assert entry["cached_tokens"] == len(prefix) - 1, (first, again)
    leaf = engine.tokenizer.encode(" Leaf", add_special_tokens=False)
    assert first["continuations"][0]["token_ids"] == leaf
    plain = engine.generate(
        input_ids=prefix + leaf,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=len(prefix),
    )
    want = [t[0] for t in plain["meta_info"]["input_token_logprobs"]]
    assert_close(again["continuations"][0]["logprobs"], want)
    engine.check_kv_accounting()


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"prompt": FRANCE, "continuations": []}, "continuations"),
        ({"prompt": FRANCE, "continuations": ["ok", ""]}, "continuations.1"),
        ({"prompt": FRANCE, "input_ids": [1], "continuations": ["ok"]}, "text"),
        ({"input_ids": [5] * CONTEXT, "continuations": ["ok"]}, "input_ids"),
    ],
)
def test_engine_invalid_calls_name_the_field(engine, kwargs, param):
    with pytest.raises(InvalidRequest) as raised:
        engine.score_continuations(**kwargs)
    assert raised.value.param == param


def test_engine_chat_roles(engine):
    assert engine.chat_roles() == chat_roles(AutoTokenizer.from_pretrained(TINY_TOKENIZER))
    assert engine.chat_roles()["default_system_prompt"] is None  # the tiny template has none


# -- afterwards ------------------------------------------------------------------------------
def test_kv_is_clean_after_scoring(server):
    """Runs last: no KV held, no tree node locked, everything freed by a flush."""
    deadline = time.monotonic() + 30
    while (state := server_state(server))["num_running"] or state["num_waiting"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert state["kv_held_by_requests"] == 0, state
    assert state["kv_tree_protected"] == 0, state
    assert state["kv_free"] + state["kv_tree_evictable"] == state["kv_total"], state
    assert requests.post(server.url + "/flush_cache", timeout=TIMEOUT_S).status_code == 200
    state = server_state(server)
    assert state["kv_free"] == state["kv_total"], state
