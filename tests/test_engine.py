"""The scheduler through the offline Engine API: greedy outputs identical to transformers
whether requests run alone, batched, with a cached prefix, chunked, or retracted; cached
tokens reported; KV accounting exact after every scenario."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import pytest
import torch

from radixserve import Engine
from tests.conftest import FP32
from tests.reference import reference_greedy, reference_logits

STEPS = 24
SHARED = [(7 * i) % 400 + 50 for i in range(200)]  # a 200-token shared prefix
PROMPTS = [SHARED + [11, 12, 13], SHARED + [21, 22], [5, 6, 7, 8, 9], SHARED[:37] + [99] * 9]


def greedy(max_new_tokens: int = STEPS, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def expected(reference) -> list[list[int]]:
    return [reference_greedy(reference, p, STEPS) for p in PROMPTS]


def make_engine(tiny_model_dirs, **config) -> Engine:
    # a pool as large as these scenarios need: the default one (a quarter of RAM) would be
    # pre-faulted by every engine
    config.setdefault("max_total_tokens", 16384)
    return Engine(str(tiny_model_dirs["llama"]), progress=False, dtype=FP32, **config)


def finish(engine: Engine) -> None:
    """Every scenario ends with the accounting exact, and with nothing leaked after flush."""
    engine.check_kv_accounting()
    assert engine.flush_cache()
    assert engine.runner.allocator.num_free == engine.runner.max_total_tokens
    engine.shutdown()


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"chunked_prefill_size": 1},
        {"chunked_prefill_size": 7},
        {"chunked_prefill_size": 64},
        {"disable_radix_cache": True},
        {"schedule_policy": "lpm"},
        {"schedule_policy": "dfs-weight"},
        {"page_size": 4},
        {"enable_mixed_chunk": False},
        {"enable_mixed_chunk": False, "chunked_prefill_size": 7},
        {"chunked_prefill_size": 3, "page_size": 4},
        {"enable_hierarchical_cache": True},  # pressure on it: tests/test_hicache_engine.py
        {"enable_hierarchical_cache": True, "hicache_write_policy": "write_through"},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default",
)
def test_greedy_identical_alone_batched_and_cached(tiny_model_dirs, expected, config):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096, **config)
    alone = [engine.generate(input_ids=p, sampling_params=greedy()) for p in PROMPTS]
    batched = engine.generate(input_ids=PROMPTS, sampling_params=greedy())  # prefixes cached
    for i, want in enumerate(expected):
        assert alone[i]["output_ids"] == want, f"prompt {i} alone"
        assert batched[i]["output_ids"] == want, f"prompt {i} batched"
    finish(engine)


@pytest.mark.parametrize("mixed", [False, True], ids=["alternating", "mixed-chunk"])
def test_forced_retraction_keeps_outputs_identical(tiny_model_dirs, reference, mixed):
    """A pool too small for all requests' outputs: decode retracts and re-admits."""
    engine = make_engine(
        tiny_model_dirs,
        max_total_tokens=160,
        init_new_token_ratio=0.1,
        min_new_token_ratio=0.01,
        enable_mixed_chunk=mixed,
        chunked_prefill_size=16,
    )
    prompts = [[(13 * i + 5 * j) % 500 + 3 for j in range(20)] for i in range(6)]
    results = engine.generate(input_ids=prompts, sampling_params=greedy())
    assert engine.scheduler.stats.retractions > 0, "the scenario should force a retraction"
    for prompt, result in zip(prompts, results):
        assert result["output_ids"] == reference_greedy(reference, prompt, STEPS)
    finish(engine)


def test_cached_tokens_reported_and_second_request_faster(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096)
    first = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(4))
    second = engine.generate(input_ids=PROMPTS[1], sampling_params=greedy(4))
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= 200
    assert second["meta_info"]["prompt_tokens"] == len(PROMPTS[1])
    finish(engine)


def test_page_aligned_cached_tokens(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096, page_size=16)
    engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(2))
    second = engine.generate(input_ids=PROMPTS[1], sampling_params=greedy(2))
    assert second["meta_info"]["cached_tokens"] == 192  # 200 shared, rounded down to pages
    finish(engine)


def test_logprobs_of_a_cached_prefix_equal_those_from_scratch(tiny_model_dirs, reference):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096)
    kwargs = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    cold = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(4), **kwargs)
    warm = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(4), **kwargs)
    cold_in = cold["meta_info"]["input_token_logprobs"]
    warm_in = warm["meta_info"]["input_token_logprobs"]
    assert len(cold_in) == len(PROMPTS[0]) and cold_in[0][0] is None
    ref = torch.log_softmax(reference_logits(reference, PROMPTS[0]), dim=-1)
    for pos in range(1, len(PROMPTS[0])):
        assert abs(cold_in[pos][0] - ref[pos - 1, PROMPTS[0][pos]].item()) < 1e-4
        assert abs(warm_in[pos][0] - cold_in[pos][0]) < 1e-4
    out_lp = [e[0] for e in warm["meta_info"]["output_token_logprobs"]]
    assert out_lp == pytest.approx(
        [e[0] for e in cold["meta_info"]["output_token_logprobs"]], abs=1e-4
    )
    assert len(warm["meta_info"]["output_top_logprobs"][0]) == 3
    finish(engine)


def test_token_ids_logprob_match_the_reference(tiny_model_dirs, reference):
    """The named tokens' logprobs at every prompt and output position equal transformers'
    log-softmax there, chunked prefill and a cached prefix included."""
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096, chunked_prefill_size=64)
    named = [7, 3, 300]
    kwargs = dict(return_logprob=True, logprob_start_len=0, token_ids_logprob=named)
    for _ in range(2):  # cold, then its prompt cached
        out = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(4), **kwargs)
        meta = out["meta_info"]
        ids = PROMPTS[0] + out["output_ids"]
        ref = torch.log_softmax(reference_logits(reference, ids), dim=-1)
        rows = meta["input_token_ids_logprobs"][1:] + meta["output_token_ids_logprobs"]
        assert meta["input_token_ids_logprobs"][0] == [] and len(rows) == len(ids) - 1
        got = torch.tensor([[e[0] for e in row] for row in rows])
        assert [[e[1] for e in row] for row in rows] == [named] * len(rows)
        torch.testing.assert_close(got, ref[: len(rows), named], atol=1e-4, rtol=0)
    finish(engine)


def test_stop_conditions_and_finish_reasons(tiny_model_dirs, expected):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096)
    tok = engine.tokenizer
    want = expected[2]
    by_id = engine.generate(input_ids=PROMPTS[2], sampling_params=greedy(stop_token_ids=[want[3]]))
    assert by_id["output_ids"] == want[: want.index(want[3]) + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": want[3]}

    full_text = tok.decode(want)
    stop = full_text[len(tok.decode(want[:5])) :][:3]  # likely spans a token boundary
    if stop.strip():
        by_str = engine.generate(input_ids=PROMPTS[2], sampling_params=greedy(stop=[stop]))
        assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in by_str["text"] and full_text.startswith(by_str["text"])
        kept = engine.generate(
            input_ids=PROMPTS[2], sampling_params=greedy(stop=[stop], no_stop_trim=True)
        )
        assert stop in kept["text"]
        # the same stop as a regex, with a character class: trimmed at its first match
        pattern = re.escape(stop[:-1]) + "[" + re.escape(stop[-1]) + "]"
        by_re = engine.generate(input_ids=PROMPTS[2], sampling_params=greedy(stop_regex=pattern))
        assert by_re["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert by_re["text"] == by_str["text"]

    held = engine.generate(
        input_ids=PROMPTS[2],
        sampling_params=greedy(6, min_new_tokens=5, stop_token_ids=[want[0]]),
    )
    assert len(held["output_ids"]) >= 5 and want[0] not in held["output_ids"][:5]
    length = engine.generate(input_ids=PROMPTS[2], sampling_params=greedy(3))
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    prefill_only = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(0))
    assert prefill_only["output_ids"] == []
    assert prefill_only["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    finish(engine)


def test_a_backtracking_stop_regex_ends_its_request_alone(tiny_model_dirs, expected):
    """`(?:.|\\s|\\S)+(?!)` tries 3^n ways over n characters (Python's `re` would take years
    at 30): its search hits the time limit, which ends that request with an abort naming
    the pattern; the request batched beside it is unaffected."""
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096)
    pattern = r"(?:.|\s|\S)+(?!)"
    results: dict[str, dict] = {}

    def run(name: str, prompt: list[int], params: dict) -> None:
        results[name] = engine.generate(input_ids=prompt, sampling_params=params)

    threads = [
        threading.Thread(target=run, args=("slow", PROMPTS[2], greedy(stop_regex=pattern))),
        threading.Thread(target=run, args=("other", PROMPTS[1], greedy())),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reason = results["slow"]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and repr(pattern) in reason["message"], reason
    assert "backtracks" in reason["message"]
    assert results["slow"]["output_ids"] == expected[2][: len(results["slow"]["output_ids"])]
    assert results["other"]["output_ids"] == expected[1]
    finish(engine)


def test_streaming_is_cumulative(tiny_model_dirs, expected):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096)
    chunks = list(engine.generate(input_ids=PROMPTS[2], sampling_params=greedy(8), stream=True))
    assert chunks[-1]["output_ids"] == expected[2][:8]
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    finish(engine)


def test_concurrent_threads_and_asyncio_are_batched(tiny_model_dirs, expected):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096)
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        results[i] = engine.generate(input_ids=PROMPTS[i], sampling_params=greedy())["output_ids"]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(PROMPTS))] == expected

    async def main():
        return await asyncio.gather(
            *(engine.async_generate(input_ids=p, sampling_params=greedy()) for p in PROMPTS)
        )

    assert [r["output_ids"] for r in asyncio.run(main())] == expected
    finish(engine)


def test_abort_frees_everything(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096)
    stream = engine.generate(
        input_ids=PROMPTS[0], sampling_params=greedy(500), stream=True, rid="victim"
    )
    first = next(stream)
    assert first["meta_info"]["finish_reason"] is None
    engine.abort("victim")
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"

    # a call of n > 1 given a rid: aborting that rid ends all of its sequences
    # ({rid}_{j}); another call whose rid merely starts the same way runs on
    results = {}
    calls = {
        "pair": {"input_ids": PROMPTS[0], "sampling_params": {**greedy(500), "n": 2}},
        "pair_x": {"input_ids": PROMPTS[1], "sampling_params": greedy(30)},
    }
    threads = [
        threading.Thread(target=lambda r=r: results.update({r: engine.generate(rid=r, **calls[r])}))
        for r in calls
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while len(engine._transport.named("pair")) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.abort("pair")
    for thread in threads:
        thread.join(120)
    assert [r["meta_info"]["finish_reason"]["type"] for r in results["pair"]] == ["abort"] * 2
    assert results["pair_x"]["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    finish(engine)


def test_invalid_requests_are_clear_errors(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs, max_total_tokens=512)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(input_ids=[1, 2], sampling_params={"temperature": -1})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        engine.generate(input_ids=[1, 2], sampling_params={"temprature": 1})
    with pytest.raises(ValueError, match="KV pool"):
        engine.generate(input_ids=[1] * 400, sampling_params={"max_new_tokens": 200})
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[], sampling_params={})
    with pytest.raises(ValueError, match="input_ids must be token ids"):
        engine.generate(input_ids=[1, 99999], sampling_params={})
    with pytest.raises(ValueError, match="input_ids must be token ids"):
        engine.generate(input_ids=["a", "b"], sampling_params={})
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate(input_ids=[1], sampling_params={"logit_bias": {"99999": 1.0}})
    finish(engine)


def test_random_seed_makes_unseeded_sampling_repeat(tiny_model_dirs):
    """--random-seed: requests without a seed of their own sample the same tokens in a run
    started from the same seed, whatever greedy requests came between; others in a run
    from another."""
    sampled = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    greedy = {"max_new_tokens": 4, "temperature": 0}
    runs = []
    for seed, between in ((7, False), (7, True), (8, False)):
        engine = make_engine(tiny_model_dirs, max_total_tokens=512, random_seed=seed)
        outputs = []
        for _ in range(2):
            outputs.append(engine.generate(input_ids=[5, 6, 7], sampling_params=sampled))
            if between:  # (draws no seed: the next sampled request's is as without it)
                engine.generate(input_ids=[9, 9], sampling_params=greedy)
        runs.append([out["output_ids"] for out in outputs])
        finish(engine)
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]  # (each request its own draws)
    assert runs[2] != runs[0]


def test_batches_are_logged_as_sglang_logs_them(tiny_model_dirs, caplog):
    """Each prefill batch, and one decode step in --decode-log-interval, at INFO."""
    engine = make_engine(tiny_model_dirs, max_total_tokens=512, decode_log_interval=3)
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with caplog.at_level(logging.INFO, logger="radixserve.scheduler.loop"):
        engine.generate(input_ids=list(range(5, 25)), sampling_params=greedy)
        engine.generate(input_ids=list(range(5, 25)) + [7], sampling_params=greedy)
    finish(engine)
    lines = [r.getMessage() for r in caplog.records if "batch" in r.getMessage()]
    prefills = [line for line in lines if line.startswith("Prefill batch")]
    decodes = [line for line in lines if line.startswith("Decode batch")]
    first = "Prefill batch. #new-seq: 1, #new-token: 20, #cached-token: 0, token usage: 0.04,"
    assert prefills[0].startswith(first)  # (20 of 512 slots: its prompt, locked in the tree)
    assert "#new-token: 1, #cached-token: 20" in prefills[1]  # (the first prompt's K/V)
    assert len(decodes) == 14 // 3
    held = int(re.search(r"#running-req: 1, #token: (\d+), ", decodes[0]).group(1))
    assert 20 < held <= 28  # (its prompt and the tokens generated so far)
    assert "gen throughput (token/s): " in decodes[0]


def test_context_length_bounds_requests_within_the_models_own(tiny_model_dirs):
    """--context-length: a sequence longer than it is refused, one within it runs; one
    longer than the model's own context (2048 here) stops the start, named."""
    from radixserve.model.loader import ModelLoadError

    engine = make_engine(tiny_model_dirs, max_total_tokens=512, context_length=64)
    info = engine.get_server_info()
    assert (info["context_length"], info["max_req_input_len"]) == (64, 63)
    with pytest.raises(ValueError, match="exceeds the context length 64"):
        engine.generate(input_ids=[1] * 60, sampling_params={"max_new_tokens": 10})
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    out = engine.generate(input_ids=[1] * 50, sampling_params=greedy)
    assert out["meta_info"]["completion_tokens"] == 10
    finish(engine)
    with pytest.raises(ModelLoadError, match="--context-length 4096 is longer than the model"):
        make_engine(tiny_model_dirs, max_total_tokens=512, context_length=4096)


@pytest.mark.parametrize("policy", ["fcfs", "lof", "random", "priority", "lpm", "dfs-weight"])
def test_every_policy_completes_every_request(tiny_model_dirs, expected, policy):
    engine = make_engine(
        tiny_model_dirs, max_total_tokens=1024, schedule_policy=policy, max_running_requests=2
    )
    results = engine.generate(input_ids=PROMPTS, sampling_params=greedy())
    assert [r["output_ids"] for r in results] == expected
    finish(engine)


def test_engine_with_the_default_model_answers():
    with Engine(progress=False, max_total_tokens=2048, dtype=FP32) as engine:
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        out = engine.generate(text, {"temperature": 0, "max_new_tokens": 16})
        assert "Paris" in out["text"]
        info = engine.get_server_info()
        assert info["max_total_num_tokens"] == 2048 and info["internal_states"]


def test_shutdown_fails_waiters_instead_of_hanging(tiny_model_dirs):
    from radixserve.engine import EngineDeadError

    engine = make_engine(tiny_model_dirs, max_total_tokens=4096)
    stream = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(1000), stream=True)
    next(stream)
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        list(stream)
    with pytest.raises(EngineDeadError):
        engine.generate(input_ids=[1, 2], sampling_params=greedy(2))
    # control calls too (they used to wait forever on a loop that had ended)
    for call in (engine.get_server_info, engine.flush_cache, engine.check_kv_accounting):
        with pytest.raises(EngineDeadError):
            call()
