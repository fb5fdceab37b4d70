"""`radixserve bench hicache`: the workload's sizing, the figures, ratios and targets from
made-up runs, the arguments, and one whole run on the tiny model (every configuration, a
few requests each). No figure of speed is asserted."""

from __future__ import annotations

import json

import pytest

from radixserve.bench import hicache
from radixserve.bench.hicache import (
    Agreement,
    Row,
    RunResult,
    Seen,
    WorkloadSize,
    concurrency_fits,
    configurations,
    counter_deltas,
    default_hicache_ratio,
    format_ratios,
    format_table,
    format_targets,
    greedy_agreement,
    make_row,
    ratios_vs_off,
    replay_speedup,
    size_workload,
    targets,
)
from radixserve.bench.serving import RequestRecord
from radixserve.cli import main


# -- sizing --------------------------------------------------------------------------------
def test_the_default_workload_is_about_four_pools_of_distinct_prefixes():
    size = size_workload(2048, conversations=16, turns=6, question_len=40, output_len=16)
    assert size.system_prompt_len > 0
    assert abs(size.total_final_prefix_tokens - 3.75 * 2048) <= 16  # rounding per conversation
    assert concurrency_fits(size, 4, 2048)
    assert not concurrency_fits(size, 5, 2048)  # the 5th in flight would not fit


def test_prompt_counts_match_the_turns_one_by_one():
    size = WorkloadSize(conversations=3, turns=4, system_prompt_len=10, question_len=5,
                        output_len=2)  # fmt: skip
    prompts = []
    prefix = 10
    for _ in range(4):
        prefix += 5
        prompts.append(prefix)
        prefix += 2  # the answer, part of the next turn's prompt
    assert [size.prompt_len(t) for t in range(1, 5)] == prompts
    assert size.final_prefix_len == prompts[-1]
    assert size.prompt_tokens == 3 * sum(prompts)
    assert size.new_prompt_tokens == 3 * (10 + 4 * 5)  # system prompt and questions


def test_a_workload_longer_than_the_ratio_allows_is_refused():
    with pytest.raises(ValueError, match="shorten them or enlarge the pool"):
        size_workload(256, conversations=16, turns=6, question_len=40, output_len=16)


def test_the_default_host_tier_holds_every_prefix():
    size = size_workload(2048, 16, 6, 40, 16)
    assert default_hicache_ratio(size, 2048) * 2048 >= size.total_final_prefix_tokens
    tiny = WorkloadSize(1, 1, 0, 4, 1)
    assert default_hicache_ratio(tiny, 2048) == 2.0  # never below the flag's default


def test_configurations_and_their_flags():
    configs = configurations(["int8", "bfloat16"], ratio=6.0, disk=True)
    assert [c.name for c in configs] == ["off", "host", "host-int8", "host-bfloat16", "disk"]
    assert configs[0].tier_flags == ()
    assert "--enable-hierarchical-cache" in configs[1].tier_flags
    assert "--hicache-ratio=6.0" in configs[1].tier_flags
    assert "--hicache-dtype=int8" in configs[2].tier_flags
    assert configs[-1].disk and not configs[1].disk
    assert [c.name for c in configurations([], 6.0, disk=False)] == ["off", "host"]


def test_counter_deltas_keep_sizes_and_subtract_counts():
    before = {"hicache_load_back_tokens": 10, "hicache_host_used": 5, "decode_steps": 1}
    after = {"hicache_load_back_tokens": 25, "hicache_host_used": 7, "decode_steps": 9}
    assert counter_deltas(before, after) == {"load_back_tokens": 15, "host_used": 7}


# -- figures from made-up runs -------------------------------------------------------------
def record(conv: int, turn: int, ttft: float, prompt: list[int], output: list[int],
           cached: int, start: float = 0.0) -> RequestRecord:  # fmt: skip
    r = RequestRecord(conv, turn, len(prompt), len(output), start=start, success=True)
    r.ttft, r.e2e = ttft, ttft + 0.1
    r.output_len, r.prompt_tokens, r.cached_tokens = len(output), len(prompt), cached
    r.prompt_ids, r.output_ids = prompt, output
    return r


def two_turns(name: str, ttfts: tuple[float, float], cached: int, tiers: dict | None,
              output: list[int], duration: float = 2.0) -> RunResult:  # fmt: skip
    """One conversation of two turns: 4 prompt tokens, then those, the answer and 2 more."""
    first = [1, 2, 3, 4]
    second = first + output + [7, 8]
    records = [
        record(0, 0, ttfts[0], first, output, 0, start=0.0),
        record(0, 1, ttfts[1], second, output, cached, start=1.0),
    ]
    seen = {(0, 0): Seen(output, tiers and {**tiers, "host": 0}), (0, 1): Seen(output, tiers)}
    return RunResult(name, records, duration, seen, {"load_back_tokens": 6.0})


def test_a_row_holds_the_runs_figures():
    run = two_turns("host", (0.5, 0.2), cached=6, tiers={"device": 0, "host": 6, "disk": 0},
                    output=[5, 6])  # fmt: skip
    row = make_row(run, reference=run)
    assert row.completed == 2 and row.failed == 0
    assert row.request_throughput == pytest.approx(1.0)
    assert row.hit_rate == pytest.approx(6 / 12)
    assert row.optimum == pytest.approx(6 / 12)  # the first prompt and its answer
    assert row.hit_of_optimum == pytest.approx(1.0)
    assert row.ttft_p50_later_ms == pytest.approx(200)
    assert row.ttft_p50_first_ms == pytest.approx(500)
    assert row.ttft_p50_ms == pytest.approx(350)
    assert row.cached_by_tier == {"device": 0, "host": 6, "disk": 0}
    assert row.load_back_tokens == 6.0
    assert row.agreement is None  # the reference itself


def test_greedy_agreement_counts_requests_and_tokens():
    ref = {(0, 0): Seen([1, 2, 3, 4], None), (0, 1): Seen([5, 6], None)}
    same = greedy_agreement(ref, ref)
    assert same == Agreement(2, 1.0, 1.0)
    other = {(0, 0): Seen([1, 2, 9, 4], None), (0, 1): Seen([5, 6], None), (1, 0): Seen([], None)}
    a = greedy_agreement(other, ref)
    assert (a.compared, a.identical, a.tokens) == (2, 0.5, 5 / 6)  # (1, 0): one run only


def test_logprob_drift_stops_where_outputs_or_conversations_diverge():
    ref = {
        (0, 0): Seen([1, 2, 3], None, [-0.5, -1.0, -2.0]),
        (0, 1): Seen([4], None, [-0.1]),
        (1, 0): Seen([7, 8], None, [-0.2, -0.3]),
    }
    out = {
        (0, 0): Seen([1, 9, 3], None, [-0.4, -1.0, -2.0]),  # differs at position 1
        (0, 1): Seen([4], None, [-5.0]),  # after a divergence: its prompt differs, skipped
        (1, 0): Seen([7, 8], None, [-0.25, -0.3]),
    }
    a = greedy_agreement(out, ref)
    assert a.logprob_drift_max == pytest.approx(0.1)
    assert a.logprob_drift_mean == pytest.approx((0.1 + 0.05 + 0.0) / 3)
    assert greedy_agreement(ref, ref).logprob_drift_max == 0.0
    assert greedy_agreement({(3, 0): Seen([1], None)}, ref) is None


def rows_of(off_later: float, host_later: float, off_duration: float) -> list[Row]:
    tiers = {"device": 0, "host": 6, "disk": 0}
    off = two_turns("off", (0.5, off_later), 0, None, [5, 6], duration=off_duration)
    host = two_turns("host", (0.5, host_later), 6, tiers, [5, 6])
    int8 = two_turns("host-int8", (0.5, host_later), 6, tiers, [5, 9])
    return [make_row(r, reference=host) for r in (off, host, int8)]


def test_ratios_targets_and_the_printed_table():
    rows = rows_of(off_later=0.8, host_later=0.2, off_duration=4.0)
    ratios = ratios_vs_off(rows)
    assert set(ratios) == {"host", "host-int8"}
    assert ratios["host"].throughput_x == pytest.approx(2.0)
    assert ratios["host"].ttft_later_x == pytest.approx(4.0)
    assert rows[2].agreement == Agreement(2, 0.0, 0.5)
    met = {t.what: t.met for t in targets(rows, replay_x=None)}
    assert met == {
        "host: hit rate / optimum": True,
        "off: hit rate / optimum": True,
        "host / off: request throughput": True,
        "off / host: TTFT p50 of turns >= 2": True,
        "disk: cold / first-replay TTFT p50": None,  # no disk run
    }
    table = format_table(rows)
    assert "host-int8" in table.splitlines()[0]
    assert "50.0%" in table  # the int8 run's identical tokens
    assert "2.00x" in format_ratios(rows) and "4.00x" in format_ratios(rows)
    assert "yes" in format_targets(targets(rows, None))


def test_targets_missed_are_said_so():
    rows = rows_of(off_later=0.3, host_later=0.2, off_duration=2.5)
    met = {t.what: t.met for t in targets(rows, replay_x=1.2)}
    assert met["host / off: request throughput"] is False  # 1.25x
    assert met["off / host: TTFT p50 of turns >= 2"] is False  # 1.5x
    assert met["disk: cold / first-replay TTFT p50"] is False
    assert "NO" in format_targets(targets(rows, 1.2))


def test_replay_speedup_compares_first_turns():
    cold = make_row(two_turns("disk", (0.9, 0.2), 6, None, [5]), None)
    replay = make_row(two_turns("disk replay", (0.3, 0.2), 6, None, [5]), None)
    assert replay_speedup(cold, replay) == pytest.approx(3.0)
    assert replay_speedup(cold, None) is None


# -- arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtypes", "int8,fp8"], "fp8 not among"),
        (["--concurrency", "0"], "must be >= 1"),
        (["--max-total-tokens", "256"], "shorten them or enlarge the pool"),
        (["--hicache-ratio", "0"], "--hicache-ratio must be > 0"),
    ],
)
def test_bad_arguments_are_refused_before_any_server_starts(argv, message, capsys):
    assert main(["bench", "hicache", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_defaults_parse():
    import argparse

    parser = argparse.ArgumentParser()
    hicache.add_args(parser)
    args = parser.parse_args([])
    assert hicache.check_args(args) is None
    assert hicache.parse_dtypes(args.dtypes) == ["int8"]
    assert hicache.parse_dtypes("") == []
    size = hicache.workload_size(args)
    assert (size.conversations, size.turns) == (16, 6)


# -- one whole run -------------------------------------------------------------------------
def test_a_run_of_the_host_and_disk_tiers_on_the_tiny_model(tiny_model_dirs, tmp_path, capsys):
    """The host tier and the disk tier with its replay (three server starts, ~15 s each:
    (off) and the narrower host tiers start the same servers with other flags)."""
    import argparse

    parser = argparse.ArgumentParser()
    hicache.add_args(parser)
    out = tmp_path / "hicache.json"
    args = parser.parse_args([
        "--model-path", str(tiny_model_dirs["llama"]), "--max-total-tokens", "256",
        "--conversations", "4", "--turns", "2", "--question-len", "16", "--output-len", "4",
        "--concurrency", "2", "--output", str(out), "--log-dir", str(tmp_path),
    ])  # fmt: skip
    bench = hicache.Bench(args)
    configs = [c for c in bench.configurations() if c.name in ("host", "disk")]
    assert bench.run(configs) == 0
    printed = capsys.readouterr().out
    for name in ("host", "disk replay", "no (off) run", "target"):
        assert name in printed
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"host", "disk", "disk replay"}
    assert all(r["failed"] == 0 for r in rows.values())
    # the prefixes did not fit in the pool: the host tier kept them for the next turns
    assert rows["host"]["cached_by_tier"]["host"] > 0
    assert rows["host"]["hit_of_optimum"] > 0.9
    assert rows["disk"]["agreement"]["identical"] == 1.0  # fp32 tiers: lossless
    # a new server found the first one's pages on disk
    assert result["server_counters"]["disk replay"]["disk_pages_read"] > 0
    assert rows["disk replay"]["hit_rate"] > 0
