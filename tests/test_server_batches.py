"""OpenAI's Batch and Files APIs end to end on SmolLM2, with the official `openai` client,
behind an API key: a batch's answers are the endpoint's own (greedy, token for token) for
chat, completions, embeddings and responses; a request the endpoint refuses lands in the
error file with its 4xx; a malformed input fails the batch with its lines; a cancelled
batch accounts for every line and frees its KV; files upload, list, read and delete."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

from tests.server_utils import (
    ServerProcess,
    assert_kv_clean,
    free_port,
    positive_metric,
    served,
    state,
)

pytestmark = pytest.mark.smollm2

TIMEOUT = 180
KEY = "batch-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTIONS = ["What is 2+2?", "Name a color.", "What is the capital of France?", "Say hi."]
ENDED = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batches")


@pytest.fixture(scope="module")
def server(storage):
    flags = ("--api-key", KEY, "--file-storage-path", str(storage / "files"))
    yield from served(storage / "server.log", *flags)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)


def upload(client: openai.OpenAI, lines: list, purpose: str = "batch") -> str:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    return client.files.create(file=("input.jsonl", io.BytesIO(text.encode())), purpose=purpose).id


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat_body(question: str, max_tokens: int = 16) -> dict:
    messages = [{"role": "user", "content": question}]
    return {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def run(client: openai.OpenAI, file_id: str, endpoint: str, **extra):
    batch = client.batches.create(
        input_file_id=file_id, endpoint=endpoint, completion_window="24h", **extra
    )
    return wait(client, batch.id)


def wait(client: openai.OpenAI, batch_id: str):
    deadline = time.monotonic() + TIMEOUT
    while (batch := client.batches.retrieve(batch_id)).status not in ENDED:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def read_jsonl(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    text = client.files.content(file_id).text
    entries = [json.loads(x) for x in text.splitlines()]
    return {e["custom_id"]: e for e in entries}


def test_a_chat_batch_answers_as_the_endpoint_does(client, server):
    lines = [line(f"q{i}", "/v1/chat/completions", chat_body(q)) for i, q in enumerate(QUESTIONS)]
    lines.append(line("empty", "/v1/chat/completions", {"model": "m", "messages": []}))
    lines.append(line("streamed", "/v1/chat/completions", {**chat_body("Hi"), "stream": True}))
    file_id = upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "one"},
    )
    assert batch.status == "validating" and batch.id.startswith("batch_")
    client.files.delete(file_id)  # the run keeps reading what it opened
    batch = wait(client, batch.id)

    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (6, 4, 2)
    assert batch.metadata == {"run": "one"} and batch.model == "m"
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.expires_at == batch.created_at + 86400

    outputs = read_jsonl(client, batch.output_file_id)
    assert set(outputs) == {f"q{i}" for i in range(len(QUESTIONS))}
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    for i, question in enumerate(QUESTIONS):
        entry = outputs[f"q{i}"]
        assert entry["id"].startswith("batch_req_") and entry["error"] is None
        response = entry["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert response["request_id"] == body["id"] and body["object"] == "chat.completion"
        direct = client.chat.completions.create(**chat_body(question))
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        for key in ("prompt_tokens", "completion_tokens"):
            usage[key] += body["usage"][key]
        usage["cached_tokens"] += body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert batch.usage.input_tokens == usage["prompt_tokens"]
    assert batch.usage.output_tokens == usage["completion_tokens"]
    assert batch.usage.input_tokens_details.cached_tokens == usage["cached_tokens"]
    assert batch.usage.total_tokens == usage["prompt_tokens"] + usage["completion_tokens"]

    errors = read_jsonl(client, batch.error_file_id)
    assert set(errors) == {"empty", "streamed"}
    for custom_id, param in (("empty", "messages"), ("streamed", "stream")):
        response = errors[custom_id]["response"]
        assert response["status_code"] == 400, response
        assert response["body"]["error"]["param"] == param, response

    made = {f.id: f for f in client.files.list(purpose="batch_output")}
    output = made[batch.output_file_id]
    assert output.filename == f"{batch.id}_output.jsonl" and output.purpose == "batch_output"
    assert batch.error_file_id in made and file_id not in {f.id for f in client.files.list()}
    listed = client.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]
    metrics = requests.get(server.url + "/metrics", headers=AUTH, timeout=30).text
    assert 'radixserve_batches{status="completed"}' in metrics
    assert "radixserve_batch_sequences_in_flight 0.0" in metrics
    assert_kv_clean(server, headers=AUTH)


def test_completions_embeddings_and_responses_batches(client):
    prompts = ["The capital of France is", "1, 2, 3,"]
    body = {"model": "m", "max_tokens": 8, "temperature": 0}
    lines = [line(f"c{i}", "/v1/completions", {**body, "prompt": p}) for i, p in enumerate(prompts)]
    batch = run(client, upload(client, lines), "/v1/completions")
    outputs = read_jsonl(client, batch.output_file_id)
    for i, prompt in enumerate(prompts):
        direct = client.completions.create(**body, prompt=prompt).choices[0].text
        assert outputs[f"c{i}"]["response"]["body"]["choices"][0]["text"] == direct

    inputs = ["hello world", "a batch of embeddings"]
    lines = [line("e", "/v1/embeddings", {"model": "m", "input": inputs})]
    batch = run(client, upload(client, lines), "/v1/embeddings")
    assert batch.status == "completed" and batch.request_counts.completed == 1, batch
    got = read_jsonl(client, batch.output_file_id)["e"]["response"]["body"]["data"]
    direct = client.embeddings.create(model="m", input=inputs).data
    for a, b in zip(got, direct):
        assert a["embedding"] == pytest.approx(b.embedding, abs=1e-5)

    score = {"query": "Is the sky blue? Answer:", "items": [" Yes", " No"]}
    score["label_token_ids"] = [330, 1770]
    batch = run(client, upload(client, [line("s", "/v1/score", score)]), "/v1/score")
    assert batch.status == "completed" and batch.request_counts.completed == 1, batch
    got = read_jsonl(client, batch.output_file_id)["s"]["response"]["body"]["scores"]
    direct = requests.post(f"{client.base_url}score", json=score, headers=AUTH, timeout=60)
    for row, expected in zip(got, direct.json()["scores"], strict=True):
        assert row == pytest.approx(expected, rel=1e-3)  # (batched apart: fp32 rounding)

    question = {"model": "m", "input": "Name a fruit.", "max_output_tokens": 12, "temperature": 0}
    lines = [
        line("r", "/v1/responses", question),
        line("bg", "/v1/responses", {**question, "background": True}),
    ]
    batch = run(client, upload(client, lines), "/v1/responses")
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1), batch
    body = read_jsonl(client, batch.output_file_id)["r"]["response"]["body"]
    direct = client.responses.create(**question)
    assert body["object"] == "response" and body["output"][0]["content"][0]["text"] == (
        direct.output_text
    )
    assert batch.usage.input_tokens == body["usage"]["input_tokens"]
    refused = read_jsonl(client, batch.error_file_id)["bg"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "background"


def test_a_malformed_input_fails_the_batch_with_its_lines(client):
    good = line("a", "/v1/chat/completions", chat_body("Hi"))
    lines = [
        good,
        "{not json",
        {**good, "custom_id": ""},
        {**good, "custom_id": "b", "url": "/v1/completions"},
        {**good, "custom_id": "c", "method": "GET"},
        good,  # "a" again
        {**good, "custom_id": "d", "body": "text"},
    ]
    batch = run(client, upload(client, lines), "/v1/chat/completions")
    assert batch.status == "failed" and batch.failed_at, batch
    assert batch.in_progress_at is None and batch.output_file_id is None
    found = [(e.line, e.code, e.param) for e in batch.errors.data]
    assert found == [
        (2, "invalid_json_line", None),
        (3, "missing_custom_id", "custom_id"),
        (4, "mismatched_url", "url"),
        (5, "invalid_method", "method"),
        (6, "duplicate_custom_id", "custom_id"),
        (7, "invalid_body", "body"),
    ]
    assert all(f"line {e.line}:" in e.message for e in batch.errors.data)

    batch = run(client, upload(client, ["", "  "]), "/v1/chat/completions")
    assert batch.status == "failed" and batch.errors.data[0].code == "empty_file"


def test_a_batch_that_cannot_be_made_is_a_clear_error(client, server):
    file_id = upload(client, [line("a", "/v1/chat/completions", chat_body("Hi"))])
    other = upload(client, [line("a", "/v1/chat/completions", chat_body("Hi"))], "user_data")
    args = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    cases = [
        ({**args, "input_file_id": "file-nope"}, 404, "input_file_id"),
        ({**args, "input_file_id": other}, 400, "input_file_id"),
        ({**args, "endpoint": "/v1/moderations"}, 400, "endpoint"),
        ({**args, "completion_window": "1h"}, 400, "completion_window"),
        ({**args, "metadata": {"k" * 65: "v"}}, 400, "metadata"),
        (
            {**args, "output_expires_after": {"anchor": "created_at", "seconds": 60}},
            400,
            "output_expires_after.seconds",
        ),
        ({**args, "colour": "blue"}, 400, "colour"),
    ]
    for body, status, param in cases:
        body = {"completion_window": "24h", **body}
        r = requests.post(server.url + "/v1/batches", json=body, headers=AUTH, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = requests.get(server.url + "/v1/batches/batch_nope", headers=AUTH, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "batch_id"
    r = requests.post(server.url + "/v1/batches", json=args | {"completion_window": "24h"})
    assert r.status_code == 401  # the key guards the batch routes too


def test_a_cancelled_batch_accounts_for_every_line(client, server):
    lines = [
        line(f"q{i}", "/v1/chat/completions", chat_body(f"Count to {100 + i}.", 400))
        for i in range(40)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 3600},
    )
    deadline = time.monotonic() + TIMEOUT
    while client.batches.retrieve(batch.id).status == "validating":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at, batch
    counts = batch.request_counts
    assert counts.total == 40 and counts.completed + counts.failed == 40, counts
    assert counts.failed > 0
    entries = {
        **read_jsonl(client, batch.output_file_id),
        **read_jsonl(client, batch.error_file_id),
    }
    assert set(entries) == {f"q{i}" for i in range(40)}
    for entry in read_jsonl(client, batch.error_file_id).values():
        assert entry["response"] is None and entry["error"]["code"] == "batch_cancelled", entry
    error_file = client.files.retrieve(batch.error_file_id)
    assert error_file.expires_at == error_file.created_at + 3600
    with pytest.raises(openai.APIStatusError) as e:
        client.batches.cancel(batch.id)
    assert e.value.status_code == 409
    assert_kv_clean(server, headers=AUTH)


def test_files_upload_list_read_and_delete(client, server):
    data = b'{"custom_id": "x"}\n' * 3
    made = client.files.create(
        file=("mine.jsonl", io.BytesIO(data)),
        purpose="user_data",
        expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert (made.filename, made.bytes, made.purpose) == ("mine.jsonl", len(data), "user_data")
    assert made.expires_at == made.created_at + 7200
    assert client.files.retrieve(made.id).id == made.id
    assert client.files.content(made.id).read() == data
    batch_file = client.files.retrieve(upload(client, ["{}"]))
    assert batch_file.expires_at == batch_file.created_at + 30 * 86400  # OpenAI's default

    listed = client.files.list(purpose="user_data")
    assert made.id in [f.id for f in listed.data] and all(
        f.purpose == "user_data" for f in listed.data
    )
    first = client.files.list(limit=1, order="asc")
    assert len(first.data) == 1 and first.has_more
    second = client.files.list(limit=1, order="asc", after=first.data[0].id)
    assert second.data[0].id != first.data[0].id

    deleted = client.files.delete(made.id)
    assert deleted.deleted and deleted.id == made.id
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(made.id)

    url = server.url + "/v1/files"
    short = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "10"}
    short_param = "expires_after.seconds"
    refusals = [
        ({"json": {"purpose": "batch"}}, None),  # not a form
        ({"files": {"file": ("a", b"x")}, "data": {"purpose": "nope"}}, "purpose"),
        ({"files": {"other": ("a", b"x")}, "data": {"purpose": "batch"}}, "file"),
        ({"files": {"file": ("a", b"x")}, "data": {"purpose": "batch", **short}}, short_param),
    ]
    for kwargs, param in refusals:
        r = requests.post(url, headers=AUTH, timeout=30, **kwargs)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_a_second_server_on_the_folder_is_refused(server, storage):
    """One server to a --file-storage-path: a second would delete the first's uploads in
    progress and resume its batches too."""
    serve = [sys.executable, "-m", "radixserve", "serve", "--port", str(free_port())]
    done = subprocess.run(
        [*serve, "--file-storage-path", str(storage / "files")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "is in use by another server" in done.stderr
    assert requests.get(server.url + "/health", timeout=30).status_code == 200


def long_background(client: openai.OpenAI):
    return client.responses.create(
        model="m", input="Count.", max_output_tokens=2000, background=True, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def test_a_batch_outlives_its_server(tiny_model_dirs, tmp_path):
    """A batch's lines run in the flex tier: with every running row taken by them, an
    interactive request still starts at once (a flex one goes back to the queue). A batch
    whose server is killed, then one whose server is stopped (SIGTERM), resumes when a
    server starts again on the folder: every line is answered once, all alike (greedy,
    whether preempted, cut off or resumed). A conversation and a stored response made on
    the first are there on the last: the response is continued, and items of both are
    referenced; background responses still running when the first is killed and the
    second stopped read back failed."""
    flags = (
        "--model-path", str(tiny_model_dirs["llama"]), "--max-total-tokens", "8192",
        "--file-storage-path", str(tmp_path / "files"), "--shutdown-timeout", "1",
        "--max-running-requests", "4",
    )  # fmt: skip
    body = {"model": "m", "prompt": "The quick", "max_tokens": 200, "ignore_eos": True}
    body["temperature"] = 0
    lines = [line(f"r{i}", "/v1/completions", body) for i in range(24)]

    def answered_past(client: openai.OpenAI, count: int) -> None:
        deadline = time.monotonic() + TIMEOUT
        while (now := client.batches.retrieve(made.id)).request_counts.completed <= count:
            assert now.status == "in_progress" and time.monotonic() < deadline, now
            time.sleep(0.05)

    with ServerProcess(*flags, log=tmp_path / "first.log") as first:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="x", max_retries=0)
        made = client.batches.create(
            input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="24h"
        )
        answered_past(client, 0)
        hello = {"type": "message", "role": "user", "content": "Hello"}
        conversation = client.conversations.create(items=[hello], metadata={"k": "v"})
        client.conversations.update(conversation.id, metadata={"k": "w"})
        stored = client.responses.create(
            model="m", input="Hi", max_output_tokens=4, temperature=0, store=True
        )
        killed = long_background(client)  # (still running when its server is killed)
        for _ in range(5):  # sent while the 4 rows run flex lines: one gives its row (the
            # lines end together, so a try may land as a wave ends, with rows free)
            while state(first)["num_running"] < 4:
                time.sleep(0.02)
            interactive = client.completions.create(
                model="m", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
            )
            assert interactive.choices[0].finish_reason == "length"
            if state(first)["preemptions"] >= 1:
                break
        assert state(first)["preemptions"] >= 1
        preempted, text = positive_metric(first.url, "radixserve_preemptions_total")
        assert preempted is not None and preempted >= 1, text
        first.proc.kill()  # no drain: what it wrote is what the next server finds
        first.proc.wait()
    with ServerProcess(*flags, log=tmp_path / "second.log") as second:
        client = openai.OpenAI(base_url=second.url + "/v1", api_key="x", max_retries=0)
        answered_past(client, 0)  # (its counts read back from its files as it resumes)
        resumed = client.batches.retrieve(made.id).request_counts.completed
        stopped = long_background(client)  # (still running when its server stops)
        answered_past(client, resumed)  # then SIGTERM: it drains, the batch stays unfinished
    with ServerProcess(*flags, log=tmp_path / "third.log") as third:
        client = openai.OpenAI(base_url=third.url + "/v1", api_key="x", max_retries=0)
        batch = wait(client, made.id)
        assert batch.status == "completed" and batch.error_file_id is None, batch
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (24, 24, 0), counts
        assert batch.usage.output_tokens == 24 * 200
        text = client.files.content(batch.output_file_id).text
        assert len(text.splitlines()) == 24  # each line answered once
        done = read_jsonl(client, batch.output_file_id)
        assert set(done) == {f"r{i}" for i in range(24)}
        choices = [entry["response"]["body"]["choices"][0] for entry in done.values()]
        assert {c["finish_reason"] for c in choices} == {"length"}
        assert len({c["text"] for c in choices}) == 1
        assert {entry["response"]["body"]["service_tier"] for entry in done.values()} == {"flex"}
        assert made.id in [b.id for b in client.batches.list()]
        kept = client.conversations.retrieve(conversation.id)  # (kept in the folder too)
        assert kept.metadata == {"k": "w"} and kept.created_at == conversation.created_at
        (item,) = client.conversations.items.list(conversation.id).data
        assert item.content[0].text == "Hello"
        assert client.responses.retrieve(stored.id).output_text == stored.output_text
        for unfinished, why in ((killed, "server stopped"), (stopped, "shutting down")):
            failed = client.responses.retrieve(unfinished.id)
            assert failed.status == "failed" and why in failed.error.message, failed
        following = client.responses.create(
            model="m", previous_response_id=stored.id, max_output_tokens=4, temperature=0,
            input=[{"type": "item_reference", "id": item.id}],  # (the conversation's)
        )  # fmt: skip
        texts = [i.content[0].text for i in client.responses.input_items.list(following.id).data]
        assert texts == ["Hello", stored.output_text, "Hi"]  # (newest first)
        reference = {"type": "item_reference", "id": stored.output[0].id}  # (a stored item)
        other = client.responses.create(
            model="m", input=[reference], max_output_tokens=4, temperature=0
        )
        assert other.status in ("completed", "incomplete")
        assert_kv_clean(third)
