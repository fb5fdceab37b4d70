"""The project's C++ CPU kernels (x86 AVX2 + FMA + F16C; `*_avx512.cpp` variants for AVX-512
with AVX512-BF16; `*_amx.cpp` for AMX-BF16), compiled with the system compiler and loaded
with ctypes.

Each kernel is one .cpp file beside this module with an `extern "C"` entry point. It is
built once per source version into a cache folder (~/.cache/radixserve/kernels by default)
and shared by every process after: by `radixserve build-kernels` (which `make` runs at
setup), or by the first start that needs it, which builds its plan's missing kernels side
by side while its model loads (`kernels_building`). Where the CPU lacks the kernel's
instruction set, or no compiler is found, or the build fails, `load_kernel` warns and
returns None and the caller keeps its torch path (or the AVX2 variant).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import queue
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from radixserve.config import default_model_cache_dir
from radixserve.hardware import KernelPlan, cpu_info

logger = logging.getLogger(__name__)

# gnu++17: linear_groups.h needs C++17 (GCC before 11 defaults to C++14)
KERNEL_FLAGS = ("-O3", "-std=gnu++17", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
# the instruction sets a kernel is built for: compiler flags beyond KERNEL_FLAGS
ISA_FLAGS = {
    "avx2": (),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"),
    "amx": (
        *("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"),
        *("-mamx-tile", "-mamx-bf16"),
    ),
}


def cpu_runs(isa: str) -> bool:
    """This CPU executes kernels built for `isa`."""
    cpu = cpu_info()
    avx2 = cpu.avx2 and "f16c" in cpu.flags
    avx512 = avx2 and cpu.avx512 and cpu.avx512_bf16
    if isa == "amx":
        return avx512 and cpu.amx_bf16
    if isa == "avx512":
        return avx512
    return avx2


def function_address(function: ctypes._CFuncPtr) -> int:
    """A loaded kernel's entry point, for C code that calls it (decode_layers.cpp)."""
    return ctypes.cast(function, ctypes.c_void_p).value or 0


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A label for torch's profiler around a ctypes kernel call, which it cannot see into
    (`radixserve bench step-breakdown` reads them: "kernel:linear", "kernel:attention");
    nothing when no profiler runs."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def kernel_dir() -> Path:
    return Path(default_model_cache_dir()) / "kernels"


def _compiler() -> str | None:
    """The C++ compiler's path: $CXX, else c++ (None: not found)."""
    return shutil.which(os.environ.get("CXX", "c++"))


def kernel_path(name: str, folder: Path | None = None, isa: str = "avx2") -> Path:
    """Where the library built from `<name>.cpp` for `isa` is kept: named by a digest of its
    source, the headers beside it and the flags, so that a changed kernel is built anew."""
    return (folder or kernel_dir()) / f"{name}-{_source_digest(name, isa)}.so"


@functools.cache
def _source_digest(name: str, isa: str) -> str:
    """A digest of `<name>.cpp`, the headers beside it and the flags for `isa` (read once
    per process: a start asks for each kernel's path several times)."""
    source_path = Path(__file__).with_name(f"{name}.cpp")
    flags = (*KERNEL_FLAGS, *ISA_FLAGS[isa])
    source = source_path.read_bytes()
    headers = b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    return hashlib.sha256(source + headers + " ".join(flags).encode()).hexdigest()[:16]


_failed_builds: set[Path] = set()  # builds that failed in this process: not tried again


def build_kernel(
    name: str, folder: Path | None = None, isa: str = "avx2", cancel: threading.Event | None = None
) -> Path | None:
    """The library built from `<name>.cpp` for `isa`, compiled into `folder` when it is not
    there yet; None, with a warning that names the reason, where this machine cannot run or
    build it. One build at a time per library, across threads and processes (a lock file
    beside it, gone once the library is there): who comes second waits for the first's and
    takes it. `cancel` set: the compile under way is killed, None."""
    if not cpu_runs(isa):
        logger.warning("this CPU lacks the %s kernel's instructions (%s): not used", name, isa)
        return None
    path = kernel_path(name, folder, isa)
    if path.is_file():
        return path
    if path in _failed_builds:
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler (set CXX): the %s kernel is not used", name)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_suffix(".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        cancelled = cancel is not None and cancel.is_set()
        if not path.is_file() and path not in _failed_builds and not cancelled:
            source = Path(__file__).with_name(f"{name}.cpp")
            command = [compiler, *KERNEL_FLAGS, *ISA_FLAGS[isa], str(source), "-o"]
            _compile(name, command, path, cancel)
        if not path.is_file():
            return None
        # whoever locks from now on (this file, or a new one made at its name) finds the
        # library there first, and removes the file it made
        lock_path.unlink(missing_ok=True)
    return path


def _compile(name: str, command: list[str], path: Path, cancel: threading.Event | None) -> None:
    """Run `command` + an output path in a temporary folder beside `path`, then move the
    library to `path` (atomic: a reader sees no file or the whole file). A failure is
    warned of and remembered; a cancel (or an exception here: SIGTERM's SystemExit) kills
    the compiler, and the temporary folder goes either way."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        proc = subprocess.Popen(
            [*command, str(built)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            while True:
                try:
                    _, stderr = proc.communicate(timeout=0.05)
                    break
                except subprocess.TimeoutExpired:
                    if cancel is not None and cancel.is_set():
                        _kill_tree(proc)
                        return
        except BaseException:
            _kill_tree(proc)
            raise
        if proc.returncode != 0:
            _failed_builds.add(path)
            logger.warning(
                "building the %s kernel with %s failed; it is not used:\n%s",
                name,
                command[0],
                stderr.decode(errors="replace")[-2000:],
            )
            return
        os.replace(built, path)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the compiler driver and what it runs (cc1plus, as), so that none outlives
    it; the driver stays in the caller's process group, where a killer of the group finds
    it."""
    pids, found = {proc.pid}, True
    while found:  # the driver's descendants, from /proc
        found = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                pid = int(stat.parent.name)
                if pid not in pids and int(stat.read_text().rsplit(")", 1)[1].split()[1]) in pids:
                    pids.add(pid)
                    found = True
    for pid in pids if proc.poll() is None else pids - {proc.pid}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


@functools.cache
def load_kernel(name: str, folder: Path | None = None, isa: str = "avx2") -> ctypes.CDLL | None:
    """The library built from `<name>.cpp` for `isa` (`build_kernel`), loaded; None where
    this machine cannot run or build it."""
    path = build_kernel(name, folder, isa)
    return None if path is None else ctypes.CDLL(str(path))


def plan_kernels(
    plan: KernelPlan, dtype: torch.dtype, quantization: str = "none"
) -> list[tuple[str, str]]:
    """The kernels ((source name, isa)) a model of `dtype` built by `runner.build_model`
    under `plan` may load, in the order it asks for them: the first choice of each (a
    fallback, say decode attention's AVX2 build where the AVX-512 one fails, is built when
    asked for)."""
    builds = []
    if quantization == "int8":
        builds.append(("int8_linear", "avx2"))
    elif plan.blocked_rows and dtype in (torch.bfloat16, torch.float32):
        blocked = "bf16_linear_amx" if dtype == torch.bfloat16 else "fp32_linear"
        builds.append((blocked, plan.blocked_isa))
        if plan.coded_linear:
            builds.append(("coded_find", "avx2"))
        if plan.coded_amx_rows:  # (coded_amx_linear asks Linux for AMX through amx_linear)
            builds += [("bf16_linear_amx", "amx"), ("fp32_coded_amx", "amx")]
        elif plan.coded_lut_rows:  # measured at load: every build this CPU runs
            builds += [("fp32_coded_lut", isa) for isa in ("avx512", "avx2") if cpu_runs(isa)]
    if quantization != "int8":
        builds += [("fp32_gemv", "avx2")] if plan.gemv else []
        builds += [("fp32_gemm_small", "avx2")] if plan.few_rows_max else []
    if plan.fused_elementwise:
        builds.append(("fused_ops", plan.fused_elementwise))
    if plan.decode_layers:
        builds.append(("decode_layers", "avx2"))
    isa = plan.decode_attention_isa
    if plan.decode_attention:
        builds.append(("decode_attention" if isa == "avx2" else "decode_attention_avx512", isa))
    if plan.extend_attention:
        builds.append(("extend_attention" if isa == "avx2" else "extend_attention_avx512", isa))
    return builds


def missing_kernels(
    builds: Sequence[tuple[str, str]], folder: Path | None = None
) -> list[tuple[str, str]]:
    """Those of `builds` this CPU runs that are not built into `folder` yet."""
    return [
        (n, isa) for n, isa in builds if cpu_runs(isa) and not kernel_path(n, folder, isa).is_file()
    ]


def build_kernels(
    builds: Sequence[tuple[str, str]], folder: Path | None = None, workers: int | None = None
) -> list[Path | None]:
    """Each of `builds` ((name, isa)) built into `folder` (`build_kernel`), `workers`
    compilers at once (one per core by default); interrupted, the compilers are killed."""
    builder = BackgroundBuilds(builds, folder, workers)
    try:
        return [future.result() for future in builder.futures]
    except BaseException:
        builder.cancel()
        raise


class BackgroundBuilds:
    """Kernels built by daemon threads, `workers` compilers at once, in the order given
    (`kernels_building`). Each job's Future ends with the library's path (None: not built).
    At the process's exit (atexit), or `cancel`, the compilers under way are killed and the
    rest dropped; a daemon thread never holds the exit back."""

    def __init__(
        self, builds: Sequence[tuple[str, str]], folder: Path | None, workers: int | None = None
    ):
        workers = workers or len(os.sched_getaffinity(0))  # one compiler per core
        self.cancelled = threading.Event()
        self._jobs = queue.SimpleQueue()
        self.futures: list[Future] = []
        for name, isa in builds:
            future: Future = Future()
            self._jobs.put((name, isa, future))
            self.futures.append(future)
        self._folder = folder
        self.threads = [
            threading.Thread(target=self._work, name=f"kernel-build-{i}", daemon=True)
            for i in range(min(workers, len(builds)))
        ]
        if self.futures:
            _open_builds.add(self)
        for thread in self.threads:
            thread.start()

    def _work(self) -> None:
        while True:
            try:
                name, isa, future = self._jobs.get_nowait()
            except queue.Empty:
                break
            if self.cancelled.is_set() or not future.set_running_or_notify_cancel():
                future.cancel()
                continue
            try:
                future.set_result(build_kernel(name, self._folder, isa, self.cancelled))
            except BaseException as e:  # (an OSError of the cache folder, say)
                future.set_exception(e)
        if all(f.done() for f in self.futures):
            _open_builds.discard(self)

    def cancel(self, wait_s: float = 5.0) -> None:
        """Kill the compiles under way, drop the rest, and wait up to `wait_s` for the
        threads (a build waiting on another process's lock may take longer: it then
        returns as soon as it gets it)."""
        self.cancelled.set()
        for future in self.futures:
            future.cancel()  # the ones not begun
        deadline = time.monotonic() + wait_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        _open_builds.discard(self)

    def wait(self) -> None:
        """Until every build has ended (done, failed or dropped)."""
        for future in self.futures:
            with contextlib.suppress(CancelledError):
                future.exception()


_open_builds: set[BackgroundBuilds] = set()


@atexit.register
def _cancel_open_builds() -> None:
    for builds in list(_open_builds):
        builds.cancel(wait_s=2.0)


@contextlib.contextmanager
def kernels_building(
    builds: Sequence[tuple[str, str]], folder: Path | None = None, workers: int | None = None
) -> Iterator[list[tuple[str, str]]]:
    """Within the block, those of `builds` ((name, isa), in the order they are wanted) not
    yet built into `folder` are built in the background, `workers` compilers at once (one
    per core by default; yields them): a first start compiles side by side while the model
    loads, and `load_kernel` waits only for the one it asks for (or builds it itself where
    none has begun). The block left normally, the builds go on (a kernel the model turned
    out not to use is built once, not at every start); left by an exception (a failed load,
    SIGTERM's SystemExit), what is compiling is killed and the rest dropped; the process's
    exit does the same."""
    missing = missing_kernels(builds, folder)
    if not missing or _compiler() is None:
        yield []
        return
    background = BackgroundBuilds(missing, folder, workers)
    logger.info(
        "building %d kernels for this CPU into %s, %d at a time (later starts load them): %s",
        len(missing), folder or kernel_dir(), len(background.threads),
        ", ".join(f"{name} ({isa})" for name, isa in missing),
    )  # fmt: skip
    try:
        yield missing
    except BaseException:
        background.cancel()
        raise


def wait_for_builds() -> None:
    """Wait for the background builds under way (before timing a kernel: compilers beside
    it would skew what it measures)."""
    for builds in list(_open_builds):
        builds.wait()


class LinearKernel:
    """A C linear kernel `name(x, weight, bias, out, [M,] N, K, threads)`: (x (M, K), weight
    (N, K), bias (N,) | None) → x @ weight.T + bias, (M, N) fp32. `fp32_gemv.cpp` takes one
    row (no M argument), `fp32_gemm_small.cpp` a few."""

    def __init__(self, library: ctypes.CDLL, name: str, takes_rows: bool) -> None:
        self._run = getattr(library, name)
        sizes = 3 if takes_rows else 2
        self._run.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * sizes + [ctypes.c_int]
        self._run.restype = None
        self.takes_rows = takes_rows

    @property
    def address(self) -> int:
        """The kernel's address, for C code that calls it (decode_layers.cpp)."""
        return function_address(self._run)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        (m, k), n = x.shape, weight.shape[0]
        x = x.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        bias_ptr = None if bias is None else bias.data_ptr()
        sizes = (m, n, k) if self.takes_rows else (n, k)
        with profiled("kernel:linear"):
            self._run(
                x.data_ptr(),
                weight.data_ptr(),
                bias_ptr,
                out.data_ptr(),
                *sizes,
                torch.get_num_threads(),
            )
        return out


@functools.cache
def gemv_kernel(folder: Path | None = None) -> LinearKernel | None:
    """The one-row fp32 linear kernel, or None where it cannot be built."""
    library = load_kernel("fp32_gemv", folder)
    return None if library is None else LinearKernel(library, "fp32_gemv", takes_rows=False)


@functools.cache
def gemm_small_kernel(folder: Path | None = None) -> LinearKernel | None:
    """The few-rows fp32 linear kernel, or None where it cannot be built."""
    library = load_kernel("fp32_gemm_small", folder)
    if library is None:
        return None
    return LinearKernel(library, "fp32_gemm_small", takes_rows=True)


class FusedOps:
    """`fused_ops.cpp` built for AVX2 (8 lanes) or AVX-512 (16): RMSNorm (alone or after
    the residual add), rotary and SiLU(gate) * up of bf16 or fp32 tensors, one pass each,
    rounding where the torch ops they replace round. Each method takes what `fits` says yes
    to."""

    DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}

    def __init__(self, library: ctypes.CDLL, lanes: int = 8) -> None:
        self.lanes = lanes
        p, i64, f32, threads = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        signatures = {
            "rms_norm": [p, p, p, i64, i64, f32, threads],
            "add_rms_norm": [p, p, p, p, p, i64, i64, f32, threads],
            "rotary": [p, p, p, p, i64, i64, i64, i64, threads],
            "silu_mul": [p, p, p, i64, i64, i64, threads],
            "lora_add": [p, i64, i64, p, p, p, p, threads],
        }
        self._kernels: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name, argtypes in signatures.items():
            for dtype, suffix in self.DTYPES.items():
                kernel = getattr(library, f"{name}_{suffix}")
                kernel.argtypes, kernel.restype = argtypes, None
                self._kernels[name, dtype] = kernel

    def pointers(self, dtype: torch.dtype) -> dict[str, int]:
        """Each op's kernel for `dtype` by name, as an address (decode_layers.cpp)."""
        return {
            name: function_address(kernel)
            for (name, kernel_dtype), kernel in self._kernels.items()
            if kernel_dtype == dtype
        }

    def fits(self, *tensors: torch.Tensor, widths: int = 1) -> bool:
        """bf16 or fp32 (all alike), contiguous, last dimension a multiple of `widths` times
        the kernels' width in lanes (rotary and SiLU * up: 2, for their halves)."""
        dtype = tensors[0].dtype
        return dtype in self.DTYPES and all(
            t.dtype == dtype and t.is_contiguous() and t.shape[-1] % (widths * self.lanes) == 0
            for t in tensors
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x (..., D) normed over D, times weight (D,)."""
        out = torch.empty_like(x)
        dim = x.shape[-1]
        with profiled("kernel:elementwise"):
            self._kernels["rms_norm", x.dtype](
                x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                torch.get_num_threads(),
            )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, that sum normed over D times weight (D,)) for x, delta (..., D)."""
        total, out = torch.empty_like(x), torch.empty_like(x)
        dim = x.shape[-1]
        with profiled("kernel:elementwise"):
            self._kernels["add_rms_norm", x.dtype](
                x.data_ptr(), delta.data_ptr(), weight.data_ptr(), total.data_ptr(),
                out.data_ptr(), x.numel() // dim, dim, eps, torch.get_num_threads(),
            )  # fmt: skip
        return total, out

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q (T, H, D), k (T, KH, D) rotated in place by cos/sin (T, 1, D)."""
        tokens, heads, dim = q.shape
        with profiled("kernel:elementwise"):
            self._kernels["rotary", q.dtype](
                q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads,
                k.shape[1], dim, torch.get_num_threads(),
            )  # fmt: skip
        return q, k

    def silu_mul(self, h: torch.Tensor) -> torch.Tensor:
        """h (M, 2I) = [gate | up] → silu(gate) * up (M, I)."""
        rows, width = h.shape
        gate, up = h[:, : width // 2], h[:, width // 2 :]
        return self.silu_mul_halves(gate, up, stride=width)

    def silu_mul_halves(
        self, gate: torch.Tensor, up: torch.Tensor, stride: int | None = None
    ) -> torch.Tensor:
        """silu(gate) * up for gate, up (M, I) whose rows start `stride` elements apart
        (default I: two contiguous tensors) and whose elements within a row are adjacent."""
        rows, width = gate.shape
        out = gate.new_empty(rows, width)
        with profiled("kernel:elementwise"):
            self._kernels["silu_mul", gate.dtype](
                gate.data_ptr(), up.data_ptr(), out.data_ptr(), rows, width,
                width if stride is None else stride, torch.get_num_threads(),
            )  # fmt: skip
        return out

    def lora_add_(
        self,
        x: torch.Tensor,
        site: torch.Tensor,
        outs: Sequence[torch.Tensor],
        row_owner: torch.Tensor | None = None,
    ) -> None:
        """Add a LoRA site's products of x (T, in) onto `outs` in place, one per module of
        the site ((T, width) each, its rows any stride apart, its elements adjacent): `site`
        is its fields (lora/state.py `site_fields`), `row_owner` each row's adapter in a
        stack (-1: none)."""
        assert x.is_contiguous() and all(o.stride(-1) == 1 for o in outs)
        pointers = (ctypes.c_void_p * 3)(*(o.data_ptr() for o in outs))
        strides = (ctypes.c_int64 * 3)(*(o.stride(0) for o in outs))
        with profiled("kernel:lora"):
            self._kernels["lora_add", x.dtype](
                x.data_ptr(), x.shape[0], x.shape[1], site.data_ptr(), pointers, strides,
                None if row_owner is None else row_owner.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip


@functools.cache
def fused_ops(folder: Path | None = None, isa: str = "avx2") -> FusedOps | None:
    """The fused element-wise ops built for `isa` ("avx2" or "avx512"), or None where they
    cannot be built."""
    library = load_kernel("fused_ops", folder, isa)
    return None if library is None else FusedOps(library, 16 if isa == "avx512" else 8)


class BlockedLinear:
    """A linear kernel for products of few rows (decode steps) that reads each weight from a
    copy laid out once in its own order (`pack`): `bf16_linear_amx.cpp` (bf16, AMX tiles,
    or that layout read with AVX512-BF16) and `fp32_linear.cpp` (fp32, blocks of 16
    features). Takes what `fits` says yes to."""

    def __init__(
        self,
        library: ctypes.CDLL,
        prefix: str,
        dtype: torch.dtype,
        k_multiple: int,
        chunked: bool = False,
    ):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        # the layout's packer, where it is a C function (CodedLinear packs in Python)
        self._pack = getattr(library, f"{prefix}_pack", None)
        if self._pack is not None:
            self._pack.argtypes = [p, p, i64, i64]
            self._pack.restype = None
        self._linear = getattr(library, f"{prefix}_linear")
        self._linear.argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int] + [i64] * chunked
        self._linear.restype = None
        # the gate/up product with SiLU * up in its epilogue (same signature, out (M, n) for
        # a [gate | up] weight of 2n features), where the library has it
        self._silu_mul = getattr(library, f"{prefix}_linear_silu_mul", None)
        if self._silu_mul is not None:
            self._silu_mul.argtypes = self._linear.argtypes
            self._silu_mul.restype = None
        self.dtype, self._k_multiple = dtype, k_multiple
        # a chunked kernel's columns per partial sum (fp32_linear.cpp; 0: one sum
        # over all), or None where the kernel takes no such argument
        self.chunk: int | None = 0 if chunked else None
        # its chunk is the one that reproduces torch's F.linear on this CPU (torch_sum_chunk)
        self.reproduces_torch = False
        self._same_as_torch: dict[tuple[int, int], bool] = {}

    @property
    def address(self) -> int:
        """The linear kernel's address, for C code that calls it (decode_layers.cpp)."""
        return function_address(self._linear)

    @property
    def silu_mul_address(self) -> int | None:
        """`silu_mul`'s entry point (for decode_layers.cpp), or None where there is none."""
        return None if self._silu_mul is None else function_address(self._silu_mul)

    def silu_mul(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """silu(gate) * up (M, n) of x (M, K) and the packed [gate | up] weight (2n, K) of no
        bias: the bits of this kernel's product followed by FusedOps.silu_mul (only where
        `silu_mul_address` is not None)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], n, dtype=self.dtype)
        with profiled("kernel:linear"):
            self._silu_mul(
                x.data_ptr(), packed.data_ptr(), None, out.data_ptr(), x.shape[0], n, x.shape[1],
                torch.get_num_threads(),
            )  # fmt: skip
        return out

    def fits(self, weight: torch.Tensor) -> bool:
        """A 2-D weight of the kernel's dtype, a multiple of 16 rows (output features) by a
        multiple of the kernel's columns (32 for the bf16 tiles)."""
        return (
            weight.dtype == self.dtype
            and weight.dim() == 2
            and weight.shape[0] % 16 == 0
            and weight.shape[1] % self._k_multiple == 0
        )

    def same_as_torch(self, weight: torch.Tensor) -> bool:
        """The kernel's products with a weight of this shape are torch's F.linear bit for
        bit (products of 16 or more rows; checked once per shape on random values, at the
        thread count in force, on at most SAME_AS_TORCH_FEATURES of its output features):
        only where `reproduces_torch`."""
        if not self.reproduces_torch or not self.fits(weight):
            return False
        shape = min(weight.shape[0], SAME_AS_TORCH_FEATURES), weight.shape[1]
        if shape not in self._same_as_torch:
            self._same_as_torch[shape] = all(
                products_agree(self, rows, *shape) for rows in SAME_AS_TORCH_ROWS
            )
        return self._same_as_torch[shape]

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight (N, K) in the kernel's layout: a flat tensor of N * K."""
        weight = weight.detach().contiguous()
        out = torch.empty(weight.numel(), dtype=self.dtype)
        self._pack(weight.data_ptr(), out.data_ptr(), *weight.shape)
        return out

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x (M, K) @ the packed (n, K) weight .T + bias (fp32 or None) → (M, n), x's
        dtype (the kernel's)."""
        x = x.contiguous()
        m, k = x.shape
        out = torch.empty(m, n, dtype=self.dtype)
        bias_ptr = None if bias is None else bias.data_ptr()
        chunk = () if self.chunk is None else (self.chunk,)
        with profiled("kernel:linear"):
            self._linear(
                x.data_ptr(), packed.data_ptr(), bias_ptr, out.data_ptr(), m, n, k,
                torch.get_num_threads(), *chunk,
            )  # fmt: skip
        return out


@functools.cache
def amx_linear(folder: Path | None = None, isa: str = "amx") -> BlockedLinear | None:
    """The bf16 linear kernel on the AMX tile layout built for `isa`: "amx" (tile
    products) or "avx512" (AVX512-BF16's vdpbf16ps on the same layout, for CPUs without
    AMX); None where it cannot be built or Linux does not grant this process the AMX tile
    state."""
    library = load_kernel("bf16_linear_amx", folder, isa=isa)
    if library is None:
        return None
    if not library.bf16_amx_enable():
        logger.warning("Linux refused this process AMX's tile state: the AMX kernel is not used")
        return None
    return BlockedLinear(library, "bf16_amx", torch.bfloat16, k_multiple=32)


# Columns per partial sum that fp32_linear.cpp tries in order to reproduce torch's fp32
# F.linear (MKL's sgemm; its kc): 0 (one sum over all columns), then multiples of 16. MKL
# 2025 on an AMD EPYC Zen 4 sums in blocks of 192 columns, a row of 193-383 columns in two
# halves (even lengths; odd ones in some other way), for products of 4 rows or more at one
# thread, 12 or more at two (MKL gives each thread its rows, and fewer than 4 take its other
# paths); measured ad hoc against every split.
SUM_CHUNKS = (0, *range(16, 1025, 16))
# The products that decide the chunk: (rows, output features, columns). The columns are no
# multiple of the usual blocks, so a chunk's tail is checked too; the second is a prefill's.
SUM_CHUNK_PROBES = ((64, 32, 1400), (544, 48, 1400))
SAME_AS_TORCH_ROWS = (16, 64)  # the rows of the products checked for each weight's shape
# The output features a weight's check takes at most: the order of the sums is the columns'
# business (each output is its own sum), and the whole of SmolLM2's tied head (49152 x 576)
# took 0.86 s of start-up to check (its first 512 features: ~10 ms). AMD EPYC Zen 4.
SAME_AS_TORCH_FEATURES = 512
# The chunk where none reproduces torch (MKL 2025 on an Intel Xeon with AMX sums in some
# order no chunk gives): partial sums of a few dozen columns round closer to a blocked
# sgemm's than one chain over all of them. Intel Xeon (AMX), the fidelity suite's SmolLM2
# decode logits against transformers', largest difference: one chain 1.01e-4 (over its bar
# of 1e-4), chunks of 16 / 32 / 64 / 128 / 256 columns 5.8 / 6.1 / 5.7 / 5.5 / 7.5e-5.
FALLBACK_SUM_CHUNK = 128


def products_agree(kernel: BlockedLinear, rows: int, features: int, columns: int) -> bool:
    """`kernel` and torch's F.linear give the same bits for a product of this shape on
    random values (seeded by the shape), with and without a bias."""
    generator = torch.Generator().manual_seed(rows * 7919 + features * 31 + columns)
    x = torch.randn(rows, columns, generator=generator)
    weight = torch.randn(features, columns, generator=generator) / columns**0.5
    bias = torch.randn(features, generator=generator)
    packed = kernel.pack(weight)
    return all(
        torch.equal(kernel(x, packed, features, b), F.linear(x, weight, b)) for b in (None, bias)
    )


def torch_sum_chunk(kernel: BlockedLinear) -> int | None:
    """The chunk of columns with which `kernel` (chunked) gives torch's F.linear bit for bit
    on this CPU at the thread count in force; None when no chunk does. Screens every
    candidate on the small probe, then checks the one found on the others; leaves the
    kernel's chunk as it was."""
    previous = kernel.chunk
    try:
        for chunk in SUM_CHUNKS:
            kernel.chunk = chunk
            if products_agree(kernel, *SUM_CHUNK_PROBES[0]):
                others = SUM_CHUNK_PROBES[1:]
                return chunk if all(products_agree(kernel, *p) for p in others) else None
        return None
    finally:
        kernel.chunk = previous


@functools.cache
def fp32_linear(folder: Path | None = None, isa: str = "avx512") -> BlockedLinear | None:
    """The fp32 linear kernel on its 16-feature block layout built for `isa` ("avx512" or
    "avx2": the same sums in the same order, so the same bits), or None where it cannot be
    built. Its sums go in the chunks that reproduce torch's F.linear on this CPU where some
    chunk does (`reproduces_torch`; see torch_sum_chunk), in FALLBACK_SUM_CHUNK's
    elsewhere."""
    library = load_kernel("fp32_linear", folder, isa=isa)
    if library is None:
        return None
    kernel = BlockedLinear(library, "fp32_blocked", torch.float32, 1, chunked=True)
    chunk = torch_sum_chunk(kernel)
    kernel.chunk = FALLBACK_SUM_CHUNK if chunk is None else chunk
    kernel.reproduces_torch = chunk is not None
    return kernel


# fp32_linear.cpp's CODED forms: per run of CODED_RUN columns of a row a d (and for
# Q4_1 an m), and a code per weight; the bytes of a run of a block of 16 features
CODED_RUN = 32
CODED_RUN_BYTES = {"q4_1": 384, "q8_0": 576}
# each form's codes: (least, greatest) q
CODE_RANGE = {"q4_1": (0, 15), "q8_0": (-128, 127)}
CODED_FORMS = tuple(CODE_RANGE)  # coded_find.cpp's numbers for them


class CodedLinear(BlockedLinear):
    """fp32 linear layers whose weights are low-bit codes in disguise, as GGUF's quantized
    blocks dequantize: every run of 32 columns of a row is (d * q) + m in fp32 for 16 values
    of q ("q4_1": Q4_1's, the default model's linear layers), or d * q for q in -128..127
    ("q8_0": Q8_0's, its tied embedding and head). `pack` finds d (m) and q and keeps them
    (6 or 9 bits a weight) where they give back every weight bit for bit, and the kernel
    decodes them into fp32 in cache as it reads them, then sums as the blocked kernel
    (`fp32_linear`) does: its bits, from under a fifth (under a third) of the bytes
    (fp32_linear.cpp CODED; figures: radixserve/hardware.py CODED_LINEAR). Any other
    weight: `pack` returns None."""

    def __init__(
        self,
        blocked: BlockedLinear,
        library: ctypes.CDLL,
        form: str = "q4_1",
        folder: Path | None = None,  # where the kernels are built (coded_runs' too)
    ) -> None:
        prefix = "fp32_coded" if form == "q4_1" else "fp32_coded8"
        super().__init__(library, prefix, torch.float32, k_multiple=CODED_RUN, chunked=True)
        self.blocked, self.form, self.folder = blocked, form, folder
        self.chunk, self.reproduces_torch = blocked.chunk, blocked.reproduces_torch

    def fits(self, weight: torch.Tensor) -> bool:
        """The blocked kernel's shapes whose chunks of sums fall on runs of 32 columns."""
        k = weight.shape[-1]
        chunk = k if not self.chunk or self.chunk > k else self.chunk
        if chunk < k < 2 * chunk and k % 2 == 0:  # the kernels' halves (effective_chunk)
            chunk = k // 2
        return super().fits(weight) and chunk % CODED_RUN == 0

    def same_as_torch(self, weight: torch.Tensor) -> bool:
        """The blocked kernel's answer: the same weights, the same sums."""
        return self.blocked.same_as_torch(weight)

    def find(self, weight: torch.Tensor) -> Codes | None:
        """weight's (d, m, q) in this form (`coded_runs`), or None where it does not fit or
        some run of it is no (d * q) + m of this form."""
        if not self.fits(weight):
            return None
        return coded_runs(weight.detach().float().contiguous(), self.form, self.folder)

    def pack(  # type: ignore[override]
        self, weight: torch.Tensor, found: Codes | None = None
    ) -> torch.Tensor | None:
        """weight (N, K) as the kernel's codes (a flat uint8 tensor), or None where `find`
        says None; `found`: what `find` gave for it already."""
        found = found if found is not None else self.find(weight)
        if found is None:
            return None
        d, m, q = found  # (N, K / 32) fp32 twice, (N, K / 32, 32) codes
        n, runs = d.shape

        def by_run(t: torch.Tensor) -> torch.Tensor:  # (N, runs) fp32 -> (N / 16, runs, 64) bytes
            return t.view(n // 16, 16, runs).transpose(1, 2).contiguous().view(torch.uint8)

        if self.form == "q4_1":  # two columns' codes a byte
            pairs = q.view(n, runs, CODED_RUN // 2, 2)
            q = pairs[..., 0] | (pairs[..., 1] << 4)
        columns = q.to(torch.int8).view(torch.uint8).view(n // 16, 16, runs, -1)
        parts = [by_run(d), by_run(m)] if self.form == "q4_1" else [by_run(d)]
        codes = torch.cat([*parts, columns.permute(0, 2, 3, 1).reshape(n // 16, runs, -1)], 2)
        assert codes.shape[-1] == CODED_RUN_BYTES[self.form]
        return codes.reshape(-1).contiguous()


# a weight's codes as `coded_runs` finds them: (d, m, q)
Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def coded_runs(
    weight: torch.Tensor, form: str = "q4_1", folder: Path | None = None
) -> Codes | None:
    """(d, m, q) with (d * q) + m == weight bit for bit in every run of CODED_RUN columns of
    a row, q in the form's CODE_RANGE (int16), or None (also where no C++ compiler builds
    the finder: the kernels that read codes are not built then either). Q4_1: m is the
    run's least value (q = 0 there), d the step that takes it to the greatest in 15 steps;
    Q8_0: m = 0 (adding it is exact), d the greatest magnitude over 127 (q = +-127 there); d
    as the GGUF stores it (fp16) or as fp32 computes it (coded_find.cpp, built in `folder`)."""
    find = _code_finder(folder)
    n, k = weight.shape
    if find is None or k % CODED_RUN or weight.dtype != torch.float32:
        return None
    weight = weight.detach().contiguous()
    d, m = torch.empty(n, k // CODED_RUN), torch.empty(n, k // CODED_RUN)
    q = torch.empty(n, k // CODED_RUN, CODED_RUN, dtype=torch.int16)
    pointers = (t.data_ptr() for t in (d, m, q))
    found = find(weight.data_ptr(), n, k, CODED_FORMS.index(form), *pointers)
    return (d, m, q) if found else None


@functools.cache
def _code_finder(folder: Path | None = None) -> Callable[..., int] | None:
    """coded_find.cpp's `coded_find`, or None where it cannot be built."""
    library = load_kernel("coded_find", folder)
    if library is None:
        return None
    find = library.coded_find
    find.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    find.argtypes += [ctypes.c_void_p] * 3
    find.restype = ctypes.c_int
    return find


@functools.cache
def coded_linear(
    folder: Path | None = None, form: str = "q4_1", isa: str = "avx512"
) -> CodedLinear | None:
    """The fp32 kernel on codes of `form` (`CodedLinear`) beside `fp32_linear` built for
    `isa`, where that one is there."""
    blocked = fp32_linear(folder, isa)
    if blocked is None:
        return None
    return CodedLinear(blocked, load_kernel("fp32_linear", folder, isa=isa), form, folder)


class CodedAmxLinear:
    """fp32 products of many rows (prefill chunks, large mixed steps) on AMX's bf16 tiles for
    weights that are GGUF codes dequantized (`coded_runs`): each run of 32 columns of a weight
    row is d * q + m for small integer codes q, exact in bf16, and x is split into three bf16
    parts that sum to it exactly, so every product is exact and summed in fp32: fp32
    arithmetic in another order, from three tile products per run instead of 32 FMAs a
    column (fp32_coded_amx.cpp; figures: radixserve/hardware.py CODED_AMX). A weight that
    is no such codes, or of a shape the kernel does not take: `pack` returns None."""

    def __init__(self, library: ctypes.CDLL, folder: Path | None = None) -> None:
        self.folder = folder  # where the kernels are built (coded_runs' too)
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._split = library.fp32_amx_split
        self._split.argtypes = [p, p, p, i64, i64, i64, c_int]
        self._split.restype = None
        self._linear = library.fp32_amx_coded_linear
        self._linear.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, c_int, c_int]
        self._linear.restype = None
        # the last x split, held (q, k and v read one x): (x, parts, sums, mp)
        self._last: tuple | None = None

    def pack(
        self, weight: torch.Tensor, found: Codes | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """weight (N, K) as (codes: bf16 AMX B tiles, scales: d and m per block of 16
        features and run, has_min: whether m is not all zero), or None where N is no multiple
        of 32, K of 32, or no form of codes gives the weight back bit for bit; `found`: its
        codes in some form, found already (`CodedLinear.find`)."""
        if weight.dim() != 2 or weight.dtype != torch.float32:
            return None
        n, k = weight.shape
        if n % 32 or k % CODED_RUN:
            return None
        if found is None:
            w = weight.detach().float().contiguous()
            forms = (coded_runs(w, form, self.folder) for form in CODE_RANGE)
            found = next(filter(None, forms), None)
            if found is None:
                return None
        d, m, q = found
        runs = k // CODED_RUN
        # tile (block b, run j): row p, pair c holds q[16 b + c][32 j + 2 p + {0, 1}]
        codes = q.to(torch.bfloat16).view(n // 16, 16, runs, 16, 2).permute(0, 2, 3, 1, 4)
        by_block = [t.view(n // 16, 16, runs).transpose(1, 2) for t in (d, m)]
        scales = torch.stack(by_block, 2)  # (N / 16, runs, [d, m], 16)
        return codes.contiguous().view(-1), scales.contiguous().view(-1), bool(m.any())

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """x's three bf16 parts and run sums (fp32_amx_split), those of the last call where
        x is the same tensor: a product's input is not written in place before the next
        product reads it (inference tensors keep no version count to tell)."""
        last = self._last
        if last is not None and last[0] is x:
            return last[1], last[2], last[3]
        m, k = x.shape
        mp = -(-m // 16) * 16
        parts = torch.empty(3 * mp * k, dtype=torch.bfloat16)
        sums = torch.empty(mp * (k // CODED_RUN))
        with profiled("kernel:linear"):
            self._split(
                x.data_ptr(), parts.data_ptr(), sums.data_ptr(), m, mp, k, torch.get_num_threads()
            )
        self._last = (x, parts, sums, mp)
        return parts, sums, mp

    def __call__(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        has_min: bool,
    ) -> torch.Tensor:
        """x (M, K) fp32 @ W.T + bias for W packed as (codes, scales)."""
        x = x.contiguous()
        (m, k), threads = x.shape, torch.get_num_threads()
        parts, sums, mp = self.split(x)
        out = torch.empty(m, n)
        with profiled("kernel:linear"):
            self._linear(
                parts.data_ptr(), sums.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                None if bias is None else bias.data_ptr(), out.data_ptr(), m, mp, n, k,
                int(has_min), threads,
            )  # fmt: skip
        return out


@functools.cache
def coded_amx_linear(folder: Path | None = None) -> CodedAmxLinear | None:
    """`CodedAmxLinear`, where this CPU and Linux give the AMX tiles (`amx_linear`) and the
    kernel builds."""
    if amx_linear(folder) is None:  # asks Linux for the tile state, once per process
        return None
    library = load_kernel("fp32_coded_amx", folder, isa="amx")
    return None if library is None else CodedAmxLinear(library, folder)


# What a coded-prefill kernel (CodedAmxLinear, CodedLutLinear) takes after x for one product:
# (codes, scales, n, bias or None, has_min), codes, scales and has_min as its `pack` gives them.
CodedPart = tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None, bool]
PART_FIELDS = 6  # fp32_coded_lut.cpp's Part: a CodedPart's pointers, out's and the two ints


class CodedLutLinear:
    """fp32 products of many rows for weights that are 4-bit GGUF codes dequantized (Q4_1,
    `coded_runs`) by tables of subset sums of x (fp32_coded_lut.cpp): per group of 8 columns
    4 lookups stand in for 8 FMAs, which pays on cores that issue one 512-bit FMA a cycle,
    not two (measured at start-up: `measure_coded_lut`, radixserve/hardware.py CODED_LUT).
    `lanes`: rows of x a vector (8, or 16 where built for AVX-512); `chunk`: groups of 8
    columns whose tables a pass over the features reads."""

    def __init__(
        self, library: ctypes.CDLL, lanes: int, chunk: int, folder: Path | None = None
    ) -> None:
        self.folder = folder  # where the kernels are built (coded_runs' too)
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._linears = library.fp32_lut_coded_linears
        self._linears.argtypes = [p, p, c_int, i64, i64, c_int, c_int, c_int]
        self._linears.restype = c_int
        self.lanes, self.chunk = lanes, chunk

    def pack(
        self, weight: torch.Tensor, found: Codes | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """weight (N, K) as (offsets: uint16 byte offsets of each feature's lookups, scales:
        (2, runs, N) d then m, has_min), or None where K is no multiple of 32 or the weight is
        no 4-bit codes (`found`: its codes, found already by `CodedLinear.find`)."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % CODED_RUN:
            return None
        if found is None:
            found = coded_runs(weight.detach().float().contiguous(), "q4_1", self.folder)
        if found is None:
            return None
        d, m, q = found
        low, high = CODE_RANGE["q4_1"]
        if int(q.min()) < low or int(q.max()) > high:  # codes of another form (Q8_0)
            return None
        n, k = weight.shape
        chunks = k // 8 // self.chunk
        q = q.to(torch.int32).view(n, chunks, self.chunk, 8)
        column_bits = 1 << torch.arange(8, dtype=torch.int32)
        group_base = torch.arange(self.chunk, dtype=torch.int32).view(1, 1, -1) * 256
        offsets = torch.stack(
            [(((q >> b) & 1) * column_bits).sum(-1) + group_base for b in range(4)], -1
        )  # (n, chunks, chunk, bit): the subset's index in the chunk's tables
        offsets = (offsets * (self.lanes * 4)).permute(1, 0, 2, 3).contiguous()
        scales = torch.stack([d.T, m.T]).float().contiguous()  # (2, runs, n)
        return offsets.to(torch.uint16).view(-1), scales.view(-1), bool(m.any())

    def __call__(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        scales: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        has_min: bool,
    ) -> torch.Tensor:
        """x (M, K) fp32 @ W.T + bias for W packed as (offsets, scales)."""
        return self.products(x, [(offsets, scales, n, bias, has_min)])[0]

    def products(self, x: torch.Tensor, parts: Sequence[CodedPart]) -> list[torch.Tensor]:
        """x (M, K) fp32 @ W.T + bias for each part's W, packed as (offsets, scales), in one
        call: x's tables built once for all (q, k and v of one input)."""
        x = x.contiguous()
        m, k = x.shape
        outs = [torch.empty(m, n) for _, _, n, _, _ in parts]
        rows = []
        for (offsets, scales, n, bias, has_min), out in zip(parts, outs, strict=True):
            pointers = (offsets, scales, bias, out)
            rows.append([0 if t is None else t.data_ptr() for t in pointers] + [n, int(has_min)])
        fields = torch.tensor(rows, dtype=torch.int64)
        assert fields.shape[1] == PART_FIELDS
        with profiled("kernel:linear"):
            self._linears(
                x.data_ptr(), fields.data_ptr(), len(parts), m, k, self.lanes, self.chunk,
                torch.get_num_threads(),
            )  # fmt: skip
        return outs


@functools.cache
def coded_lut_linear(
    lanes: int = 16, chunk: int = 2, folder: Path | None = None
) -> CodedLutLinear | None:
    """`CodedLutLinear` with `lanes` rows a vector (16: the AVX-512 build; 8: the AVX2 one)
    and `chunk` groups a chunk, where this CPU runs and the machine builds it."""
    library = load_kernel("fp32_coded_lut", folder, isa="avx512" if lanes == 16 else "avx2")
    return None if library is None else CodedLutLinear(library, lanes, chunk, folder)


@dataclass(frozen=True)
class LutSample:
    """A product shape of the model for `measure_coded_lut`: a weight of that shape, its Q4_1
    codes, how many of the model's units have the shape, and what makes the product where
    the lookup kernel does not (x -> the product(s); None: F.linear, i.e. MKL)."""

    weight: torch.Tensor
    codes: Codes
    count: int
    otherwise: Callable[[torch.Tensor], object] | None = None


@dataclass(frozen=True)
class LutChoice:
    """What `measure_coded_lut` found: the fastest build of the lookup kernel over the
    sampled shapes (kernel), the weight shapes (N, K) where it beat what makes their
    products otherwise by the margin (shapes; empty: none), and each shape's ratio of that
    time to the kernel's (speedups)."""

    kernel: CodedLutLinear
    shapes: frozenset[tuple[int, int]]
    speedups: dict[tuple[int, int], float]


def measure_coded_lut(
    samples: dict[tuple[int, int], LutSample],
    rows: int,
    margin: float,
    folder: Path | None = None,
    reps: int = 7,
) -> LutChoice | None:
    """Time the lookup kernel's builds (`coded_lut_linear`: 16 rows a vector where AVX-512
    is there, 8 elsewhere; 1 or 2 groups a chunk) against what makes each shape's products
    otherwise (`LutSample.otherwise`: the blocked kernel where it takes every row count,
    else MKL) on one weight of each shape (N, K), products of `rows` random rows, the two
    alternated `reps` times. The build with the least time over the model's layers wins;
    the shapes where it takes at most 1 / margin of the other's time are its, by the least
    times and by the medians both (the ratio reported is the smaller). None where no build
    loads or takes the codes."""
    builds = [(16, 1), (16, 2), (8, 2)] if cpu_runs("avx512") else [(8, 1), (8, 2)]
    wait_for_builds()  # (a first start's compilers would share the cores it times)
    best: tuple[float, LutChoice] | None = None
    for lanes, chunk in builds:
        kernel = coded_lut_linear(lanes, chunk, folder)
        if kernel is None:
            continue
        speedups, total = {}, 0.0
        for shape, sample in samples.items():
            packed = kernel.pack(sample.weight, sample.codes)
            if packed is None:
                return None
            x = torch.randn(rows, shape[1])
            otherwise = sample.otherwise or functools.partial(F.linear, weight=sample.weight)
            times: dict[str, list[float]] = {"otherwise": [], "lut": []}
            for rep in range(reps + 1):  # the first: warm-up
                for name in times:
                    start = time.perf_counter()
                    if name == "otherwise":
                        otherwise(x)
                    else:
                        kernel(x, packed[0], packed[1], shape[0], None, packed[2])
                    if rep:
                        times[name].append(time.perf_counter() - start)
            # the least and the median time of each, so that a core taken by another
            # process for part of the run does not make a loser look a winner
            other, lut = (min(times[name]) for name in ("otherwise", "lut"))
            typical = statistics.median(times["otherwise"]) / statistics.median(times["lut"])
            speedups[shape] = min(other / lut, typical)
            total += sample.count * lut
        shapes = frozenset(s for s, speedup in speedups.items() if speedup >= margin)
        if best is None or total < best[0]:
            best = (total, LutChoice(kernel, shapes, speedups))
    return None if best is None else best[1]


# a kernel for fp32 products of many rows on a weight's codes: `pack(weight, found)` ->
# (codes in its layout, scales, has_min) | None, then `(x, codes, scales, n, bias, has_min)`
CodedPrefill = CodedAmxLinear | CodedLutLinear


def blocked_linear(
    dtype: torch.dtype, folder: Path | None = None, isa: str = "avx512"
) -> BlockedLinear | None:
    """The blocked-layout linear kernel for a model of `dtype` built for `isa` (bf16:
    `amx_linear`, "amx" or "avx512"; fp32: `fp32_linear`, "avx512" or "avx2"), or None where
    there is none or it cannot be built."""
    if dtype == torch.bfloat16:
        return amx_linear(folder, isa)
    return fp32_linear(folder, isa) if dtype == torch.float32 else None
