"""LoRA adapters through `radixserve serve` (SmolLM2-135M-Instruct, fp32), driven as their
clients drive them: SGLang's `lora_path` on /generate (one name, or one per prompt), the
`model` field of the OpenAI routes (an adapter's name, or BASE:NAME) with the official
`openai` client, /v1/models listing the adapters, and SGLang's /load_lora_adapter and
/unload_lora_adapter while serving. Outputs are PEFT's on the same weights."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import requests
from transformers import AutoModelForCausalLM

from radixserve.config import Config
from radixserve.model.loader import resolve_model_folder
from tests.server_utils import assert_kv_clean, served
from tests.test_lora import ADAPTERS, GREEDY, Case, make_adapter

TIMEOUT = 120
PROMPT = "The three primary colors are"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    root = tmp_path_factory.mktemp("server-lora")
    folder = resolve_model_folder(None, Config.from_flat().model.cache_dir, progress=False)
    base = AutoModelForCausalLM.from_pretrained(folder)
    adapters = {
        name: make_adapter(base, root / name, seed, **config)
        for seed, (name, config) in enumerate(ADAPTERS.items(), start=1)
    }
    return Case(folder, adapters)


@pytest.fixture(scope="module")
def server(case, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-lora-log") / "server.log"
    yield from served(log, "--max-total-tokens", "8192", "--lora-paths", f"a={case.adapters['a']}")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def post(server, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=TIMEOUT)


def generate(server, body: dict[str, Any]) -> Any:
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def error_of(r: requests.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS
    return error


def test_generate_picks_the_adapter_per_prompt(server, case):
    outs = generate(
        server, {"text": [PROMPT, PROMPT], "sampling_params": GREEDY, "lora_path": ["a", None]}
    )
    assert outs[0]["output_ids"] == case.greedy(PROMPT, "a")
    assert outs[1]["output_ids"] == case.greedy(PROMPT, None)
    assert outs[0]["output_ids"] != outs[1]["output_ids"]
    one = generate(server, {"text": PROMPT, "sampling_params": GREEDY, "lora_path": "a"})
    assert one["output_ids"] == outs[0]["output_ids"]


def test_openai_model_names_the_adapter(server, client, case):
    expected = case.tokenizer.decode(case.greedy(PROMPT, "a"))
    for model in ("a", "default:a"):
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert reply.choices[0].text == expected, model
        assert reply.model == model
    base = client.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0)
    assert base.choices[0].text == case.tokenizer.decode(case.greedy(PROMPT, None))
    via_extra = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"lora_path": "a"}
    )
    assert via_extra.choices[0].text == expected
    chat = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_encode_runs_with_the_adapter(server):
    body = {"text": PROMPT}
    base = post(server, "/encode", body).json()["embedding"]
    adapted = post(server, "/encode", {**body, "lora_path": "a"}).json()["embedding"]
    again = post(server, "/v1/embeddings", {"input": PROMPT, "model": "a"}).json()
    assert adapted != base
    assert again["data"][0]["embedding"] == pytest.approx(adapted, abs=1e-5)


def test_score_continuations_runs_with_the_adapter(server, case):
    """Each continuation's logprobs are PEFT's under the adapter named, the base model's
    without one; an adapter not loaded is a 400."""
    text = PROMPT + " red, blue and"
    body = {"text": PROMPT, "continuations": [" red, blue and", " green"]}
    adapted = post(server, "/score_continuations", {**body, "lora_path": "a"}).json()
    base = post(server, "/score_continuations", body).json()
    first = adapted["continuations"][0]
    span = len(first["logprobs"])
    expected = case.prompt_logprobs(text, "a")[-span:].tolist()
    assert first["logprobs"] == pytest.approx(expected, abs=2e-3)
    assert base["continuations"][0]["token_ids"] == first["token_ids"]
    assert base["continuations"][0]["logprobs"] != pytest.approx(expected, abs=2e-3)
    error = error_of(post(server, "/score_continuations", {**body, "lora_path": "nope"}))
    assert error["param"] == "lora_path" and error["code"] == "lora_not_found"


def test_models_lists_the_adapters(server, client, case):
    ids = [m.id for m in client.models.list().data]
    assert ids[1:] == ["a"]
    card = requests.get(server.url + "/v1/models/a", timeout=TIMEOUT).json()
    assert card["parent"] == ids[0] and card["root"] == str(case.adapters["a"])
    info = requests.get(server.url + "/get_server_info", timeout=TIMEOUT).json()
    assert info["loaded_lora_adapters"] == {"a": str(case.adapters["a"])}


def test_unknown_adapters_are_400s(server, client):
    error = error_of(post(server, "/generate", {"text": PROMPT, "lora_path": "nope"}))
    assert error["param"] == "lora_path" and "'nope' is not loaded" in error["message"]
    assert error["code"] == "lora_not_found"
    error = error_of(post(server, "/generate", {"text": [PROMPT, PROMPT], "lora_path": ["a"]}))
    assert error["param"] == "lora_path" and "one entry per prompt" in error["message"]
    with pytest.raises(openai.BadRequestError, match="not loaded"):
        client.completions.create(
            model="default", prompt=PROMPT, max_tokens=2, extra_body={"lora_path": "nope"}
        )


def test_a_model_naming_no_loaded_adapter_is_a_404(server, client):
    """BASE:NAME with NAME not loaded, or the name of an adapter since unloaded, is
    OpenAI's 404 model_not_found, not the base model's output; any other `model` is the
    base model, as before."""
    served = client.models.list().data[0].id
    with pytest.raises(openai.NotFoundError, match="'typo' is not loaded"):
        client.completions.create(model=f"{served}:typo", prompt=PROMPT, max_tokens=2)
    anything = client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert anything.choices[0].finish_reason == "length"
    error = error_of(post(server, "/load_lora_adapter", {"lora_name": served, "lora_path": "/x"}))
    assert error["param"] == "lora_name" and "served model's name" in error["message"]


def test_load_and_unload_while_serving(server, case):
    path_b = str(case.adapters["b"])
    r = post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": path_b})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "success": True,
        "error_message": None,
        "loaded_adapters": {"a": str(case.adapters["a"]), "b": path_b},
    }
    out = generate(server, {"text": PROMPT, "sampling_params": GREEDY, "lora_path": "b"})
    assert out["output_ids"] == case.greedy(PROMPT, "b")
    again = post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": path_b})
    assert "already loaded" in error_of(again)["message"]
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})  # vLLM's path
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a": str(case.adapters["a"])}
    error = error_of(post(server, "/generate", {"text": PROMPT, "lora_path": "b"}))
    assert "'b' is not loaded" in error["message"]
    gone = post(server, "/v1/completions", {"model": "b", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and "'b' was unloaded" in gone.json()["error"]["message"]
    error = error_of(post(server, "/unload_lora_adapter", {"lora_name": "b"}))
    assert error["param"] == "lora_name"


def test_a_folder_that_cannot_be_served_is_a_400(server, tmp_path):
    r = post(server, "/load_lora_adapter", {"lora_name": "c", "lora_path": str(tmp_path)})
    body = r.json()
    assert r.status_code == 400 and body["success"] is False
    assert "adapter_config.json" in body["error_message"]
    assert body["error"]["param"] == "lora_path"
    assert "c" not in body["loaded_adapters"]
    error = error_of(post(server, "/load_lora_adapter", {"lora_name": "c"}))
    assert "lora_path" in error["message"]


def test_v1_loads_counts_the_adapters_in_use(server):
    """/v1/loads's lora section: the adapters the running requests use, out of
    --max-loras-per-batch (SGLang's default, 8)."""
    long = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
    body = {"text": PROMPT, "sampling_params": long, "lora_path": "a", "stream": True}
    body["rid"] = "loads-lora"
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith(b"data:"))  # running
        (load,) = requests.get(server.url + "/v1/loads", timeout=TIMEOUT).json()["loads"]
        assert post(server, "/abort_request", {"rid": "loads-lora"}).status_code == 200
        for _ in lines:  # to its end
            pass
    assert load["lora"] == {"slots_used": 1, "slots_total": 8, "utilization": 0.125}, load


def test_nothing_leaks(server):
    assert_kv_clean(server)
