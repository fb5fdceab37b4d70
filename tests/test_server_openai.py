"""The OpenAI-compatible API end to end: a real `radixserve serve` (the default SmolLM2 model)
driven by the official `openai` client, checked against the wire contract (§2, and §3 for the
lm-eval shapes of /v1/completions). One server serves the whole module."""

from __future__ import annotations

import math
import re
import time

import openai
import pytest
import requests

from tests.conftest import FP32
from tests.server_utils import STARTUP_TIMEOUT_S, ServerProcess

pytestmark = pytest.mark.smollm2

CONTEXT_LEN = 8192  # SmolLM2-135M-Instruct
FRANCE = "The capital of France is"
GERMANY = "The capital of Germany is"
STORY = "Once upon a time, in a small village by the sea, there lived"
CAPITAL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DRAGON = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]


# -- fixtures and helpers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("openai-server") / "server.log"
    proc = ServerProcess("--max-total-tokens", "20000", log=log)
    try:
        # The port is bound before the server can answer, so an early /health may get no
        # reply within wait_ready's 2 s poll timeout (a ReadTimeout, which it does not
        # retry) while the machine is busy: keep polling until its own deadline.
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                proc.wait_ready()
                break
            except requests.Timeout:
                if time.monotonic() > deadline:
                    raise
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    # no retries: a 5xx must surface as a failure, not be retried into a pass
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def tokenize(server: ServerProcess, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids as the server encodes a text prompt (special tokens as a str prompt gets)."""
    r = requests.post(
        server.url + "/tokenize",
        json={"prompt": text, "add_special_tokens": add_special_tokens},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def greedy(client, model_id, prompt, max_tokens=16, **kw):
    kw.setdefault("model", model_id)
    return client.completions.create(prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


def check_usage(usage, prompt_tokens: int | None = None, completion_tokens: int | None = None):
    assert usage is not None
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached <= usage.prompt_tokens
    if prompt_tokens is not None:
        assert usage.prompt_tokens == prompt_tokens, usage
    if completion_tokens is not None:
        assert usage.completion_tokens == completion_tokens, usage


def error_body(e: openai.APIStatusError) -> dict:
    """The inner `error` object of an OpenAI-shaped error body."""
    assert isinstance(e.body, dict), e.body
    return e.body


def assert_error_shape(response: requests.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# -- 1. models --------------------------------------------------------------------------------
def test_models_list_retrieve_and_unknown(client, server):
    models = client.models.list()
    assert len(models.data) == 1
    card = models.data[0]
    assert card.id and card.object == "model"
    assert card.max_model_len == CONTEXT_LEN
    assert isinstance(card.created, int) and card.owned_by

    again = client.models.retrieve(card.id)
    assert again.id == card.id and again.object == "model"
    assert again.max_model_len == CONTEXT_LEN

    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"
    assert "no-such-model" in error_body(info.value)["message"]

    raw = requests.get(server.url + "/v1/models", timeout=30).json()
    assert raw["object"] == "list" and len(raw["data"]) == 1
    assert {"id", "object", "created", "owned_by", "max_model_len"} <= set(raw["data"][0])


# -- 2. completions, non-streaming ------------------------------------------------------------
def test_completion_greedy_basic(client, model_id, server):
    out = greedy(client, model_id, FRANCE)
    assert out.object == "text_completion"
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0
    assert choice.text.strip()
    assert "Paris" in choice.text
    assert choice.finish_reason in ("stop", "length")
    assert "matched_stop" in (choice.model_extra or {})  # the contract's extra field
    check_usage(out.usage, prompt_tokens=len(tokenize(server, FRANCE)))
    assert 1 <= out.usage.completion_tokens <= 16
    if choice.finish_reason == "length":
        assert out.usage.completion_tokens == 16

    # the same request again gives the same greedy text
    assert greedy(client, model_id, FRANCE).choices[0].text == choice.text


def test_completion_prompt_forms(client, model_id, server):
    france_ids = tokenize(server, FRANCE)
    germany_ids = tokenize(server, GERMANY)
    text = greedy(client, model_id, FRANCE, max_tokens=4).choices[0].text
    assert text.startswith(" Paris"), text

    # a list of token ids is one prompt, the same as its text
    by_ids = greedy(client, model_id, france_ids, max_tokens=4)
    assert [c.index for c in by_ids.choices] == [0]
    assert by_ids.choices[0].text == text
    check_usage(by_ids.usage, prompt_tokens=len(france_ids))

    # the request's model may be any string
    other = greedy(client, model_id, FRANCE, max_tokens=4, model="any-name-at-all")
    assert other.choices[0].text == text

    # a list of str and a list of lists of ids are batches, answered in prompt order
    for batch in ([FRANCE, GERMANY], [france_ids, germany_ids]):
        out = greedy(client, model_id, batch, max_tokens=2)
        assert [c.index for c in out.choices] == [0, 1], out
        assert out.choices[0].text.startswith(" Paris"), out.choices[0].text
        assert out.choices[1].text.startswith(" Berlin"), out.choices[1].text
        check_usage(out.usage, prompt_tokens=len(france_ids) + len(germany_ids))
        assert 2 <= out.usage.completion_tokens <= 4


def test_completion_n_counts_the_prompt_once(client, model_id, server):
    n_prompt = len(tokenize(server, STORY))
    kw = dict(model=model_id, prompt=STORY, max_tokens=6, temperature=0.8, seed=1234, n=2)
    out = client.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    check_usage(out.usage, prompt_tokens=n_prompt)  # once per prompt, not times n
    assert 2 <= out.usage.completion_tokens <= 12

    # a seed makes sampling reproducible
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]

    # two prompts × n=2: four choices, prompt-major; prompt tokens counted once per prompt
    both = client.completions.create(**{**kw, "prompt": [STORY, FRANCE], "max_tokens": 3})
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    check_usage(both.usage, prompt_tokens=n_prompt + len(tokenize(server, FRANCE)))

    # streamed with n=2: each index finishes exactly once; the usage chunk counts the
    # prompt once
    chunks = list(
        client.completions.create(
            **{**kw, "max_tokens": 4}, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == []
    check_usage(chunks[-1].usage, prompt_tokens=n_prompt)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert [c.finish_reason for c in mine if c.finish_reason] in (["stop"], ["length"])
        assert "".join(c.text for c in mine)


def test_completion_logprobs(client, model_id):
    out = greedy(client, model_id, FRANCE, max_tokens=8, logprobs=2)
    choice = out.choices[0]
    lp = choice.logprobs
    n = out.usage.completion_tokens
    assert n >= 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == choice.text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(logprob, float) and logprob <= 0
        assert 1 <= len(top) <= 2
        # greedy: the chosen token is the most likely one
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)
        assert token in top and top[token] == pytest.approx(logprob, abs=1e-5)
    # the first token is " Paris" with high probability
    assert lp.tokens[0] == " Paris" and math.exp(lp.token_logprobs[0]) > 0.5


def test_completion_echo_logprobs_lm_eval_style(client, model_id, server):
    """lm-eval's loglikelihood request: a batch of token-id lists, echo, logprobs=1,
    max_tokens=1; it reads token_logprobs[ctxlen:-1] per choice sorted by index."""
    ctx = tokenize(server, FRANCE)
    cont = tokenize(server, " Paris", add_special_tokens=False)
    prompts = [ctx + cont, tokenize(server, STORY)]
    out = client.completions.create(
        model=model_id,
        prompt=prompts,
        max_tokens=1,
        temperature=0,
        logprobs=1,
        echo=True,
        seed=1234,
    )
    assert [c.index for c in out.choices] == [0, 1]
    check_usage(out.usage, prompt_tokens=sum(map(len, prompts)), completion_tokens=2)
    for choice, ids in zip(out.choices, prompts):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1, lp.token_logprobs
        assert len(lp.tokens) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None
        assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
        assert all(isinstance(t, dict) and len(t) >= 1 for t in lp.top_logprobs[1:])
        # as OpenAI's: the chosen token is always among them (up to logprobs + 1 entries),
        # likely or not (lm-eval reads top_logprobs[i][tokens[i]])
        for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert len(top) <= 2 and top[token] == logprob, (token, top)
        assert any(len(top) == 2 for top in lp.top_logprobs[1:])  # unlikely prompt tokens
        prompt_text = "".join(lp.tokens[: len(ids)])
        assert choice.text.startswith(prompt_text)
    assert out.choices[0].text.startswith(FRANCE + " Paris")
    assert out.choices[1].text.startswith(STORY)

    # the echoed logprob of " Paris" after the context is the one generation gives it, and
    # it is the greedy choice there (lm-eval's is_greedy: top_logprobs' max is the token)
    gen = greedy(client, model_id, FRANCE, max_tokens=1, logprobs=1).choices[0].logprobs
    assert gen.tokens == [" Paris"]
    lp = out.choices[0].logprobs
    at = len(ctx)
    assert lp.tokens[at] == " Paris"
    assert lp.token_logprobs[at] == pytest.approx(gen.token_logprobs[0], abs=2e-3)
    top = lp.top_logprobs[at]
    assert max(top, key=top.get) == " Paris", top


# -- 3. completions, streaming ----------------------------------------------------------------
def test_completion_stream_matches_non_streaming(client, model_id):
    expected = greedy(client, model_id, STORY)

    def story_stream(**stream_options) -> list:
        options = {"stream_options": stream_options} if stream_options else {}
        return list(
            client.completions.create(
                model=model_id, prompt=STORY, max_tokens=16, temperature=0, stream=True, **options
            )
        )

    chunks = story_stream(include_usage=True)
    assert chunks, "no chunks"
    last = chunks[-1]
    assert last.choices == [], last
    check_usage(
        last.usage,
        prompt_tokens=expected.usage.prompt_tokens,
        completion_tokens=expected.usage.completion_tokens,
    )
    body = chunks[:-1]
    assert all(c.choices and c.choices[0].index == 0 for c in body)
    text = "".join(c.choices[0].text for c in body)
    assert text == expected.choices[0].text
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == [expected.choices[0].finish_reason]
    assert body[-1].choices[0].finish_reason is not None  # the finish comes last

    # without include_usage, no usage-only chunk
    plain = story_stream()
    assert all(c.choices for c in plain)
    assert "".join(c.choices[0].text for c in plain) == expected.choices[0].text
    assert all(c.usage is None for c in plain)

    # vLLM's continuous_usage_stats: every chunk has the counts so far
    counted = story_stream(include_usage=True, continuous_usage_stats=True)
    so_far = [c.usage.completion_tokens for c in counted[:-1] if c.choices[0].text]
    assert so_far == sorted(so_far) and so_far[-1] == expected.usage.completion_tokens
    assert all(c.usage.prompt_tokens == expected.usage.prompt_tokens for c in counted)


# -- 4. chat ----------------------------------------------------------------------------------
def test_chat_greedy_and_streaming(client, model_id):
    out = client.chat.completions.create(
        model=model_id, messages=CAPITAL_QUESTION, max_tokens=16, temperature=0
    )
    assert out.object == "chat.completion"
    message = out.choices[0].message
    assert message.role == "assistant"
    assert "Paris" in message.content
    assert out.choices[0].finish_reason in ("stop", "length")
    check_usage(out.usage)

    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=CAPITAL_QUESTION,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    check_usage(
        chunks[-1].usage,
        prompt_tokens=out.usage.prompt_tokens,
        completion_tokens=out.usage.completion_tokens,
    )
    body = chunks[:-1]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert all(len(c.choices) == 1 and c.choices[0].index == 0 for c in body)
    assert body[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in body)
    assert content == message.content
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == [out.choices[0].finish_reason]


def test_service_tiers(client, model_id, server):
    """OpenAI's service_tier: "flex" runs deferred (after the other tiers' requests) with
    the same greedy output, and the answer names the tier it ran in; the others run as
    "default"; an unknown tier is a 400 naming the field."""
    ask = {"model": model_id, "messages": CAPITAL_QUESTION, "max_tokens": 8, "temperature": 0}
    plain = client.chat.completions.create(**ask)
    flex = client.chat.completions.create(**ask, service_tier="flex")
    assert flex.service_tier == "flex" and plain.service_tier is None
    assert flex.choices[0].message.content == plain.choices[0].message.content
    chunks = list(client.chat.completions.create(**ask, service_tier="priority", stream=True))
    assert {c.service_tier for c in chunks} == {"default"}
    done = greedy(client, model_id, "The capital of", extra_body={"service_tier": "flex"})
    assert done.to_dict()["service_tier"] == "flex"
    r = requests.post(server.url + "/v1/chat/completions", json={**ask, "service_tier": "fast"})
    assert assert_error_shape(r, 400)["param"] == "service_tier"


def test_chat_stream_n2(client, model_id):
    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=CAPITAL_QUESTION,
            max_tokens=6,
            temperature=0.8,
            seed=7,
            n=2,
            stream=True,
        )
    )
    by_index: dict[int, list] = {0: [], 1: []}
    for chunk in chunks:
        assert len(chunk.choices) == 1, chunk
        by_index[chunk.choices[0].index].append(chunk.choices[0])
    for index, choices in by_index.items():
        assert choices, f"no chunk for index {index}"
        assert choices[0].delta.role == "assistant", (index, choices[0])
        finishes = [c.finish_reason for c in choices if c.finish_reason]
        assert len(finishes) == 1, (index, finishes)
        assert finishes[0] in ("stop", "length")
        assert choices[-1].finish_reason is not None
        assert "".join(c.delta.content or "" for c in choices).strip(), index


def test_chat_logprobs(client, model_id):
    out = client.chat.completions.create(
        model=model_id,
        messages=DRAGON,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert 1 <= len(entry.top_logprobs) <= 3
        best = max(t.logprob for t in entry.top_logprobs)
        assert entry.logprob == pytest.approx(best, abs=1e-5)  # greedy
        assert entry.bytes == list(entry.token.encode())
    if choice.finish_reason == "length":
        assert "".join(e.token for e in content) == choice.message.content
    # top_logprobs alone asks for nothing OpenAI would give: a 400 naming it
    body = bad_request(
        lambda: client.chat.completions.create(
            model=model_id, messages=DRAGON, max_tokens=1, top_logprobs=3
        )
    )
    assert body["param"] == "top_logprobs" and "logprobs" in body["message"]


def test_chat_max_completion_tokens(client, model_id):
    out = client.chat.completions.create(
        model=model_id, messages=DRAGON, max_completion_tokens=5, temperature=0
    )
    assert out.usage.completion_tokens <= 5
    # a long story does not fit in 5 tokens
    assert out.usage.completion_tokens == 5
    assert out.choices[0].finish_reason == "length"


def test_null_fields_mean_their_defaults(client, model_id):
    """The official client sends `null` for a field passed as None: OpenAI reads it as the
    field's default."""
    plain = client.chat.completions.create(
        model=model_id, messages=DRAGON, max_tokens=4, temperature=0
    )
    nulls = client.chat.completions.create(
        model=model_id,
        messages=DRAGON,
        max_tokens=4,
        temperature=0,
        n=None,
        stream=None,
        logprobs=None,
        extra_body={"continue_final_message": None, "separate_reasoning": None},
    )
    assert len(nulls.choices) == 1 and nulls.choices[0].logprobs is None
    assert nulls.choices[0].message.content == plain.choices[0].message.content
    completion = client.completions.create(
        model=model_id, prompt="The capital of France is", max_tokens=3, n=None, echo=None
    )
    assert len(completion.choices) == 1
    assert not completion.choices[0].text.startswith("The capital")


def test_a_developer_message_is_a_system_message_to_a_template_without_that_role(
    client, model_id, server
):
    """OpenAI's newer name of the system role; SmolLM2's ChatML template knows only system
    (given a `developer` turn, it would add its default system prompt before it)."""
    question = {"role": "user", "content": "Say hi in two words."}
    outs = [
        client.chat.completions.create(
            model=model_id,
            messages=[{"role": role, "content": "Be brief."}, question],
            max_tokens=6,
            temperature=0,
        )
        for role in ("developer", "system")
    ]
    assert outs[0].usage.prompt_tokens == outs[1].usage.prompt_tokens
    assert outs[0].choices[0].message.content == outs[1].choices[0].message.content
    # text parts are joined by newlines (as vLLM's), not run together
    parts = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]
    split = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "system", "content": parts}, question],
        max_tokens=1,
    )
    joined = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "system", "content": "Be\nbrief."}, question],
        max_tokens=1,
    )
    assert split.usage.prompt_tokens == joined.usage.prompt_tokens
    # vLLM's add_generation_prompt false: the prompt ends after the user's turn
    bare = client.chat.completions.create(
        model=model_id,
        messages=[question],
        max_tokens=1,
        extra_body={"add_generation_prompt": False},
    )
    full = client.chat.completions.create(model=model_id, messages=[question], max_tokens=1)
    assert bare.usage.prompt_tokens < full.usage.prompt_tokens


# -- 5. stop strings --------------------------------------------------------------------------
def test_stop_string_across_a_token_boundary(client, model_id):
    free = greedy(client, model_id, STORY, logprobs=1)
    text = free.choices[0].text
    tokens = free.choices[0].logprobs.tokens
    assert "".join(tokens) == text
    # a stop made of the last 2 chars of one token and the first 2 of the next, whose first
    # occurrence in the text is at that boundary
    stop, offset, at = None, 0, None
    for a, b in zip(tokens, tokens[1:]):
        offset += len(a)
        candidate = a[-2:] + b[:2]
        if (
            len(a) >= 2
            and len(b) >= 2
            and offset >= 4
            and text.find(candidate) == offset - 2
            and candidate.strip() == candidate
        ):
            stop, at = candidate, offset - 2
            break
    assert stop is not None, f"no token pair to build a stop string from: {tokens}"
    expected = text[:at]

    out = greedy(client, model_id, STORY, stop=[stop])
    choice = out.choices[0]
    assert choice.text == expected, (stop, choice.text, expected)
    assert choice.finish_reason == "stop"
    assert choice.matched_stop == stop

    stream = client.completions.create(
        model=model_id, prompt=STORY, max_tokens=16, temperature=0, stop=[stop], stream=True
    )
    acc = ""
    finishes = []
    for chunk in stream:
        piece = chunk.choices[0]
        acc += piece.text
        # nothing beyond the final text is ever sent, not even a part of the stop string
        assert expected.startswith(acc), (acc, expected, stop)
        if piece.finish_reason:
            finishes.append(piece.finish_reason)
    assert acc == expected
    assert stop not in acc
    assert finishes == ["stop"]


def hold_back_stop(tokens: list[str]) -> str:
    """A stop string that starts with a whole generated token (k >= 1) and is never
    completed: while that token's text could still begin the stop, the server holds it back."""
    text = "".join(tokens)
    for k in range(1, len(tokens)):
        token = tokens[k]
        if len(token.strip()) >= 3 and text.find(token) == len("".join(tokens[:k])):
            return token + " qqzx"
    raise AssertionError(f"no token to build a stop string from: {tokens}")


def test_completion_stream_logprobs_cover_held_back_tokens(client, model_id):
    """Every generated token's logprob is streamed once, also a token whose text was held
    back for a while because it could have been the start of a stop string."""
    free = greedy(client, model_id, STORY, logprobs=1)
    lp = free.choices[0].logprobs
    stop = hold_back_stop(lp.tokens)
    for stops in (None, [stop]):
        tokens, logprobs, text = [], [], ""
        for chunk in client.completions.create(
            model=model_id,
            prompt=STORY,
            max_tokens=16,
            temperature=0,
            logprobs=1,
            stop=stops,
            stream=True,
        ):
            piece = chunk.choices[0]
            text += piece.text
            if piece.logprobs is not None:
                tokens += piece.logprobs.tokens
                logprobs += piece.logprobs.token_logprobs
        assert text == free.choices[0].text, stops  # the stop never matches
        assert tokens == lp.tokens, f"stop={stops!r}: streamed logprob tokens {tokens}"
        assert logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_chat_stream_logprobs_cover_held_back_tokens(client, model_id):
    free = client.chat.completions.create(
        model=model_id, messages=DRAGON, max_tokens=10, temperature=0, logprobs=True
    )
    expected = [e.token for e in free.choices[0].logprobs.content]
    assert "".join(expected) == free.choices[0].message.content
    stop = hold_back_stop(expected)
    for stops in (None, [stop]):
        tokens, content = [], ""
        for chunk in client.chat.completions.create(
            model=model_id,
            messages=DRAGON,
            max_tokens=10,
            temperature=0,
            logprobs=True,
            stop=stops,
            stream=True,
        ):
            for piece in chunk.choices:
                content += piece.delta.content or ""
                if piece.logprobs is not None and piece.logprobs.content:
                    tokens += [e.token for e in piece.logprobs.content]
        assert content == free.choices[0].message.content, stops
        assert tokens == expected, f"stop={stops!r}: streamed logprob tokens {tokens}"


JAPANESE = "日本語のテキストを少し書きます。"  # SmolLM2 splits most of these characters' bytes


def token_bytes(token: str) -> bytes:
    """A completion logprobs token's bytes: one that is not UTF-8 on its own is written
    `bytes:\\xe6\\x97` (OpenAI's convention)."""
    if token.startswith("bytes:"):
        return bytes.fromhex(token.removeprefix("bytes:").replace("\\x", ""))
    return token.encode()


def test_completion_logprobs_of_tokens_that_split_characters(client, model_id):
    """Tokens holding part of a character are written as their bytes, so they join back to
    the text and keep distinct top_logprobs keys (decoded, they would all be U+FFFD)."""
    out = client.completions.create(
        model=model_id, prompt=JAPANESE, max_tokens=8, temperature=0, logprobs=5, echo=True
    )
    choice, prompt_tokens = out.choices[0], out.usage.prompt_tokens
    lp = choice.logprobs
    assert b"".join(map(token_bytes, lp.tokens[:prompt_tokens])) == JAPANESE.encode()
    assert any(t.startswith("bytes:") for t in lp.tokens[:prompt_tokens]), lp.tokens
    assert all("\ufffd" not in t for t in lp.tokens), lp.tokens
    assert all(len(top) in (5, 6) for top in lp.top_logprobs[1:]), lp.top_logprobs
    partial = [sum(key.startswith("bytes:") for key in top) for top in lp.top_logprobs[1:]]
    assert max(partial) >= 2, lp.top_logprobs  # keys that decoded would collide
    # text_offset indexes the text; a token ending inside a character starts at it
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, offset in zip(lp.tokens, lp.text_offset):
        if not token.startswith("bytes:"):
            assert choice.text[offset : offset + len(token)] == token, (token, offset)


def test_streamed_text_offsets_continue_over_the_chunks(client, model_id):
    """A stream's text_offsets count over the whole text (prompt included when echoed), as
    the non-streamed response's do, not from 0 in each chunk."""
    kw = dict(model=model_id, prompt=JAPANESE, max_tokens=8, temperature=0, logprobs=1)
    whole = client.completions.create(**kw, echo=True).choices[0].logprobs
    tokens, offsets, chunks = [], [], 0
    for chunk in client.completions.create(**kw, echo=True, stream=True):
        piece = chunk.choices[0]
        if piece.logprobs is not None and piece.logprobs.tokens:
            chunks += 1
            tokens += piece.logprobs.tokens
            offsets += piece.logprobs.text_offset
    assert chunks > 1
    assert offsets == whole.text_offset
    assert tokens == whole.tokens


def test_chat_logprobs_bytes_join_to_the_content(client, model_id):
    """Each token's `bytes` are its own (not those of U+FFFD where it holds part of a
    character): together they are the content's UTF-8. The regex makes the content
    Japanese whatever the small model would write."""
    text = "日本語のテキスト"
    out = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": f"Write {text}"}],
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"regex": text},
    )
    choice = out.choices[0]
    assert choice.message.content == text
    content = choice.logprobs.content
    assert b"".join(bytes(e.bytes) for e in content) == text.encode()
    assert any(e.token.startswith("bytes:") for e in content), [e.token for e in content]
    for entry in content:
        assert bytes(entry.bytes) == token_bytes(entry.token)
        assert all(bytes(t.bytes) == token_bytes(t.token) for t in entry.top_logprobs)


# -- 6. prefix cache --------------------------------------------------------------------------
def test_cached_tokens_on_a_repeated_prompt(client, model_id):
    prompt = "A lighthouse keeper counts the ships that pass the rocky northern cape. " * 20
    first = greedy(client, model_id, prompt, max_tokens=1)
    n = first.usage.prompt_tokens
    assert n >= 200
    check_usage(first.usage)
    second = greedy(client, model_id, prompt, max_tokens=1)
    assert second.usage.prompt_tokens == n
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert n - 1 <= cached <= n, (cached, n)
    assert second.choices[0].text == first.choices[0].text


# -- 7. errors --------------------------------------------------------------------------------
def bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return error_body(info.value)


def test_error_temperature_not_a_number(client, model_id):
    body = bad_request(
        lambda: client.completions.create(
            model=model_id, prompt=FRANCE, max_tokens=1, extra_body={"temperature": "hot"}
        )
    )
    assert "temperature" in body["message"]


def test_error_top_p_out_of_range(client, model_id):
    body = bad_request(
        lambda: client.completions.create(model=model_id, prompt=FRANCE, max_tokens=1, top_p=2)
    )
    assert "top_p" in body["message"]
    body = bad_request(
        lambda: client.chat.completions.create(
            model=model_id, messages=CAPITAL_QUESTION, max_tokens=1, top_p=2
        )
    )
    assert "top_p" in body["message"]


def test_error_n_zero(client, model_id):
    body = bad_request(
        lambda: client.completions.create(model=model_id, prompt=FRANCE, max_tokens=1, n=0)
    )
    assert re.search(r"\bn\b", body["message"]), body


def test_error_context_length_exceeded(client, model_id, server):
    n_prompt = len(tokenize(server, FRANCE))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_id, prompt=FRANCE, max_tokens=9000)
    e = info.value
    assert e.status_code == 400
    assert e.code == "context_length_exceeded"
    message = error_body(e)["message"]
    assert str(CONTEXT_LEN) in message
    assert str(n_prompt + 9000) in message and "9000" in message

    # a prompt that alone is longer than the context
    long_ids = [1000] * (CONTEXT_LEN + 10)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_id, prompt=long_ids, max_tokens=1)
    assert info.value.code == "context_length_exceeded"

    # chat with an explicit max_tokens over the context
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_id, messages=CAPITAL_QUESTION, max_tokens=9000)
    assert info.value.code == "context_length_exceeded"

    # streaming: refused with the status, not inside a 200 event stream
    with pytest.raises(openai.BadRequestError) as info:
        list(client.completions.create(model=model_id, prompt=FRANCE, max_tokens=9000, stream=True))
    assert info.value.code == "context_length_exceeded"


def test_error_empty_prompt(client, model_id):
    body = bad_request(lambda: client.completions.create(model=model_id, prompt="", max_tokens=1))
    assert "prompt" in body["message"] and "empty" in body["message"]
    body = bad_request(lambda: client.completions.create(model=model_id, prompt=[], max_tokens=1))
    assert "empty" in body["message"]


def test_error_unknown_field(client, model_id):
    body = bad_request(
        lambda: client.completions.create(
            model=model_id, prompt=FRANCE, max_tokens=1, extra_body={"foo": 1}
        )
    )
    assert "foo" in body["message"]
    body = bad_request(
        lambda: client.chat.completions.create(
            model=model_id, messages=CAPITAL_QUESTION, max_tokens=1, extra_body={"foo": 1}
        )
    )
    assert "foo" in body["message"]


def test_error_invalid_json_and_unknown_route(server):
    r = requests.post(
        server.url + "/v1/completions",
        data=b'{"prompt": "hi", "max_tokens": ',
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    error = assert_error_shape(r, 400)
    assert "JSON" in error["message"]

    r = requests.post(server.url + "/v1/chat/completions", json=["not", "an", "object"], timeout=30)
    assert_error_shape(r, 400)

    r = requests.post(server.url + "/v1/no-such-route", json={"prompt": "hi"}, timeout=30)
    assert_error_shape(r, 404)
    r = requests.get(server.url + "/v1/no-such-route", timeout=30)
    assert_error_shape(r, 404)


def test_error_is_400_not_422_for_a_missing_field(server):
    r = requests.post(server.url + "/v1/completions", json={"max_tokens": 1}, timeout=30)
    error = assert_error_shape(r, 400)
    assert "prompt" in error["message"]
    r = requests.post(server.url + "/v1/chat/completions", json={"max_tokens": 1}, timeout=30)
    error = assert_error_shape(r, 400)
    assert "messages" in error["message"]


def test_server_still_serves_after_errors(client, model_id, server):
    r = requests.get(server.url + "/health", timeout=10)
    assert r.status_code == 200
    out = greedy(client, model_id, FRANCE, max_tokens=4)
    assert out.choices[0].text.startswith(" Paris")
    chat = client.chat.completions.create(
        model=model_id, messages=CAPITAL_QUESTION, max_tokens=16, temperature=0
    )
    assert "Paris" in chat.choices[0].message.content


# -- 8. the server and the offline Engine agree -----------------------------------------------
def test_server_greedy_matches_offline_engine(client, model_id, server):
    from radixserve import Engine

    prompts = [
        tokenize(server, FRANCE),
        tokenize(server, STORY),
        tokenize(server, "def fibonacci(n):\n    "),
    ]
    served = []
    for ids in prompts:
        out = greedy(client, model_id, ids, max_tokens=16)
        served.append(out.choices[0].text)
    engine = Engine(max_total_tokens=20000, progress=False, dtype=FP32)
    try:
        offline = [
            engine.generate(
                input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 16}
            )["text"]
            for ids in prompts
        ]
    finally:
        engine.shutdown()
    assert served == offline
