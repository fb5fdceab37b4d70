"""Constrained decoding end to end: a real `radixserve serve` (the default SmolLM2 model)
driven by the official `openai` client and by raw HTTP on /generate, with JSON schemas
(checked by `jsonschema`), regexes (checked by `re.fullmatch`) and EBNF / Lark grammars
(checked by a small parser written here). One server serves the module; a second one with
`--disable-jump-forward` lives only for the jump-forward comparison at the end.

Schemas bound every string and array so that a document fits the small token budgets."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
import requests

from tests.server_utils import ServerProcess, assert_kv_clean, state

pytestmark = pytest.mark.smollm2

TIMEOUT = 180  # seconds for any one HTTP call on a busy 2-core machine
MAX_TOKENS = 80

# -- the documents ----------------------------------------------------------------------------
PERSON = {  # required + optional fields, string pattern and maxLength, integer range
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$", "maxLength": 30},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {  # nested objects, an array of objects with minItems / maxItems
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "city": {"type": "string", "maxLength": 16},
            },
            "required": ["name", "city"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                "required": ["product", "quantity"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["customer", "items"],
    "additionalProperties": False,
}
WEATHER = {  # an enum, a negative-capable integer range
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
        "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
    },
    "required": ["city", "condition", "temperature_c"],
    "additionalProperties": False,
}
BOOK = {  # an array of enum items with minItems / maxItems
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 32},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2100},
        "genres": {
            "type": "array",
            "items": {"enum": ["fiction", "science", "history", "poetry", "fantasy"]},
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["title", "year", "genres"],
    "additionalProperties": False,
}
PRODUCT = {  # a string pattern without maxLength, a boolean, a number range
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "in_stock": {"type": "boolean"},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
    },
    "required": ["sku", "in_stock", "price"],
    "additionalProperties": False,
}
# (name, schema, what to extract from)
SCHEMAS = [
    ("person", PERSON, "Extract the person as JSON: John Smith is 42 years old, email john@x.com."),
    ("order", ORDER, "Extract the order as JSON: Maria from Lisbon ordered 2 apples and 3 pears."),
    ("weather", WEATHER, "Describe the weather as JSON: It is sunny in Madrid today, 28 degrees."),
    ("book", BOOK, "Extract the book as JSON: The Hobbit, a fantasy novel, came out in 1937."),
    ("product", PRODUCT, "Extract the product as JSON: Item ABC-1234 is in stock, 19.99 dollars."),
]
SCHEMA_BY_NAME = {name: schema for name, schema, _ in SCHEMAS}

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
DATE = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
COLOR = r" (red|green|blue)"
YES_NO = r"(yes|no)"

# GBNF: a bounded arithmetic expression (at most three terms, one level of parentheses)
ARITHMETIC = r"""root ::= term (" " addop " " term (" " addop " " term)?)?
term ::= factor | factor mulop factor
factor ::= number | "(" number " " addop " " number ")"
number ::= [1-9] | [1-9] [0-9]
addop ::= "+" | "-"
mulop ::= "*" | "/"
"""
# Lark: a small SELECT statement, and the same language as a Python regex
SQL = r"""start: "SELECT " columns " FROM " table where? ";"
columns: "*" | column (", " column)~0..2
column: "name" | "age" | "city" | "email"
table: "users" | "customers" | "orders"
where: " WHERE " column " = " value
value: /[0-9]{1,3}/ | "'" /[A-Za-z]{1,12}/ "'"
"""
_COLUMN = "(name|age|city|email)"
SQL_RE = (
    rf"SELECT (\*|{_COLUMN}(, {_COLUMN}){{0,2}}) FROM (users|customers|orders)"
    rf"( WHERE {_COLUMN} = ([0-9]{{1,3}}|'[A-Za-z]{{1,12}}'))?;"
)


def is_arithmetic(text: str) -> bool:
    """A recursive-descent check of expr := term (("+"|"-") term)*,
    term := factor (("*"|"/") factor)*, factor := number | "(" expr ")" (spaces allowed)."""
    if not re.fullmatch(r"(\s*(\d+|[-+*/()]))*\s*", text):
        return False
    tokens = re.findall(r"\d+|[-+*/()]", text)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def factor() -> bool:
        nonlocal pos
        if peek() == "(":
            pos += 1
            if not expr() or peek() != ")":
                return False
            pos += 1
            return True
        if peek() is not None and peek().isdigit():
            pos += 1
            return True
        return False

    def chain(operand: Callable[[], bool], ops: str) -> bool:
        nonlocal pos
        if not operand():
            return False
        while peek() is not None and peek() in ops:
            pos += 1
            if not operand():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(tokens)


def test_the_checkers_themselves():
    assert is_arithmetic("10 + (3 * 4) - 2") and is_arithmetic("7")
    assert not is_arithmetic("10 +") and not is_arithmetic("(1 + 2") and not is_arithmetic("1 2")
    assert re.fullmatch(SQL_RE, "SELECT name, age FROM users WHERE city = 'Paris';")
    assert not re.fullmatch(SQL_RE, "SELECT FROM users;")


# -- servers and helpers ----------------------------------------------------------------------
def start_server(tmp_path_factory, name: str, *flags: str) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp(name) / "server.log"
    proc = ServerProcess("--max-total-tokens", "20000", *flags, log=log)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    yield from start_server(tmp_path_factory, "constrained-server")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    # no retries: a 5xx must surface as a failure, not be retried into a pass
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def post(server: ServerProcess, path: str, body: Any) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=TIMEOUT)


def generate(server: ServerProcess, body: dict[str, Any]) -> Any:
    r = post(server, "/generate", body)
    assert r.status_code == 200, f"/generate {body} -> {r.status_code}: {r.text[:500]}"
    return r.json()


def parallel(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls at once (they reach the server together) and return their results."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def assert_valid_json(text: str, schema: dict[str, Any]) -> Any:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise AssertionError(f"not JSON ({e}): {text!r}") from None
    jsonschema.validate(doc, schema)
    return doc


def json_prompt(prompt: str) -> str:
    return prompt + "\nJSON: "


def native_schema_batch(**sampling: Any) -> dict[str, Any]:
    """One /generate batch over every schema; even ones as a JSON string, odd ones as an object
    (the native API takes both)."""
    params = [
        {
            "max_new_tokens": MAX_TOKENS,
            "json_schema": json.dumps(schema) if i % 2 == 0 else schema,
            **sampling,
        }
        for i, (_, schema, _) in enumerate(SCHEMAS)
    ]
    return {"text": [json_prompt(p) for _, _, p in SCHEMAS], "sampling_params": params}


def chat_schema(client: openai.OpenAI, name: str, **kw: Any) -> Any:
    schema = SCHEMA_BY_NAME[name]
    prompt = next(p for n, _, p in SCHEMAS if n == name)
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": prompt}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        },
        **kw,
    )


def detokenize(server: ServerProcess, ids: list[int]) -> str:
    r = post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def tokenize(server: ServerProcess, text: str) -> list[int]:
    r = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def chat_greedy(client) -> dict[str, Any]:
    """Every schema through /v1/chat/completions, greedy, all at once."""
    names = [name for name, _, _ in SCHEMAS]
    calls = [lambda n=n: chat_schema(client, n, temperature=0) for n in names]
    return dict(zip(names, parallel(calls)))


@pytest.fixture(scope="module")
def native_greedy(server) -> dict[str, Any]:
    """Every schema through one native /generate batch, greedy; with the grammar stats it
    moved (nothing else runs on the server meanwhile)."""
    before = state(server)
    results = generate(server, native_schema_batch(temperature=0))
    after = state(server)
    return {"results": results, "before": before, "after": after}


# -- 1. JSON schemas ----------------------------------------------------------------------------
def test_chat_json_schema_greedy_outputs_validate(chat_greedy):
    for name, out in chat_greedy.items():
        choice = out.choices[0]
        print(f"{name}: {choice.message.content}")
        assert choice.finish_reason == "stop", (name, choice)
        assert_valid_json(choice.message.content, SCHEMA_BY_NAME[name])
        assert 0 < out.usage.completion_tokens <= MAX_TOKENS
    # the optional field may be left out, the required ones never
    assert {"name", "age"} <= set(json.loads(chat_greedy["person"].choices[0].message.content))


def test_native_json_schema_greedy_outputs_validate(native_greedy, server):
    for (name, schema, _), out in zip(SCHEMAS, native_greedy["results"]):
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "stop", (name, out)
        assert_valid_json(out["text"], schema)
        assert meta["completion_tokens"] == len(out["output_ids"]) > 0
    doc = json.loads(native_greedy["results"][1]["text"])  # the order: nested, with an array
    assert isinstance(doc["customer"], dict) and 1 <= len(doc["items"]) <= 3


def test_json_is_written_with_fixed_separators(native_greedy):
    for out in native_greedy["results"]:
        text = out["text"]
        assert text == json.dumps(json.loads(text), ensure_ascii=False), text


def test_sampled_json_schema_outputs_validate(client):
    names = [name for name, _, _ in SCHEMAS]
    calls = [
        lambda n=n, i=i: chat_schema(client, n, temperature=0.8, seed=100 + i)
        for i, n in enumerate(names)
    ]
    for name, out in zip(names, parallel(calls)):
        choice = out.choices[0]
        print(f"sampled {name}: {choice.message.content}")
        assert choice.finish_reason == "stop", (name, choice)
        assert_valid_json(choice.message.content, SCHEMA_BY_NAME[name])


# -- 2. response_format json_object -------------------------------------------------------------
def test_response_format_json_object(client):
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Return a JSON object with Alice's age: 30."}],
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict), choice.message.content


def test_strict_json_schema_allows_no_undeclared_keys(client):
    """OpenAI's strict mode: a schema that leaves its objects open is read closed (SmolLM2
    adds keys of its own to an open one: location, skills, ... until max_tokens)."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Give a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": schema, "strict": True},
        },
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop", choice
    assert set(json.loads(choice.message.content)) == {"name", "age"}, choice.message.content


# -- 3. regexes -----------------------------------------------------------------------------------
def test_regex_outputs_fully_match(client, server):
    def completion() -> str:
        out = client.completions.create(
            model="m",
            prompt="Our office phone number is",
            max_tokens=30,
            temperature=0,
            extra_body={"regex": PHONE},
        )
        assert out.choices[0].finish_reason == "stop", out
        return out.choices[0].text

    def chat() -> str:
        out = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
            max_tokens=10,
            temperature=0,
            extra_body={"regex": YES_NO},
        )
        assert out.choices[0].finish_reason == "stop", out
        return out.choices[0].message.content

    def native(prompt: str, pattern: str) -> Callable[[], str]:
        def call() -> str:
            body = {
                "text": prompt,
                "sampling_params": {"regex": pattern, "max_new_tokens": 30, "temperature": 0},
            }
            out = generate(server, body)
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            return out["text"]

        return call

    calls = [
        completion,
        chat,
        native("The date of the first moon landing, as YYYY-MM-DD, is ", DATE),
        native("The best color is", COLOR),
    ]
    texts = parallel(calls)
    print(texts)
    for pattern, text in zip([PHONE, YES_NO, DATE, COLOR], texts):
        assert re.fullmatch(pattern, text), (pattern, text)


# -- 4. EBNF / Lark grammars -------------------------------------------------------------------
def test_ebnf_outputs_parse(client, server):
    def arithmetic() -> str:
        body = {
            "text": "Q: Write an arithmetic expression that equals 10.\nA: ",
            "sampling_params": {"ebnf": ARITHMETIC, "max_new_tokens": 30, "temperature": 0},
        }
        out = generate(server, body)
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        return out["text"]

    def sql() -> str:
        out = client.completions.create(
            model="m",
            prompt="-- SQL: the names and ages of all users who live in Paris\n",
            max_tokens=40,
            temperature=0,
            extra_body={"ebnf": SQL},
        )
        assert out.choices[0].finish_reason == "stop", out
        return out.choices[0].text

    expression, statement = parallel([arithmetic, sql])
    print(expression, "|", statement)
    assert is_arithmetic(expression), expression
    assert re.fullmatch(SQL_RE, statement), statement


# -- 5. invalid constraints -------------------------------------------------------------------
def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def _native(**params: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 4, **params}}


# (route, body, words the message must name)
INVALID = [
    ("/generate", _native(json_schema="{not json"), ["json_schema"]),
    ("/generate", _native(json_schema=json.dumps({"type": "foo"})), ["json_schema", "foo"]),
    ("/generate", _native(json_schema={"type": "foo"}), ["json_schema", "foo"]),
    ("/generate", _native(regex="(("), ["regex"]),
    ("/generate", _native(ebnf="root ::= undefined_rule"), ["ebnf", "undefined_rule"]),
    ("/generate", _native(ebnf='root ::= "a" ('), ["ebnf"]),
    ("/generate", _native(regex="a+", ebnf='root ::= "a"'), ["regex", "ebnf"]),
    # valid, but nothing can be generated: refused at admission, not aborted at the first token
    ("/generate", _native(regex=r"[^\s\S]"), ["regex", "no text satisfies it"]),
    ("/generate", _native(json_schema='{"$ref": "#"}'), ["json_schema", "no text satisfies it"]),
    ("/generate", _native(regex="a{1000000}"), ["regex", "too many expressions constructed"]),
    ("/v1/chat/completions", _chat(regex=r"[^\s\S]"), ["regex", "no text satisfies it"]),
    (
        "/v1/chat/completions",
        _chat(regex=r"[^\s\S]", stream=True),
        ["regex", "no text satisfies it"],
    ),
    (
        "/v1/completions",
        {"model": "m", "prompt": "hi", "json_schema": "{not json"},
        ["json_schema"],
    ),
    (
        "/v1/completions",
        {"model": "m", "prompt": "hi", "regex": "a+", "json_schema": '{"type": "object"}'},
        ["regex", "json_schema"],
    ),
    ("/v1/chat/completions", _chat(regex="(("), ["regex"]),
    # reasoning first needs the server to know the model's reasoning tags
    ("/generate", {**_native(regex=YES_NO), "require_reasoning": True}, ["--reasoning-parser"]),
    (
        "/v1/chat/completions",
        {**_chat(regex=YES_NO), "require_reasoning": True},
        ["require_reasoning", "--reasoning-parser"],
    ),
    (
        "/v1/chat/completions",
        _chat(response_format={"type": "json_schema"}),
        ["response_format", "json_schema"],
    ),
    (
        "/v1/chat/completions",
        _chat(response_format={"type": "json_object"}, regex="a+"),
        ["response_format"],
    ),
    (
        "/v1/chat/completions",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "foo"}},
            }
        ),
        ["invalid response_format", "foo"],
    ),
]


LOOKAROUND_FORMAT = {  # valid JSON schema, but a pattern constrained decoding cannot follow
    "type": "json_schema",
    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}},
}


def test_invalid_constraints_are_400_before_any_work(server, client):
    before = state(server)
    for route, body, words in INVALID:
        r = post(server, route, body)
        assert r.status_code == 400, (route, body, r.status_code, r.text)
        error = r.json()
        assert set(error) == {"error"}, error
        assert {"message", "type", "param", "code"} <= set(error["error"]), error
        message = error["error"]["message"]
        for word in words:
            assert word in message, (body, message)
        assert "\n" not in message and "<state>" not in message, message
    # the official client sees the same thing as an exception
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="hi", max_tokens=4, extra_body={"regex": "(("})
    assert info.value.status_code == 400 and "regex" in info.value.message

    after = state(server)
    for key in ("prefill_batches", "prompt_tokens", "generated_tokens", "grammar_mask_rows"):
        assert after[key] == before[key], f"{key}: a refused request did some work"
    assert_kv_clean(server)
    # and the server still serves, constrained and not
    out = generate(server, _native(regex=DATE, temperature=0, max_new_tokens=16))
    assert re.fullmatch(DATE, out["text"]), out
    assert generate(server, _native(temperature=0))["meta_info"]["completion_tokens"] == 4
    assert_kv_clean(server)


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/chat/completions", _chat(response_format=LOOKAROUND_FORMAT)),
        ("/v1/chat/completions", _chat(response_format=LOOKAROUND_FORMAT, stream=True)),
        ("/v1/completions", {"model": "m", "prompt": "hi", "response_format": LOOKAROUND_FORMAT}),
    ],
)
def test_a_refused_response_format_is_named_as_the_client_sent_it(server, route, body):
    """The engine refuses the grammar by its own kind (json_schema); the client sent a
    response_format, and the 400 says so."""
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format", error
    assert (
        error["message"].startswith("invalid response_format: ")
        and "look-around" in error["message"]
    )


def test_a_grammar_failing_mid_output_is_an_abort_that_says_why(server, client):
    """`x|a{1000000}` can start (with `x`), so it is admitted; pushed to `a`, llguidance's
    lexer gives up at the next token. The request ends as SGLang and vLLM end it, with
    finish_reason "abort"; the OpenAI routes add the reason in `abort_message`, one line."""
    why = "the grammar cannot continue: lexer error: too many expressions constructed"
    a = tokenize(server, "a")
    assert len(a) == 1
    extra = {"regex": "x|a{1000000}", "logit_bias": {str(a[0]): 100}}
    kw = dict(model="m", prompt="Say a:", max_tokens=8, temperature=0, extra_body=extra)
    choice = client.completions.create(**kw).choices[0]
    assert choice.finish_reason == "abort" and choice.text == "a", choice
    assert choice.model_extra["abort_message"] == why
    last = [c.choices[0] for c in client.completions.create(**kw, stream=True)][-1]
    assert last.finish_reason == "abort" and last.model_extra["abort_message"] == why
    native = generate(server, {"text": "Say a:", "sampling_params": {**extra, "temperature": 0}})
    assert native["meta_info"]["finish_reason"] == {"type": "abort", "message": why}
    assert_kv_clean(server)


# -- 6. constrained and free requests at once -----------------------------------------------------
FREE_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    "def fibonacci(n):",
]


def test_constrained_and_free_requests_mixed_concurrently(server):
    def free(prompt: str) -> Callable[[], dict[str, Any]]:
        params = {"max_new_tokens": 12, "temperature": 0}
        return lambda: generate(server, {"text": prompt, "sampling_params": params})

    def constrained(prompt: str, **params: Any) -> Callable[[], dict[str, Any]]:
        params = {"max_new_tokens": MAX_TOKENS, "temperature": 0, **params}
        return lambda: generate(server, {"text": prompt, "sampling_params": params})

    requests.post(server.url + "/flush_cache", timeout=30)
    alone = [free(p)()["text"] for p in FREE_PROMPTS]
    requests.post(server.url + "/flush_cache", timeout=30)  # the same prefill path as alone

    checks = [  # (call, check of its text), free and constrained interleaved
        (constrained(json_prompt(SCHEMAS[0][2]), json_schema=PERSON), PERSON),
        (free(FREE_PROMPTS[0]), alone[0]),
        (constrained("Call us at", regex=PHONE), PHONE),
        (free(FREE_PROMPTS[1]), alone[1]),
        (constrained(json_prompt(SCHEMAS[2][2]), json_schema=WEATHER), WEATHER),
        (free(FREE_PROMPTS[2]), alone[2]),
        (constrained("Today's date is ", regex=DATE), DATE),
        (free(FREE_PROMPTS[3]), alone[3]),
    ]
    results = parallel([call for call, _ in checks])
    for (_, want), out in zip(checks, results):
        text = out["text"]
        if isinstance(want, dict):
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            assert_valid_json(text, want)
        elif want in (PHONE, DATE):
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            assert re.fullmatch(want, text), (want, text)
        else:
            assert text == want, f"free greedy output changed next to constrained ones: {out}"
    assert_kv_clean(server)


# -- 7. a budget too small for the document ----------------------------------------------------
def test_max_new_tokens_too_small_gives_a_prefix_of_the_document(server, native_greedy, client):
    name, schema, prompt = SCHEMAS[1]  # the order: the longest document
    full = native_greedy["results"][1]["text"]
    budgets = [6, 13]
    body = {
        "text": [json_prompt(prompt)] * len(budgets),
        "sampling_params": [
            {"max_new_tokens": n, "temperature": 0, "json_schema": json.dumps(schema)}
            for n in budgets
        ],
    }
    for n, out in zip(budgets, generate(server, body)):
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": n}, out
        assert meta["completion_tokens"] == len(out["output_ids"]) == n
        assert full.startswith(out["text"]) and len(out["text"]) < len(full), (out, full)

    chat = chat_schema(client, name, temperature=0, max_tokens=8)
    text = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    assert chat_schema(client, name, temperature=0).choices[0].message.content.startswith(text)


# -- 8. stop strings inside the document ---------------------------------------------------------
def test_stop_strings_inside_a_json_document_do_not_cut_it(server, native_greedy):
    _, schema, prompt = SCHEMAS[0]  # the person: "," and '"' occur inside the document
    params = {
        "max_new_tokens": MAX_TOKENS,
        "temperature": 0,
        "json_schema": json.dumps(schema),
        "stop": [",", '"'],
    }
    out = generate(server, {"text": json_prompt(prompt), "sampling_params": params})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert_valid_json(out["text"], schema)
    assert out["text"] == native_greedy["results"][0]["text"]


def test_stop_string_inside_a_complete_regex_document_does_not_cut_it(server):
    """The document 'London, Paris' is complete (and could still grow) when the stop string
    ',' that it contains is looked for: the text must still match the regex."""
    pattern = "[A-Z][a-z]+, [A-Z][a-z]+"
    params = {"max_new_tokens": 20, "temperature": 0, "regex": pattern, "stop": ","}
    out = generate(server, {"text": "Two European capital cities: ", "sampling_params": params})
    assert re.fullmatch(pattern, out["text"]), out


def test_a_stop_after_a_complete_document_fires_whatever_the_grammar_expects_next(server):
    """'12' is a complete document of 12(34)?; the '3' that follows could begin more of it, yet
    the stop string '3' ends the output there (the grammar's state after the stop does not
    matter: the text before it is a document)."""
    params = {"max_new_tokens": 8, "temperature": 0, "regex": "12(34)?", "stop": ["3"]}
    out = generate(server, {"text": "Count: ", "sampling_params": params})
    assert out["text"] == "12", out
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "3"}, out


# -- 10. streaming --------------------------------------------------------------------------------
def test_streamed_chat_json_schema_matches_the_non_streamed_text(client, chat_greedy):
    for name in ("order", "person"):
        stream = chat_schema(client, name, temperature=0, stream=True)
        pieces, finishes = [], []
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                if choice.finish_reason is not None:
                    finishes.append(choice.finish_reason)
        text = "".join(pieces)
        assert finishes == ["stop"], finishes
        assert text == chat_greedy[name].choices[0].message.content
        assert_valid_json(text, SCHEMA_BY_NAME[name])


# -- 9. jump-forward on and off -------------------------------------------------------------------
@pytest.fixture(scope="class")
def no_jump_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """A second server with --disable-jump-forward, alive only for the class below."""
    yield from start_server(tmp_path_factory, "no-jump-server", "--disable-jump-forward")


def grammar_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: after[k] - before[k] for k in after if k.startswith("grammar_")}


class TestJumpForwardOnAndOff:
    def test_same_requests_valid_on_both_and_tokens_accounted(
        self, server, native_greedy, no_jump_server
    ):
        with_jump = native_greedy["results"]
        jump = grammar_delta(native_greedy["before"], native_greedy["after"])
        before = state(no_jump_server)
        without = generate(no_jump_server, native_schema_batch(temperature=0))
        no_jump = grammar_delta(before, state(no_jump_server))
        print(f"\ngrammar stats, jump-forward on: {jump}\n                          off: {no_jump}")

        differ, retokenized = [], []
        for (name, schema, _), a, b in zip(SCHEMAS, with_jump, without):
            for out in (a, b):
                assert out["meta_info"]["finish_reason"]["type"] == "stop", (name, out)
                assert_valid_json(out["text"], schema)
                # completion_tokens counts every output token, jumped ones included
                assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) > 0
            print(
                f"{name}: {a['meta_info']['completion_tokens']} tokens with jump-forward, "
                f"{b['meta_info']['completion_tokens']} without"
            )
            if a["text"] != b["text"]:
                differ.append((name, a["text"], b["text"]))
            elif a["output_ids"] != b["output_ids"]:  # the same text, tokenized differently
                retokenized.append((name, a["output_ids"], b["output_ids"]))
        print(f"{len(differ)} of {len(SCHEMAS)} texts differ with jump-forward on and off")
        if differ:
            name, on, off = differ[0]
            print(f"for example {name}:\n  on:  {on}\n  off: {off}")
        print(f"{len(retokenized)} more have the same text in other tokens")
        if retokenized:
            name, on, off = retokenized[0]
            at = next(i for i, (x, y) in enumerate(zip(on, off)) if x != y)
            print(f"for example {name} from token {at}:\n  on:  {on[at:]}\n  off: {off[at:]}")

        # the jumped tokens are real output tokens: the ids spell the whole text
        for out in with_jump:
            assert detokenize(server, out["output_ids"]) == out["text"]
        # each output token was either sampled under a mask or appended by a jump
        total = sum(out["meta_info"]["completion_tokens"] for out in with_jump)
        assert jump["grammar_jump_tokens"] > 0 and jump["grammar_jumps"] > 0, jump
        assert total == jump["grammar_mask_rows"] + jump["grammar_jump_tokens"], (total, jump)
        total = sum(out["meta_info"]["completion_tokens"] for out in without)
        assert total == no_jump["grammar_mask_rows"], (total, no_jump)

    def test_no_jump_server_never_jumps(self, no_jump_server):
        s = state(no_jump_server)
        assert s["grammar_jumps"] == 0 and s["grammar_jump_tokens"] == 0, s
        assert s["grammar_retokenized"] == 0 and s["grammar_mask_rows"] > 0, s
