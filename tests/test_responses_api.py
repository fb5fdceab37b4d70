"""The Responses API's parts without a server: input items into chat messages, flat tools
and tool_choice into the chat route's, the output builder (a stream of any cuts builds the
same items as the whole text, with events in the order OpenAI's client checks), and the
store of chained responses."""

from __future__ import annotations

import codecs
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.server import responses_api as rapi
from radixserve.server.checks import constraint_error
from radixserve.server.conversations import Conversation, ConversationStore
from radixserve.server.errors import APIError
from radixserve.server.reasoning import reasoning_plan
from radixserve.server.tool_calls import Tool, ToolPlan

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


# -- input ----------------------------------------------------------------------------------
def test_a_string_is_one_user_message():
    (item,) = rapi.input_items("hello")
    assert item["type"] == "message" and item["role"] == "user"
    assert item["content"] == [{"type": "input_text", "text": "hello"}]
    assert item["id"].startswith("msg_") and item["status"] == "completed"
    assert rapi.chat_messages([item]) == [{"role": "user", "content": "hello"}]


def test_function_calls_join_their_assistant_turn_and_outputs_are_tool_messages():
    items = rapi.input_items(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "message", "role": "assistant", "content": "Let me look.", "id": "m1"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"},
        ]
    )
    messages = rapi.chat_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] == "Let me look."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert messages[3]["content"] is None and messages[3]["tool_calls"][0]["id"] == "c3"
    assert items[1]["id"] == "m1"  # given ids are kept
    assert items[1]["content"][0]["type"] == "output_text"  # an assistant's text is output


def test_every_item_gets_an_id_and_an_item_twice_is_a_400():
    items = rapi.input_items(
        [
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
        ]
    )
    assert [i["id"][:3] for i in items] == ["rs_", "fc_", "fco"]
    rapi.check_unique_ids(items)
    with pytest.raises(APIError) as e:
        rapi.check_unique_ids(items + items[1:2])
    assert e.value.status == 400 and items[1]["id"] in e.value.message


def test_an_output_item_sent_back_as_input_is_read():
    """Clients append a response's output to their next input, with every field."""
    output = {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "phase": None,
        "content": [{"type": "output_text", "text": "Paris.", "annotations": [], "logprobs": []}],
    }
    (item,) = rapi.input_items([output])
    assert rapi.chat_messages([item]) == [{"role": "assistant", "content": "Paris."}]


@pytest.mark.parametrize(
    "given, param",
    [
        (
            [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            "input[0].content[0]",
        ),
        ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_file"}],
                }
            ],
            "input[0].content[1]",
        ),
        (
            [{"role": "user", "content": [{"type": ["input_text"], "text": "hi"}]}],
            "input[0].content[0]",
        ),
        ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text"),
        (
            [
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": {}, "text": "x"}],
                }
            ],
            "input[0].output[0]",
        ),
        ([{"role": "robot", "content": "hi"}], "input[0].role"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
        (
            [
                {"role": "user", "content": "a"},
                {"type": "function_call_output", "call_id": "c", "output": 3},
            ],
            "input[1].output",
        ),
    ],
)
def test_items_this_engine_cannot_serve_are_a_400_naming_them(given, param):
    with pytest.raises(APIError) as e:
        rapi.input_items(given)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.message.startswith(param)


# -- tools ----------------------------------------------------------------------------------
def test_flat_tools_become_chat_tools_and_are_echoed_flat():
    (tool,) = rapi.chat_tools([WEATHER])
    assert tool == {
        "type": "function",
        "function": {k: v for k, v in WEATHER.items() if k != "type"},
    }
    Tool.model_validate(tool)  # the chat route's own model takes it
    (echo,) = rapi.flat_tools([tool])
    assert echo["name"] == "get_weather" and echo["strict"] is None and echo["type"] == "function"


def test_hosted_tools_and_bad_function_tools_are_a_400():
    with pytest.raises(APIError) as e:
        rapi.chat_tools([WEATHER, {"type": "web_search"}])
    assert e.value.param == "tools[1].type"
    with pytest.raises(APIError) as e:
        rapi.chat_tools([{**WEATHER, "name": "has spaces"}])
    assert e.value.param == "tools[0].name"


def test_tool_choice_by_name_and_allowed_tools():
    tools = rapi.chat_tools([WEATHER, {**WEATHER, "name": "get_time"}])
    choice, allowed = rapi.chat_tool_choice({"type": "function", "name": "get_time"}, tools)
    assert choice == {"type": "function", "function": {"name": "get_time"}} and allowed == tools
    subset = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_time"}],
    }
    choice, allowed = rapi.chat_tool_choice(subset, tools)
    assert choice == "required" and [t["function"]["name"] for t in allowed] == ["get_time"]
    for bad in (
        {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]},
        {
            "type": "allowed_tools",
            "mode": "none",
            "tools": [{"type": "function", "name": "get_time"}],
        },
        {"type": "file_search"},
    ):
        with pytest.raises(APIError) as e:
            rapi.chat_tool_choice(bad, tools)
        assert e.value.param == "tool_choice"


# -- output ---------------------------------------------------------------------------------
THINKING = reasoning_plan("qwen3", True, True, prompt="<|im_start|>assistant\n")
CALLS = ToolPlan("auto", tuple(Tool.model_validate(t) for t in rapi.chat_tools([WEATHER])))
TEXTS = [
    "<think>\nThe user wants weather.\n</think>\n\nLet me check.<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<think>short</think>Just an answer, no call.",
    'No reasoning at all; <tool_call>\n{"name": "nope"}\n</tool_call> is not a call.',
    "<think>cut short by max_output_tokens",
    '<think>x</think>Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    '\n</tool_call>\nand then <tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    "\n\ndone.",
]
META = {"output_token_logprobs": []}
NAMED = ToolPlan("named", CALLS.tools, "get_weather")
NO_TOOLS = ToolPlan("none")
LLAMA3 = ToolPlan("auto", CALLS.tools, family="llama3")
# (the plans an output is read with, texts of that kind)
PLANS = {
    "hermes": ((THINKING, CALLS), TEXTS),
    "named": (
        (THINKING, NAMED),
        ['<think>\nplan it\n</think>\n\n{"city": "Paris"}', '<think>x</think>{"city": "Rome"}'],
    ),
    "llama3": (
        (None, LLAMA3),
        [
            '<|python_tag|> {"name": "get_weather", "parameters": {"city": "Oslo"}}',
            '{"name": "get_weather", "parameters": {}}; {"name": "get_weather", "parameters": {}}',
            "Plain text, no call.",
        ],
    ),
}


def _build(
    pieces: list[str], incomplete: bool = False, plans: tuple = (THINKING, CALLS)
) -> tuple[list[dict], list[dict]]:
    builder = rapi.OutputBuilder(*plans, None)
    events = []
    for i, piece in enumerate(pieces):
        events += builder.feed(piece, META, final=i == len(pieces) - 1)
    events += builder.close(incomplete)
    return builder.items, events


def _check_order(events: list[dict], items: list[dict]) -> None:
    """What the openai client's stream state asserts: an item is added before its parts and
    deltas, each index once, and every added item is done."""
    added, done = [], []
    for e in events:
        index = e.get("output_index")
        if e["type"] == "response.output_item.added":
            assert index == len(added) and not done[index:], e
            added.append(index)
        elif e["type"] == "response.output_item.done":
            assert index in added and index not in done
            assert e["item"] == items[index]
            done.append(index)
        else:
            assert index in added and index not in done, e
    assert added == done == list(range(len(items)))


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]


@pytest.mark.parametrize(
    "plans, text", [(plans, text) for plans, texts in PLANS.values() for text in texts]
)
@given(cuts=st.lists(st.integers(0, 200), max_size=12))
@settings(max_examples=40, deadline=None)
def test_any_stream_builds_the_items_of_the_whole_text(plans, text, cuts):
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    whole, whole_events = _build([text], plans=plans)
    streamed, events = _build(pieces, plans=plans)
    assert _without_ids(streamed) == _without_ids(whole)
    _check_order(events, streamed)
    _check_order(whole_events, whole)
    # the deltas add up to each item's text
    for index, item in enumerate(streamed):
        kinds = (
            "response.output_text.delta",
            "response.reasoning_text.delta",
            "response.function_call_arguments.delta",
        )
        deltas = "".join(
            e["delta"] for e in events if e["type"] in kinds and e["output_index"] == index
        )
        assert deltas == (
            item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        )


def test_the_items_of_each_kind_of_output():
    items, _ = _build([TEXTS[0]])
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "The user wants weather."}]
    assert items[1]["content"][0]["text"] == "Let me check."
    assert items[2]["name"] == "get_weather" and items[2]["arguments"] == '{"city": "Paris"}'
    assert items[2]["call_id"].startswith("call_") and items[2]["id"].startswith("fc_")
    assert all(i["status"] == "completed" for i in items)
    items, _ = _build([TEXTS[2]])
    assert [i["type"] for i in items] == ["message"]  # an unknown function stays text
    items, _ = _build([TEXTS[3]], incomplete=True)
    assert [(i["type"], i["status"]) for i in items] == [("reasoning", "incomplete")]


def test_text_between_calls_is_a_message_of_its_own_in_text_order():
    items, _ = _build([TEXTS[4]])
    shown = [
        (i["type"], i["content"][0]["text"] if i["type"] != "function_call" else i["arguments"])
        for i in items
    ]
    assert shown == [
        ("reasoning", "x"),
        ("message", "Sure."),
        ("function_call", '{"city": "Paris"}'),
        ("message", "and then"),
        ("function_call", "{}"),
        ("message", "done."),
    ]


TOKENS = ["<think>", "hm", "</think>", "\n\n", "Hi", " there", "!"]
CALL_TOKENS = [
    *("<think>", "hm", "</think>", "\n\n", "Let", " me", " check", ".", "<tool_call>"),
    *('\n{"name": "get_weather", ', '"arguments": {}}', "\n</tool_call>", "\n", "Done", "."),
]


def _with_logprobs(
    pieces: list[list[str | bytes]],
    tokens: list[str | bytes] = TOKENS,
    tools: ToolPlan = NO_TOOLS,
    skipped: frozenset[int] = frozenset(),
    hidden: frozenset[int] | None = None,
) -> tuple[list[dict], list[dict]]:
    """Build from the tokens (a text, or bytes that may hold part of a character; token i
    has id i), fed in the given groups, with a logprob entry for each. A token in `skipped`
    is a special token the text leaves out, as the detokenizer does (`hidden`: those the
    text leaves out, where the builder is not told)."""
    hidden = skipped if hidden is None else hidden
    raw = [t if isinstance(t, bytes) else t.encode() for t in tokens]
    entries = [
        {"token": t if isinstance(t, str) else repr(t), "logprob": -float(i)}
        | {"bytes": list(b), "top_logprobs": []}
        for i, (t, b) in enumerate(zip(tokens, raw))
    ]
    triples = [(-float(i), i, None) for i in range(len(raw))]
    builder = rapi.OutputBuilder(THINKING, tools, lambda meta, start: entries[start : meta["n"]])
    builder.skipped = skipped
    decoder = codecs.getincrementaldecoder("utf-8")()
    events, n = [], 0
    for k, group in enumerate(pieces):
        text = "".join(decoder.decode(raw[i]) for i in range(n, n + len(group)) if i not in hidden)
        n += len(group)
        meta = {"n": n, "output_token_logprobs": triples[:n]}
        events += builder.feed(text, meta, final=k == len(pieces) - 1)
    return builder.items, events + builder.close(incomplete=False)


@pytest.mark.parametrize(
    "groups", [[TOKENS], [[t] for t in TOKENS], [TOKENS[:3], TOKENS[3:5], TOKENS[5:]]]
)
def test_logprobs_are_the_message_tokens_whole_or_streamed(groups):
    items, events = _with_logprobs(groups)
    reasoning, message = items
    assert message["content"][0]["text"] == "Hi there!"
    logprobs = message["content"][0]["logprobs"]
    # the whitespace after the reasoning is in neither item's text, nor its tokens
    assert [e["token"] for e in logprobs] == ["Hi", " there", "!"]
    streamed = [
        lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]
    ]
    assert streamed == logprobs  # the deltas carry them all, once
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == logprobs


@pytest.mark.parametrize(
    "groups",
    [
        [CALL_TOKENS],
        [[t] for t in CALL_TOKENS],
        [CALL_TOKENS[:5], CALL_TOKENS[5:10], CALL_TOKENS[10:]],
    ],
)
def test_logprobs_around_calls_are_each_message_own_tokens(groups):
    items, events = _with_logprobs(groups, CALL_TOKENS, CALLS)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "message"]
    tokens = [
        [e["token"] for e in i["content"][0]["logprobs"]] for i in items if i["type"] == "message"
    ]
    assert tokens == [["Let", " me", " check", "."], ["Done", "."]]
    for index, item in enumerate(items):
        if item["type"] != "message":
            continue
        streamed = [
            lp
            for e in events
            if e["type"] == "response.output_text.delta" and e["output_index"] == index
            for lp in e["logprobs"]
        ]
        assert streamed == item["content"][0]["logprobs"]


SPLIT = [b"<think>", b"hm", b"</think>", b"Caf", b"\xc3", b"\xa9", b" \xe6", b"\x97", b"\xa5", b"!"]
EOS = len(SPLIT)  # its id: a special token, its bytes not in the text


@pytest.mark.parametrize("tools", [NO_TOOLS, CALLS], ids=["no tools", "tools"])
@pytest.mark.parametrize("grouping", ["whole", "tokens"])
def test_tokens_of_split_characters_and_special_tokens(tools, grouping):
    """Each token holding part of a character is the message's; a special token the text
    leaves out is no message's, wherever it comes."""
    tokens = [*SPLIT, b"<|im_end|>"]
    groups = [tokens] if grouping == "whole" else [[t] for t in tokens]
    items, events = _with_logprobs(groups, tokens, tools, skipped=frozenset({EOS}))
    reasoning, message = items
    assert message["content"][0]["text"] == "Café 日!"
    owned = [e["token"] for e in message["content"][0]["logprobs"]]
    assert owned == [repr(t) for t in SPLIT[3:]]
    # without knowing it is special, its bytes (past the text's end) still are no message's
    items, _ = _with_logprobs(groups, tokens, tools, hidden=frozenset({EOS}))
    assert len(items[1]["content"][0]["logprobs"]) == len(SPLIT) - 3


def test_items_are_added_without_their_parts():
    """The client's stream helper appends each content_part.added to its item."""
    _, events = _build([TEXTS[1]])
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["type"], i["content"]) for i in added] == [("reasoning", []), ("message", [])]


def test_a_refused_grammar_is_named_by_the_field_it_came_from():
    refused = APIError(400, "invalid json_schema: no text satisfies it", param="json_schema")
    for field in ("tools", "text.format"):
        named = constraint_error(refused, field)
        assert named.param == field and named.message == f"invalid {field}: no text satisfies it"
    assert constraint_error(refused, None) is refused  # SGLang's own json_schema field
    other = APIError(400, "max_tokens is too large", param="max_tokens")
    assert constraint_error(other, "tools") is other


# -- the store ------------------------------------------------------------------------------
def _stored(rid: str, previous: str | None, text: str, status: str = "completed") -> rapi.Stored:
    output = [
        {
            "type": "message",
            "id": f"out-{rid}",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text}],
        }
    ]
    response = {"id": rid, "status": status, "output": output}
    return rapi.Stored(response, rapi.input_items(f"question {rid}"), previous)


def test_a_chain_of_responses_is_the_conversation():
    store = rapi.ResponseStore(capacity=3)
    store.put(_stored("a", None, "A"))
    store.put(_stored("b", "a", "B"))
    context = store.context("b")
    texts = [m["content"] for m in rapi.chat_messages(context)]
    assert texts == ["question a", "A", "question b", "B"]


def test_the_least_recently_used_goes_and_a_broken_chain_is_a_404():
    store = rapi.ResponseStore(capacity=2)
    store.put(_stored("a", None, "A"))
    store.put(_stored("b", "a", "B"))
    store.get("a")  # used: b is now the oldest
    store.put(_stored("c", None, "C"))
    with pytest.raises(APIError) as e:
        store.get("b")
    assert e.value.status == 404
    store.put(_stored("d", "c", "D"))  # a goes
    store.put(_stored("e", "d", "E"))  # c goes: e's chain is broken
    with pytest.raises(APIError) as e:
        store.context("e")
    assert (
        e.value.status == 404 and "'c'" in e.value.message and "no longer stored" in e.value.message
    )


def test_an_unfinished_response_cannot_be_continued_and_none_are_kept_at_capacity_0():
    store = rapi.ResponseStore(capacity=4)
    store.put(_stored("a", None, "", status="in_progress"))
    with pytest.raises(APIError) as e:
        store.context("a")
    assert e.value.status == 400 and e.value.param == "previous_response_id"
    empty = rapi.ResponseStore(capacity=0)
    empty.put(_stored("a", None, "A"))
    with pytest.raises(APIError):
        empty.get("a")


def test_stored_bytes_are_bounded_but_a_running_response_stays():
    store = rapi.ResponseStore(capacity=100, max_bytes=2500)
    running = _stored("run", None, "x" * 1500)
    running.task = object()  # a background task, still running
    store.put(running)
    store.put(_stored("a", None, "A"))
    store.put(_stored("b", None, "y" * 600))  # past the bound: the oldest idle one goes
    assert list(store.entries) == ["run", "b"] and store.bytes > 2500  # none else can go
    running.task = None
    store.refresh(running)  # finished: the most recently used now
    store.put(_stored("c", None, "z" * 600))
    assert list(store.entries)[-1] == "c" and "b" not in store.entries
    assert store.bytes <= 2500


def test_item_references_are_the_stored_items_until_their_response_goes():
    store = rapi.ResponseStore(capacity=2)
    store.put(_stored("a", None, "A"))
    question = store.get("a").inputs[0]["id"]
    given = [
        {"type": "item_reference", "id": question},
        {"type": "item_reference", "id": "out-a"},
        {"role": "user", "content": "and?"},
    ]
    resolved = store.resolve(given)
    assert [m["content"] for m in rapi.chat_messages(rapi.input_items(resolved))] == [
        "question a",
        "A",
        "and?",
    ]
    resolved[1]["content"][0]["text"] = "changed"  # a copy: the stored item stays
    assert store.get("a").response["output"][0]["content"][0]["text"] == "A"
    assert store.resolve("text") == "text" and store.resolve(given[2:]) == given[2:]
    for bad, status, param in (
        ({"type": "item_reference", "id": "nope"}, 404, "input[0].id"),
        ({"type": "item_reference"}, 400, "input[0].id"),
    ):
        with pytest.raises(APIError) as e:
            store.resolve([bad])
        assert (e.value.status, e.value.param) == (status, param)
    store.put(_stored("b", None, "B"))
    store.put(_stored("c", None, "C"))  # a goes, and its items with it
    with pytest.raises(APIError):
        store.resolve(given[1:2])
    store.delete("c")
    assert "out-c" not in store.holders and "out-b" in store.holders


def test_conversations_go_least_recently_used_first_but_not_while_a_response_runs():
    store = ConversationStore(capacity=2)
    first, second, third = (Conversation(f"c{i}", 0, {}) for i in range(3))
    store.put(first)
    first.lock("r1")  # a response runs in it
    store.put(second)
    store.put(third)  # past the bound: the oldest idle one goes
    assert list(store.entries) == ["c0", "c2"]
    store.add(first, rapi.input_items("hello"))
    assert store.sizes["c0"] > 2 and len(first.items) == 1
    with pytest.raises(APIError) as e:
        first.lock("r2")
    assert e.value.code == "conversation_locked"
    first.unlock("r2")  # not its lock: still held
    assert first.running == "r1"
    first.unlock("r1")
    store.add(second, rapi.input_items("lost"))  # gone: nothing is added
    assert second.items == []


def test_a_conversations_items_are_found_by_id_whoever_holds_them():
    store = ConversationStore(capacity=10)
    first, second = (Conversation(f"conv_{i}", 0, {}) for i in range(2))
    store.put(first)
    store.put(second)
    store.add(first, [{"id": "msg_1", "type": "message", "role": "user", "content": "A"}])
    store.add(second, [{"id": "msg_1", "type": "message", "role": "user", "content": "B"}])
    assert store.find_item("msg_1")["content"] == "B"
    store.delete(second.id)  # the id is still held by the first
    assert store.find_item("msg_1")["content"] == "A"
    first.items.clear()
    assert store.find_item("msg_1") is None and "msg_1" not in store.holders


def test_stored_responses_kept_in_a_folder_outlive_the_store(tmp_path):
    """With a folder (--file-storage-path), a stored response dropped from memory, or
    stored by a store since gone, is read back: fetched, continued (its chain), its items
    referenced; a delete removes it from disk too."""
    store = rapi.ResponseStore(capacity=1, folder=tmp_path)
    first, second = rapi.new_id("resp"), rapi.new_id("resp")
    store.put(_stored(first, None, "A"))
    store.put(_stored(second, first, "B"))  # past the capacity: the first leaves memory
    assert list(store.entries) == [second]
    texts = [m["content"] for m in rapi.chat_messages(store.context(second))]
    assert texts == [f"question {first}", "A", f"question {second}", "B"]

    again = rapi.ResponseStore(capacity=10, folder=tmp_path)
    assert again.get(second).response == store.get(second).response
    assert [m["content"] for m in rapi.chat_messages(again.context(second))] == texts
    referenced = rapi.ResponseStore(capacity=10, folder=tmp_path)  # (nothing in memory)
    given = [{"type": "item_reference", "id": f"out-{first}"}]
    (item,) = referenced.resolve(given)
    assert item["content"][0]["text"] == "A"
    question = referenced.get(second).inputs[0]["id"]
    fresh = rapi.ResponseStore(capacity=10, folder=tmp_path)
    assert fresh.resolve([{"type": "item_reference", "id": question}])[0]["id"] == question
    fresh.delete(first)
    assert not (tmp_path / f"{first}.json").exists()
    gone = rapi.ResponseStore(capacity=10, folder=tmp_path)
    for ask in (lambda: gone.get(first), lambda: gone.resolve(given), lambda: gone.context(second)):
        with pytest.raises(APIError) as e:
            ask()
        assert e.value.status == 404
    assert rapi.ResponseStore(capacity=0, folder=tmp_path / "none").files is None


def test_a_background_response_its_server_left_unfinished_reads_back_failed(tmp_path):
    """A response stored while queued (the server stopped before it ended) reads back
    failed, and stays so; a streamed background one's events read back whole and ended.
    Files past the 30 days OpenAI keeps a stored response go; a cut-off index line and a
    file that is not a response are skipped."""
    store = rapi.ResponseStore(capacity=10, folder=tmp_path)
    queued = rapi.new_id("resp")
    store.put(_stored(queued, None, "", status="queued"))
    streamed = _stored(rapi.new_id("resp"), None, "S")
    streamed.events = rapi.EventLog()
    for n in range(3):
        streamed.events.append(f'event: e\ndata: {{"sequence_number": {n}}}\n\n'.encode())
    store.put(streamed)
    old = _stored(rapi.new_id("resp"), None, "O")
    store.put(old)
    month_ago = time.time() - 31 * 24 * 3600
    os.utime(tmp_path / f"{old.response['id']}.json", (month_ago, month_ago))
    (tmp_path / f"{rapi.new_id('resp')}.json").write_text("[1, 2]")
    with (tmp_path / "items.jsonl").open("ab") as out:
        out.write(b'["msg_cut", "resp_')  # a line a kill cut off

    again = rapi.ResponseStore(capacity=10, folder=tmp_path)
    failed = again.get(queued).response
    assert failed["status"] == "failed" and "stopped" in failed["error"]["message"]
    assert rapi.ResponseStore(capacity=10, folder=tmp_path).get(queued).response == failed
    log = again.get(streamed.response["id"]).events
    assert log is not None and log.ended and log.frames == streamed.events.frames
    running = _stored(rapi.new_id("resp"), None, "", status="in_progress")
    running.events = rapi.EventLog()
    running.events.append(b'event: response.created\ndata: {"sequence_number": 0}\n\n')
    store.put(running)  # (its server killed while it ran)
    replayed = rapi.ResponseStore(capacity=10, folder=tmp_path).get(running.response["id"])
    assert replayed.events.ended and len(replayed.events.frames) == 2
    assert replayed.events.frames[-1].startswith(b"event: response.failed\n")
    assert not (tmp_path / f"{old.response['id']}.json").exists()
    with pytest.raises(APIError):
        again.get(old.response["id"])
    assert (tmp_path / "items.jsonl").read_bytes().endswith(b"\n")  # written whole again
    assert again.files.items.get(f"out-{queued}") == queued


def test_the_item_index_drops_what_is_gone_and_survives_a_cut_line(tmp_path):
    from radixserve.server.kept import ItemIndex

    path = tmp_path / "items.jsonl"
    index = ItemIndex(path, kept=lambda holder: True)
    index.add(["a", "b"], "kept")
    index.add(["c"], "gone")
    with path.open("ab") as out:
        out.write(b'["cut", "ke')  # an append a full disk cut short
    index.whole = False  # (as its failed write leaves it)
    index.add(["d"], "kept")
    again = ItemIndex(path, kept=lambda holder: holder == "kept")
    assert again.holders == {"a": "kept", "b": "kept", "d": "kept"}
    assert path.read_bytes().count(b"\n") == 3  # written again without what is gone


def test_stored_responses_on_disk_are_checked_swept_and_not_left_stale(tmp_path, monkeypatch):
    """A file whose items lack ids is not read back; a chain edited into a loop is a 404,
    not a hang; responses past 30 days are swept while the server runs; a write the disk
    refuses leaves no older copy to be read back in its place."""
    from radixserve.server import kept

    store = rapi.ResponseStore(capacity=10, folder=tmp_path)
    first, second = _stored(rapi.new_id("resp"), None, "A"), None
    store.put(first)
    second = _stored(rapi.new_id("resp"), first.response["id"], "B")
    store.put(second)
    first_path = tmp_path / f"{first.response['id']}.json"
    record = json.loads(first_path.read_text())
    record["previous"] = second.response["id"]  # a loop: first <-> second
    first_path.write_text(json.dumps(record))
    looped = rapi.ResponseStore(capacity=10, folder=tmp_path)
    with pytest.raises(APIError) as e:
        looped.context(second.response["id"])
    assert e.value.status == 404 and "continues itself" in e.value.message
    record["response"]["output"] = [{"type": "message"}]  # no id
    first_path.write_text(json.dumps(record))
    with pytest.raises(APIError):
        rapi.ResponseStore(capacity=10, folder=tmp_path).get(first.response["id"])

    month_ago = time.time() - 31 * 24 * 3600
    second_path = tmp_path / f"{second.response['id']}.json"
    os.utime(second_path, (month_ago, month_ago))
    store.files.swept_at -= 2 * kept.SWEEP_INTERVAL_S  # (as if an hour had gone by)
    third = _stored(rapi.new_id("resp"), None, "C", status="queued")
    store.put(third)
    store.files.sweeper.join()
    assert not second_path.exists()  # swept
    third_path = tmp_path / f"{third.response['id']}.json"
    assert third_path.exists()

    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kept, "write_bytes_whole", full_disk)
    third.response = third.response | {"status": "completed"}
    store.refresh(third)  # its end is not written: the queued copy goes
    assert not third_path.exists() and store.get(third.response["id"]) is third


def test_conversation_items_on_disk_are_found_by_reference(tmp_path):
    store = ConversationStore(capacity=10, folder=tmp_path)
    kept = Conversation(rapi.new_id("conv"), 1, {}, rapi.input_items("one"))
    store.put(kept)
    store.add(kept, rapi.input_items("two"))
    again = ConversationStore(capacity=10, folder=tmp_path)
    assert again.find_item(kept.items[1]["id"]) == kept.items[1]
    again.delete(kept.id)
    assert ConversationStore(capacity=10, folder=tmp_path).find_item(kept.items[0]["id"]) is None


def test_conversations_kept_in_a_folder_outlive_the_store(tmp_path):
    """With a folder (--file-storage-path), a conversation is read back by a store on the
    folder: created, its items added, its metadata changed, one item deleted; one dropped
    from memory is read back too; a line a stop cut off is dropped; a delete removes it."""
    store = ConversationStore(capacity=1, folder=tmp_path)
    kept = Conversation(rapi.new_id("conv"), 123, {"k": "v"}, rapi.input_items("one"))
    store.put(kept)
    store.add(kept, rapi.input_items("two") + rapi.input_items("three"))
    kept.metadata = {"k": "w"}
    store.put(kept)  # (what the update route does)
    kept.items.remove(kept.items[1])
    store.put(kept)
    store.add(kept, rapi.input_items("four"))
    other = Conversation(rapi.new_id("conv"), 124, {})
    store.put(other)  # past the capacity: `kept` leaves memory, stays on disk
    assert list(store.entries) == [other.id]
    assert store.get(kept.id).items == kept.items  # read back

    again = ConversationStore(capacity=10, folder=tmp_path)
    read = again.get(kept.id)
    assert read.public() == kept.public() and read.items == kept.items
    assert [i["content"][0]["text"] for i in read.items] == ["one", "three", "four"]
    with (tmp_path / f"{kept.id}.jsonl").open("ab") as out:
        out.write(b'{"id": "msg_cut", "type": "mess')  # a write a kill cut off
    assert ConversationStore(capacity=10, folder=tmp_path).get(kept.id).items == kept.items

    again.delete(kept.id)
    assert not (tmp_path / f"{kept.id}.jsonl").exists()
    with pytest.raises(APIError) as e:
        ConversationStore(capacity=10, folder=tmp_path).get(kept.id)
    assert e.value.status == 404


def test_a_conversation_file_a_write_left_short_is_written_whole_next(tmp_path, monkeypatch):
    """After a line a kill cut off, or an append the disk refused, the next change writes
    the file whole: what is read back is what was served."""
    store = ConversationStore(capacity=10, folder=tmp_path)
    conversation = Conversation(rapi.new_id("conv"), 1, {}, rapi.input_items("one"))
    store.put(conversation)
    with (tmp_path / f"{conversation.id}.jsonl").open("ab") as out:
        out.write(b'{"id": "msg_cut", "type": "mess')  # a kill mid-append
    again = ConversationStore(capacity=10, folder=tmp_path)
    read = again.get(conversation.id)
    again.add(read, rapi.input_items("two"))
    real_open = Path.open

    def full(self, mode="r", *args, **kwargs):
        if mode == "ab":
            raise OSError(28, "No space left on device")
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", full)
    again.add(read, rapi.input_items("three"))  # served from memory
    monkeypatch.setattr(Path, "open", real_open)
    again.add(read, rapi.input_items("four"))
    back = ConversationStore(capacity=10, folder=tmp_path).get(conversation.id)
    assert [i["content"][0]["text"] for i in back.items] == ["one", "two", "three", "four"]
