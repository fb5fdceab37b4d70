"""`radixserve bench step-breakdown`: the classification of profiler events, and a whole run
on the tiny random-weight Llama whose parts must add up to the step time."""

from __future__ import annotations

import argparse
import json

import pytest

from radixserve.bench import step_breakdown
from radixserve.bench.step_breakdown import breakdown_us, classify
from radixserve.model.attention import decode_attention_kernel
from radixserve.model.decode_layers import decode_layers_library


def test_classify_sorts_ops_into_the_four_parts():
    events = [
        ("aten::mm", 10.0),
        ("aten::addmm", 5.0),
        ("aten::linear", 1.0),
        ("aten::matmul", 1.0),
        ("aten::bmm", 2.0),
        ("aten::_weight_int8pack_mm", 3.0),
        ("mkldnn::_linear_pointwise", 4.0),
        ("aten::mkldnn_linear", 1.0),
        ("kernel:linear", 7.0),
        ("kernel:attention", 20.0),
        ("aten::scaled_dot_product_attention", 1.0),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", 6.0),
        ("aten::index_select", 2.0),
        ("aten::mul", 1.5),
        ("aten::add", 0.5),
        ("aten::rsqrt", 0.25),
        ("aten::silu", 0.25),
        ("aten::cat", 1.0),
        ("aten::copy_", 0.5),
        ("aten::index_copy_", 0.5),
        ("kernel:decode_layers", 40.0),
        ("some python label", 100.0),  # not an op: stays in "other"
    ]
    assert breakdown_us(events) == {
        "matmul": 34.0,
        "attention": 29.0,
        "elementwise": 4.5,
        "layers": 40.0,
    }
    assert classify("aten::embedding") == "elementwise"
    assert classify("ProfilerStep#3") is None


def _run(tmp_path, capsys, model, batch_sizes, kernels, layer_by_layer=False):
    parser = argparse.ArgumentParser()
    step_breakdown.add_args(parser)
    out = tmp_path / f"rows-{kernels}.json"
    args = parser.parse_args(
        ["--model-path", str(model), "--kernels", kernels, "--batch-sizes"]
        + [str(b) for b in batch_sizes]
        + ["--context-len", "16", "--steps", "2", "--output-json", str(out)]
        + ["--layer-by-layer"] * layer_by_layer
    )
    assert step_breakdown.run(args) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


@pytest.mark.parametrize(
    ("kernels", "layer_by_layer"), [("auto", False), ("auto", True), ("torch", False)]
)
def test_parts_add_up_to_the_step_time(tmp_path, capsys, tiny_model_dirs, kernels, layer_by_layer):
    model = tiny_model_dirs["llama"]
    stdout, rows = _run(tmp_path, capsys, model, [1, 4], kernels, layer_by_layer)
    assert "threads" in stdout and "kernels KernelPlan(" in stdout
    table = {
        int(line.split()[0]): [float(x) for x in line.split()[1:]]
        for line in stdout.splitlines()
        if line.split() and line.split()[0].isdigit()
    }
    assert sorted(table) == [1, 4]
    for cells in table.values():
        step_ms, parts = cells[0], cells[1:11:2]  # ms and % alternate after ms/step
        assert all(p >= 0 for p in parts)
        assert sum(parts) == pytest.approx(step_ms, rel=0.01, abs=0.03)  # printed to 0.01 ms
    assert [r["batch_size"] for r in rows] == [1, 4]
    for row in rows:
        names = ("matmul", "attention", "elementwise", "layers", "other")
        parts = [row[f"{p}_ms"] for p in names]
        assert all(p >= 0 for p in parts)
        assert sum(parts) == pytest.approx(row["ms_per_step"], rel=0.01)
        assert row["matmul_ms"] > 0 and row["elementwise_ms"] > 0 and row["tok_per_s"] > 0
        in_one_call = kernels == "auto" and not layer_by_layer and decode_layers_library()
        assert (row["layers_ms"] > 0) == bool(in_one_call)  # "kernel:decode_layers"
        if kernels == "auto" and layer_by_layer and decode_attention_kernel() is not None:
            assert row["attention_ms"] > 0  # the "kernel:attention" label's own time
