"""SGLang-paper-shaped programs written with `radixserve.lang` (few-shot MMLU, HellaSwag
select, tree of thought, skeleton of thought, LLM judge, regex JSON, multi-turn chat; see
lang_workloads.py), each a batch through `run_batch`, under three configurations in one run:
(a) radixserve as it is, (b) the radix cache off (`--disable-radix-cache`), (c) the
frontend's co-design off (no pre-cache from tracing, no fork prefix hint, one scoring call
per select choice). Prints programs/s, tokens/s and the cache hit rate per workload and
configuration, the ratios (a)/(b) and (a)/(c), and draws a bar chart like the paper's
Figure 5 (each configuration's throughput over the best one's, per workload).

Two servers (`radixserve serve`, cache on and cache off) on the same weights start side by
side; (a) and (c) share the cache-on one. Only one is fed at a time: every workload runs
under the three configurations back to back, their order rotated from workload to workload
and from repetition to repetition, each after a cache flush. Data are generated (no
downloads), greedy (temperature 0)."""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from radixserve.bench.lang_workloads import BUILDERS, Workload, build_workloads
from radixserve.lang import Backend, ProgramState, RuntimeEndpoint, global_config

DEFAULT_PLOT = "benchmarks/programs.png"
DEFAULT_SIZES = {  # programs per workload: the whole run takes about 10 minutes on 2 cores
    "mmlu": 24,
    "hellaswag": 20,
    "tot": 8,
    "sot": 8,
    "judge": 8,
    "json": 16,
    "chat": 12,
}
FLUSH_RETRIES = 20  # /flush_cache answers 400 while requests still run: retry
SHOWN_CHARS = 800  # of a program's text, with --show-text
WARMUP_PROGRAMS = 1  # of each workload on each server before timing (kernels, regexes)
COUNTERS = {  # /metrics counter → Counters field
    "radixserve_prompt_tokens_total": "prompt_tokens",
    "radixserve_cached_tokens_total": "cached_tokens",
    "radixserve_generation_tokens_total": "generated_tokens",
    "radixserve_requests_total": "requests",
}


@dataclass(frozen=True)
class Configuration:
    key: str
    label: str
    radix_cache: bool  # served by the cache-on server
    co_design: bool  # the frontend's three co-design switches (global_config)


CONFIGS = (
    Configuration("a", "radixserve", radix_cache=True, co_design=True),
    Configuration("b", "no radix cache", radix_cache=False, co_design=True),
    Configuration("c", "no co-design", radix_cache=True, co_design=False),
)


@contextmanager
def co_design(on: bool) -> Iterator[None]:
    """The frontend's co-design switches on or off for the duration (restored after)."""
    names = ("enable_precache_with_tracing", "enable_fork_prefix_hint", "enable_batched_select")
    saved = {name: getattr(global_config, name) for name in names}
    for name in names:
        setattr(global_config, name, on)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(global_config, name, value)


@dataclass(frozen=True)
class Counters:
    """A server's /metrics counters: prompt tokens (cached ones included), cached prompt
    tokens, generated tokens, finished requests. Every request counts: the programs' gens,
    and the pre-cache, prefix-hint and scoring calls the frontend makes for them."""

    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    generated_tokens: float = 0.0
    requests: float = 0.0

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))


def read_counters(url: str) -> Counters:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    values = dict.fromkeys(COUNTERS.values(), 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        field = COUNTERS.get(name.split("{", 1)[0])
        if field is not None:
            values[field] += float(value)
    return Counters(**values)


def flush_cache(url: str) -> None:
    request = urllib.request.Request(url + "/flush_cache", method="POST")
    for _ in range(FLUSH_RETRIES):
        try:
            urllib.request.urlopen(request, timeout=60).read()
            return
        except urllib.error.HTTPError as e:
            if e.code != 400:
                raise
        time.sleep(0.5)
    raise RuntimeError(f"{url} kept refusing to flush its cache")


@dataclass(frozen=True)
class Run:
    """One workload's batch under one configuration."""

    workload: str
    config: str
    repetition: int
    programs: int
    seconds: float
    counters: Counters

    @property
    def programs_per_s(self) -> float:
        return self.programs / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return (self.counters.prompt_tokens + self.counters.generated_tokens) / self.seconds

    @property
    def hit_rate(self) -> float:
        c = self.counters
        return c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0


def measure(
    workload: Workload, config: Configuration, url: str, backend: Backend, repetition: int = 0
) -> tuple[Run, list[ProgramState]]:
    """Run the workload's batch once (after a cache flush); every program must succeed.
    The figures, and the programs' states."""
    flush_cache(url)
    before = read_counters(url)
    with co_design(config.co_design):
        start = time.perf_counter()
        states = workload.program.run_batch(workload.batch, backend=backend, temperature=0)
        errors = [e for e in (s.error() for s in states) if e is not None]
        seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{workload.name} ({config.label}): {len(errors)} programs failed; "
                           f"the first: {errors[0]!r}")  # fmt: skip
    counters = read_counters(url) - before
    return Run(workload.name, config.key, repetition, len(states), seconds, counters), states


def run_all(
    workloads: list[Workload],
    urls: dict[str, str],
    configs: tuple[Configuration, ...] = CONFIGS,
    repeats: int = 1,
    report: Callable[[Run, list[ProgramState]], None] = lambda run, states: None,
    warmup: bool = True,
) -> list[Run]:
    """Every workload under every configuration (`urls[config.key]` serves it), `repeats`
    times; the configurations' order rotates, so drift on the machine falls on all of them.
    With `warmup`, first a few programs of each workload on each server. `report` sees
    each run as it ends, with its programs' states."""
    backends = {url: RuntimeEndpoint(url) for url in set(urls.values())}
    try:
        start = time.perf_counter()
        for workload in workloads if warmup else ():
            head = Workload(workload.name, workload.program, workload.batch[:WARMUP_PROGRAMS])
            for config in {urls[c.key]: c for c in configs}.values():
                url = urls[config.key]
                measure(head, config, url, backends[url])
        if warmup:
            print(f"warm-up: {time.perf_counter() - start:.0f} s", flush=True)
        runs = []
        for rep in range(repeats):
            for i, workload in enumerate(workloads):
                shift = (rep + i) % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    url = urls[config.key]
                    run, states = measure(workload, config, url, backends[url], rep)
                    runs.append(run)
                    report(run, states)
        return runs
    finally:
        for backend in backends.values():
            backend.shutdown()


# -- the report -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """A workload under a configuration: medians over the repetitions; the hit rate and
    requests per program over all of them."""

    programs_per_s: float
    tokens_per_s: float
    hit_rate: float
    requests_per_program: float


def summarize(runs: list[Run]) -> dict[str, dict[str, Cell]]:
    """workload → configuration key → its Cell, in the order the runs name them."""
    grouped: dict[str, dict[str, list[Run]]] = {}
    for run in runs:
        grouped.setdefault(run.workload, {}).setdefault(run.config, []).append(run)
    out: dict[str, dict[str, Cell]] = {}
    for workload, by_config in grouped.items():
        out[workload] = {}
        for key, group in sorted(by_config.items()):
            prompt = sum(r.counters.prompt_tokens for r in group)
            cached = sum(r.counters.cached_tokens for r in group)
            out[workload][key] = Cell(
                statistics.median(r.programs_per_s for r in group),
                statistics.median(r.tokens_per_s for r in group),
                cached / prompt if prompt else 0.0,
                sum(r.counters.requests for r in group) / sum(r.programs for r in group),
            )
    return out


def ratio(cells: dict[str, Cell], top: str, bottom: str) -> float | None:
    if top not in cells or bottom not in cells or not cells[bottom].programs_per_s:
        return None
    return cells[top].programs_per_s / cells[bottom].programs_per_s


def table(summary: dict[str, dict[str, Cell]], configs: tuple[Configuration, ...]) -> str:
    """A Markdown table: per workload, each configuration's programs/s, tokens/s, hit rate
    and requests per program, then (a)/(b) and (a)/(c)."""
    head = ["workload"]
    for c in configs:
        head += [f"({c.key}) prog/s", f"({c.key}) tok/s", f"({c.key}) hit", f"({c.key}) req/prog"]
    head += ["(a)/(b)", "(a)/(c)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for workload, cells in summary.items():
        row = [workload]
        for c in configs:
            cell = cells.get(c.key)
            row += (
                ["-"] * 4
                if cell is None
                else [f"{cell.programs_per_s:.2f}", f"{cell.tokens_per_s:.0f}",
                      f"{cell.hit_rate:.0%}", f"{cell.requests_per_program:.1f}"]
            )  # fmt: skip
        for bottom in ("b", "c"):
            r = ratio(cells, "a", bottom)
            row.append("-" if r is None else f"{r:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(
    summary: dict[str, dict[str, Cell]], configs: tuple[Configuration, ...], path: str | Path
) -> None:
    """Grouped bars: per workload, each configuration's programs/s over the best one's."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = list(summary)
    width = 0.8 / len(configs)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 3.6))
    for j, c in enumerate(configs):
        heights = []
        for name in names:
            best = max(cell.programs_per_s for cell in summary[name].values())
            cell = summary[name].get(c.key)
            heights.append(cell.programs_per_s / best if cell and best else 0.0)
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, heights, width, label=f"({c.key}) {c.label}")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("throughput (normalized)")
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=8, ncol=len(configs), loc="upper center", bbox_to_anchor=(0.5, 1.18))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the command ------------------------------------------------------------------------------
def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-total-tokens", type=int, default=40000, help="each server's pool")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each workload per config")
    parser.add_argument("--seed", type=int, default=0)
    for name, n in DEFAULT_SIZES.items():
        parser.add_argument(f"--{name}", type=int, default=n, help=f"{name} programs (0: skip)")
    parser.add_argument(
        "--configs", default="abc", help="which configurations to run (a, b, c; default all)"
    )
    parser.add_argument(
        "--server-args",
        default="",
        help="more `radixserve serve` flags for both servers, one string (e.g. "
        "'--disable-in-batch-prefix-caching': the co-design's worth on a runtime that does "
        "not share a prefix among the requests of one batch)",
    )
    parser.add_argument("--plot", default=DEFAULT_PLOT, help="the bar chart (PNG)")
    parser.add_argument("--output-json", default=None, help="also write every run here")
    parser.add_argument(
        "--show-text", action="store_true", help="print one program's text per workload (a)"
    )


def run(args: argparse.Namespace) -> int:
    from radixserve.bench.server_vs_engine import Server
    from radixserve.config import default_model_cache_dir
    from radixserve.hardware import cpu_info
    from radixserve.model.loader import resolve_model_folder

    configs = tuple(c for c in CONFIGS if c.key in args.configs)
    workloads = build_workloads({name: getattr(args, name) for name in BUILDERS}, args.seed)
    folder = resolve_model_folder(args.model_path, Path(default_model_cache_dir()))
    flags = [f"--model-path={folder}", f"--dtype={args.dtype}",
             f"--max-total-tokens={args.max_total_tokens}"]  # fmt: skip
    flags += shlex.split(args.server_args)
    started = time.perf_counter()
    with ExitStack() as stack:
        urls: dict[str, str] = {}
        if any(c.radix_cache for c in configs):
            on = stack.enter_context(Server(flags))
            urls.update({c.key: on for c in configs if c.radix_cache})
        if any(not c.radix_cache for c in configs):
            off = stack.enter_context(Server([*flags, "--disable-radix-cache"]))
            urls.update({c.key: off for c in configs if not c.radix_cache})
        print(f"servers ready in {time.perf_counter() - started:.0f} s", flush=True)
        report = functools.partial(_print_run, show_text=args.show_text)
        runs = run_all(workloads, urls, configs, args.repeats, report=report)
    summary = summarize(runs)
    seconds = time.perf_counter() - started
    if args.server_args:
        print(f"servers' extra flags: {args.server_args}")
    print(f"\nCPU: {cpu_info().summary()}; {folder.name}, {args.dtype}; greedy; "
          f"{args.repeats} repetition(s), medians; {seconds:.0f} s in all")  # fmt: skip
    print("tok/s: prompt (cached included) + generated tokens of every request, from the "
          "servers' /metrics; hit: cached / prompt tokens")  # fmt: skip
    print(table(summary, configs))
    if args.plot:
        plot(summary, configs, args.plot)
        print(f"chart: {args.plot}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(r) for r in runs], f, indent=2)
    return 0


def _print_run(run: Run, states: list[ProgramState], show_text: bool = False) -> None:
    print(f"[rep {run.repetition + 1}] {run.workload:<22} ({run.config}) {run.seconds:6.1f} s "
          f"{run.programs_per_s:6.2f} prog/s {run.tokens_per_s:7.0f} tok/s "
          f"hit {run.hit_rate:4.0%} {run.counters.requests / run.programs:4.1f} req/prog",
          flush=True)  # fmt: skip
    if show_text and run.config == "a" and run.repetition == 0:
        print("    " + states[0].text()[-SHOWN_CHARS:].replace("\n", "\n    "))
