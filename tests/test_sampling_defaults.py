"""--sampling-defaults model (the default): the OpenAI-compatible routes take the sampling
parameters a request leaves unset from the model folder's generation_config.json, as
SGLang and vLLM do; what the request sets wins. One tiny-model server on a copy of the
tiny model's folder with such a file (temperature 0: its defaults make the routes greedy)."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import requests

from radixserve.config import Config
from radixserve.sampling_defaults import model_sampling_defaults
from radixserve.server import openai_api as oai
from tests.server_utils import tiny_model_server

RECOMMENDED = {"temperature": 0.0, "top_k": 0, "repetition_penalty": 7.0, "do_sample": True}


def test_the_folders_recommended_sampling_is_read(tmp_path):
    assert model_sampling_defaults(tmp_path) == {}  # no file
    (tmp_path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    # top_k 0 is transformers' "no top-k"; a repetition_penalty the engine refuses is left
    # out (a warning), not failing every request that leaves it unset
    assert model_sampling_defaults(tmp_path) == {"temperature": 0.0, "top_k": -1}
    (tmp_path / "generation_config.json").write_text('{"temperature": ')
    assert model_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("[0.7]")
    assert model_sampling_defaults(tmp_path) == {}


def test_what_a_request_sets_wins():
    body = oai.CompletionRequest(prompt="x", temperature=0.5, top_k=None)
    params = body.sampling_params(16, {"temperature": 0.0, "top_p": 0.9, "top_k": 20})
    assert (params["temperature"], params["top_p"], params["top_k"]) == (0.5, 0.9, 20)
    assert body.sampling_params(16)["top_p"] is None  # (the API's default, downstream)
    with pytest.raises(ValueError, match="sampling_defaults must be one of"):
        Config.from_flat(sampling_defaults="vllm")


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(tiny_model_dirs["llama"], folder)
    (folder / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    yield from tiny_model_server(folder, tmp_path_factory.mktemp("sampling-defaults"))


def test_requests_that_leave_sampling_unset_take_the_models(server):
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    assert info["default_sampling_params"] == {"temperature": 0.0, "top_k": -1}
    assert info["sampling_defaults"] == "model"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    ask = {"model": "m", "prompt": "The quick brown", "max_tokens": 12}
    greedy = client.completions.create(temperature=0, **ask).choices[0].text
    unset = client.completions.create(n=3, **ask)  # the model's temperature 0: greedy
    assert [c.text for c in unset.choices] == [greedy] * 3
    messages = [{"role": "user", "content": "Hello there"}]
    chat = {"model": "m", "messages": messages, "max_tokens": 12}
    greedy_chat = client.chat.completions.create(temperature=0, **chat).choices[0]
    unset_chat = client.chat.completions.create(n=3, **chat).choices
    assert [c.message.content for c in unset_chat] == [greedy_chat.message.content] * 3
    response = client.responses.create(model="m", input="Hello there", max_output_tokens=12)
    assert response.output_text == greedy_chat.message.content
    assert (response.temperature, response.top_p) == (0.0, 1.0)  # (those it ran with)


def test_weights_from_another_folder_bring_its_recommended_sampling(server, tmp_path):
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    other = tmp_path / "other"
    shutil.copytree(info["model_path"], other)
    (other / "generation_config.json").write_text('{"temperature": 0.0, "top_p": 0.5}')
    update = {"model_path": str(other)}
    r = requests.post(server.url + "/update_weights_from_disk", json=update, timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    assert info["default_sampling_params"] == {"temperature": 0.0, "top_p": 0.5}
