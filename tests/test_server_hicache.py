"""The hierarchical cache through the real server: cached tokens by source in meta_info,
in OpenAI usage (the official client) and in /metrics, the tiers in /get_server_info, and
the disk tier surviving a restart (serve, SIGTERM, serve again on the same folder: the
same prompts hit the disk tier and give the same greedy outputs)."""

from __future__ import annotations

import time

import openai
import pytest
import requests

from tests.server_utils import ServerProcess

# a pool of 256 tokens; eight prompts of 130 tokens: the first ones are evicted (to the
# host tier) by the later ones, and each has two full 64-token pages for the disk tier
PROMPTS = [[(29 * i + 7 * j) % 250 + 30 for j in range(130)] for i in range(8)]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def hicache_server(model_dir, log, storage) -> ServerProcess:
    return ServerProcess(
        "--model-path", str(model_dir),
        "--max-total-tokens", "256",
        "--enable-hierarchical-cache",
        "--hicache-ratio", "8",
        "--hicache-storage-dir", str(storage),
        log=log,
    ).wait_ready()  # fmt: skip


def generate(url: str, ids: list[int]) -> dict:
    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


def metrics_once(url: str, name: str, at_least: float, **labels: str) -> str:
    """/metrics once the scheduler's periodic state (a fraction of a second behind the
    last request) shows `name` >= `at_least`; the last text after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        text = requests.get(url + "/metrics").text
        if metric(text, name, **labels) >= at_least or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    head = f"{name}{{{want}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(head + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{head} not in /metrics")


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-pages")


def test_tiers_reported_and_the_disk_tier_survives_a_restart(tiny_model_dirs, storage, tmp_path):
    model = tiny_model_dirs["llama"]
    first = hicache_server(model, tmp_path / "first.log", storage)
    try:
        cold = [generate(first.url, p) for p in PROMPTS]
        assert all(c["meta_info"]["cached_tokens_details"]["host"] == 0 for c in cold)
        again = [generate(first.url, p) for p in PROMPTS[:2]]  # evicted: back from the host
        for a, c in zip(again, cold):
            assert a["output_ids"] == c["output_ids"]
            details = a["meta_info"]["cached_tokens_details"]
            assert details["host"] > 0 and sum(details.values()) == a["meta_info"]["cached_tokens"]
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="none")
        completion = client.completions.create(
            model=client.models.list().data[0].id, prompt=PROMPTS[2], max_tokens=2, temperature=0
        )
        usage = completion.usage.model_dump()["prompt_tokens_details"]
        assert usage["cached_tokens"] > 0
        assert sum(usage["cached_tokens_details"].values()) == usage["cached_tokens"]
        metrics = metrics_once(first.url, "radixserve_hicache_load_back_tokens_total", 1)
        assert metric(metrics, "radixserve_cached_tokens_by_tier_total", tier="host") > 0
        assert metric(metrics, "radixserve_hicache_load_back_tokens_total") > 0
        assert metric(metrics, "radixserve_hicache_used_tokens", tier="host") > 0
        state = requests.get(first.url + "/get_server_info").json()
        assert state["enable_hierarchical_cache"] is True
        internal = state["internal_states"][0]
        assert internal["hicache_host_total"] > 0 and internal["hicache_disk_pages_written"] >= 0
    finally:
        assert first.stop() == 0  # SIGTERM: the scheduler lets its page writes land
    assert len(list(storage.rglob("*.kv"))) >= len(PROMPTS)

    second = hicache_server(model, tmp_path / "second.log", storage)
    try:
        warm = [generate(second.url, p) for p in PROMPTS[:3]]
        for w, c in zip(warm, cold):
            assert w["output_ids"] == c["output_ids"]
            assert w["meta_info"]["cached_tokens_details"]["disk"] >= 128, w["meta_info"]
        by_tier = "radixserve_cached_tokens_by_tier_total"
        metrics = metrics_once(second.url, by_tier, 3 * 128, tier="disk")
        assert metric(metrics, "radixserve_cached_tokens_by_tier_total", tier="disk") >= 3 * 128
        assert metric(metrics, "radixserve_hicache_disk_read_pages_total") >= 6
    finally:
        assert second.stop() == 0
