"""The step profiler behind /start_profile and /stop_profile, without a model: it begins
after start_step steps, ends by itself after num_steps (the next stop reports the trace),
never raises out of a step, and refuses arguments it cannot use."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest
import torch

from radixserve.scheduler.profiler import ProfileRefused, StepProfiler


def steps(profiler: StepProfiler, count: int) -> None:
    for _ in range(count):
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
        profiler.after_step()


def test_a_profile_of_num_steps_after_start_step(tmp_path):
    profiler = StepProfiler(dp_rank=1)
    profiler.start({"output_dir": str(tmp_path), "start_step": 2, "num_steps": 3})
    steps(profiler, 2)
    assert profiler.profile is not None and not list(tmp_path.iterdir())
    steps(profiler, 3)
    assert not profiler.active
    (trace,) = tmp_path.glob("*-DP-1.trace.json.gz")
    with gzip.open(trace) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "aten::mm" in names
    assert profiler.stop() == str(trace)  # the next stop reports it, once
    assert profiler.stop() is None


def test_a_stop_before_any_step_writes_nothing(tmp_path):
    profiler = StepProfiler()
    profiler.start({"output_dir": str(tmp_path), "start_step": 5})
    steps(profiler, 1)
    assert profiler.stop() == "" and not list(tmp_path.iterdir())


def test_a_failing_profile_never_stops_the_steps(tmp_path):
    profiler = StepProfiler()
    folder = tmp_path / "gone"
    profiler.start({"output_dir": str(folder), "num_steps": 2})
    steps(profiler, 1)
    shutil.rmtree(folder)  # a cleaner took it: the trace cannot be written
    steps(profiler, 2)  # does not raise
    assert not profiler.active
    with pytest.raises(RuntimeError, match="the profile failed"):
        profiler.stop()
    assert profiler.stop() is None


@pytest.mark.parametrize(
    "given",
    [
        {"colour": 1},
        {"start_step": "3"},
        {"num_steps": True},
        {"num_steps": 0},
        {"start_step": -1},
        {"activities": ["RPD"]},
        {"activities": "CPU"},
        {"profile_prefix": "a/b"},
        {"profile_id": "x\0"},
        {"output_dir": "/tmp/a\0b"},
    ],
)
def test_arguments_it_cannot_use_are_refused(tmp_path, given):
    profiler = StepProfiler()
    with pytest.raises(ProfileRefused):
        profiler.start({"output_dir": str(tmp_path), **given})
    assert not profiler.active
