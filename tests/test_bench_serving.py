"""`radixserve bench serving`: the workload generators, the figures, and whole runs against a
real server (the tiny random-weight Llama) for every backend and dataset.

Figures are checked for consistency (counts, lengths, ordering of percentiles), never for
speed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from radixserve.bench import datasets
from radixserve.bench.serving import (
    CompletionsBackend,
    NativeBackend,
    RequestRecord,
    Session,
    Slo,
    TokenTrie,
    compute_figures,
    optimum_cache_hit_rate,
    ttft_by_turn,
)
from radixserve.cli import main
from tests.conftest import TINY_TOKENIZER
from tests.server_utils import ServerProcess, free_port

KV_TOKENS = "8192"
CONTEXT = 2048  # the tiny model's context


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


# -- datasets -----------------------------------------------------------------------------------
def test_random_ids_lengths_stay_in_range(tokenizer):
    work = datasets.random_workload(tokenizer, 50, 40, 10, 0.5, seed=1, as_ids=True)
    assert len(work) == 50
    for conv in work:
        (prompt,), (n_out,) = conv.questions, conv.output_lens
        assert 20 <= len(prompt) <= 40 and 5 <= n_out <= 10
        assert all(datasets.FIRST_RANDOM_ID <= i < len(tokenizer) for i in prompt)
    assert len({len(c.questions[0]) for c in work}) > 1  # lengths do vary


def test_random_text_is_about_the_asked_length_and_repeatable(tokenizer):
    work = datasets.random_workload(tokenizer, 10, 64, 8, 1.0, seed=3, as_ids=False)
    again = datasets.random_workload(tokenizer, 10, 64, 8, 1.0, seed=3, as_ids=False)
    assert work == again
    for conv in work:
        assert isinstance(conv.questions[0], str) and conv.output_lens == [8]
        assert 48 <= len(tokenizer.encode(conv.questions[0], add_special_tokens=False)) <= 64


def test_shared_prefix_prompts_share_their_groups_system_prompt():
    prompts = datasets.shared_prefix_prompts(3, 4, 20, 5, vocab_size=500, seed=0)
    assert len(prompts) == 12 and all(len(p) == 25 for p in prompts)
    systems = [tuple(p[:20]) for p in prompts]
    assert systems[:4] == [systems[0]] * 4 and len(set(systems)) == 3
    assert len({tuple(p[20:]) for p in prompts}) == 12


def test_shared_prefix_workload_is_shuffled_groups(tokenizer):
    work = datasets.shared_prefix_workload(tokenizer, 3, 4, 32, 8, 6, seed=0)
    assert len(work) == 12 and all(c.output_lens == [6] for c in work)
    systems = [c.questions[0].split("\n\n")[0] for c in work]
    assert len(set(systems)) == 3 and all(systems.count(s) == 4 for s in systems)
    grouped = sorted(systems, key=systems.index)
    assert systems != grouped  # shuffled, not group after group


def test_multi_turn_workload_structure(tokenizer):
    work = datasets.multi_turn_workload(tokenizer, 5, 3, 16, 4, seed=0)
    assert len(work) == 5
    for conv in work:
        assert conv.num_turns == 3 and conv.output_lens == [4, 4, 4]
        assert all(isinstance(q, str) and q for q in conv.questions)
    assert len({q for c in work for q in c.questions}) == 15


def test_multi_turn_system_prompts_are_shared_within_a_group(tokenizer):
    plain = datasets.multi_turn_workload(tokenizer, 6, 3, 16, 4, seed=0)
    work = datasets.multi_turn_workload(
        tokenizer, 6, 3, 16, 4, seed=0, system_prompt_len=40, conversations_per_system=4
    )
    again = datasets.multi_turn_workload(
        tokenizer, 6, 3, 16, 4, seed=0, system_prompt_len=40, conversations_per_system=4
    )
    assert work == again  # deterministic from the seed
    systems = []
    for conv, base in zip(work, plain):
        first = conv.questions[0]
        assert first.endswith("\n\n" + base.questions[0])  # the system prompt, then the question
        systems.append(first[: -len("\n\n" + base.questions[0])])
        assert conv.questions[1:] == base.questions[1:]  # later turns extend the first
        assert conv.output_lens == [4, 4, 4]
    assert systems[:4] == [systems[0]] * 4  # conversations 0-3 share one, 4-5 another
    assert systems[4:] == [systems[4]] * 2 and systems[4] != systems[0]
    for system in (systems[0], systems[4]):
        assert 30 <= len(tokenizer.encode(system, add_special_tokens=False)) <= 40
    other_seed = datasets.multi_turn_workload(
        tokenizer, 6, 3, 16, 4, seed=1, system_prompt_len=40, conversations_per_system=4
    )
    assert not other_seed[0].questions[0].startswith(systems[0])


def test_conversation_rejects_multi_turn_token_ids():
    with pytest.raises(AssertionError):
        datasets.Conversation([[1, 2], [3]], [1, 1])


def sharegpt_entries() -> list[dict]:
    def entry(*turns: tuple[str, str]) -> dict:
        return {"conversations": [{"from": f, "value": v} for f, v in turns]}

    long_answer = "the answer goes on and on about many things " * 3
    return [
        entry(("human", "What is the capital of France, please?"), ("gpt", long_answer)),
        entry(
            ("system", "be brief"),
            ("human", "Tell me about the radix tree cache."),
            ("gpt", long_answer),
            ("human", "more"),
            ("gpt", "no"),
        ),
        entry(("human", "Explain prefix caching in a few words."), ("gpt", long_answer)),
        entry(("human", "hi"), ("gpt", long_answer)),  # prompt too short: skipped
        entry(("gpt", "an answer with no question")),  # no exchange: skipped
        {"id": "no conversations at all"},
    ]


def test_sharegpt_takes_the_first_exchange_and_skips_the_rest(tokenizer, tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(sharegpt_entries()))
    work = datasets.sharegpt_workload(tokenizer, path, 10, None, seed=0)
    assert len(work) == 3
    prompts = {c.questions[0] for c in work}
    assert "Tell me about the radix tree cache." in prompts and "hi" not in prompts
    answer_len = len(tokenizer.encode(sharegpt_entries()[0]["conversations"][1]["value"]))
    assert all(c.output_lens == [answer_len] for c in work)
    fixed = datasets.sharegpt_workload(tokenizer, path, 2, 7, seed=0)
    assert len(fixed) == 2 and all(c.output_lens == [7] for c in fixed)


# -- figures ------------------------------------------------------------------------------------
def record(ttft: float, e2e: float, n_out: int, cached: int | None = 10) -> RequestRecord:
    """A completed request of 100 prompt tokens, its output arriving at an even pace."""
    done = RequestRecord(0, 0, prompt_len=100, expected_output_len=n_out, success=True)
    done.ttft, done.e2e, done.output_len = ttft, e2e, n_out
    done.itl = [(e2e - ttft) / (n_out - 1)] * (n_out - 1)
    done.prompt_tokens, done.cached_tokens = 100, cached
    return done


def test_figures_goodput_cache_hit_rate_and_failures():
    records = [record(0.1, 1.0, 10), record(0.5, 2.0, 10, cached=None), record(0.2, 1.1, 4)]
    records.append(RequestRecord(1, 0, 100, 10, error="HTTP 400: too long"))
    figures = compute_figures(records, duration=2.0, slo=Slo(ttft_ms=300, tpot_ms=400))
    assert (figures.completed, figures.failed) == (3, 1)
    assert figures.total_output_tokens == 24 and figures.output_throughput == 12
    assert figures.goodput == 1.0  # two of three in 2 s: the second misses its TTFT
    assert figures.cache_hit_rate == 20 / 200  # only the requests that report cached tokens
    assert figures.ttft_ms.p50 == pytest.approx(200)
    assert figures.e2e_ms.mean == pytest.approx(1000 * 4.1 / 3)
    assert figures.errors == ["HTTP 400: too long"]
    assert compute_figures(records, 2.0, Slo()).goodput is None
    assert figures.optimum_cache_hit_rate is None  # no token ids, as for chat messages
    assert figures.ttft_ms_by_turn is None  # single turns


def test_ttft_by_turn_groups_the_turns_of_all_conversations():
    records = []
    for conv, ttfts in enumerate(([0.1, 0.2, 0.4], [0.3, 0.4, 0.8])):
        for turn, ttft in enumerate(ttfts):
            done = record(ttft, ttft + 1, 4)
            done.conversation, done.turn = conv, turn
            records.append(done)
    records[-1].success = False  # the second conversation's third turn failed
    records.append(RequestRecord(2, 3, 100, 4, error="an earlier turn failed"))
    by_turn = ttft_by_turn(records)
    assert [(t.requests, t.mean, t.p50) for t in by_turn] == [
        (2, pytest.approx(200), pytest.approx(200)),
        (2, pytest.approx(300), pytest.approx(300)),
        (1, pytest.approx(400), pytest.approx(400)),
        (0, None, None),
    ]
    assert compute_figures(records, 1.0, Slo()).ttft_ms_by_turn == by_turn


# -- the optimum cache hit rate -----------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=8),
    st.lists(st.integers(0, 3), max_size=12),
)
def test_token_trie_matches_the_longest_prefix_of_any_inserted_sequence(inserted, query):
    trie = TokenTrie()
    for ids in inserted:
        trie.insert(ids)

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    assert trie.match(query) == max((common(ids, query) for ids in inserted), default=0)
    assert all(trie.match(ids) == len(ids) for ids in inserted)


def sent(prompt: list[int], output: list[int], start: float, end: float) -> RequestRecord:
    """A completed request with its token ids, sent at `start` and finished at `end`."""
    done = RequestRecord(0, 0, len(prompt), len(output), start=start, success=True)
    done.ttft, done.e2e, done.output_len = (end - start) / 2, end - start, len(output)
    done.prompt_ids, done.output_ids = prompt, output
    return done


def test_optimum_serves_each_turn_the_turns_before_it_with_their_answers():
    p1, a1 = list(range(10, 20)), [20, 21, 22]
    p2, a2 = [*p1, *a1, 30, 31, 32, 33, 34], [40, 41]
    p3 = [*p2, *a2, 50, 51]
    other1, other_answer = list(range(100, 108)), [108]
    other2 = [*other1, *other_answer, 110, 111]
    records = [  # two conversations side by side, each turn sent after the one before ended
        sent(p1, a1, 0, 1),
        sent(other1, other_answer, 0.1, 2),
        sent(p2, a2, 1.5, 2.5),  # served p1 + a1: 13
        sent(other2, [112], 2.1, 3),  # served other1 + other_answer: 9
        sent(p3, [60], 3, 4),  # served p2 + a2: 20
    ]
    total = len(p1) + len(p2) + len(p3) + len(other1) + len(other2)
    assert optimum_cache_hit_rate(records) == pytest.approx((13 + 9 + 20) / total)


def test_optimum_takes_the_prompts_of_running_requests_but_not_their_outputs():
    prompt, answer = list(range(10, 20)), [20, 21, 22]
    running = sent(prompt, answer, 0, 5)
    follow_up = sent([*prompt, *answer, 30], [31], 1, 2)  # sent before `running` ended
    assert optimum_cache_hit_rate([running, follow_up]) == pytest.approx(10 / (10 + 14))
    again = sent(prompt, answer, 6, 7)  # all of it cached, but the last token is computed
    assert optimum_cache_hit_rate([running, again]) == pytest.approx(9 / 20)
    # the warm-up's request, left in the cache, serves the first request of the run as well
    warm_up = sent(prompt, answer, 0, 1)
    assert optimum_cache_hit_rate([running, again], [warm_up]) == pytest.approx(18 / 20)


def test_optimum_of_shared_system_prompts_and_of_unrelated_prompts():
    def prompt(group: int, question: int) -> list[int]:
        system = [1000 * group + i for i in range(64)]
        return system + [1000 * group + 500 + 10 * question + i for i in range(8)]

    order = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    records = [sent(prompt(g, q), [7], 0.1 * i, 10) for i, (g, q) in enumerate(order)]
    # all in flight at once: each group's first request computes the system prompt, the
    # others find it cached
    assert optimum_cache_hit_rate(records) == pytest.approx(4 * 64 / (6 * 72))
    unrelated = [sent(prompt(g, 0), [7], g, g + 0.5) for g in range(4)]
    assert optimum_cache_hit_rate(unrelated) == 0.0
    chat = sent(prompt(0, 0), [7], 0, 1)
    chat.prompt_ids = None  # messages through the server's chat template
    assert optimum_cache_hit_rate([chat, *records]) is None
    assert optimum_cache_hit_rate([]) is None


# -- reading streams (a fake server) -----------------------------------------------------------
def sse(*events: dict | str) -> bytes:
    return b"".join(
        f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events
    )


def send_one(backend: Any, body: bytes, tokenizer: Any) -> RequestRecord:
    """One request through a Session whose server always answers `body`."""

    async def go() -> RequestRecord:
        transport = httpx2.MockTransport(lambda request: httpx2.Response(200, content=body))
        async with httpx2.AsyncClient(transport=transport) as client:
            session = Session(client, backend, "http://fake", "m", tokenizer, None)
            return (await session.turn(0, 0, [], "a question", 3))[0]

    return asyncio.run(go())


def test_stream_reading_counts_errors_and_cut_streams(tokenizer):
    chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("one", " two", " three")]
    unreported = send_one(CompletionsBackend(), sse(*chunks, "[DONE]"), tokenizer)
    assert unreported.success and unreported.prompt_tokens is None
    assert unreported.output_len == len(tokenizer.encode("one two three", add_special_tokens=False))
    assert len(unreported.itl) == 2 and 0 < unreported.ttft <= unreported.e2e

    meta = {"prompt_tokens": 9, "completion_tokens": 1, "cached_tokens": 4}
    native = sse({"text": "x", "meta_info": meta}, "[DONE]")
    assert send_one(NativeBackend(), native, tokenizer).cached_tokens == 4

    cut = send_one(NativeBackend(), sse({"text": "x", "meta_info": meta}), tokenizer)
    assert not cut.success and "[DONE]" in cut.error
    failed = sse({"text": "x", "meta_info": meta}, {"error": {"message": "engine died"}})
    assert send_one(NativeBackend(), failed, tokenizer).error == "engine died"


# -- whole runs against the tiny model ----------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("bench-serving") / "server.log"
    with ServerProcess(
        "--model-path", str(tiny_model_dirs["llama"]), "--max-total-tokens", KV_TOKENS, log=log
    ) as server:
        yield server


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(sharegpt_entries()))
    return path


def bench(server: ServerProcess, tmp_path: Path, flags: str, rc: int = 0) -> dict[str, Any]:
    """Run `bench serving` with `flags` (split on spaces) and read its JSON results."""
    out = tmp_path / "results.json"
    argv = ["bench", "serving", "--base-url", server.url, "--output-file", str(out)]
    assert main([*argv, *flags.split()]) == rc
    return json.loads(out.read_text())


WORKLOADS = {  # dataset: (flags, requests it makes)
    "random": ("--num-prompts 5 --random-input-len 48 --random-output-len 8 "
               "--random-range-ratio 0.5", 5),
    "random-ids": ("--num-prompts 5 --random-input-len 48 --random-output-len 8", 5),
    "generated-shared-prefix": ("--gsp-num-groups 2 --gsp-prompts-per-group 3 "
                                "--gsp-system-prompt-len 64 --gsp-question-len 8 "
                                "--gsp-output-len 6 --max-concurrency 1", 6),
    "multi-turn": ("--num-conversations 2 --num-turns 3 --multi-turn-question-len 12 "
                   "--multi-turn-output-len 6", 6),
    "sharegpt": ("--num-prompts 3 --sharegpt-output-len 5", 3),
}  # fmt: skip
CASES = [
    (backend, dataset)
    for backend in ("radixserve", "openai", "openai-chat")
    for dataset in WORKLOADS
    if not (backend == "openai-chat" and dataset == "random-ids")
]


@pytest.mark.parametrize(("backend", "dataset"), CASES)
def test_every_backend_and_dataset(server, sharegpt_file, tmp_path, capsys, backend, dataset):
    flags, n_requests = WORKLOADS[dataset]
    if dataset == "sharegpt":
        flags += f" --dataset-path {sharegpt_file}"
    result = bench(
        server, tmp_path, f"--backend {backend} --dataset-name {dataset} --flush-cache " + flags
    )
    figures, requests = result["figures"], result["requests"]
    assert (figures["completed"], figures["failed"]) == (n_requests, 0), figures["errors"]
    assert result["config"]["cache_flushed"] is True
    assert len(requests) == n_requests
    assert all(r["output_len"] == r["expected_output_len"] for r in requests)  # ignore_eos
    assert figures["total_output_tokens"] == sum(r["expected_output_len"] for r in requests)
    assert all(r["ttft"] > 0 and r["e2e"] >= r["ttft"] for r in requests)
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        stats = figures[name]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], name
    assert figures["output_throughput"] > 0 and figures["request_throughput"] > 0
    decode = result["config"]["server_decode"]  # radixserve reports where decode time went
    assert decode["decode_steps"] > 0 and decode["ms_per_step"] > 0
    shares = decode["forward_share"] + decode["scheduler_share"] + decode["loop_share"]
    assert 0 < decode["forward_share"] <= 1 and abs(shares - 1) < 1e-6
    # and the prefill batches' forward time per prompt token (mixed ones among them)
    assert 0 <= decode["mixed_steps"] <= decode["prefill_batches"]
    assert decode["prefill_forward_s"] > 0 and decode["prefill_ms_per_token"] > 0
    if dataset == "random-ids":
        assert all(r["prompt_tokens"] == r["prompt_len"] for r in requests)
    if dataset in ("generated-shared-prefix", "multi-turn"):
        assert figures["cache_hit_rate"] > 0
    assert not {"prompt_ids", "output_ids"} & requests[0].keys()
    printed = capsys.readouterr().out
    optimum = figures["optimum_cache_hit_rate"]
    if backend == "openai-chat":
        assert optimum is None  # the prompt is messages through the server's chat template
        assert "optimum" not in printed
    else:
        # The optimum bounds what the server served, flushed before the run: its cache holds
        # at most the prompts of requests sent earlier (once prefilled) and the prompt +
        # output of those that ended earlier, which the optimum counts in full. The server's
        # count may hold one token per request more, a BOS token the client's ids lack.
        slack = n_requests / figures["total_input_tokens"]
        assert 0 <= figures["cache_hit_rate"] <= optimum + slack and optimum <= 1
        assert "optimum (unbounded cache)" in printed
        if dataset in ("generated-shared-prefix", "multi-turn"):
            assert optimum > 0
    by_turn = figures["ttft_ms_by_turn"]
    if dataset != "multi-turn":
        assert by_turn is None and "TTFT by turn" not in printed
    else:
        assert "TTFT by turn" in printed
        assert [t["requests"] for t in by_turn] == [2, 2, 2]
        for turn, t in enumerate(by_turn):
            ttfts = [1000 * r["ttft"] for r in requests if r["turn"] == turn]
            assert t["mean"] == pytest.approx(np.mean(ttfts)) and t["mean"] > 0
            assert t["p50"] == pytest.approx(np.median(ttfts))
    if dataset == "multi-turn":
        turns = sorted((r["conversation"], r["turn"]) for r in requests)
        assert turns == [(c, t) for c in range(2) for t in range(3)]
        for c in range(2):  # each turn's prompt holds the turns before it
            lens = [
                r["prompt_tokens"]
                for r in sorted(requests, key=lambda r: r["turn"])
                if r["conversation"] == c
            ]
            assert lens == sorted(lens) and len(set(lens)) == 3


def test_rate_slo_and_plots(server, tmp_path):
    plots = tmp_path / "plots"
    result = bench(
        server,
        tmp_path,
        "--num-prompts 6 --random-input-len 32 --random-output-len 4 "
        "--request-rate 50 --max-concurrency 2 --slo-ttft-ms 60000 --slo-e2e-ms 60000 "
        f"--plot-dir {plots} --api-key not-needed",
    )
    figures = result["figures"]
    assert figures["completed"] == 6
    assert 0 < figures["goodput"] <= figures["request_throughput"]
    assert result["config"]["api_key"] == "<set>"  # the key itself is never written
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["e2e.png", "itl.png", "throughput.png", "ttft.png"]


def test_failed_requests_are_counted_with_their_errors(server, tmp_path):
    result = bench(
        server,
        tmp_path,
        "--dataset-name random-ids --num-prompts 2 "
        f"--random-input-len {CONTEXT + 10} --random-range-ratio 1 "
        "--random-output-len 4 --warmup-requests 0",
        rc=1,
    )
    figures = result["figures"]
    assert (figures["completed"], figures["failed"]) == (0, 2)
    assert figures["errors"] and figures["errors"][0].startswith("HTTP 400")
    assert figures["ttft_ms"] is None and figures["cache_hit_rate"] is None


def test_a_failed_warm_up_or_no_server_stops_the_run(server, capsys):
    too_long = f"--dataset-name random-ids --random-input-len {CONTEXT + 10} --random-range-ratio 1"
    assert main(["bench", "serving", "--base-url", server.url, *too_long.split()]) == 2
    assert "warm-up request failed" in capsys.readouterr().err
    nobody = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "serving", "--base-url", nobody]) == 2
    assert f"cannot reach {nobody}" in capsys.readouterr().err


def test_http_shared_prefix_runs_all_three_sides(tiny_model_dirs, tmp_path):
    """`bench http-shared-prefix` on the tiny model: both servers and transformers produce
    every output token; only the radix-cache server reports cached prompt tokens."""
    out = tmp_path / "http.json"
    argv = ["bench", "http-shared-prefix", "--model-path", str(tiny_model_dirs["llama"])]
    argv += ["--num-groups", "2", "--prompts-per-group", "3", "--system-prompt-len", "40"]
    argv += ["--question-len", "6", "--output-len", "5", "--concurrency", "4"]
    argv += ["--max-total-tokens", "2048", "--output-json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert set(rows) == {"server, radix cache", "server, radix cache off", "transformers"}
    for name, [row] in rows.items():
        assert row["output_tokens"] == 6 * 5, name
        assert row["prompt_tokens"] == 6 * 46, name
        assert row["seconds"] > 0
    # after the flush: each group's first request is computed whole, later ones reuse its
    # 40-token system prompt (at least; more where question tokens happen to match)
    assert rows["server, radix cache"][0]["cached_tokens"] >= 2 * 2 * 40
    assert rows["server, radix cache off"][0]["cached_tokens"] == 0
