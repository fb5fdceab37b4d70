"""Tool calling end to end with the official `openai` client: on the default SmolLM2 (whose
ChatML template knows no tools, so they reach it in a system message) `required` and named
choices give arguments valid by their schema every time, and the whole flow (call → tool
result → answer) runs; on a tiny model whose template renders tools Hermes-style, the
prompt is what transformers' apply_chat_template(tools=...) renders and the `auto` parser
reads the model's <tool_call> blocks (the output forced by a regex, since a random-weight
model writes none on its own); with --reasoning-parser qwen3 the same server splits a forced
<think> block out into reasoning_content, before any tool call is read from the rest (and
/v1/responses into a reasoning item, a message and a function_call item). Streams
reassemble to the non-streamed messages."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import openai
import pytest
import requests
from transformers import AutoTokenizer

from radixserve.server.tool_calls import closed_objects as closed
from tests.conftest import build_tiny_model
from tests.server_utils import ServerProcess, assert_kv_clean

TIMEOUT = 180
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert_currency",
        "description": "Convert an amount of money from one currency to another.",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "minimum": 0, "maximum": 1e9},
                "source": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "target": {"type": "string", "pattern": "^[A-Z]{3}$"},
            },
            "required": ["amount", "source", "target"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "current_time"}}  # no parameters at all
TOOLS = [WEATHER, CONVERT, TIME]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}
QUESTIONS = [
    "What is the weather like in Paris today?",
    "How much is 250 US dollars in euros?",
    "What time is it?",
]


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def stream_message(client: openai.OpenAI, **kwargs) -> tuple[dict, str]:
    """The message a client assembles from a stream's deltas, and the finish reason."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id is not None:
                assert entry["id"] is None, "a call's id is sent once"
                entry["id"], entry["name"] = call.id, call.function.name
            entry["arguments"] += call.function.arguments or ""
        reason = choice.finish_reason or reason
    message = {"content": content or None, "calls": [calls[i] for i in sorted(calls)]}
    return message, reason


def as_plain(message) -> dict:
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]
    return {"content": message.content or None, "calls": calls}


def without_ids(message: dict) -> dict:
    return {**message, "calls": [{**c, "id": None} for c in message["calls"]]}


# -- SmolLM2 ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    log = tmp_path_factory.mktemp("tools-smol") / "server.log"
    proc = ServerProcess("--max-total-tokens", "16000", log=log)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(smol) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


@pytest.mark.smollm2
@pytest.mark.parametrize("question", QUESTIONS)
def test_required_gives_valid_calls_every_time(client, question):
    """One call each (parallel_tool_calls false) ends with tool_calls; with parallel calls
    the small model may repeat calls until max_tokens, and every complete one is valid."""
    for temperature, parallel in ((0.0, False), (1.0, True)):
        r = client.chat.completions.create(
            model="m",
            messages=ask(question),
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            temperature=temperature,
            max_tokens=120,
            n=2,
        )
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls" or parallel, choice
            if parallel and choice.finish_reason == "length" and not choice.message.tool_calls:
                # sampled, the small model can run its first call's number on to max_tokens
                # (a fresh clone's run once gave "amount": 250.0000637921136200250...): cut
                # inside that call, there is no complete call to return, only its text
                content = choice.message.content
                assert content.startswith("[") and '"name"' in content, choice
                continue
            assert choice.message.content is None and choice.message.tool_calls, choice
            assert len(choice.message.tool_calls) == 1 or parallel
            for call in choice.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                arguments = json.loads(call.function.arguments)
                jsonschema.validate(arguments, SCHEMAS[call.function.name])


@pytest.mark.smollm2
@pytest.mark.parametrize("tool", TOOLS, ids=lambda t: t["function"]["name"])
def test_a_named_function_is_called_with_valid_arguments(client, tool):
    name = tool["function"]["name"]
    for question in QUESTIONS[:2]:
        r = client.chat.completions.create(
            model="m",
            messages=ask(question),
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
            temperature=0.8,
            seed=len(question),
            max_tokens=120,
        )
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == name
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[name])
        assert set(arguments) <= set(SCHEMAS[name].get("properties", {}))  # nothing undeclared


@pytest.mark.smollm2
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "convert_currency"}}, "none"]
)
def test_streamed_tool_calls_reassemble_to_the_message(client, choice):
    kwargs = dict(
        model="m",
        messages=ask(QUESTIONS[1]),
        tools=TOOLS,
        tool_choice=choice,
        temperature=0,
        max_tokens=60,
    )
    whole = client.chat.completions.create(**kwargs)
    streamed, reason = stream_message(client, **kwargs)
    assert without_ids(streamed) == without_ids(as_plain(whole.choices[0].message))
    assert reason == whole.choices[0].finish_reason
    assert bool(streamed["calls"]) == (choice != "none")  # required may repeat to max_tokens
    assert reason in (("stop", "length") if choice == "none" else ("tool_calls", "length"))


@pytest.mark.smollm2
def test_call_then_tool_result_then_answer(client, smol):
    messages = ask(QUESTIONS[0])
    first = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, tool_choice="required", max_tokens=80
    )
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    result = {"temperature": 18, "sky": "sunny"}
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    answer = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, max_tokens=40, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    # the second prompt holds the first turn: it is served from the radix cache
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens
    assert answer.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert_kv_clean(smol)


FOO_PARAMETERS = {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
STRING = {"type": "string"}
BAD = [
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "'nope', which is not in tools",
    ),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "pattern"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "cannot be combined",
    ),
    # as OpenAI: the parameters are checked whatever tool_choice is, and named as such
    *(
        (
            {"tools": [WEATHER, FOO_PARAMETERS], **choice},
            "tools[1].function.parameters",
            "Invalid schema for function 'f':",
        )
        for choice in ({}, {"tool_choice": "required"})
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": STRING}}]},
        "tools[0].function.parameters",
        'of type "object", got type "string"',
    ),
]


@pytest.mark.smollm2
@pytest.mark.parametrize(("fields", "param", "words"), BAD, ids=[b[2] for b in BAD])
def test_bad_tool_fields_are_400s_naming_the_field(client, smol, fields, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ask("hi"), max_tokens=4, **fields)
    error = e.value.body
    assert error["param"] and error["param"].startswith(param), error
    assert words in error["message"], error


@pytest.mark.smollm2
def test_tool_messages_need_their_call_id(client):
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(
            model="m", messages=[{"role": "tool", "content": "42"}], max_tokens=4
        )


# -- a tiny model with a template that renders tools ------------------------------------------
THINK, END_THINK = "<think>", "</think>"
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"

# (and thinks as Qwen3's does: enable_thinking false closes an empty block in the prompt;
# open_thinking, as Qwen3-Thinking's and DeepSeek-R1's, opens one)
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% elif open_thinking is defined and open_thinking %}<think>
{% endif %}{% endif %}"""


def serve_hermes(root, added_tokens: tuple[str, ...] = ()):
    """A server of a tiny model with HERMES_TEMPLATE and the qwen3 reasoning parser."""
    folder = build_tiny_model(root / "model", "llama", added_tokens=added_tokens)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    flags = ("--model-path", str(folder), "--max-total-tokens", "4000")
    flags += ("--reasoning-parser", "qwen3")
    proc = ServerProcess(*flags, log=root / "log")
    try:
        yield proc.wait_ready(), folder
    finally:
        proc.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    """With <think>, </think>, <tool_call> and </tool_call> one (added) token each, ids
    512-515, as in Qwen's vocabulary: a bias can push the model to write them, and regexes
    that write them as text must still work (constrained/llguidance_backend.text_tokenizer)."""
    added = (THINK, END_THINK, TOOL_CALL, END_TOOL_CALL)
    yield from serve_hermes(tmp_path_factory.mktemp("tools-hermes"), added)


def hermes_client(hermes) -> openai.OpenAI:
    url = hermes[0].url + "/v1"
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=TIMEOUT)


def test_tools_reach_a_template_as_transformers_renders_them(hermes):
    _, folder = hermes
    tokenizer = AutoTokenizer.from_pretrained(folder)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = '{"city": "Rome", "unit": "celsius"}'
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    r = hermes_client(hermes).chat.completions.create(
        model="m", messages=history, tools=TOOLS, max_tokens=1
    )
    as_objects = [dict(m) for m in history]  # templates read the arguments as an object
    as_objects[2] = {**history[2], "tool_calls": [{**call, "function": {**call["function"]}}]}
    as_objects[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Rome", "unit": "celsius"}
    text = tokenizer.apply_chat_template(
        as_objects, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert '"name": "get_weather", "arguments": {"city": "Rome"' in text  # rendered as JSON
    assert r.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


FORCED = (
    r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Rome|Oslo)", "unit": "celsius"\}\}\n</tool_call>'
)


def test_the_auto_parser_reads_hermes_blocks_out_of_the_output(hermes):
    client = hermes_client(hermes)
    kwargs = dict(
        model="m",
        messages=ask("Weather in Rome?"),
        tools=TOOLS,
        max_tokens=120,
        temperature=0,
        extra_body={"regex": FORCED, "require_reasoning": False},  # the regex: all of it
    )
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Rome", "Oslo")
    streamed, reason = stream_message(client, **kwargs)
    assert reason == "tool_calls"
    assert without_ids(streamed) == without_ids(as_plain(choice.message))
    # with tool_choice none, the same text is plain content
    plain = client.chat.completions.create(**{**kwargs, "tool_choice": "none"})
    assert plain.choices[0].message.tool_calls is None
    assert "<tool_call>" in plain.choices[0].message.content
    assert_kv_clean(hermes[0])


# -- reasoning (the server runs with --reasoning-parser qwen3) ---------------------------------
THOUGHT = r"<think>\nThe user asks about (Rome|Oslo)\.\n</think>\n\nIt is sunny\."


def stream_reasoning(client: openai.OpenAI, **kwargs) -> tuple[list[str], str, str | None]:
    """A stream's reasoning pieces, its content, and its finish reason."""
    thoughts, content, reason = [], "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        if (delta.model_extra or {}).get("reasoning_content"):
            assert not content, "the reasoning comes before the content"
            thoughts.append(delta.model_extra["reasoning_content"])
        content += delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
    return thoughts, content, reason


def test_reasoning_is_split_out_of_the_content(hermes):
    client = hermes_client(hermes)
    kwargs = dict(
        model="m",
        messages=ask("Weather in Rome?"),
        max_tokens=60,
        temperature=0,
        extra_body={"regex": THOUGHT, "require_reasoning": False},
    )
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.content == "It is sunny."
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning in ("The user asks about Rome.", "The user asks about Oslo.")
    thoughts, content, reason = stream_reasoning(client, **kwargs)
    assert "".join(thoughts) == reasoning and content == message.content and reason == "stop"

    # stream_reasoning false: the reasoning comes in one piece once its block has ended
    one = {**kwargs, "extra_body": {**kwargs["extra_body"], "stream_reasoning": False}}
    assert stream_reasoning(client, **one)[:2] == ([reasoning], message.content)

    # separate_reasoning false, or thinking off in the template: all of it is content
    raw = {**kwargs, "extra_body": {**kwargs["extra_body"], "separate_reasoning": False}}
    whole = client.chat.completions.create(**raw).choices[0].message
    assert whole.content.startswith("<think>") and "reasoning_content" not in whole.model_extra
    plain = {"regex": "It is sunny\\.", "chat_template_kwargs": {"enable_thinking": False}}
    # (its prompt ends with the empty block closed: the regex is all of the output)
    message = client.chat.completions.create(**{**kwargs, "extra_body": plain}).choices[0].message
    assert message.content == "It is sunny." and message.model_extra["reasoning_content"] is None

    # cut short by max_tokens inside the block: reasoning only
    short = client.chat.completions.create(**{**kwargs, "max_tokens": 8}).choices[0]
    assert short.finish_reason == "length" and short.message.content == ""
    assert reasoning.startswith(short.message.model_extra["reasoning_content"])
    assert_kv_clean(hermes[0])


def _items(output: list) -> list[dict]:
    """Output items less their ids (and the stream helper's empty `parsed` fields)."""
    return [i.model_dump(exclude={"id", "call_id"}, exclude_none=True) for i in output]


def test_the_responses_api_makes_reasoning_message_and_call_items(hermes):
    """/v1/responses on the same parsers: the forced output is a reasoning item, the text
    before the call a message, the call a function_call item; streamed, the same items."""
    client = hermes_client(hermes)
    weather = {"type": "function", **TOOLS[0]["function"]}
    forced = THOUGHT.removesuffix(r"It is sunny\.") + FORCED
    kwargs = dict(
        model="m",
        input="Weather in Rome?",
        tools=[weather],
        max_output_tokens=120,
        temperature=0,
        extra_body={"regex": forced, "require_reasoning": False},
    )
    r = client.responses.create(**kwargs)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = r.output
    assert reasoning.content[0].text in ("The user asks about Rome.", "The user asks about Oslo.")
    assert message.content[0].text == "Checking." and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Rome", "Oslo")
    assert r.status == "completed" and r.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        streamed = stream.get_final_response()
    assert "".join(deltas) == reasoning.content[0].text
    assert _items(streamed.output) == _items(r.output)
    assert_kv_clean(hermes[0])


DIGIT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}


def test_a_constraint_applies_after_the_reasoning(hermes):
    """With --reasoning-parser, a chat request's constraint applies after the model's block of
    reasoning (require_reasoning, on by default), whose text is free. The tiny model is
    pushed to open the block (<think>, +50) and to end it (</think>, +100): it may only
    open it where the prompt has not (the schema comes first otherwise), then ends it at
    once, and the schema holds after it. With require_reasoning false the schema holds from
    the first token, whatever the bias."""
    client = hermes_client(hermes)
    tokenizer = AutoTokenizer.from_pretrained(hermes[1])
    think, end = tokenizer.convert_tokens_to_ids([THINK, END_THINK])
    kwargs = dict(
        model="m",
        messages=ask("Pick a digit."),
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": DIGIT}},
        logit_bias={str(think): 50, str(end): 100},
    )
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.model_extra["reasoning_content"] == ""
    jsonschema.validate(json.loads(message.content), DIGIT)
    streamed, reason = stream_message(client, **kwargs)
    assert streamed["content"] == message.content and reason == "stop"

    def raw(**extra) -> str:
        body = {"separate_reasoning": False, "require_reasoning": True, **extra}
        return client.chat.completions.create(**kwargs, extra_body=body).choices[0].message.content

    text = raw()
    assert text.startswith(THINK + END_THINK), text
    jsonschema.validate(json.loads(text.removeprefix(THINK + END_THINK)), DIGIT)
    # the prompt opens the block: the output starts inside it, and cannot open another
    text = raw(chat_template_kwargs={"open_thinking": True})
    assert text.startswith(END_THINK), text
    jsonschema.validate(json.loads(text.removeprefix(END_THINK)), DIGIT)
    # require_reasoning false: all of the output is the document
    jsonschema.validate(json.loads(raw(require_reasoning=False)), DIGIT)
    # the native API asks for it by name (SGLang's require_reasoning)
    r = requests.post(
        hermes[0].url + "/generate",
        json={
            "text": "Yes or no?",
            "sampling_params": {
                "regex": "(yes|no)",
                "max_new_tokens": 20,
                "temperature": 0,
                "logit_bias": {str(think): 50, str(end): 100},
            },
            "require_reasoning": True,
        },
        timeout=TIMEOUT,
    )
    assert re.fullmatch(r"<think></think>\s*(yes|no)", r.json()["text"]), r.text
    assert_kv_clean(hermes[0])


def test_a_block_the_prompt_opens_and_a_tool_call_after_the_reasoning(hermes):
    client = hermes_client(hermes)
    forced = r"Rome has no tool\.\n</think>\n\n" + FORCED
    kwargs = dict(
        model="m",
        messages=ask("Weather in Rome?"),
        tools=TOOLS,
        max_tokens=160,
        temperature=0,
        extra_body={
            "regex": forced,
            "chat_template_kwargs": {"open_thinking": True},
            "require_reasoning": False,
        },
    )
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.model_extra["reasoning_content"] == "Rome has no tool."
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    thoughts, content, reason = stream_reasoning(client, **kwargs)
    assert "".join(thoughts) == "Rome has no tool." and content == "Checking."
    assert reason == "tool_calls"


# -- strict tools under auto, and structural tags ---------------------------------------------
def strict(tool: dict) -> dict:
    return {**tool, "function": {**tool["function"], "strict": True}}


def pushed_to_call(hermes, **kwargs) -> dict:
    """Arguments where a bias pushes the tiny model to write <tool_call> (one token here)
    whenever it may: it opens a block at once, and another after each one closes."""
    tokenizer = AutoTokenizer.from_pretrained(hermes[1])
    opening = tokenizer.convert_tokens_to_ids(TOOL_CALL)
    return dict(
        model="m",
        messages=ask("Weather in Oslo, and 5 USD in EUR?"),
        max_tokens=100,
        temperature=1.0,
        logit_bias={str(opening): 30},
        extra_body={"require_reasoning": False},
        **kwargs,
    )


def test_strict_tools_under_auto_make_every_call_valid(hermes):
    """tool_choice auto with strict tools (as SGLang's): the output is free text, but each
    <tool_call> block the model opens is a call of a given tool, whose arguments follow its
    schema (closed to undeclared keys). The same bias without strict tools leaves the random
    model's blocks unparseable."""
    client = hermes_client(hermes)
    tools = [strict(WEATHER), strict(CONVERT)]
    schemas = {t["function"]["name"]: closed(t["function"]["parameters"]) for t in tools}
    for seed in range(3):
        kwargs = pushed_to_call(hermes, tools=tools, seed=seed)
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.tool_calls, message.content
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        streamed, _ = stream_message(client, **kwargs)
        assert without_ids(streamed) == without_ids(as_plain(message))
    loose = client.chat.completions.create(**pushed_to_call(hermes, tools=[WEATHER, CONVERT]))
    assert loose.choices[0].message.tool_calls is None
    assert_kv_clean(hermes[0])


WEATHER_TAG = {
    "type": "structural_tag",
    "triggers": [TOOL_CALL],
    "structures": [
        {
            "begin": f'{TOOL_CALL}{{"city": ',
            "schema": {"enum": ["Oslo", "Rome"]},
            "end": f"}}{END_TOOL_CALL}",
        }
    ],
}


def test_a_structural_tag_response_format_on_both_routes(hermes):
    """response_format of type structural_tag (SGLang's), on chat and completions, and the
    native structural_tag sampling parameter: each block the model opens is valid."""
    client = hermes_client(hermes)
    block = re.compile(re.escape(TOOL_CALL) + r'\{"city": "(Oslo|Rome)"\}' + END_TOOL_CALL)
    kwargs = pushed_to_call(hermes, response_format=WEATHER_TAG)
    chat = client.chat.completions.create(**kwargs).choices[0].message.content
    del kwargs["messages"], kwargs["response_format"]
    kwargs["extra_body"] = {"response_format": WEATHER_TAG}  # not in the client's signature
    completion = client.completions.create(prompt="Weather:", **kwargs).choices[0].text
    params = {"structural_tag": json.dumps(WEATHER_TAG), "max_new_tokens": 60}
    params["logit_bias"] = kwargs["logit_bias"]
    r = requests.post(
        hermes[0].url + "/generate",
        json={"text": "Weather:", "sampling_params": params},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    for text in (chat, completion, r.json()["text"]):
        blocks = block.findall(text)
        assert len(blocks) >= 2, text
        rest = block.sub("", text)  # only the block max_tokens cut may be left open
        assert TOOL_CALL not in rest or text.endswith(rest[rest.index(TOOL_CALL) :]), text
    assert_kv_clean(hermes[0])


@pytest.mark.parametrize(
    ("response_format", "words"),
    [
        ({"type": "structural_tag", "structures": WEATHER_TAG["structures"]}, "needs structures"),
        ({**WEATHER_TAG, "format": {"type": "any_text"}}, "needs format, or structures"),
        ({**WEATHER_TAG, "triggers": ["<call>"]}, "does not start with any trigger"),
        ({"type": "json_object", "triggers": [TOOL_CALL]}, "go with type structural_tag"),
        ({"type": "structural_tag", "format": {"type": "token"}}, "'token' is not supported"),
        ({**WEATHER_TAG, "json_schema": {"name": "x"}}, "goes with type json_schema"),
    ],
)
def test_a_bad_structural_tag_is_a_400_naming_response_format(hermes, response_format, words):
    r = requests.post(
        hermes[0].url + "/v1/chat/completions",
        json={"model": "m", "messages": ask("Hi"), "response_format": response_format},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    assert (error["param"] or "").split(".")[0] == "response_format", error


def test_a_format_tree_response_format(hermes):
    """xgrammar's form (vLLM's and newer SGLang's): the output is what the tree says."""
    tree = {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "City: "},
            {"type": "json_schema", "json_schema": {"enum": ["Oslo", "Rome"]}},
        ],
    }
    r = hermes_client(hermes).chat.completions.create(
        model="m",
        messages=ask("Where?"),
        max_tokens=20,
        response_format={"type": "structural_tag", "format": tree},
        extra_body={"require_reasoning": False},
    )
    assert re.fullmatch(r'City: "(Oslo|Rome)"', r.choices[0].message.content), r
