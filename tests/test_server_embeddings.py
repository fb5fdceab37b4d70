"""Embeddings end to end: a real `radixserve serve` (the tiny Llama) driven by the official
`openai` client (`/v1/embeddings`, both encoding formats, text and token-id inputs) and by
plain HTTP (`/encode`), checked against transformers; bad inputs are 400s in the OpenAI
error shape; the prefix cache is shared with generation; no KV is left behind. One server
serves the whole module."""

from __future__ import annotations

import base64
import struct
import time

import openai
import pytest
import requests
import torch

from radixserve.cli import SERVER_PARTS
from radixserve.config import add_config_args, config_from_args
from tests.server_utils import tiny_model_server
from tests.test_embeddings import SHARED, max_diff, reference_embedding

TIMEOUT_S = 60
TOL = 1e-4
HIDDEN = 256  # the tiny Llama's hidden size
CONTEXT = 2048  # its max_position_embeddings (the pool holds more)


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    yield from tiny_model_server(tiny_model_dirs["llama"], tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=TIMEOUT_S)


def tokenize(server, text: str) -> list[int]:
    return post(server, "/tokenize", {"prompt": text}).json()["tokens"]


def want(reference, ids: list[int]) -> torch.Tensor:
    return reference_embedding(reference, ids, "last", normalize=True)


# -- the openai client ----------------------------------------------------------------------
def test_openai_client_default_base64_and_float_agree_with_transformers(server, client, reference):
    texts = ["hello world", "the sea and the village"]
    default = client.embeddings.create(model="tiny", input=texts)  # sends base64, decodes it
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert default.object == "list" and default.model == "tiny"
    assert [d.index for d in default.data] == [0, 1]
    ids = [tokenize(server, t) for t in texts]
    for i in range(2):
        assert default.data[i].object == "embedding"
        assert len(default.data[i].embedding) == HIDDEN
        assert max_diff(default.data[i].embedding, want(reference, ids[i])) < TOL
        # float32 bytes vs JSON floats: equal to float32 precision
        assert max_diff(floats.data[i].embedding, torch.tensor(default.data[i].embedding)) < 1e-6
    tokens = sum(map(len, ids))
    assert default.usage.prompt_tokens == default.usage.total_tokens == tokens


def test_explicit_base64_is_little_endian_float32(client, server):
    out = client.embeddings.create(model="tiny", input="hello", encoding_format="base64")
    raw = base64.b64decode(out.data[0].embedding)  # the client leaves an explicit format as is
    assert len(raw) == 4 * HIDDEN
    decoded = struct.unpack(f"<{HIDDEN}f", raw)
    floats = client.embeddings.create(model="tiny", input="hello", encoding_format="float")
    assert max_diff(list(decoded), torch.tensor(floats.data[0].embedding)) < 1e-6


def test_token_id_inputs(client, reference):
    one = [5, 6, 7, 8, 9]
    batch = [SHARED + [1, 2], [42], one]
    single = client.embeddings.create(model="m", input=one, encoding_format="float")
    assert len(single.data) == 1 and single.usage.prompt_tokens == len(one)
    assert max_diff(single.data[0].embedding, want(reference, one)) < TOL
    many = client.embeddings.create(model="m", input=batch, dimensions=HIDDEN)
    assert len(many.data) == 3 and many.usage.prompt_tokens == sum(map(len, batch))
    for ids, item in zip(batch, many.data):
        assert max_diff(item.embedding, want(reference, ids)) < TOL


# -- the native /encode ---------------------------------------------------------------------
def test_encode_single_batch_and_ids(server, reference):
    single = post(server, "/encode", {"text": "hello world"})
    assert single.status_code == 200, single.text
    body = single.json()
    assert set(body) == {"embedding", "meta_info"}
    ids = tokenize(server, "hello world")
    assert body["meta_info"]["prompt_tokens"] == len(ids)
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert max_diff(body["embedding"], want(reference, ids)) < TOL
    batch = post(server, "/encode", {"input_ids": [ids, [3, 4, 5]], "rid": "enc"})
    assert batch.status_code == 200, batch.text
    results = batch.json()
    assert [r["meta_info"]["id"] for r in results] == ["enc_0", "enc_1"]
    assert max_diff(results[0]["embedding"], torch.tensor(body["embedding"])) < 1e-5
    assert max_diff(results[1]["embedding"], want(reference, [3, 4, 5])) < TOL


def test_a_generation_warms_the_cache_for_an_embedding_and_back(server, reference):
    prompt = SHARED + [77, 78, 79]
    gen = post(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
    assert gen.status_code == 200, gen.text
    first = post(server, "/encode", {"input_ids": prompt}).json()
    assert first["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert max_diff(first["embedding"], want(reference, prompt)) < TOL
    other = SHARED + [90, 91]  # its prefix was cached by the embedding above too
    again = post(server, "/encode", {"input_ids": other}).json()
    assert again["meta_info"]["cached_tokens"] >= len(SHARED)
    assert max_diff(again["embedding"], want(reference, other)) < TOL
    gen = post(server, "/generate", {"input_ids": other, "sampling_params": {"max_new_tokens": 1}})
    assert gen.json()["meta_info"]["cached_tokens"] == len(other) - 1


# -- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "empty list"),
        ({"input": [""]}, "input", "empty string"),
        ({"input": [[1, 2], []]}, "input", "empty list of token ids"),
        ({"input": ["a", 1]}, "input", "mixed"),
        ({"input": [1, [2]]}, "input", "mixed"),
        ({"input": {"text": "a"}}, "input", "got dict"),
        ({"input": [1, 100000]}, "input", "vocabulary"),
        ({"input": [1] * (CONTEXT + 1)}, "input", "maximum context length is 2048"),
        ({"input": "a", "dimensions": 7}, "dimensions", "256 dimensions"),
        ({"input": "a", "encoding_format": "binary"}, "encoding_format", "float"),
        ({"input": "a", "pooling": "mean"}, "pooling", "Unrecognized"),
    ],
)
def test_bad_embedding_requests_are_400s_naming_the_problem(server, body, param, words):
    r = post(server, "/v1/embeddings", {"model": "m", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert words in error["message"], error


def test_context_length_error_has_its_code(server):
    r = post(server, "/v1/embeddings", {"input": [1] * (CONTEXT + 1)})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, "/encode", {"input_ids": [1] * (CONTEXT + 1)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="m", input="hello", dimensions=12)


@pytest.mark.parametrize(
    ("body", "param"),
    [({"text": ""}, "text"), ({"input_ids": [[1], []]}, "input_ids"), ({}, "text")],
)
def test_bad_encode_requests(server, body, param):
    r = post(server, "/encode", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_pooling_flags_parse():
    import argparse

    parser = argparse.ArgumentParser()
    add_config_args(parser, SERVER_PARTS)
    args = parser.parse_args(["--embedding-pooling", "mean", "--no-embedding-normalize"])
    config = config_from_args(args, SERVER_PARTS).embedding
    assert (config.embedding_pooling, config.embedding_normalize) == ("mean", False)
    assert config_from_args(parser.parse_args([]), SERVER_PARTS).embedding.embedding_pooling == (
        "last"
    )


# -- afterwards ------------------------------------------------------------------------------
def test_kv_is_clean_afterwards(server):
    """Runs last: nothing held by requests, no tree node locked, everything freed by a flush."""

    def state() -> dict:
        info = requests.get(server.url + "/get_server_info", timeout=TIMEOUT_S).json()
        return info["internal_states"][0]

    deadline = time.monotonic() + 30
    while (now := state())["num_running"] or now["num_waiting"]:
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
    assert now["kv_held_by_requests"] == 0, now
    assert now["kv_tree_protected"] == 0, now
    assert now["kv_free"] + now["kv_tree_evictable"] == now["kv_total"], now
    assert now["kv_tree_evictable"] > 0, "the embeddings' prompts should be in the tree"
    assert requests.post(server.url + "/flush_cache", timeout=TIMEOUT_S).status_code == 200
    now = state()
    assert now["kv_free"] == now["kv_total"], now
