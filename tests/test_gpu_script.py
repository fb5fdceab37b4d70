"""benchmarks/gpu/check.py as a CPU dry run (the check itself needs a lent GPU machine).

It runs in a subprocess that cannot import the packages the GPU image lacks, so the check
stays within what that image has; every part reports, float32 fidelity is within the CPU
tests' bar, the host tier's round trips are exact (int8: within its bound), and every
throughput figure and host-tier bandwidth is a positive rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "check.py"
# radixserve's dependencies that the GPU image lacks (import names; httpx2 is left out: the
# huggingface_hub here needs it, the image's own uses httpx)
MISSING_ON_GPU_IMAGE = ("msgspec", "fastapi", "uvicorn", "zmq", "llguidance", "gguf")

RUN_WITHOUT = """
import runpy, sys

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {missing!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Missing())
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def run_script(cmd: list[str], cwd: Path) -> None:
    """A check script in a subprocess, one thread (light on a shared machine), from `cwd`
    (the scripts find the repository themselves); it must succeed."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_cpu_dry_run_reports_every_part(tmp_path):
    code = RUN_WITHOUT.format(missing=MISSING_ON_GPU_IMAGE, script=str(SCRIPT))
    args = ["--device", "cpu", "--quick", "--out", str(tmp_path), "--budget-s", "90"]
    run_script([sys.executable, "-c", code, *args], tmp_path)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["stand_ins"] == ["msgspec"]
    assert report["environment"]["device"] == "cpu"

    cases = report["parts"]["fidelity"]["cases"]
    assert sorted(cases) == ["llama/float32", "qwen2/float32"]
    for case in cases.values():
        assert case["passed"] is True, case
        assert 0 <= case["decode_max_abs"] <= case["atol"]
        assert case["greedy_identical"] == case["greedy_prompts"] == 8
        # the decode graphs' static steps (uncaptured on CPU) against the eager steps
        assert case["decode_graphs"] == [1, 2, 3, 4, 5, 6, 7, 8], case
        assert case["graph_eager_greedy_identical"] == 8
        assert 0 <= case["eager_decode_max_abs"] <= case["atol"]

    drift = report["parts"]["attention_drift"]
    assert drift["references"] == ["float32"]
    assert sorted(drift["kernels"]) == ["DecodeKernel", "torch SDPA (gathered K/V)"]
    for row in drift["kernels"].values():
        assert 0 <= row["decode_max_abs_vs_float32"] <= 1e-4

    tp = report["parts"]["tensor_parallel"]  # --tp-size 2, rank 1 in its own process
    assert tp["passed"] is True and tp["comm"] == "shm", tp
    assert tp["greedy_identical"] == tp["greedy_prompts"] == 8
    assert len(tp["weight_bytes_per_rank"]) == 2

    hicache = report["parts"]["hicache"]["cases"]
    assert sorted(hicache) == [
        "bfloat16 pool / bfloat16 host",
        "bfloat16 pool / int8 host",
        "float32 pool / float32 host",
        "float32 pool / int8 host",
    ]
    for key, case in hicache.items():
        assert case["passed"] is True and case["pinned"] is False, (key, case)
        assert sorted(case["layouts"]) == ["contiguous", "scattered"]
        for layout in case["layouts"].values():
            assert layout["load_matches"] and layout["async_matches_load"], (key, layout)
            assert layout["wait_layer_mismatched_layers"] == []
            assert layout["load_async_events"] == 0  # CPU: done on return, no events
            assert layout["load_gb_s"] > 0 and layout["backup_gb_s"] > 0
            if case["host_dtype"] == "int8":
                assert 0 < layout["load_max_abs_error"]
                assert 0 < layout["load_error_over_int8_bound"] <= 1
            else:
                assert layout["load_max_abs_error"] == 0
                assert layout["load_error_over_int8_bound"] is None

    part = report["parts"]["throughput"]
    names = [fig["name"] for fig in part["figures"]]
    assert names == [
        "prefill 64 tokens (tok/s)",
        "decode batch 1 (tok/s)",
        "decode batch 4 (tok/s)",
    ]
    for fig in part["figures"]:
        assert fig["radixserve"] > 0 and fig["baseline"] > 0 and fig["eager"] > 0, fig
        assert fig["ratio"] == fig["radixserve"] / fig["baseline"]

    table = (tmp_path / "gpu_check.md").read_text()
    assert "| decode batch 4 (tok/s) |" in table and "| llama/float32 |" in table
    assert "| float32 pool / int8 host | scattered | no |" in table


def test_engine_check_dry_run(tmp_path):
    """benchmarks/gpu/engine_check.py on CPU: both Engines serve every workload alike."""
    script = ROOT / "benchmarks" / "gpu" / "engine_check.py"
    args = ["--device", "cpu", "--quick", "--rounds", "1", "--out", str(tmp_path)]
    run_script([sys.executable, str(script), *args], tmp_path)
    report = json.loads((tmp_path / "engine_check.json").read_text())
    assert [row["requests"] for row in report["rows"]] == [4, 8, 32]
    for row in report["rows"]:
        assert row["identical_outputs"] == row["requests"], row
        assert row["identical_without_speculation"] == row["requests"], row
        assert row["graphs_req_per_s"] > 0 and row["eager_req_per_s"] > 0
    shared = report["rows"][0]["cached_tokens"]
    assert shared["graphs"][0] == shared["eager"][0] > 0  # the group's prefix, from the cache
    assert report["graphs_kv_accounting"] == report["eager_kv_accounting"] == "ok"
    assert report["graphs, no speculation_kv_accounting"] == "ok"
