"""The hierarchical cache in the engine: greedy outputs identical to transformers with the
host tier on (each write policy, chunked prefill, pages, batching, a forced retraction),
prefixes evicted from the KV pool found again in the host tier (cached tokens by source
say so), a reduced-precision host tier, and the disk tier surviving a restart, a corrupt
page file skipped with a log line, never loaded."""

from __future__ import annotations

import logging

import pytest

from radixserve.config import Config, HiCacheConfig
from tests.reference import reference_greedy
from tests.test_engine import greedy, make_engine

STEPS = 8
HOST = {"enable_hierarchical_cache": True, "hicache_ratio": 4.0}  # room for all six
# six conversations' prefixes of 60 tokens, each asked twice: a pool of 200 tokens holds
# about three, so the second round finds the first ones only in the host tier
PREFIXES = [[(37 * i + 11 * j) % 300 + 20 for j in range(60)] for i in range(6)]
ROUNDS = [[p + [400 + r, 401 + r] for p in PREFIXES] for r in range(3)]


@pytest.fixture(scope="module")
def expected(reference) -> dict[tuple, list[int]]:
    return {tuple(p): reference_greedy(reference, p, STEPS) for rnd in ROUNDS for p in rnd}


def tiers(engine) -> dict:
    state = engine.get_server_info()["internal_states"][0]
    return {k.removeprefix("hicache_"): v for k, v in state.items() if k.startswith("hicache_")}


def finish_tiers(engine) -> None:
    engine.check_kv_accounting()  # the tree recounts both tiers too
    assert engine.flush_cache()
    host = engine.scheduler.kv.hitree.host_pool
    assert host.allocator.num_free == host.size, "a host slot leaked"
    assert engine.runner.allocator.num_free == engine.runner.max_total_tokens
    engine.shutdown()


@pytest.mark.parametrize(
    "config",
    [
        {"hicache_write_policy": "write_back"},
        {"hicache_write_policy": "write_through"},
        {"hicache_write_policy": "write_through_selective"},
        {"chunked_prefill_size": 16},
        {"page_size": 4},
        {"speculative_algorithm": "none"},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_greedy_identical_with_the_host_tier(tiny_model_dirs, expected, config):
    engine = make_engine(tiny_model_dirs, max_total_tokens=200, **HOST, **config)
    host_hits = []
    # write_through_selective copies a node once matched twice: each first prompt thrice
    repeat = 3 if config.get("hicache_write_policy") == "write_through_selective" else 1
    for r, rnd in enumerate(ROUNDS):
        for prompt in rnd:  # one at a time: each evicts the least recently used prefix
            for _ in range(repeat if r == 0 else 1):
                out = engine.generate(input_ids=prompt, sampling_params=greedy(STEPS))
                assert out["output_ids"] == expected[tuple(prompt)]
                host_hits.append(out["meta_info"]["cached_tokens_details"]["host"])
                engine.check_kv_accounting()
    assert sum(host_hits) > 0, "later rounds should load prefixes back from the host tier"
    t = tiers(engine)
    assert t["cached_tokens_host"] == sum(host_hits) and t["load_back_tokens"] >= sum(host_hits)
    assert t["write_back_tokens"] > 0 and t["host_used"] > 0
    finish_tiers(engine)


def test_batched_and_retracted_with_the_host_tier(tiny_model_dirs, expected):
    engine = make_engine(
        tiny_model_dirs,
        max_total_tokens=200,
        init_new_token_ratio=0.1,
        min_new_token_ratio=0.01,
        chunked_prefill_size=32,
        **HOST,
    )
    for rnd in ROUNDS[:2]:
        results = engine.generate(input_ids=rnd, sampling_params=greedy(STEPS))
        for prompt, result in zip(rnd, results):
            assert result["output_ids"] == expected[tuple(prompt)]
        engine.check_kv_accounting()
    assert tiers(engine)["write_back_tokens"] > 0
    finish_tiers(engine)


def test_without_the_host_tier_the_same_load_recomputes(tiny_model_dirs, expected):
    """The control: the same rounds without tiers find (almost) nothing cached."""
    engine = make_engine(tiny_model_dirs, max_total_tokens=200)
    cached = 0
    for rnd in ROUNDS[:2]:
        for prompt in rnd:
            out = engine.generate(input_ids=prompt, sampling_params=greedy(STEPS))
            assert out["output_ids"] == expected[tuple(prompt)]
            assert "cached_tokens_details" not in out["meta_info"]
            cached += out["meta_info"]["cached_tokens"]
    with_tier = make_engine(tiny_model_dirs, max_total_tokens=200, **HOST)
    cached_tier = 0
    for rnd in ROUNDS[:2]:
        for prompt in rnd:
            out = with_tier.generate(input_ids=prompt, sampling_params=greedy(STEPS))
            cached_tier += out["meta_info"]["cached_tokens"]
    assert cached_tier > cached + 200, (cached_tier, cached)
    engine.shutdown()
    finish_tiers(with_tier)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_narrower_host_tier_holds_more_and_still_serves(tiny_model_dirs, expected, dtype):
    engine = make_engine(
        tiny_model_dirs, max_total_tokens=200, **{**HOST, "hicache_ratio": 1.0}, hicache_dtype=dtype
    )
    fp32_tokens = 200  # a ratio of 1 in float32 would hold the pool's size
    assert engine.scheduler.kv.hitree.host_pool.size >= 1.9 * fp32_tokens
    agree = total = 0
    for rnd in ROUNDS[:2]:
        for prompt in rnd:
            out = engine.generate(input_ids=prompt, sampling_params=greedy(STEPS))
            want = expected[tuple(prompt)]
            agree += sum(a == b for a, b in zip(out["output_ids"], want))
            total += len(want)
    assert tiers(engine)["cached_tokens_host"] > 0
    assert agree / total > 0.5, f"{dtype} host tier: {agree}/{total} greedy tokens agree"
    finish_tiers(engine)


def test_the_disk_tier_survives_a_restart(tiny_model_dirs, reference, tmp_path, caplog):
    disk = {**HOST, "hicache_storage_dir": str(tmp_path / "kv")}
    prompts = [PREFIXES[i] * 2 + [400, 401] for i in range(3)]  # 122 tokens: 1 full page each
    first = make_engine(tiny_model_dirs, max_total_tokens=1024, **disk)
    cold = [first.generate(input_ids=p, sampling_params=greedy(STEPS)) for p in prompts]
    assert all(r["meta_info"]["cached_tokens_details"]["disk"] == 0 for r in cold)
    first.shutdown()  # lets the queued page writes land
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert len(files) >= len(prompts), files

    again = make_engine(tiny_model_dirs, max_total_tokens=1024, **disk)
    warm = [again.generate(input_ids=p, sampling_params=greedy(STEPS)) for p in prompts]
    for c, w, p in zip(cold, warm, prompts):
        assert w["output_ids"] == c["output_ids"] == reference_greedy(reference, p, STEPS)
        assert w["meta_info"]["cached_tokens_details"]["disk"] >= 64, w["meta_info"]
    t = tiers(again)
    assert t["disk_pages_read"] >= len(prompts) and t["cached_tokens_disk"] >= 64 * len(prompts)
    finish_tiers(again)

    for f in files:  # every page damaged: detected, logged, skipped, recomputed
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING)
    third = make_engine(tiny_model_dirs, max_total_tokens=1024, **disk)
    results = [third.generate(input_ids=p, sampling_params=greedy(STEPS)) for p in prompts]
    for c, r in zip(cold, results):
        assert r["output_ids"] == c["output_ids"]
        assert r["meta_info"]["cached_tokens_details"]["disk"] == 0
    assert tiers(third)["disk_corrupt_skipped"] >= 1
    assert any(
        "disk" in rec.getMessage().lower() or ".kv" in rec.getMessage()
        for rec in caplog.records
        if rec.levelno >= logging.WARNING
    )
    finish_tiers(third)


def test_flags_are_checked():
    with pytest.raises(ValueError, match="needs --enable-hierarchical-cache"):
        HiCacheConfig(hicache_storage_dir="/tmp/x")
    with pytest.raises(ValueError, match="hicache_write_policy"):
        HiCacheConfig(hicache_write_policy="sometimes")
    with pytest.raises(ValueError, match="hicache_dtype"):
        HiCacheConfig(hicache_dtype="fp8")
    with pytest.raises(ValueError, match="radix cache"):
        Config.from_flat(enable_hierarchical_cache=True, disable_radix_cache=True)


def test_the_forward_waits_for_loaded_rows_layer_by_layer(tiny_model_dirs, monkeypatch):
    """Load backs are handed to the next forward, whose attention waits for each layer's
    rows just before reading that layer (on CUDA the copies overlap the layers before)."""
    from radixserve.cache.host_pool import LoadHandle

    waited: list[int] = []
    real = LoadHandle.wait_layer
    monkeypatch.setattr(LoadHandle, "wait_layer", lambda h, i: (waited.append(i), real(h, i)))
    engine = make_engine(tiny_model_dirs, max_total_tokens=200, **HOST)
    for rnd in ROUNDS[:2]:
        for prompt in rnd:
            engine.generate(input_ids=prompt, sampling_params=greedy(STEPS))
    loads = tiers(engine)["load_back_tokens"]
    assert loads > 0 and waited, "a load back should have been waited on"
    layers = engine.runner.hf_config.num_hidden_layers
    assert sorted(set(waited)) == list(range(layers))
    assert engine.scheduler.kv.hitree.pending_loads == [], "every load handed to a forward"
    finish_tiers(engine)


def test_a_failing_disk_tier_fails_no_request(tiny_model_dirs, expected, tmp_path, caplog):
    """The disk tier's faults are misses and lost writes, logged: requests still succeed."""
    engine = make_engine(
        tiny_model_dirs, max_total_tokens=1024, hicache_storage_dir=str(tmp_path), **HOST
    )
    engine.scheduler.kv.storage.store.close()  # every later write or read now raises
    caplog.set_level(logging.ERROR)
    for prompt in ROUNDS[0][:2]:
        out = engine.generate(input_ids=prompt, sampling_params=greedy(STEPS))
        assert out["output_ids"] == expected[tuple(prompt)]
    assert tiers(engine)["disk_errors"] >= 1
    assert any("disk tier" in r.getMessage() for r in caplog.records)
    finish_tiers(engine)
