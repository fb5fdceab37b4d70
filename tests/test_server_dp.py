"""Data parallelism end to end: `radixserve serve --dp-size 2` over the tiny model, two
scheduler processes behind one server. Each group of prompts sharing a prefix goes to the
replica that caches it (its later prompts hit), different groups spread over both replicas,
greedy outputs match the one-replica server's, a prefix cached under a LoRA adapter is
routed as that adapter's alone, control requests reach every replica, and a replica that
dies takes the server down with it."""

from __future__ import annotations

import json
import time

import psutil
import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from tests.server_utils import ServerProcess, assert_all_gone
from tests.test_lora import ADAPTERS, make_adapter

TIMEOUT = 120
SYSTEM = " ".join(f"rule {i}: be brief." for i in range(12))


@pytest.fixture(scope="module")
def dp_server(tiny_model_dirs, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp") / "server.log"
    flags = ("--model-path", str(tiny_model_dirs["llama"]), "--max-total-tokens", "4000")
    more = ("--enable-lora", "--enable-return-hidden-states")
    proc = ServerProcess(*flags, "--dp-size", "2", *more, log=log)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def generate(server: ServerProcess, text: str, lora_path: str | None = None) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    body["lora_path"] = lora_path
    r = requests.post(server.url + "/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def states(server: ServerProcess) -> list[dict]:
    r = requests.get(server.url + "/get_server_info", timeout=TIMEOUT)
    return r.json()["internal_states"]


def prompts() -> list[tuple[int, str]]:
    return [(g, f"group {g}. {SYSTEM} question {q}?") for q in range(3) for g in range(4)]


def test_groups_stick_to_a_replica_and_spread_over_both(dp_server):
    before = states(dp_server)
    assert [s["dp_rank"] for s in before] == [0, 1]
    assert before[0]["pid"] != before[1]["pid"]
    cached = {}
    for group, text in prompts():
        cached.setdefault(group, []).append(generate(dp_server, text)["meta_info"]["cached_tokens"])
    for group, hits in cached.items():
        assert hits[0] < 10 and min(hits[1:]) > 40, (group, hits)  # first misses, rest hit
    after = states(dp_server)
    served = [a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before)]
    assert min(served) > 0 and max(served) <= 2 * min(served), served  # groups split 2 / 2


def test_outputs_match_one_replica(dp_server, tiny_model_dirs, tmp_path):
    flags = ("--model-path", str(tiny_model_dirs["llama"]), "--max-total-tokens", "4000")
    single = ServerProcess(*flags, log=tmp_path / "single.log").wait_ready()
    try:
        for _, text in prompts()[:6]:
            assert generate(dp_server, text)["text"] == generate(single, text)["text"]
    finally:
        single.stop()


def test_an_adapters_prefixes_are_its_own(dp_server, tiny_model_dirs, tmp_path):
    """The dispatcher mirrors each replica's tree per adapter: a prompt cached for the base
    model is no hit for an adapter's request (a miss: it goes where there is room, the
    other replica), and the adapter's next request on that prefix follows its own."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"])
    folder = make_adapter(base, tmp_path / "adapter", seed=1, **ADAPTERS["a"])
    body = {"lora_name": "a", "lora_path": str(folder)}
    r = requests.post(dp_server.url + "/load_lora_adapter", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["success"], r.text
    requests.post(dp_server.url + "/flush_cache", timeout=TIMEOUT).raise_for_status()

    def replica_of(text: str, lora_path: str | None) -> tuple[int, int]:
        before = states(dp_server)
        cached = generate(dp_server, text, lora_path)["meta_info"]["cached_tokens"]
        after = states(dp_server)
        grew = zip(after, before)
        (rank,) = [i for i, (a, b) in enumerate(grew) if a["prompt_tokens"] != b["prompt_tokens"]]
        return rank, cached

    text = f"adapters. {SYSTEM} question"
    first, _ = replica_of(text + " 0?", None)
    second, cached = replica_of(text + " 1?", "a")
    assert second != first and cached == 0
    third, cached = replica_of(text + " 2?", "a")
    assert third == second and cached > 40
    requests.post(
        dp_server.url + "/unload_lora_adapter", json={"lora_name": "a"}, timeout=TIMEOUT
    ).raise_for_status()


def test_hidden_states_come_through_the_processes(dp_server, tiny_model_dirs):
    """return_hidden_states over HTTP (the scheduler, detokenizer and main processes), whole
    and streamed: transformers' final-norm hidden states of the prompt and the outputs."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"]).eval()
    body = {
        "text": "hidden states, please",
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        "return_hidden_states": True,
    }
    r = requests.post(dp_server.url + "/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out = r.json()
    prompt, *steps = out["meta_info"]["hidden_states"]
    assert len(prompt) == out["meta_info"]["prompt_tokens"] and len(steps) == 4
    tokens = requests.post(dp_server.url + "/tokenize", json={"prompt": body["text"]}, timeout=30)
    ids = tokens.json()["tokens"] + out["output_ids"][:-1]
    with torch.no_grad():
        expected = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    assert torch.allclose(torch.tensor(prompt + steps), expected, atol=1e-4)
    with requests.post(
        dp_server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=TIMEOUT
    ) as streamed:
        chunks = [
            json.loads(line[6:])
            for line in streamed.iter_lines(decode_unicode=True)
            if line.startswith("data: {")
        ]
    assert all("hidden_states" not in c["meta_info"] for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["hidden_states"] == out["meta_info"]["hidden_states"]


def test_flush_reaches_every_replica(dp_server):
    generate(dp_server, prompts()[0][1])
    r = requests.post(dp_server.url + "/flush_cache", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    for s in states(dp_server):
        assert s["kv_free"] == s["kv_total"] and s["kv_held_by_requests"] == 0, s


def test_a_dead_replica_stops_the_server(dp_server):
    replica = psutil.Process(states(dp_server)[1]["pid"])
    replica.kill()
    deadline = time.monotonic() + 30
    while dp_server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dp_server.proc.returncode == 1, "the server outlived a dead replica"
    assert_all_gone(dp_server.children)  # the other replica and the detokenizer too
