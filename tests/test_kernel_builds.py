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
from radixserve.hardware import (
    CpuInfo,
    KernelPlan,
    resolve_device_and_dtype,
    resolve_kv_dtype,
)
from radixserve.model import cpu_kernels
from radixserve.model.cpu_kernels import (
    build_kernel,
    build_kernels,
    kernel_path,
    kernels_building,
    plan_kernels,
    wait_for_builds,
)
from radixserve.model.runner import ModelRunner
from tests.conftest import FP32

pytestmark = pytest.mark.skipif(
    cpu_kernels._compiler() is None or not cpu_kernels.cpu_runs("avx2"),
    reason="no C++ compiler, or a CPU without AVX2",
)
CHEAP = ("decode_layers", "avx2")  # the quickest kernel to build (~0.3 s)
AVX2_AMD = "avx2 fma f16c"
AVX512 = " avx512f avx512bw avx512vl avx512dq avx512_bf16"


@pytest.fixture
def counted_compiler(tmp_path, monkeypatch):
    """CXX set to a wrapper of the system compiler that writes a line per call to the
    returned file (before compiling, `delay` seconds later: `tmp_path / "delay"`)."""
    wait_for_builds()  # (an earlier test's runner may have left builds going on)
    calls = tmp_path / "calls"
    wrapper = tmp_path / "cxx"
    real = cpu_kernels._compiler()  # (before CXX names the wrapper)
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "$$" >> {calls}\n'
        f"[ -f {tmp_path}/delay ] && sleep $(cat {tmp_path}/delay)\n"
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    return calls


def _running(argv: list[bytes]) -> list[int]:
    """The live processes whose command line is `argv`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")[:-1]
        except (OSError, IndexError):
            continue
        if cmdline == argv and state != "Z":
            found.append(int(stat.parent.name))
    return found


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
    try:
        deadline = time.monotonic() + 120
        while compiles(counted_compiler) == 0:  # the other process holds the lock, compiles
            assert other.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        paths = build_kernels([CHEAP] * 3, folder, workers=3)
        assert other.wait(120) == 0
    finally:
        other.kill()
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


def wait_for_compiles(calls: Path, count: int = 1) -> None:
    deadline = time.monotonic() + 120
    while compiles(calls) < count:
        assert time.monotonic() < deadline, "no compile began"
        time.sleep(0.02)


def test_a_failure_in_the_block_kills_the_compile_under_way_and_drops_the_rest(
    tmp_path, counted_compiler
):
    folder = tmp_path / "kernels"
    (tmp_path / "delay").write_text("30.25")  # the compiler "runs" until it is killed
    wanted = [CHEAP, ("fp32_gemv", "avx2"), ("coded_find", "avx2")]
    start = time.monotonic()
    with pytest.raises(RuntimeError), kernels_building(wanted, folder, workers=1) as building:
        assert building == wanted
        wait_for_compiles(counted_compiler)
        raise RuntimeError("the model did not load")
    assert time.monotonic() - start < 20  # not the 30 s compile
    assert not any(t.name.startswith("kernel-build") for t in threading.enumerate())
    compiler = int(counted_compiler.read_text().split()[0])
    assert not Path(f"/proc/{compiler}").exists()  # killed and reaped
    assert not _running([b"sleep", b"30.25"])  # and what it ran, with it
    assert compiles(counted_compiler) == 1  # the others never began
    assert not [p for p in folder.iterdir() if p.suffix != ".lock"]  # no library, no temp
    (tmp_path / "delay").unlink()
    with kernels_building(wanted[:1], folder) as building:
        assert building == wanted[:1]  # not built: the next start builds it


def test_builds_go_on_after_the_block_left_normally(tmp_path, counted_compiler):
    """A kernel the model did not ask for (its plan lists it, the model cannot use it) is
    still built once, not dropped at every start."""
    folder = tmp_path / "kernels"
    (tmp_path / "delay").write_text("0.5")
    wanted = [CHEAP, ("fp32_gemv", "avx2")]
    with kernels_building(wanted, folder, workers=1):
        pass
    wait_for_builds()
    assert all(kernel_path(n, folder, isa).is_file() for n, isa in wanted)
    assert compiles(counted_compiler) == 2
    with kernels_building(wanted, folder) as building:
        assert building == []


def test_the_process_exit_kills_the_builds_still_running(tmp_path, counted_compiler):
    folder = tmp_path / "kernels"
    (tmp_path / "delay").write_text("30.5")
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from radixserve.model.cpu_kernels import kernels_building\n"
        f"with kernels_building([{CHEAP!r}], Path({str(folder)!r})):\n"
        "    pass\n"
        f"while not Path({str(counted_compiler)!r}).exists():\n"
        "    time.sleep(0.02)\n"
        "sys.exit(3)\n"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert done.returncode == 3
    assert time.monotonic() - start < 25  # not the 30 s compile
    assert not _running([b"sleep", b"30.5"])
    assert not [p for p in folder.iterdir() if p.suffix != ".lock"]


def test_a_kernel_asked_for_while_its_build_runs_waits_for_that_build(tmp_path, counted_compiler):
    folder = tmp_path / "kernels"
    (tmp_path / "delay").write_text("1")
    with kernels_building([CHEAP], folder):
        wait_for_compiles(counted_compiler)  # the background build has begun
        library = cpu_kernels.load_kernel(CHEAP[0], folder, CHEAP[1])
    assert library is not None and library.decode_layers
    assert compiles(counted_compiler) == 1


@pytest.mark.parametrize(
    "flags",
    [AVX2_AMD, AVX2_AMD + AVX512, AVX2_AMD + AVX512 + " amx_bf16 amx_tile"],
    ids=["avx2", "avx512", "amx"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cpus_plan_lists_sources_that_exist(flags, dtype):
    cpu = CpuInfo("test cpu", "x86_64", "AVX2", frozenset(flags.split()), 2, "GenuineIntel")
    plan = KernelPlan.choose("auto", torch.device("cpu"), dtype, dtype, cpu)
    listed = plan_kernels(plan, dtype)
    assert listed and len(set(listed)) == len(listed)
    for name, isa in listed:
        assert (Path(cpu_kernels.__file__).parent / f"{name}.cpp").is_file(), name
        assert isa in cpu_kernels.ISA_FLAGS
    if plan.coded_amx_rows:  # its kernel asks Linux for the tiles through the bf16 one's
        assert listed.index(("bf16_linear_amx", "amx")) < listed.index(("fp32_coded_amx", "amx"))


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
        device="cpu",
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
    config = Config.from_flat(dtype=FP32, device="cpu")
    device, dtype = resolve_device_and_dtype(config.model)
    plan = KernelPlan.choose("auto", device, dtype, dtype)
    listed = plan_kernels(plan, dtype)
    folder = tmp_path / "kernels"
    folder.mkdir()
    for (name, isa), path in zip(listed, build_kernels(listed)):  # where every process finds them
        assert path is not None, f"{name} ({isa}) did not build"
        shutil.copy(path, folder / path.name)
    calls_before = compiles(counted_compiler)
    argv = ["build-kernels", "--dtype", FP32, "--device", "cpu", "--model-cache-dir", str(tmp_path)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{len(listed)} kernels for cpu/torch.float32 on this CPU, in {folder}:"
    for (name, isa), line in zip(listed, lines[1:], strict=True):
        assert line == f"  {name} ({isa}): {kernel_path(name, folder, isa).name}"
    assert compiles(counted_compiler) == calls_before  # all there: none compiled
