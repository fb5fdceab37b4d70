"""`radixserve bench programs` at a tiny size: every workload's programs run to the end on
one real server (the tiny random-weight Llama) under one configuration, and the report has
numbers. No timing is asserted."""

from __future__ import annotations

import pytest

from radixserve.bench.lang_workloads import BUILDERS, DIMENSIONS, JSON_FIELDS, build_workloads
from radixserve.bench.programs import (
    CONFIGS,
    Counters,
    Run,
    co_design,
    plot,
    ratio,
    run_all,
    summarize,
    table,
)
from radixserve.lang import global_config
from tests.server_utils import tiny_model_server

PROGRAMS = 2  # per workload


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    yield from tiny_model_server(tiny_model_dirs["llama"], tmp_path_factory.mktemp("programs"))


@pytest.fixture(scope="module")
def workloads():
    return build_workloads(dict.fromkeys(BUILDERS, PROGRAMS), seed=0)


def test_the_data_are_generated_from_the_seed():
    first = build_workloads({"mmlu": 3, "chat": 2}, seed=1)
    again = build_workloads({"chat": 2, "mmlu": 3}, seed=1)  # each workload its own generator
    other = build_workloads({"mmlu": 3, "chat": 2}, seed=2)
    by_name = {w.name: w.batch for w in again}
    assert all(w.batch == by_name[w.name] for w in first)
    assert first[0].batch != other[0].batch


def check_variables(name: str, s) -> None:
    """What each program must have produced."""
    if name.startswith("mmlu"):
        assert isinstance(s["answer"], str)
    elif name.startswith("hellaswag"):
        assert s["ending"] in s.stream_executor.arguments["endings"]
    elif name == "tree of thought":
        assert len(s["plan"]) == 2 and [len(b) for b in s["step"]] == [2, 2]
        assert isinstance(s["final"], str)
    elif name == "skeleton of thought":
        assert len(s["point"]) == 5 and isinstance(s["summary"], str)
    elif name == "llm judge":
        assert len(s["judgment"]) == len(DIMENSIONS) and isinstance(s["verdict"], str)
    elif name.startswith("json"):
        record = s["record"]
        assert record.startswith("{\n") and record.endswith("}")
        assert all(f'"{field}": ' in record for field, _, _ in JSON_FIELDS)
    elif name == "multi-turn chat":
        assert all(isinstance(s[f"answer_{i}"], str) for i in range(4))
        assert [m["role"] for m in s.messages()] == ["system"] + ["user", "assistant"] * 4
    else:
        raise AssertionError(f"no check for {name}")


def test_every_program_completes_and_the_report_has_numbers(server, workloads, tmp_path):
    config = CONFIGS[0]
    checked = []

    def check(run: Run, states: list) -> None:
        assert [s.error() for s in states] == [None] * PROGRAMS, run.workload
        check_variables(run.workload, states[0])
        checked.append(run.workload)

    runs = run_all(workloads, {config.key: server.url}, (config,), report=check, warmup=False)
    assert checked == [w.name for w in workloads] == [r.workload for r in runs]
    for r in runs:
        assert r.programs == PROGRAMS and r.seconds > 0
        assert r.counters.requests >= PROGRAMS and r.counters.prompt_tokens > 0
        assert 0.0 <= r.hit_rate <= 1.0
    summary = summarize(runs)
    for cells in summary.values():
        assert cells[config.key].programs_per_s > 0 and cells[config.key].tokens_per_s > 0
    text = table(summary, (config,))
    assert all(w.name in text for w in workloads)
    plot(summary, (config,), tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"


def test_summary_takes_medians_and_ratios():
    def run(config: str, rep: int, seconds: float) -> Run:
        return Run("w", config, rep, 10, seconds, Counters(100.0, 50.0, 10.0, 20.0))

    runs = [run("a", 0, 1.0), run("a", 1, 2.0), run("a", 2, 9.0), run("b", 0, 4.0)]
    cells = summarize(runs)["w"]
    assert cells["a"].programs_per_s == 5.0  # the median of 10, 5 and 1.1 programs/s
    assert cells["a"].hit_rate == 0.5 and cells["a"].requests_per_program == 2.0
    assert ratio(cells, "a", "b") == 2.0 and ratio(cells, "a", "c") is None
    assert "| w | 5.00 |" in table(summarize(runs), CONFIGS)


def test_co_design_switches_are_restored():
    names = ("enable_precache_with_tracing", "enable_fork_prefix_hint", "enable_batched_select")
    before = [getattr(global_config, name) for name in names]
    with co_design(False):
        assert [getattr(global_config, name) for name in names] == [False] * 3
    assert [getattr(global_config, name) for name in names] == before
