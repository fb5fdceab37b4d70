"""The Responses API end to end on SmolLM2, with the official `openai` client: a response is
the chat completion of the same conversation (greedy, token for token); a stream builds the
same output with events in the order the client's stream helper checks; stored responses
chain (previous_response_id), list their input items, run in the background (streamed too,
their events read again from any point), cancel and delete; function calls go round trip;
structured output parses; bad requests are 400s that name the Responses field; and no KV is
left held."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel

from tests.server_utils import ServerProcess, assert_kv_clean

pytestmark = pytest.mark.smollm2

TIMEOUT = 180
CONTEXT = 2048  # --max-total-tokens: the longest prompt + output (truncation is tested on it)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}
GREEDY = {"model": "m", "temperature": 0, "max_output_tokens": 24}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("responses") / "server.log"
    proc = ServerProcess("--max-total-tokens", str(CONTEXT), log=log)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int = 24) -> str:
    r = client.chat.completions.create(
        model="m", messages=messages, temperature=0, max_tokens=max_tokens
    )
    return r.choices[0].message.content


def test_a_response_is_the_chat_completion_of_its_conversation(client):
    r = client.responses.create(
        input="What is the capital of France?", instructions="Be brief.", **GREEDY
    )
    assert r.status == "completed" and r.id.startswith("resp_") and r.object == "response"
    (message,) = r.output
    assert (
        message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    chat = client.chat.completions.create(
        model="m", messages=messages, temperature=0, max_tokens=24
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the request's settings are echoed, defaults resolved
    assert r.temperature == 0 and r.top_p == 1.0 and r.instructions == "Be brief."
    assert r.tools == [] and r.tool_choice == "auto" and r.store is True


def test_a_stream_builds_the_same_output_in_order(client):
    whole = client.responses.create(input="Name three colors.", **GREEDY)
    events = list(client.responses.create(input="Name three colors.", stream=True, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        whole.status == "completed" and "response.completed" or "response.incomplete",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id
    assert final.output[0].id == events[2].item.id  # the streamed item is the final one
    # the client's own stream helper accepts the events
    with client.responses.stream(input="Name three colors.", **GREEDY) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert len(final.output) == 1 and len(final.output[0].content) == 1  # each part once


def test_a_raw_stream_names_each_event_and_sends_no_done_marker(server):
    body = {"model": "m", "input": "Hi", "stream": True, "max_output_tokens": 4}
    with requests.post(server.url + "/v1/responses", json=body, stream=True, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.text.strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]
    assert "[DONE]" not in blocks[-1]


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(input="What is the capital of France?", **GREEDY)
    second = client.responses.create(
        input="And of Germany?", previous_response_id=first.id, **GREEDY
    )
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Germany?"},
    ]
    assert second.output_text == chat_text(client, messages)
    assert second.previous_response_id == first.id
    # the input items: the whole conversation before the second output, newest first
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role) for i in items.data] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert items.data[0].content[0].text == "And of Germany?" and not items.has_more
    page = client.responses.input_items.list(second.id, limit=1, order="asc")
    assert page.data[0].content[0].text == "What is the capital of France?" and page.has_more
    rest = client.responses.input_items.list(second.id, after=page.data[0].id, order="asc")
    assert [i.id for i in rest.data] == [i.id for i in items.data[::-1][1:]]
    # the earlier output sent again as well as continued: an item twice, as OpenAI refuses it
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            input=[*first.output, {"role": "user", "content": "Hi"}],
            previous_response_id=first.id,
            **GREEDY,
        )
    assert "Duplicate item" in e.value.message
    client.responses.delete(first.id)  # a link of the chain gone: its items cannot be listed
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.input_items.list(second.id)
    assert e.value.body["param"] == "response_id" and "no longer stored" in e.value.message


def test_reasoning_items_are_taken_and_listed(client):
    """A reasoning item sent back (as a client of a reasoning model does) is kept in the
    input items but not replayed into the prompt."""
    question = {"role": "user", "content": "What is 2 + 2?"}
    plain = client.responses.create(input=[question], **GREEDY)
    with_reasoning = client.responses.create(
        input=[
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Add."}]},
            question,
        ],
        **GREEDY,
    )
    assert with_reasoning.output_text == plain.output_text
    assert with_reasoning.usage.input_tokens == plain.usage.input_tokens
    items = client.responses.input_items.list(with_reasoning.id, order="asc")
    assert [i.type for i in items.data] == ["reasoning", "message"]
    assert items.data[0].id.startswith("rs_")


def test_function_calls_round_trip(client):
    ask = {"input": "What is the weather like in Paris?", "tools": [WEATHER], **GREEDY}
    first = client.responses.create(
        tool_choice="required", parallel_tool_calls=False, **ask | {"max_output_tokens": 60}
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"}
    # stored, or stateless with the items sent back: the same conversation, the same answer
    chained = client.responses.create(
        previous_response_id=first.id, input=[result], tools=[WEATHER], tool_choice="none", **GREEDY
    )
    stateless = client.responses.create(
        input=[{"role": "user", "content": ask["input"]}, call.model_dump(), result],
        tools=[WEATHER],
        tool_choice="none",
        store=False,
        **GREEDY,
    )
    assert chained.status == stateless.status == "completed"
    assert chained.output_text == stateless.output_text and chained.output_text


def test_a_streamed_function_call_is_the_whole_one(client):
    ask = {
        "input": "What is the weather like in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        **GREEDY | {"max_output_tokens": 60},
    }
    whole = client.responses.create(**ask)
    events = list(client.responses.create(stream=True, **ask))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = whole.output
    assert deltas == call.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments


def test_structured_output_parses(client):
    class City(BaseModel):
        name: str
        country: str

    r = client.responses.parse(
        model="m",
        input="Name a city in Italy.",
        text_format=City,
        temperature=0,
        max_output_tokens=60,
    )
    assert isinstance(r.output_parsed, City)
    assert r.text.format.type == "json_schema" and r.text.format.name == "City"


def test_logprobs_when_included(client):
    ask = {"input": "Hi", **GREEDY | {"max_output_tokens": 6}}
    r = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **ask)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert logprobs[0].token == logprobs[0].top_logprobs[0].token  # greedy: the likeliest
    assert client.responses.create(**ask).output[0].content[0].logprobs == []


def test_max_output_tokens_leaves_it_incomplete(client):
    ask = {"model": "m", "input": "Tell me a long story.", "max_output_tokens": 5}
    r = client.responses.create(**ask)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 5
    last = list(client.responses.create(stream=True, **ask))[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"


def test_background_responses_poll_cancel_and_delete(client, server):
    quick = client.responses.create(
        model="m", input="Say hi.", max_output_tokens=8, background=True
    )
    assert quick.status == "queued" and quick.background is True
    deadline = time.monotonic() + TIMEOUT
    while (got := client.responses.retrieve(quick.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert got.status in ("completed", "incomplete") and got.output_text
    slow = client.responses.create(
        model="m",
        input="Count to a thousand.",
        max_output_tokens=1500,
        background=True,
        extra_body={"ignore_eos": True},  # it runs until cancelled
    )
    time.sleep(0.5)
    cancelled = client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(slow.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # only background responses cancel
        client.responses.cancel(client.responses.create(input="Hi", **GREEDY).id)
    client.responses.delete(quick.id)
    for gone in (
        lambda: client.responses.retrieve(quick.id),
        lambda: client.responses.delete(quick.id),
    ):
        with pytest.raises(openai.NotFoundError):
            gone()
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="Hi", previous_response_id=quick.id, **GREEDY)
    assert e.value.body["param"] == "previous_response_id"
    assert_kv_clean(server)


def test_a_streamed_background_response_is_read_again_from_any_point(client, server):
    ask = {"input": "Name three colors.", **GREEDY}
    whole = client.responses.create(**ask)
    events = list(client.responses.create(background=True, stream=True, **ask))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert events[0].response.status == "queued" and events[0].response.background is True
    last = events[-1]
    assert last.type == "response.completed" or last.type == "response.incomplete"
    assert last.response.output_text == whole.output_text  # greedy: the same answer
    response_id = events[0].response.id
    assert client.responses.retrieve(response_id).output_text == whole.output_text

    def dumped(stream) -> list[dict]:
        return [e.model_dump() for e in stream]

    everything = dumped(events)
    assert dumped(client.responses.retrieve(response_id, stream=True)) == everything
    for after in (0, 5, len(events) - 2, len(events) - 1):
        again = client.responses.retrieve(response_id, stream=True, starting_after=after)
        assert dumped(again) == everything[after + 1 :]
    # the client's stream helper builds the response from the events read again
    with client.responses.stream(response_id=response_id) as stream:
        assert stream.get_final_response().output_text == whole.output_text
    # only a streamed background response keeps its events; a sequence number must be one
    for asked, query, param in (
        (whole.id, "stream=true", "stream"),
        (response_id, f"stream=true&starting_after={len(events)}", "starting_after"),
        (response_id, "stream=true&starting_after=-2", "starting_after"),
    ):
        r = requests.get(f"{server.url}/v1/responses/{asked}?{query}", timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def counting(client: openai.OpenAI, up_to: int, tokens: int):
    """A streamed background response that runs its `tokens` whatever it says."""
    return client.responses.create(
        model="m",
        input=f"Count to {up_to}.",
        max_output_tokens=tokens,
        background=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def test_a_streamed_background_response_outlives_its_reader(client, server):
    """The client that made it goes away mid-stream; the response goes on, and a new reader
    takes up the stream where the first left off."""
    stream = counting(client, 100, 48)
    first = [e for _, e in zip(range(5), stream)]
    stream.close()  # the connection drops
    response_id = first[0].response.id
    rest = list(
        client.responses.retrieve(
            response_id, stream=True, starting_after=first[-1].sequence_number
        )
    )
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"  # its 48 tokens, not a cancel
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = client.responses.retrieve(response_id)
    assert final.status == "incomplete" and final.usage.output_tokens == 48
    assert text == final.output_text
    # cancelled while a reader follows it: the reader's stream ends, the response says why
    slow = counting(client, 1000, 1500)
    seen = [e for _, e in zip(range(4), slow)]
    ahead = f"{server.url}/v1/responses/{seen[0].response.id}?stream=true&starting_after=99999"
    r = requests.get(ahead, timeout=TIMEOUT)  # past its events so far, while it runs: a 400
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after", r.text
    assert client.responses.cancel(seen[0].response.id).status == "cancelled"
    after = list(slow)
    assert all(e.type != "response.completed" for e in after)
    assert_kv_clean(server)


def test_item_references_stand_for_stored_items(client):
    """An input may name items of stored responses (their inputs or outputs) instead of
    sending them again: the conversation is the same as continuing the response."""
    first = client.responses.create(input="Name a color.", **GREEDY)
    (question,) = client.responses.input_items.list(first.id).data
    follow_up = {"role": "user", "content": "Name another one."}
    chained = client.responses.create(input=[follow_up], previous_response_id=first.id, **GREEDY)
    references = [{"type": "item_reference", "id": i} for i in (question.id, first.output[0].id)]
    referenced = client.responses.create(input=[*references, follow_up], **GREEDY)
    assert referenced.output_text == chained.output_text
    assert referenced.usage.input_tokens == chained.usage.input_tokens
    listed = client.responses.input_items.list(referenced.id, order="asc").data
    assert [i.id for i in listed[:2]] == [question.id, first.output[0].id]
    assert listed[1].type == "message" and listed[1].role == "assistant"


def test_item_references_stand_for_a_conversations_items(client):
    """Items added to a conversation by hand can be named by an item_reference too, until
    the conversation is deleted."""
    conversation = client.conversations.create()
    intro = {"type": "message", "role": "user", "content": "My name is Ada."}
    (added,) = client.conversations.items.create(conversation.id, items=[intro]).data
    question = {"role": "user", "content": "What is my name?"}
    spelled = client.responses.create(input=[intro, question], **GREEDY)
    referenced = client.responses.create(  # (not stored: no other holder of the item)
        input=[{"type": "item_reference", "id": added.id}, question], store=False, **GREEDY
    )
    assert referenced.output_text == spelled.output_text
    assert referenced.usage.input_tokens == spelled.usage.input_tokens
    client.conversations.delete(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input=[{"type": "item_reference", "id": added.id}], **GREEDY)


def test_a_conversation_holds_the_responses_made_in_it(client, server):
    """OpenAI's Conversations API: a response in a conversation reads its items and adds its
    own once it ends (whole or streamed); the items list, read and delete as OpenAI's."""
    intro = {"type": "message", "role": "user", "content": "My name is Ada."}
    conversation = client.conversations.create(items=[intro], metadata={"topic": "names"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "names"}
    first = client.responses.create(
        input="What is my name?", conversation=conversation.id, **GREEDY
    )
    assert first.conversation.id == conversation.id
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "user", "content": "What is my name?"},
    ]
    assert first.output_text == chat_text(client, history)
    items = list(client.conversations.items.list(conversation.id, order="asc"))
    assert [i.type for i in items] == ["message"] * 3 and items[2].id == first.output[0].id
    history.append({"role": "assistant", "content": first.output_text})
    streamed = list(
        client.responses.create(
            input="Say it again.",
            conversation={"id": conversation.id},
            stream=True,
            **GREEDY,
        )
    )
    history.append({"role": "user", "content": "Say it again."})
    assert streamed[-1].response.output_text == chat_text(client, history)
    page = client.conversations.items.list(conversation.id, limit=2)  # newest first
    assert [i.id for i in page.data] == [streamed[-1].response.output[0].id, page.data[1].id]
    assert len(list(client.conversations.items.list(conversation.id, limit=2))) == 5
    added = client.conversations.items.create(
        conversation.id, items=[{"role": "user", "content": "Thanks."}]
    )
    assert len(added.data) == 1
    item = client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)
    assert item.content[0].text == "Thanks."
    client.conversations.items.delete(item.id, conversation_id=conversation.id)
    assert len(list(client.conversations.items.list(conversation.id))) == 5
    # one response at a time adds to a conversation: a second one meanwhile is refused
    slow = client.responses.create(
        model="m",
        input="Count to a thousand.",
        max_output_tokens=1500,
        background=True,
        conversation=conversation.id,
        extra_body={"ignore_eos": True},
    )
    for blocked in (
        lambda: client.responses.create(input="Hi", conversation=conversation.id, **GREEDY),
        lambda: client.conversations.items.create(
            conversation.id, items=[{"role": "user", "content": "Hi"}]
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            blocked()
        assert e.value.body["code"] == "conversation_locked"
    assert client.responses.cancel(slow.id).status == "cancelled"  # adds nothing, unlocks
    assert len(list(client.conversations.items.list(conversation.id))) == 5
    updated = client.conversations.update(conversation.id, metadata={"topic": "done"})
    assert client.conversations.retrieve(conversation.id).metadata == updated.metadata
    with pytest.raises(openai.BadRequestError) as e:  # one or the other
        client.responses.create(
            input="Hi", conversation=conversation.id, previous_response_id=first.id, **GREEDY
        )
    assert e.value.body["param"] == "conversation"
    client.conversations.delete(conversation.id)
    for gone in (
        lambda: client.conversations.retrieve(conversation.id),
        lambda: client.responses.create(input="Hi", conversation=conversation.id, **GREEDY),
    ):
        with pytest.raises(openai.NotFoundError):
            gone()
    assert_kv_clean(server)


def test_store_false_keeps_nothing(client):
    r = client.responses.create(input="Hi", store=False, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_truncation_auto_drops_the_oldest_turns(client):
    long = "word " * 1200  # a turn of ~1200 tokens: two of them do not fit in the context
    conversation = [
        {"role": "developer", "content": "Answer in one word."},  # stays, whatever is dropped
        {"role": "user", "content": long},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": long},
        {"role": "assistant", "content": "Noted again."},
        {"role": "user", "content": "Now, what is 2 + 2?"},
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input=conversation, **GREEDY)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "input"
    r = client.responses.create(input=conversation, truncation="auto", **GREEDY)
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    kept = [conversation[0], *conversation[3:]]  # the fewest turns dropped: one
    assert r.output_text == chat_text(client, kept)
    chat = client.chat.completions.create(model="m", messages=kept, max_tokens=1)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    # continuing a stored turn: the new input is never cut into, its developer message kept
    first = client.responses.create(input=long, **GREEDY)
    new = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": long}]
    r = client.responses.create(
        input=new, previous_response_id=first.id, truncation="auto", **GREEDY
    )
    assert r.output_text == chat_text(client, new)


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].id"),  # none such
        ({"input": ""}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER | {"parameters": {"type": "string"}}]}, "tools[0].parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
            "text.format",
        ),
        (
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "x",
                        "schema": {"type": "string", "pattern": "(?=a)"},
                    }
                }
            },
            "text.format",
        ),
        ({"text": {"format": {"type": "json_object"}}, "regex": "a+"}, "text.format"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"background": True, "store": False}, "store"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"include": ["file_search.everything"]}, "include.0"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_bad_requests_are_errors_naming_the_field(server, fields, param):
    body = {"model": "m", "input": "Hi", "max_output_tokens": 4} | fields
    r = requests.post(server.url + "/v1/responses", json=body, timeout=TIMEOUT)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    # in the Responses API's words, each field named once (not renamed word by word)
    assert error["message"] and error["message"].count("text.format") <= 1, error


def test_nothing_is_left_held(server):
    assert_kv_clean(server)
