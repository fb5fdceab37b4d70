"""Tool calling without a server: the parsers (each format, and their failure cases), the
streaming invariant (a stream cut anywhere reassembles to the non-streamed message), the
constraint a plan puts on the output, and what reaches the chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.server.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    NamedToolChoice,
    RequiredParser,
    Tool,
    ToolFieldError,
    ToolPlan,
    ToolStream,
    closed_objects,
    message,
    mistral_call_id,
    parser_family,
    template_messages,
    tool_mode,
)

NAMES = frozenset({"get_weather", "add"})
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add", "description": "a + b"}}
TOOLS = tuple(Tool(**t) for t in (WEATHER, ADD))


def block(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


# -- the parsers ------------------------------------------------------------------------------
def test_hermes_reads_calls_and_keeps_the_text_around_them():
    text = "Let me check.\n" + block("get_weather", {"city": "Paris"}) + "\n" + block("add", {})
    parsed = HermesParser(NAMES, parallel=True).parse(text, final=True)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {}),
    ]


def test_hermes_leaves_a_block_that_is_no_valid_call_in_the_content():
    unknown = block("launch_rockets", {})
    broken = "<tool_call>{not json</tool_call>"
    for text in (unknown, broken, "<tool_call>" + json.dumps({"name": "add", "arguments": 3})):
        parsed = HermesParser(NAMES, parallel=True).parse(text, final=True)
        assert parsed.calls == [] and parsed.content == text


def test_hermes_accepts_arguments_written_as_a_json_string_and_an_unclosed_last_block():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}'  # cut before the close
    (call,) = HermesParser(NAMES, parallel=True).parse(text, final=True).calls
    assert json.loads(call.arguments) == {"a": 1}


def test_hermes_without_parallel_calls_keeps_the_first():
    text = block("add", {"a": 1}) + block("add", {"a": 2})
    parsed = HermesParser(NAMES, parallel=False).parse(text, final=True)
    assert [json.loads(c.arguments) for c in parsed.calls] == [{"a": 1}]


def test_hermes_holds_back_what_may_be_the_start_of_a_call():
    parser = HermesParser(NAMES, parallel=True)
    assert parser.parse("Sure <tool_", final=False).content == "Sure"
    assert parser.parse("Sure <tool_", final=True).content == "Sure <tool_"
    assert parser.parse("Sure <tool_call>{", final=False).calls == []


def test_llama3_reads_one_or_several_calls_and_the_python_tag():
    one = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    parsed = Llama3JsonParser(NAMES, parallel=True).parse(one, final=True)
    assert parsed.content == "" and parsed.calls[0].name == "get_weather"
    two = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; ' + one
    assert [c.name for c in Llama3JsonParser(NAMES, True).parse(two, True).calls] == [
        "add",
        "get_weather",
    ]


# JSON a model may write that Python's json cannot turn into a call: a name that is a list
# or an object (unhashable), an integer of 4,400 digits, arrays nested 1,100 deep
ODD_CALLS = [
    '{"name": ["add"], "arguments": {}}',
    '{"name": {"a": 1}, "arguments": {}}',
    '{"name": "add", "arguments": {"a": ' + "1" * 4400 + "}}",
    '{"name": "add", "arguments": {"a": ' + "[" * 1100 + "]" * 1100 + "}}",
    '{"name": "add", "arguments": "{\\"a\\": ' + "1" * 4400 + '}"}',
]


@pytest.mark.parametrize("call", ODD_CALLS, ids=range(len(ODD_CALLS)))
def test_json_python_cannot_read_is_content_in_every_parser(call):
    hermes = f"<tool_call>\n{call}\n</tool_call>"
    for parser, text in [
        (HermesParser(NAMES, parallel=True), hermes),
        (Llama3JsonParser(NAMES, parallel=True), call),
        (RequiredParser(NAMES, parallel=True), f"[{call}]"),
    ]:
        for final in (False, True):
            parsed = parser.parse(text, final=final)
            assert parsed.calls == []
        assert parsed.content == text


def test_llama3_text_that_is_not_a_call_is_content():
    parser = Llama3JsonParser(NAMES, parallel=True)
    for text in ("Hello there", '{"a": 1}', '{"name": "add", "parameters": {}} and more'):
        parsed = parser.parse(text, final=True)
        assert parsed.calls == [] and parsed.content == text
    assert parser.parse('{"name": "ad', final=False).content == ""  # could still be a call


def test_required_and_named_outputs():
    text = '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]'
    assert [c.name for c in RequiredParser(NAMES, True).parse(text, True).calls] == [
        "add",
        "get_weather",
    ]
    assert len(RequiredParser(NAMES, False).parse(text, True).calls) == 1
    cut = '[{"name": "add", "argu'
    assert RequiredParser(NAMES, True).parse(cut, final=True).content == cut
    (call,) = NamedParser("add").parse('{"a": 1', final=False).calls
    assert call.name == "add" and call.arguments == '{"a": 1'


def test_mistral_reads_an_array_of_calls_or_named_calls_after_its_token():
    array = (
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "add", "arguments": {"a": 1}}]'
    )
    parsed = MistralParser(NAMES, parallel=True).parse(array, final=True)
    assert parsed.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1}),
    ]
    named = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]add[ARGS] {"b": 2}'
    parsed = MistralParser(NAMES, parallel=True).parse(named, final=True)
    assert parsed.content == "" and [c.name for c in parsed.calls] == ["get_weather", "add"]
    first = MistralParser(NAMES, parallel=False).parse(named, final=True)
    assert [c.name for c in first.calls] == ["get_weather"]


def test_mistral_keeps_what_does_not_read_as_calls_as_content():
    parser = MistralParser(NAMES, parallel=True)
    for text in ("[TOOL_CALLS]nope[ARGS]{}", '[TOOL_CALLS][{"name": "nope", "arguments": {}}]'):
        parsed = parser.parse(text, final=True)
        assert parsed.content == text and parsed.calls == []
    cut = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "add", "argu'
    parsed = parser.parse(cut, final=True)  # (cut short: the complete call stays a call)
    assert [c.name for c in parsed.calls] == ["add"]
    assert parsed.content == '{"name": "add", "argu'
    assert parser.parse("Hello [TOOL_CA", final=False).content == "Hello"  # (held back)
    assert parser.parse("Hello [TOOL_CA", final=True).content == "Hello [TOOL_CA"


def test_mistral_reads_a_lone_call_object_and_gives_its_templates_their_ids():
    parsed = MistralParser(NAMES, True).parse('[TOOL_CALLS] {"name": "add", "arguments": {}}', True)
    assert [c.name for c in parsed.calls] == ["add"] and parsed.content == ""
    assert mistral_call_id("call_0123456789abcdef") == "789abcdef"
    short = mistral_call_id("c-1")
    assert len(short) == 9 and short.isalnum() and short == mistral_call_id("c-1")
    history = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": "c-1"}]},
        {"role": "tool", "content": "2", "tool_call_id": "c-1"},
    ]
    plan = ToolPlan("auto", TOOLS, family="mistral")
    messages, _ = template_messages(history, plan, "{{ tools }}[TOOL_CALLS]")
    assert messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"] == short


def test_mistral_tools_keep_its_special_token_in_the_text():
    from radixserve.server import openai_api as oai

    messages = [{"role": "user", "content": "Weather?"}]
    body = oai.ChatCompletionRequest(model="m", messages=messages, tools=[WEATHER])
    for family, kept in (("mistral", {"skip_special_tokens": False}), ("hermes", {})):
        plan = ToolPlan("auto", TOOLS, family=family)
        assert oai._tool_constraint(plan, body) == kept
    said = body.model_copy(update={"skip_special_tokens": True})
    assert oai._tool_constraint(ToolPlan("auto", TOOLS, family="mistral"), said) == {}


# -- streaming reassembles to the whole message -----------------------------------------------
PIECES = [
    "Hi",
    " ",
    "\n",
    "<tool",
    "_call>",
    block("add", {"a": 1}),
    block("get_weather", {"city": "Oslo"}),
    block("nope", {}),
    "<tool_call>{bad}</tool_call>",
    '{"name": "add", "parameters": {"b": 2}}',
    "; ",
    "<|python_tag|>",
    "[",
    '{"name": "add", "arguments": {"x": [1, 2]}}',
    ", ",
    "]",
    "[TOOL_CALLS]",
    "[TOOL_",
    "add[ARGS]",
    '{"a": 3}',
]
PARSERS = [
    MistralParser(NAMES, True),
    MistralParser(NAMES, False),
    HermesParser(NAMES, True),
    HermesParser(NAMES, False),
    Llama3JsonParser(NAMES, True),
    RequiredParser(NAMES, True),
    NamedParser("add"),
]


def reassemble(parser, text: str, cuts: list[int]) -> dict:
    """The message a client builds from the stream of `text` cut at `cuts`."""
    stream = ToolStream(parser)
    content, calls = "", {}
    bounds = [0, *sorted(set(cuts)), len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        delta = stream.feed(text[a:b], final=i == len(bounds) - 2)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:
                assert entry["name"] is None, "a call's header is sent once"
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(PIECES), max_size=8),
    cuts=st.lists(st.integers(0, 400), max_size=12),
    which=st.integers(0, len(PARSERS) - 1),
)
def test_a_stream_cut_anywhere_reassembles_to_the_message(parts, cuts, which):
    parser = PARSERS[which]
    text = "".join(parts)
    whole = message(parser, text)
    got = reassemble(parser, text, [c for c in cuts if c <= len(text)])
    expected_calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in whole.get("tool_calls", [])
    ]
    assert got["calls"] == expected_calls
    assert got["content"] == (whole["content"] or "")


# -- the plan -----------------------------------------------------------------------------
def test_tool_mode_checks_the_fields_together():
    assert tool_mode(None, None) == "none" and tool_mode([], "none") == "none"
    assert tool_mode(list(TOOLS), None) == "auto"
    named = {"type": "function", "function": {"name": "add"}}
    assert tool_mode(list(TOOLS), NamedToolChoice(**named)) == "named"
    with pytest.raises(ToolFieldError, match="only allowed when tools") as e:
        tool_mode(None, "required")
    assert e.value.param == "tool_choice"
    missing = NamedToolChoice(type="function", function={"name": "sub"})
    with pytest.raises(ToolFieldError, match="'sub', which is not in tools"):
        tool_mode(list(TOOLS), missing)
    with pytest.raises(ToolFieldError, match="same name"):
        tool_mode([TOOLS[0], TOOLS[0]], "auto")


def function(parameters: dict) -> Tool:
    return Tool(type="function", function={"name": "f", "parameters": parameters})


@pytest.mark.parametrize("choice", ["auto", "none", "required", None])
@pytest.mark.parametrize(
    ("parameters", "words"),
    [
        ({"type": "foo"}, 'of type "object", got type "foo"'),
        ({"type": "string"}, 'of type "object", got type "string"'),
        ({"properties": {"x": {"type": "integer"}}}, 'of type "object", got type null'),
        ({"type": "object", "properties": {"x": {"type": "foo"}}}, "Invalid type: foo"),
        ({"type": "object", "required": "x"}, "Expected array for 'required'"),
    ],
)
def test_invalid_parameters_are_refused_whatever_tool_choice_is(parameters, words, choice):
    """As OpenAI: the function's parameters must be a valid object schema, whether or not
    the output is constrained to them, and the error names them, not json_schema."""
    with pytest.raises(ToolFieldError) as e:
        tool_mode([TOOLS[0], function(parameters)], choice)
    assert e.value.param == "tools[1].function.parameters"
    assert str(e.value).startswith("Invalid schema for function 'f': "), str(e.value)
    assert words in str(e.value)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_empty_parameters_declare_a_function_of_no_arguments(choice):
    """`parameters: {}`, as clients write a function of no arguments, is no schema error: it
    reads as the empty object schema, as leaving parameters out does."""
    tool = function({})
    assert tool_mode([TOOLS[0], tool], choice) == choice
    assert tool.schema() == function(None).schema()


def test_a_schema_constrained_decoding_cannot_follow_is_refused_only_where_it_constrains():
    """`not` is valid JSON Schema that llguidance does not compile: fine in the prompt
    (auto, or another function named), a 400 where the output must follow it."""
    unsupported = function({"type": "object", "not": {"required": ["x"]}})
    tools = [TOOLS[0], unsupported]
    assert tool_mode(tools, "auto") == "auto"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_mode(tools, NamedToolChoice(**named)) == "named"
    for choice in ("required", NamedToolChoice(type="function", function={"name": "f"})):
        with pytest.raises(ToolFieldError, match="Unimplemented keys") as e:
            tool_mode(tools, choice)
        assert e.value.param == "tools[1].function.parameters"


def test_the_required_constraint_accepts_calls_and_refuses_anything_else():
    schema = json.loads(ToolPlan("required", TOOLS).constraint()["json_schema"])
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Paris"}}], schema)
    jsonschema.validate([{"name": "add", "arguments": {}}] * 2, schema)
    for bad in (
        [],  # at least one call
        [{"name": "sub", "arguments": {}}],  # an unknown function
        [{"name": "get_weather", "arguments": {}}],  # its required argument
        [{"name": "get_weather", "arguments": {"city": "P", "country": "F"}}],  # undeclared
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(ToolPlan("required", TOOLS, parallel=False).constraint()["json_schema"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "arguments": {}}] * 2, single)
    named = ToolPlan("named", TOOLS, named="get_weather").constraint()["json_schema"]
    assert json.loads(named)["required"] == ["city"]
    assert json.loads(named)["additionalProperties"] is False
    assert ToolPlan("auto", TOOLS).constraint() == {}  # no strict tool: the output is free


def test_a_strict_tool_under_auto_must_have_parameters_the_grammar_can_follow():
    """Its arguments are constrained (Hermes family): a schema llguidance does not compile
    is a 400 naming the tool's parameters, as under `required`; not with Llama 3's parser,
    which leaves them free."""
    odd = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    tool = Tool(type="function", function={"name": "f", "parameters": odd, "strict": True})
    with pytest.raises(ToolFieldError, match="Unimplemented keys.*strict") as e:
        tool_mode([TOOLS[0], tool], "auto")
    assert e.value.param == "tools[1].function.parameters"
    assert tool_mode([TOOLS[0], tool], "auto", family="llama3") == "auto"
    loose = Tool(type="function", function={"name": "f", "parameters": odd})
    assert tool_mode([TOOLS[0], loose], "auto") == "auto"


def test_strict_tools_under_auto_make_a_structural_tag_of_hermes_blocks():
    """As SGLang's: each <tool_call> block calls a tool, written as TOOLS_PROMPT asks; a
    strict tool's arguments follow its (closed) schema, the others' are any object."""
    weather = Tool(**{**WEATHER, "function": {**WEATHER["function"], "strict": True}})
    plan = ToolPlan("auto", (weather, TOOLS[1]))
    tag = json.loads(plan.constraint()["structural_tag"])
    assert tag["triggers"] == ["<tool_call>"]
    strict, loose = tag["structures"]
    assert strict["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert strict["end"] == "}\n</tool_call>" and loose["schema"] == {"type": "object"}
    assert strict["schema"] == closed_objects(WEATHER["function"]["parameters"])
    assert ToolPlan("auto", (weather,), family="llama3").constraint() == {}  # not tagged text


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "pets": {"type": "array", "items": {"type": "object", "properties": {"kind": {}}}},
        "home": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},  # kept open
    },
    "$defs": {"address": {"properties": {"city": {"type": "string"}}}},
}


def test_strict_mode_closes_every_object_schema_that_leaves_keys_open():
    closed = closed_objects(PERSON)
    good = {"name": "A", "pets": [{"kind": "cat"}], "home": {"city": "Rome"}, "tags": {"x": "y"}}
    jsonschema.validate(good, closed)
    for bad in (
        {**good, "age": 3},
        {**good, "pets": [{"kind": "cat", "age": 2}]},
        {**good, "home": {"city": "Rome", "zip": "00100"}},
    ):
        jsonschema.validate(bad, PERSON)  # the schema as written allows them
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, closed)
    assert closed["properties"]["tags"] == PERSON["properties"]["tags"]
    assert "additionalProperties" not in PERSON  # the request's own schema is not changed
    strict = Tool(**{**WEATHER, "function": {**WEATHER["function"], "strict": True}})
    assert strict.schema()["additionalProperties"] is False


EITHER = {  # keys declared in branches: closing the object itself would refuse them all
    "type": "object",
    "anyOf": [
        {"properties": {"city": {"type": "string"}}, "required": ["city"]},
        {"properties": {"zip": {"type": "integer"}}, "required": ["zip"]},
    ],
}
BOTH = {
    "allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
    ]
}
ONE_OF_TWO = {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "null"}]}


def test_closing_leaves_objects_whose_keys_branches_declare_open():
    for strict in (None, True):
        tool = {"name": "w", "parameters": EITHER, "strict": strict}
        tools = [Tool(type="function", function=tool)]
        assert tool_mode(tools, "required") == "required"  # no unsatisfiable-schema error
        closed = tools[0].schema()
        jsonschema.validate({"city": "Rome"}, closed)
        jsonschema.validate({"zip": 10115}, closed)
    closed = closed_objects(BOTH)
    jsonschema.validate({"a": 1, "b": "x"}, closed)  # each allOf branch stays open
    closed = closed_objects(ONE_OF_TWO)  # a branch that stands for the whole value is closed
    jsonschema.validate({"a": 1}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": 1, "b": 2}, closed)


def test_the_parser_family_comes_from_the_flag_or_the_template():
    assert parser_family("{{ '<|python_tag|>' }}", None) == "llama3"
    assert parser_family("<tool_call>", None) == "hermes"
    assert parser_family(None, None) == "hermes"
    assert parser_family("<|python_tag|>", "qwen25") == "hermes"
    assert parser_family("{{ '[TOOL_CALLS]' + calls }}", None) == "mistral"
    assert parser_family(None, "mistral") == "mistral"


# -- what reaches the template ----------------------------------------------------------------
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1+1?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "2", "tool_call_id": "call_1"},
]


def test_a_template_that_renders_tools_gets_them_and_objects_of_arguments():
    messages, tools = template_messages(HISTORY, ToolPlan("auto", TOOLS), "{{ tools }}")
    assert tools == [WEATHER, ADD]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    _, tools = template_messages(HISTORY, ToolPlan("none"), "{{ tools }}")
    assert tools is None


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_as_text():
    messages, tools = template_messages(HISTORY, ToolPlan("auto", TOOLS), "{{ messages }}")
    assert tools is None
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n") and json.dumps(WEATHER) in system
    assert messages[2]["content"] == block("add", {"a": 1})
    assert "tool_calls" not in messages[2]
    no_system, _ = template_messages(HISTORY[1:], ToolPlan("auto", TOOLS), "x")
    assert no_system[0]["role"] == "system" and "<tool_call>" in no_system[0]["content"]
