"""Structural tags (SGLang's `structural_tag`): free text in which every tagged part follows
its schema. What a request may give (a 400 naming the field otherwise), the grammar the
llguidance backend builds on the committed tiny tokenizer, and the Engine on the tiny
random-weight model, which a bias pushes to write the trigger: every part it then writes
validates because the masks made it so."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from radixserve import Engine
from radixserve.constrained.base import Constraint, GrammarError, unpack_bitmask
from radixserve.constrained.llguidance_backend import LLGuidanceBackend
from radixserve.core.sampling_params import SamplingParams, SamplingParamsError, ThinkBlock
from radixserve.core.structural_tag import MAX_STRUCTURES
from tests.conftest import FP32, TINY_SHAPE, TINY_TOKENIZER, build_tiny_model

VOCAB = TINY_SHAPE["vocab_size"]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
DIGIT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"],
    "additionalProperties": False,
}


def call(name: str, schema: dict | None = None) -> dict:
    structure = {"begin": f'<tool_call>{{"name": "{name}", "arguments": ', "end": "}</tool_call>"}
    return structure if schema is None else {**structure, "schema": schema}


TOOLS_TAG = {
    "type": "structural_tag",
    "triggers": ["<tool_call>"],
    "structures": [call("get_weather", WEATHER), call("anything")],
}


@pytest.fixture(scope="module")
def backend() -> LLGuidanceBackend:
    return LLGuidanceBackend(AutoTokenizer.from_pretrained(TINY_TOKENIZER), VOCAB)


def tagged(tag: dict) -> Constraint:
    constraint = Constraint.of(SamplingParams.from_dict({"structural_tag": tag}))
    assert constraint is not None and constraint.kind == "structural_tag"
    return constraint


def follows(backend: LLGuidanceBackend, constraint: Constraint, text: str) -> bool:
    """The whole text is one the grammar allows, and may end there."""
    matcher = backend.matcher(constraint)
    tokens = backend.tokenize_bytes(text.encode())
    return matcher.accept(tokens) and matcher.is_accepting


WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}'


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("Any text at all, {even} JSON-ish [1, 2] without the trigger.", True),
        (f"Let me look. {WEATHER_CALL}</tool_call> Done.", True),
        (
            f'{WEATHER_CALL}</tool_call>\n<tool_call>{{"name": "anything", "arguments": [1]}}'
            "</tool_call>",
            True,
        ),
        (f"{WEATHER_CALL}</tool_call>", True),
        # the trigger commits the text to a structure
        ("<tool_call> and then some prose", False),
        ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', False),
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}'
            "</tool_call>",
            False,
        ),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', False),
        (WEATHER_CALL, False),  # its end is missing
    ],
)
def test_tagged_parts_follow_their_schemas_and_the_rest_is_free(backend, text, valid):
    assert follows(backend, tagged(TOOLS_TAG), text) == valid


def test_after_the_trigger_the_grammar_forces_what_the_structures_share(backend):
    matcher = backend.matcher(tagged(TOOLS_TAG))
    assert matcher.forced_bytes() == b""  # free text: anything may come
    assert matcher.accept(backend.tokenize_bytes(b"Sure. <tool_call>"))
    assert matcher.forced_bytes() == b'{"name": "'  # jump-forward appends it
    assert matcher.accept(
        backend.tokenize_bytes(b'{"name": "get_weather", "arguments": {"city": "Oslo"')
    )
    assert matcher.forced_bytes() == b', "days": '  # written as json_schema writes JSON
    assert matcher.accept(backend.tokenize_bytes(b', "days": 12}'))  # more digits may come
    assert matcher.forced_bytes() == b"}</tool_call>"


def test_a_trigger_inside_another_starts_the_structures_of_both(backend):
    """Triggers "<f" and "<fn=": writing "<fn=" writes "<f" first, so every structure
    either begins is one "<f" may go on to."""
    tag = {
        "triggers": ["<fn=", "<f"],
        "structures": [
            {"begin": "<fn=a>", "schema": DIGIT, "end": "</fn>"},
            {"begin": "<flag>", "schema": {"enum": [True]}, "end": ""},
        ],
    }
    constraint = tagged(tag)
    assert follows(backend, constraint, 'x <fn=a>{"x": 4}</fn> y <flag>true z')
    assert not follows(backend, constraint, "x <fn=b>")
    assert not follows(backend, constraint, "x <f y")


def test_a_format_that_may_begin_empty_keeps_the_reasoning_free(backend):
    """An optional prefix before triggered_tags: the tags' text may still begin the output,
    so a trigger inside the reasoning block stays reasoning there too."""
    calls = {
        "type": "triggered_tags",
        "triggers": ["<tool_call>"],
        "tags": [tag("<tool_call>", JSON_DIGIT, "</tool_call>")],
    }
    note = {"type": "optional", "content": {"type": "const_string", "value": "Note:"}}
    tree = {"type": "sequence", "elements": [note, calls]}
    think = ThinkBlock("<think>", "</think>", inside=False)
    constraint = dataclasses.replace(fmt(tree), think=think)
    text = '<think>Maybe <tool_call> it.</think>\n\nSure. <tool_call>{"x": 1}</tool_call>'
    assert follows(backend, constraint, text)


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        (f"<think>Maybe <tool_call> it.</think>\n\nSure. {WEATHER_CALL}</tool_call>", True),
        (f"Sure. {WEATHER_CALL}</tool_call>", True),  # the block is optional
        ("<think>hm</think> <tool_call> prose", False),  # after the block, the tag holds
        ("<tool_call> prose", False),
    ],
)
def test_a_structural_tag_after_a_block_of_reasoning(backend, text, valid):
    """The reasoning is free, triggers and all (the lazy lexemes of the tag's free text do
    not end the block: that text cannot start with the block's opening)."""
    think = ThinkBlock("<think>", "</think>", inside=False)
    constraint = dataclasses.replace(tagged(TOOLS_TAG), think=think)
    assert follows(backend, constraint, text) == valid


def test_a_trigger_that_is_a_special_token_is_that_token():
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    special = LLGuidanceBackend(tokenizer, VOCAB + 1)
    tag = {
        "triggers": ["<|python_tag|>"],
        "structures": [{"begin": '<|python_tag|>{"x": ', "schema": DIGIT, "end": "}"}],
    }
    matcher = special.matcher(tagged(tag))
    bitmask = torch.full((1, (VOCAB + 1 + 31) // 32), -1, dtype=torch.int32)
    special.fill_masks([matcher], bitmask)
    assert unpack_bitmask(bitmask, VOCAB + 1)[0][VOCAB]  # the token is offered in free text
    assert matcher.accept([*special.tokenize_bytes(b"Call: "), VOCAB])
    assert matcher.forced_bytes() == b'{"x": {"x": '
    assert matcher.accept(special.tokenize_bytes(b'{"x": {"x": 7}} ok'))
    assert matcher.is_accepting


@pytest.mark.parametrize(
    ("tag", "words"),
    [
        ("{not json", "not JSON"),
        ([1, 2], "must be a JSON object"),
        ({"structures": [call("f")]}, "triggers must be a non-empty array"),
        ({"triggers": ["<tool_call>"], "structures": []}, "structures must be a non-empty"),
        ({"triggers": [""], "structures": [call("f")]}, "non-empty strings"),
        ({"triggers": ["<fn"], "structures": [call("f")]}, "does not start with any trigger"),
        ({"triggers": ["<"], "structures": [{"begin": "<a"}]}, "needs begin and end strings"),
        (
            {"triggers": ["<"], "structures": [{"begin": "<", "end": "", "schema": [1]}]},
            r"structures\[0\].schema must be a JSON schema object",
        ),
        ({**TOOLS_TAG, "type": "json_schema"}, "type must be structural_tag"),
        ({**TOOLS_TAG, "extra": 1}, "unknown key"),
        ({"format": {"type": "any_text"}, "triggers": ["<"]}, "either format or structures"),
        ({"format": [1]}, "format must be a format object"),
        (
            {"triggers": ["<"], "structures": [{"begin": "<", "end": ""}] * (MAX_STRUCTURES + 1)},
            f"at most {MAX_STRUCTURES} structures",
        ),
    ],
)
def test_a_malformed_structural_tag_is_refused_naming_what_is_wrong(tag, words):
    spec = tag if isinstance(tag, str) else json.dumps(tag)
    with pytest.raises(SamplingParamsError, match=words) as caught:
        SamplingParams.from_dict({"structural_tag": spec})
    assert caught.value.field == "structural_tag"
    assert str(caught.value).startswith("invalid structural_tag: ")


def test_any_text_may_be_a_trigger_begin_or_end(backend):
    """Quotes, backslashes, newlines, DEL, non-ASCII: written into the grammar as Lark
    strings (JSON's escapes), each is matched as the text it is."""
    text = 'a"b\\c\n\x7f\u00e9\U0001f600'
    tag = {"triggers": [f"<{text}"], "structures": [{"begin": f"<{text}:", "end": text}]}
    assert follows(backend, tagged(tag), f"x <{text}:[1]{text} y")
    assert not follows(backend, tagged(tag), f"x <{text}[1]")


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"$ref": "#"}, r"structures\[1\]\.schema: no text satisfies it"),
        ({"x-guidance": 5}, r"structures\[1\]\.schema: x-guidance must be an object"),
        ({"type": "nonsense"}, r"structures\[1\]\.schema: .*nonsense"),
    ],
)
def test_a_structure_whose_schema_cannot_be_followed_is_refused(backend, schema, words):
    """As the json_schema constraint is: up front, naming the structure (such a part would
    abort its request once the model began it)."""
    structures = [call("f", DIGIT), {**call("g"), "schema": schema}]
    tag = {"triggers": ["<tool_call>"], "structures": structures}
    with pytest.raises(GrammarError, match="^invalid structural_tag: " + words) as refused:
        backend.matcher(tagged(tag))
    assert refused.value.param == "structural_tag"


def test_a_trigger_that_begins_as_the_reasoning_opening_is_refused_after_reasoning(backend):
    """Its lazy lexeme would end the text at "<" before "<think>" could open the block."""
    think = ThinkBlock("<think>", "</think>", inside=False)
    for trigger in ("<", "<think>"):
        tag = {"triggers": [trigger], "structures": [{"begin": f"{trigger}x", "end": ""}]}
        constraint = dataclasses.replace(tagged(tag), think=think)
        with pytest.raises(GrammarError, match="begins as the reasoning block's opening"):
            backend.matcher(constraint)
    inside = dataclasses.replace(think, inside=True)  # the block is open: nothing to tell
    tag = {"triggers": ["<"], "structures": [{"begin": "<x", "end": ""}]}
    assert follows(backend, dataclasses.replace(tagged(tag), think=inside), "hm</think>a <x0")


def test_the_params_take_the_tag_as_an_object_too():
    built = SamplingParams(structural_tag=TOOLS_TAG)
    assert json.loads(built.structural_tag) == TOOLS_TAG
    assert (
        built.structural_tag
        == SamplingParams.from_dict({"structural_tag": TOOLS_TAG}).structural_tag
    )


def test_one_constraint_per_request(backend):
    with pytest.raises(SamplingParamsError, match="at most one of") as caught:
        SamplingParams.from_dict({"structural_tag": TOOLS_TAG, "regex": "a"})
    assert caught.value.field == "structural_tag"
    bad_schema = {
        "triggers": ["<"],
        "structures": [
            {
                "begin": "<",
                "end": "",
                "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
            }
        ],
    }
    words = r"^invalid structural_tag: structures\[0\].schema: .*nonsense"
    with pytest.raises(GrammarError, match=words) as refused:
        backend.matcher(tagged(bad_schema))
    assert refused.value.param == "structural_tag"


def test_the_engine_writes_only_valid_parts_where_a_bias_pushes_the_trigger(tmp_path):
    """A bias makes the random model write "<" (one token here) whenever it may: after
    each part's end the next part begins, so the output is many parts, each chosen and
    filled by the model, and each one valid."""
    tag = {
        "triggers": ["<"],
        "structures": [
            {"begin": "<digit>", "schema": DIGIT, "end": "</>"},
            {"begin": "<weather>", "schema": WEATHER, "end": "</>"},
        ],
    }
    lt = AutoTokenizer.from_pretrained(TINY_TOKENIZER).convert_tokens_to_ids("<")
    folder = build_tiny_model(tmp_path / "model", "llama")
    params = {
        "temperature": 1.0,
        "max_new_tokens": 120,
        "logit_bias": {str(lt): 30.0},
        "structural_tag": tag,
    }
    with Engine(str(folder), progress=False, max_total_tokens=4096, dtype=FP32) as e:
        outs = [
            e.generate(input_ids=[5, 6, 7], sampling_params={**params, "sampling_seed": s})
            for s in range(4)
        ]
    schemas = {"digit": DIGIT, "weather": WEATHER}
    kinds = set()
    for out in outs:
        text = out["text"]
        parts = re.findall(r"<(digit|weather)>(.*?)</>", text)
        assert len(parts) >= 2, text
        for kind, body in parts:
            jsonschema.validate(json.loads(body), schemas[kind])
            kinds.add(kind)
        # every "<" began a part: outside them, one may only start the part max_new_tokens cut
        rest = re.sub(r"<(digit|weather)>.*?</>", "", text)
        if "<" in rest:
            assert out["meta_info"]["finish_reason"]["type"] == "length", text
            assert text.endswith(rest[rest.index("<") :]), text
    assert kinds == {"digit", "weather"}  # the model chose between the structures


def nested(depth: int) -> dict:
    tree: dict = JSON_DIGIT
    for _ in range(depth):
        tree = {"type": "optional", "content": tree}
    return tree


# -- xgrammar's format trees (`{"type": "structural_tag", "format": {...}}`) ------------------
def fmt(tree: dict) -> Constraint:
    return tagged({"type": "structural_tag", "format": tree})


def tag(begin: str, content: dict, end) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


ANY_TEXT = {"type": "any_text"}
JSON_DIGIT = {"type": "json_schema", "json_schema": DIGIT}
CALLS = {
    "type": "triggered_tags",
    "triggers": ["<call="],
    "tags": [tag("<call=d>", JSON_DIGIT, "</call>"), tag("<call=t>", ANY_TEXT, "</call>")],
}
FORMATS = {
    "think-then-json": {
        "type": "sequence",
        "elements": [
            tag("<think>", ANY_TEXT, "</think>"),
            {"type": "const_string", "value": "\n"},
            JSON_DIGIT,
        ],
    },
    "calls": CALLS,
    "calls-first": {**CALLS, "at_least_one": True},
    "one-call": {**CALLS, "stop_after_first": True},
    "no-xml-text": {**CALLS, "excludes": ["<xml"]},
    "choices": {
        "type": "sequence",
        "elements": [
            {
                "type": "or",
                "elements": [
                    {"type": "const_string", "value": "yes"},
                    {"type": "const_string", "value": "no"},
                ],
            },
            {"type": "optional", "content": {"type": "const_string", "value": "!"}},
            {
                "type": "repeat",
                "min": 2,
                "max": 3,
                "content": {"type": "regex", "pattern": "[0-9]"},
            },
            {"type": "plus", "content": {"type": "const_string", "value": "."}},
        ],
    },  # fmt: skip
    "list": {
        "type": "tags_with_separator",
        "tags": [tag("<n>", JSON_DIGIT, "</n>")],
        "separator": ",",
        "at_least_one": True,
    },
    "ebnf": {"type": "grammar", "grammar": 'root ::= "a" [0-9]+ "/" "b"'},
    "ends": tag("[", {"type": "regex", "pattern": "[a-z]+"}, ["]", ")"]),
    "slashes": {"type": "regex", "pattern": "a\\/b/c"},  # "\/" and "/" both a slash
    "clean-tail": {
        "type": "sequence",
        "elements": [{"type": "const_string", "value": "x"}, {**ANY_TEXT, "excludes": ["bad"]}],
    },
    "open-end": tag("<a>", ANY_TEXT, ["", "</a>"]),  # to </a>, or to the end of the output
    "none": {"type": "repeat", "min": 0, "max": 0, "content": JSON_DIGIT},
}


@pytest.mark.parametrize(
    ("name", "text", "valid"),
    [
        ("think-then-json", '<think>free <b> text</think>\n{"x": 3}', True),
        ("think-then-json", '<think>free</think>{"x": 3}', False),
        ("think-then-json", '<think>free</think>\n{"x": 13}', False),
        ("calls", 'Hi <call=d>{"x": 1}</call> then <call=t>any <text></call> bye', True),
        ("calls", "Hi <call=q>", False),
        ("calls-first", '<call=d>{"x": 1}</call> then text', True),
        ("calls-first", 'Hi <call=d>{"x": 1}</call>', False),
        ("one-call", "Hi <call=t>x</call>", True),
        ("one-call", "Only text", True),
        ("one-call", "Hi <call=t>x</call> and more", False),
        ("no-xml-text", "free text", True),
        ("no-xml-text", "free <xml> text", False),
        ("choices", "yes!12.", True),
        ("choices", "no123...", True),
        ("choices", "no1.", False),
        ("choices", "maybe12.", False),
        ("list", '<n>{"x": 1}</n>,<n>{"x": 2}</n>', True),
        ("list", "", False),
        ("list", '<n>{"x": 1}</n><n>{"x": 2}</n>', False),
        ("ebnf", "a123/b", True),
        ("ebnf", "a/b", False),
        ("ends", "[abc]", True),
        ("ends", "[abc)", True),
        ("ends", "[abc}", False),
        ("slashes", "a/b/c", True),
        ("slashes", "a", False),
        ("clean-tail", "x all good", True),
        ("clean-tail", "x not bad", False),
        ("open-end", "<a>text</a>", True),
        ("open-end", "<a>text to the end", True),
        ("open-end", "<a>text</a>more", False),
    ],
)
def test_a_format_tree_is_the_grammar_it_describes(backend, name, text, valid):
    assert follows(backend, fmt(FORMATS[name]), text) == valid, FORMATS[name]


@pytest.mark.parametrize(
    ("tree", "words"),
    [
        ({"type": "token", "token": "<|x|>"}, r"format\.type 'token' is not supported"),
        ({**JSON_DIGIT, "style": "qwen_xml"}, r"format\.style 'qwen_xml' is not supported"),
        (
            {"type": "sequence", "elements": [ANY_TEXT, JSON_DIGIT]},
            r"format\.elements\[0\]: any_text is supported as a tag's content or at the end",
        ),
        (
            {
                "type": "sequence",
                "elements": [JSON_DIGIT, {**JSON_DIGIT, "json_schema": {"$ref": "#"}}],
            },
            r"format\.elements\[1\]\.json_schema: no text satisfies it",
        ),
        ({**CALLS, "tags": [tag("<fn>", ANY_TEXT, "</fn>")]}, r"does not start with any trigger"),
        ({"type": "repeat", "min": 3, "max": 2, "content": JSON_DIGIT}, r"format: min and max"),
        ({**ANY_TEXT, "max_tokens": 8}, r"format\.max_tokens is not supported"),
        ({"type": "const_string", "value": ""}, "matches the empty text only"),
        (FORMATS["none"], "matches the empty text only"),
        ({"type": "regex", "pattern": "a\\"}, r"format\.pattern ends in a lone backslash"),
        (nested(70), "nest more than 64 deep"),
        (
            {"type": "sequence", "elements": [tag("<a>", ANY_TEXT, ""), JSON_DIGIT]},
            r"format\.elements\[0\]\.end: an empty end cannot end any_text here",
        ),
    ],
)
def test_a_format_the_grammar_cannot_follow_is_refused_naming_the_node(backend, tree, words):
    with pytest.raises(GrammarError, match="^invalid structural_tag: .*" + words) as refused:
        backend.matcher(fmt(tree))
    assert refused.value.param == "structural_tag"


def test_a_regex_cannot_write_grammar_outside_itself(backend):
    """Its slashes are escaped, unless escaped already: `a\\/ | "evil" #` is the regex of
    `a/ ` or ` "evil" #`, not a regex `a\\` then a Lark alternative "evil"."""
    constraint = fmt({"type": "regex", "pattern": 'a\\/ | "evil" #'})
    assert not follows(backend, constraint, "evil")
    assert follows(backend, constraint, "a/ ") and follows(backend, constraint, ' "evil" #')


def test_the_engine_follows_a_format_tree(tmp_path):
    """Free text up to "]" (a tag's any_text: it ends at the tag's end), then a JSON
    document: the random model, pushed to close the bracket, writes both as the tree says
    (the document made valid by the masks)."""
    folder = build_tiny_model(tmp_path / "model", "llama")
    tree = {"type": "sequence", "elements": [tag("[", ANY_TEXT, "]"), JSON_DIGIT]}
    close = AutoTokenizer.from_pretrained(TINY_TOKENIZER).convert_tokens_to_ids("]")
    params = {"temperature": 1.0, "max_new_tokens": 40, "logit_bias": {str(close): 4.0}}
    params["structural_tag"] = {"type": "structural_tag", "format": tree}
    with Engine(str(folder), progress=False, max_total_tokens=4096, dtype=FP32) as e:
        outs = [
            e.generate(input_ids=[5, 6, 7], sampling_params={**params, "sampling_seed": s})
            for s in range(4)
        ]
    texts = [o["text"] for o in outs]
    done = [o["text"] for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert done, texts
    for text in done:
        inside, _, answer = text.removeprefix("[").partition("]")
        assert text.startswith("[") and inside, text  # some free text first
        jsonschema.validate(json.loads(answer), DIGIT)
