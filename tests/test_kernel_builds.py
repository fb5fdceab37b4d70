"""Building the C++ kernels: one compile per library across threads and processes (a
compiler wrapper counts them), a failed build not tried again, builds dropped when their
block ends, the plan's list naming every kernel a model runner loads, and
`radixserve build-kernels`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from radixserve.cli import main
from radixserve.config import Config
from radixserve.hardware import KernelPlan, resolve_device_and_dtype, resolve_kv_dtype
from radixserve.model import cpu_kernels
from radixserve.model.cpu_kernels import (
    build_kernel,
    build_kernels,
    kernel_path,
    kernels_building,
    plan_kernels,
)
from radixserve.model.runner import ModelRunner
from tests.conftest import FP32

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None or not cpu_kernels.cpu_runs("avx2"),
    reason="no C++ compiler, or a CPU without AVX2",
)
CHEAP = ("decode_layers", "avx2")  # the quickest kernel to build (~0.3 s)


@pytest.fixture
def counted_compiler(tmp_path, monkeypatch):
    """CXX set to a wrapper of the system compiler that writes a line per call to the
    returned file (before compiling, `delay` seconds later: `tmp_path / "delay"`)."""
    calls = tmp_path / "calls"
    wrapper = tmp_path / "cxx"
    real = shutil.which(os.environ.get("CXX", "c++"))
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "$$" >> {calls}\n'
        f"[ -f {tmp_path}/delay ] && sleep $(cat {tmp_path}/delay)\n"
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    return calls


def compiles(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_one_compile_for_builders_in_threads_and_another_process(tmp_path, counted_compiler):
    folder = tmp_path / "kernels"
    (tmp_path / "delay").write_text("2")  # the others start while the first compiles
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys; from radixserve.model.cpu_kernels import "
         f"build_kernel; sys.exit(build_kernel('{CHEAP[0]}', __import__('pathlib')"
         f".Path('{folder}'), '{CHEAP[1]}') is None)"],
        env=os.environ.copy(),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while compiles(counted_compiler) == 0:  # the other process holds the lock and compiles
        assert other.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    paths = build_kernels([CHEAP] * 3, folder, workers=3)
    assert other.wait(120) == 0
    assert paths == [kernel_path(CHEAP[0], folder, CHEAP[1])] * 3
    assert compiles(counted_compiler) == 1
    assert sorted(p.name for p in folder.iterdir()) == [paths[0].name]  # no lock, no temp
    assert cpu_kernels.load_kernel(CHEAP[0], folder, CHEAP[1]).decode_layers


def test_a_failed_build_warns_once_and_is_not_tried_again(tmp_path, monkeypatch, caplog):
    calls = tmp_path / "calls"
    failing = tmp_path / "cxx"
    failing.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'no such luck' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    folder = tmp_path / "kernels"
    assert build_kernels([CHEAP, CHEAP], folder, workers=2) == [None, None]
    assert build_kernel(CHEAP[0], folder, CHEAP[1]) is None
    assert compiles(calls) == 1
    warnings = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(warnings) == 1 and "no such luck" in warnings[0].getMessage()


def test_builds_not_begun_when_the_block_ends_are_dropped(tmp_path, counted_compiler):
    folder = tmp_path / "kernels"
    (tmp_path / "delay").write_text("0.5")
    wanted = [CHEAP, ("fp32_gemv", "avx2"), ("coded_find", "avx2")]
    with kernels_building(wanted, folder, workers=1) as building:
        assert building == wanted
    deadline = time.monotonic() + 120
    while any(t.name.startswith("kernel-build") for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert kernel_path(CHEAP[0], folder, CHEAP[1]).is_file()  # under way: ends
    assert not any(kernel_path(n, folder, isa).exists() for n, isa in wanted[1:])
    assert compiles(counted_compiler) == 1
    with kernels_building(wanted[:1], folder) as building:
        assert building == []  # built already


def test_a_kernel_asked_for_while_its_build_runs_waits_for_that_build(tmp_path, counted_compiler):
    folder = tmp_path / "kernels"
    (tmp_path / "delay").write_text("1")
    with kernels_building([CHEAP], folder):
        time.sleep(0.3)  # the background build has begun
        library = cpu_kernels.load_kernel(CHEAP[0], folder, CHEAP[1])
    assert library is not None and library.decode_layers
    assert compiles(counted_compiler) == 1


@pytest.mark.parametrize(
    "dtype,quantization", [(FP32, "none"), ("bfloat16", "none"), (FP32, "int8")]
)
def test_the_plans_list_names_every_kernel_the_runner_loads(
    tiny_model_dirs, tmp_path, monkeypatch, dtype, quantization
):
    config = Config.from_flat(
        model_path=str(tiny_model_dirs["llama"]),
        max_total_tokens=2048,
        dtype=dtype,
        quantization=quantization,
        model_cache_dir=str(tmp_path),
    )
    device, torch_dtype = resolve_device_and_dtype(config.model)
    kv_dtype = resolve_kv_dtype(config.cache, torch_dtype)
    plan = KernelPlan.choose(config.model.kernels, device, torch_dtype, kv_dtype)
    listed = plan_kernels(plan, torch_dtype, quantization)
    # built where every process finds them, then copied in: this test compiles nothing
    folder = tmp_path / "kernels"
    folder.mkdir()
    for (name, isa), path in zip(listed, build_kernels(listed)):
        assert path is not None, f"{name} ({isa}) did not build"
        shutil.copy(path, folder / path.name)
    asked: list[tuple[str, str]] = []

    def spy(name, folder=None, isa="avx2"):
        asked.append((name, isa))
        return build_kernel(name, folder, isa)

    monkeypatch.setattr(cpu_kernels, "build_kernel", spy)
    before = sorted(folder.iterdir())
    runner = ModelRunner(config, progress=False)
    assert asked, "the runner loaded no kernel"
    assert set(asked) <= set(listed)
    assert sorted(folder.iterdir()) == before  # nothing built while it loaded
    assert runner.dtype == getattr(torch, dtype)


def test_build_kernels_command_reports_each_kernel(tmp_path, counted_compiler, capsys):
    config = Config.from_flat(dtype=FP32)
    device, dtype = resolve_device_and_dtype(config.model)
    plan = KernelPlan.choose("auto", device, dtype, dtype)
    listed = plan_kernels(plan, dtype)
    folder = tmp_path / "kernels"
    folder.mkdir()
    for path in build_kernels(listed):  # where every process finds them
        shutil.copy(path, folder / path.name)
    calls_before = compiles(counted_compiler)
    assert main(["build-kernels", "--dtype", FP32, "--model-cache-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{len(listed)} kernels for cpu/torch.float32 on this CPU, in {folder}:"
    for (name, isa), line in zip(listed, lines[1:], strict=True):
        assert line == f"  {name} ({isa}): {kernel_path(name, folder, isa).name}"
    assert compiles(counted_compiler) == calls_before  # all there: none compiled
