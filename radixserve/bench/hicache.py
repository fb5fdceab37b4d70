"""The hierarchical KV cache against its targets, in one run: multi-turn conversations whose
prefixes add up to ~4x a small device KV pool, a few requests in flight at a time, so that
other conversations' turns evict a conversation's prefix between its turns. Each
configuration is its own `radixserve serve`, one after another: (off) no tiers, (host) the
host tier (fp32), (host-<dtype>) the host tier in a narrower dtype, (disk) host + disk tier,
stopped after the run and replayed by a new server on the same folder (first turns only).
Prints throughput, the cache hit rate next to the workload's optimum, TTFT of later turns,
cached tokens by tier, greedy agreement with the fp32 host tier, the ratios vs (off) and
the issue's targets next to them. Temperature 0, EOS ignored. The defaults take about 7
minutes on 2 cores (five server starts included)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from radixserve.bench import serving
from radixserve.bench.datasets import Conversation, multi_turn_workload
from radixserve.bench.serving import RequestRecord

DEFAULT_POOL_TOKENS = 2048
PREFIX_TO_POOL = 3.75  # all final prefixes / the pool: ~4x, and 4 final turns still fit in it
HOST_HEADROOM = 1.5  # the default host tier holds this many times every conversation's prefix
NARROW_DTYPES = ("bfloat16", "float16", "int8")
WARMUP_SEED_OFFSET = 7919  # the warm-up conversation: drawn apart, shares nothing
STARTUP_TIMEOUT_S = 300
TARGETS = {  # the issue's targets
    "host_hit_of_optimum": 0.90,  # host tier: hit rate >= 90% of the optimum...
    "off_hit_of_optimum": 0.50,  # ...while (off) stays <= 50% of it
    "throughput_x": 1.5,  # host tier's request throughput / (off)'s
    "ttft_later_x": 2.0,  # (off)'s TTFT p50 of turns >= 2 / the host tier's
    "replay_x": 2.0,  # cold first-turn TTFT p50 / the disk replay's
}


# -- the workload ---------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkloadSize:
    """Conversations of `turns` turns: turn 1 is the conversation's own system prompt and a
    question, every later turn the previous prompt, its answer and a new question. Lengths
    in tokens (the texts come out at most that long)."""

    conversations: int
    turns: int
    system_prompt_len: int
    question_len: int
    output_len: int

    def __post_init__(self) -> None:
        assert self.conversations >= 1 and self.turns >= 1, self
        assert self.system_prompt_len >= 0 and self.question_len >= 1, self
        assert self.output_len >= 1, self

    def prompt_len(self, turn: int) -> int:
        """Tokens of turn `turn`'s prompt (from 1)."""
        return self.system_prompt_len + turn * self.question_len + (turn - 1) * self.output_len

    @property
    def final_prefix_len(self) -> int:
        """A conversation's last prompt: what a cache must keep between its turns."""
        return self.prompt_len(self.turns)

    @property
    def total_final_prefix_tokens(self) -> int:
        return self.conversations * self.final_prefix_len

    @property
    def prompt_tokens(self) -> int:
        """Every prompt token sent (what a run without a cache computes)."""
        per_conversation = sum(self.prompt_len(t) for t in range(1, self.turns + 1))
        return self.conversations * per_conversation

    @property
    def new_prompt_tokens(self) -> int:
        """The prompt tokens no earlier request had: a perfect cache computes only these."""
        return self.conversations * (self.final_prefix_len - (self.turns - 1) * self.output_len)


def size_workload(
    pool_tokens: int,
    conversations: int,
    turns: int,
    question_len: int,
    output_len: int,
    prefix_to_pool: float = PREFIX_TO_POOL,
) -> WorkloadSize:
    """The system prompt length that makes all conversations' final prefixes add up to
    `prefix_to_pool` times the pool."""
    per_conversation = round(prefix_to_pool * pool_tokens / conversations)
    system = per_conversation - turns * question_len - (turns - 1) * output_len
    if system < 0:
        raise ValueError(
            f"{turns} turns of {question_len}-token questions and {output_len}-token answers "
            f"are already longer than {per_conversation} tokens a conversation "
            f"({prefix_to_pool}x a {pool_tokens}-token pool over {conversations}): "
            "shorten them or enlarge the pool"
        )
    return WorkloadSize(conversations, turns, system, question_len, output_len)


def concurrency_fits(size: WorkloadSize, concurrency: int, pool_tokens: int) -> bool:
    """Whether `concurrency` final turns (prompt and output) fit in the pool at once."""
    return concurrency * (size.final_prefix_len + size.output_len) <= pool_tokens


def default_hicache_ratio(size: WorkloadSize, pool_tokens: int) -> float:
    """A host tier (in multiples of the pool) holding every conversation's prefix, with
    room to spare: what the targets presume."""
    return max(
        2.0, math.ceil(10 * HOST_HEADROOM * size.total_final_prefix_tokens / pool_tokens) / 10
    )


def build_conversations(tokenizer: Any, size: WorkloadSize, seed: int) -> list[Conversation]:
    """Each conversation with a system prompt of its own (so conversations share nothing)."""
    return multi_turn_workload(
        tokenizer,
        size.conversations,
        size.turns,
        size.question_len,
        size.output_len,
        seed,
        system_prompt_len=size.system_prompt_len,
        conversations_per_system=1,
    )


def first_turns(workload: list[Conversation]) -> list[Conversation]:
    return [Conversation(c.questions[:1], c.output_lens[:1]) for c in workload]


# -- the configurations ---------------------------------------------------------------------
@dataclass(frozen=True)
class Configuration:
    name: str  # off, host, host-int8, disk
    tier_flags: tuple[str, ...]  # beyond the flags every server gets
    disk: bool = False  # also a disk tier, then a replay on a new server


def configurations(dtypes: Sequence[str], ratio: float, disk: bool) -> list[Configuration]:
    tiers = ("--enable-hierarchical-cache", f"--hicache-ratio={ratio}")
    out = [
        Configuration("off", ()),
        Configuration("host", tiers),  # the pool's dtype: fp32
        *(Configuration(f"host-{d}", (*tiers, f"--hicache-dtype={d}")) for d in dtypes),
    ]
    if disk:
        out.append(Configuration("disk", tiers, disk=True))
    return out


# -- one run against a server ---------------------------------------------------------------
class TierBackend(serving.NativeBackend):
    """Native /generate that also keeps each request's last event, by rid: its output ids
    and cached tokens by tier (every event is cumulative)."""

    def __init__(self) -> None:
        self.last: dict[str, dict[str, Any]] = {}

    def read(self, event: dict[str, Any], text: str) -> serving.Chunk:
        rid = (event.get("meta_info") or {}).get("id")
        if rid is not None:
            self.last[rid] = event
        return super().read(event, text)


@dataclass(frozen=True)
class Seen:
    """What the server returned for one request beyond `bench serving`'s record."""

    output_ids: list[int]
    tiers: dict[str, int] | None  # cached_tokens_details; None: the server sends none
    logprobs: list[float] = field(default_factory=list)  # of each output token


Key = tuple[int, int]  # (conversation, turn)


@dataclass
class TierSession(serving.Session):
    """`bench serving`'s session, each request with a rid of its own so that the backend's
    events can be matched to the (conversation, turn) that sent them."""

    label: str = ""
    seen: dict[Key, Seen] = field(default_factory=dict)
    _count: int = field(default=0, init=False)

    async def _stream(self, body: dict[str, Any], record: RequestRecord) -> str:
        self._count += 1
        rid = f"bench-hicache-{self.label}-{record.conversation}-{record.turn}-{self._count}"
        text = await super()._stream({**body, "rid": rid, "return_logprob": True}, record)
        backend = self.backend
        assert isinstance(backend, TierBackend)
        event = backend.last.pop(rid, None)
        if record.success and event is not None:
            meta = event["meta_info"]
            logprobs = [entry[0] for entry in meta.get("output_token_logprobs") or []]
            key = (record.conversation, record.turn)
            self.seen[key] = Seen(event["output_ids"], meta.get("cached_tokens_details"), logprobs)
        return text


@dataclass
class RunResult:
    """One workload on one server, the warm-up left out."""

    name: str
    records: list[RequestRecord]
    duration: float
    seen: dict[Key, Seen]
    counters: dict[str, float]  # the server's hicache_* counters: after the run - before
    cached_before: list[RequestRecord] = field(default_factory=list)  # the warm-up


async def run_workload(
    url: str,
    name: str,
    tokenizer: Any,
    workload: list[Conversation],
    warmup: list[Conversation],
    concurrency: int,
    seed: int,
) -> RunResult:
    """A warm-up conversation (sharing nothing with the workload), then the timed run."""
    import httpx2
    from tqdm import tqdm

    timeout = httpx2.Timeout(serving.CONNECT_TIMEOUT_S, read=serving.READ_TIMEOUT_S, pool=None)
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx2.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        limit = asyncio.Semaphore(concurrency)
        session = TierSession(client, TierBackend(), url, None, tokenizer, limit, label=name)
        warm = await serving._warm_up(session, warmup, len(warmup))
        before = await server_state(client, url)
        total = sum(c.num_turns for c in workload)
        with tqdm(total=total, desc=name, unit="req", leave=False) as bar:
            session.t0 = time.perf_counter()
            records = await serving.send_workload(session, workload, math.inf, seed, bar)
            duration = time.perf_counter() - session.t0
        after = await server_state(client, url)
    seen = {k: v for k, v in session.seen.items() if k[0] >= 0}  # the warm-up is -1
    return RunResult(name, records, duration, seen, counter_deltas(before, after), warm)


async def server_state(client: Any, url: str) -> dict[str, float]:
    response = await client.get(url + "/get_server_info")
    response.raise_for_status()
    return response.json()["internal_states"][0]


def counter_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """The hierarchical cache's counters (`hicache_*`) moved by the run; sizes as after."""
    sizes = ("host_total", "host_used", "host_bytes", "disk_used_bytes", "disk_pages",
             "disk_page_tokens")  # fmt: skip
    out = {}
    for key, value in after.items():
        if not key.startswith("hicache_"):
            continue
        name = key[len("hicache_") :]
        out[name] = value if name in sizes else value - before.get(key, 0)
    return out


# -- the figures ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Agreement:
    """Greedy outputs of a run next to a reference run's, request by request."""

    compared: int  # requests both completed
    identical: float  # share of them whose output ids are identical
    tokens: float  # share of output positions holding the same id
    # |logprob - the reference's| of the same token after the same tokens: over every
    # request whose conversation agreed so far, up to its first differing token
    logprob_drift_mean: float | None = None
    logprob_drift_max: float | None = None


def greedy_agreement(outputs: dict[Key, Seen], reference: dict[Key, Seen]) -> Agreement | None:
    """Position by position (a later turn's prompt holds the earlier answers, so once a
    conversation diverges its later turns are compared on different prompts)."""
    keys = sorted(outputs.keys() & reference.keys())
    if not keys:
        return None
    same = matched = positions = 0
    drifts: list[float] = []
    diverged: set[int] = set()  # conversations whose prompts differ from here on
    for key in keys:  # (conversation, turn) order: earlier turns first
        a, b = outputs[key], reference[key]
        same += a.output_ids == b.output_ids
        matched += sum(x == y for x, y in zip(a.output_ids, b.output_ids))
        positions += max(len(a.output_ids), len(b.output_ids))
        if key[0] in diverged:
            continue
        for x, y, lp_a, lp_b in zip(a.output_ids, b.output_ids, a.logprobs, b.logprobs):
            if x != y:
                break
            drifts.append(abs(lp_a - lp_b))
        if a.output_ids != b.output_ids:
            diverged.add(key[0])
    return Agreement(
        len(keys),
        same / len(keys),
        matched / positions if positions else 1.0,
        statistics.fmean(drifts) if drifts else None,
        max(drifts) if drifts else None,
    )


@dataclass(frozen=True)
class Row:
    """One configuration's column of the table."""

    name: str
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    hit_rate: float | None
    optimum: float | None
    ttft_p50_later_ms: float | None  # turns >= 2
    ttft_p50_first_ms: float | None  # turn 1
    ttft_p50_ms: float | None
    cached_by_tier: dict[str, int] | None  # summed cached_tokens_details
    load_back_tokens: float | None  # the server's counters, host → device
    disk_pages_written: float | None
    disk_pages_read: float | None
    agreement: Agreement | None  # with the fp32 host tier's run

    @property
    def hit_of_optimum(self) -> float | None:
        if self.hit_rate is None or not self.optimum:
            return None
        return self.hit_rate / self.optimum


def ttft_p50_ms(
    records: Sequence[RequestRecord], of_turn: Callable[[int], bool] = lambda turn: True
) -> float | None:
    """TTFT p50 of the completed requests whose turn (from 0) `of_turn` keeps."""
    ttfts = [r.ttft for r in records if r.success and of_turn(r.turn)]
    return 1000 * statistics.median(ttfts) if ttfts else None


def cached_by_tier(seen: dict[Key, Seen]) -> dict[str, int] | None:
    details = [s.tiers for s in seen.values() if s.tiers is not None]
    if not details:
        return None
    return {tier: sum(d.get(tier, 0) for d in details) for tier in ("device", "host", "disk")}


def make_row(result: RunResult, reference: RunResult | None) -> Row:
    figures = serving.compute_figures(
        result.records, result.duration, serving.Slo(), result.cached_before
    )
    counters = result.counters
    agreement = None
    if reference is not None and reference is not result:
        agreement = greedy_agreement(result.seen, reference.seen)
    return Row(
        name=result.name,
        completed=figures.completed,
        failed=figures.failed,
        duration_s=result.duration,
        request_throughput=figures.request_throughput,
        output_throughput=figures.output_throughput,
        hit_rate=figures.cache_hit_rate,
        optimum=figures.optimum_cache_hit_rate,
        ttft_p50_later_ms=ttft_p50_ms(result.records, lambda turn: turn >= 1),
        ttft_p50_first_ms=ttft_p50_ms(result.records, lambda turn: turn == 0),
        ttft_p50_ms=ttft_p50_ms(result.records),
        cached_by_tier=cached_by_tier(result.seen),
        load_back_tokens=counters.get("load_back_tokens"),
        disk_pages_written=counters.get("disk_pages_written"),
        disk_pages_read=counters.get("disk_pages_read"),
        agreement=agreement,
    )


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return top / bottom if top is not None and bottom else None


@dataclass(frozen=True)
class Ratios:
    """A configuration against (off): both read "x times better"."""

    throughput_x: float | None  # its request throughput / (off)'s
    ttft_later_x: float | None  # (off)'s TTFT p50 of turns >= 2 / its


def ratios_vs_off(rows: Sequence[Row]) -> dict[str, Ratios]:
    off = next((r for r in rows if r.name == "off"), None)
    if off is None:
        return {}
    return {
        r.name: Ratios(
            _ratio(r.request_throughput, off.request_throughput),
            _ratio(off.ttft_p50_later_ms, r.ttft_p50_later_ms),
        )
        for r in rows
        if r.name != "off" and r.name != "disk replay"
    }


@dataclass(frozen=True)
class Target:
    what: str
    figure: float | None
    goal: str
    met: bool | None  # None: no figure

    @staticmethod
    def at_least(what: str, figure: float | None, goal: float, fmt: str) -> Target:
        met = None if figure is None else figure >= goal
        return Target(what, figure, f">= {format(goal, fmt)}", met)

    @staticmethod
    def at_most(what: str, figure: float | None, goal: float, fmt: str) -> Target:
        met = None if figure is None else figure <= goal
        return Target(what, figure, f"<= {format(goal, fmt)}", met)


def targets(rows: Sequence[Row], replay_x: float | None) -> list[Target]:
    by_name = {r.name: r for r in rows}
    host, off = by_name.get("host"), by_name.get("off")
    vs_off = ratios_vs_off(rows).get("host", Ratios(None, None))
    t = TARGETS
    return [
        Target.at_least("host: hit rate / optimum", host and host.hit_of_optimum,
                        t["host_hit_of_optimum"], ".0%"),
        Target.at_most("off: hit rate / optimum", off and off.hit_of_optimum,
                       t["off_hit_of_optimum"], ".0%"),
        Target.at_least("host / off: request throughput", vs_off.throughput_x,
                        t["throughput_x"], ".1f"),
        Target.at_least("off / host: TTFT p50 of turns >= 2", vs_off.ttft_later_x,
                        t["ttft_later_x"], ".1f"),
        Target.at_least("disk: cold / first-replay TTFT p50", replay_x, t["replay_x"], ".1f"),
    ]  # fmt: skip


def replay_speedup(cold: Row | None, replay: Row | None) -> float | None:
    """The cold run's first-turn TTFT p50 over the replay's (the same prompts)."""
    if cold is None or replay is None:
        return None
    return _ratio(cold.ttft_p50_first_ms, replay.ttft_p50_first_ms)


# -- the report -----------------------------------------------------------------------------
LABEL_WIDTH = 34
CELL_WIDTH = 15  # fits "host-bfloat16" with a gap


def _fmt(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: Sequence[Row]) -> str:
    """Configurations side by side, one line per figure."""

    def tier(row: Row, name: str) -> int | None:
        return None if row.cached_by_tier is None else row.cached_by_tier[name]

    def agree(row: Row, attr: str) -> float | None:
        return None if row.agreement is None else getattr(row.agreement, attr)

    lines_spec: list[tuple[str, Any, str]] = [
        ("requests completed (failed)", lambda r: f"{r.completed} ({r.failed})", ""),
        ("duration (s)", lambda r: r.duration_s, ".1f"),
        ("request throughput (req/s)", lambda r: r.request_throughput, ".3f"),
        ("output throughput (tok/s)", lambda r: r.output_throughput, ".1f"),
        ("cache hit rate (server)", lambda r: r.hit_rate, ".1%"),
        ("  optimum (unbounded cache)", lambda r: r.optimum, ".1%"),
        ("  hit rate / optimum", lambda r: r.hit_of_optimum, ".1%"),
        ("TTFT p50, turns >= 2 (ms)", lambda r: r.ttft_p50_later_ms, ".0f"),
        ("TTFT p50, turn 1 (ms)", lambda r: r.ttft_p50_first_ms, ".0f"),
        ("TTFT p50, all (ms)", lambda r: r.ttft_p50_ms, ".0f"),
        ("cached tokens: device", lambda r: tier(r, "device"), "d"),
        ("               host", lambda r: tier(r, "host"), "d"),
        ("               disk", lambda r: tier(r, "disk"), "d"),
        ("loaded back host -> device (tok)", lambda r: r.load_back_tokens, ".0f"),
        ("disk pages written / read", _disk_pages, ""),
        ("vs (host): identical requests", lambda r: agree(r, "identical"), ".1%"),
        ("           identical tokens", lambda r: agree(r, "tokens"), ".1%"),
        ("           logprob drift mean", lambda r: agree(r, "logprob_drift_mean"), ".2e"),
        ("           logprob drift max", lambda r: agree(r, "logprob_drift_max"), ".2e"),
    ]
    head = f"{'':<{LABEL_WIDTH}}" + "".join(f"{r.name:>{CELL_WIDTH}}" for r in rows)
    out = [head, "-" * len(head)]
    for label, value, fmt in lines_spec:
        cells = "".join(f"{_fmt(value(r), fmt):>{CELL_WIDTH}}" for r in rows)
        out.append(f"{label:<{LABEL_WIDTH}}{cells}")
    return "\n".join(out)


def _disk_pages(row: Row) -> str | None:
    if row.disk_pages_written is None and row.disk_pages_read is None:
        return None
    return f"{_fmt(row.disk_pages_written, '.0f')} / {_fmt(row.disk_pages_read, '.0f')}"


def format_ratios(rows: Sequence[Row]) -> str:
    ratios = ratios_vs_off(rows)
    if not ratios:
        return "(no (off) run: no ratios)"
    head = f"{'vs (off)':<{LABEL_WIDTH}}" + "".join(f"{n:>{CELL_WIDTH}}" for n in ratios)
    out = [head, "-" * len(head)]
    for label, attr in (("request throughput", "throughput_x"),
                        ("TTFT p50 of turns >= 2 (off / it)", "ttft_later_x")):  # fmt: skip
        cells = "".join(
            f"{_fmt(getattr(r, attr), '.2f') + 'x':>{CELL_WIDTH}}" for r in ratios.values()
        )
        out.append(f"{label:<{LABEL_WIDTH}}{cells}")
    return "\n".join(out)


def format_targets(items: Sequence[Target]) -> str:
    out = [f"{'target':<40}{'figure':>10}{'goal':>10}{'met':>6}"]
    for t in items:
        fmt = ".1%" if "optimum" in t.what else ".2f"
        figure = _fmt(t.figure, fmt) + ("" if fmt == ".1%" or t.figure is None else "x")
        met = "-" if t.met is None else ("yes" if t.met else "NO")
        out.append(f"{t.what:<40}{figure:>10}{t.goal:>10}{met:>6}")
    return "\n".join(out)


def describe(size: WorkloadSize, pool: int, concurrency: int, ratio: float) -> str:
    return (
        f"workload: {size.conversations} conversations x {size.turns} turns, each with its own "
        f"{size.system_prompt_len}-token system prompt; questions {size.question_len}, answers "
        f"{size.output_len} tokens; final prefixes {size.final_prefix_len} tokens each, "
        f"{size.total_final_prefix_tokens} in all = "
        f"{size.total_final_prefix_tokens / pool:.2f}x the {pool}-token device pool; "
        f"{size.prompt_tokens} prompt tokens sent, {size.new_prompt_tokens} of them new; "
        f"{concurrency} requests in flight at most; host tier {ratio}x the pool's bytes"
    )


# -- the command ----------------------------------------------------------------------------
def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32", help="the model's and KV pool's dtype")
    parser.add_argument(
        "--max-total-tokens", type=int, default=DEFAULT_POOL_TOKENS, help="the device KV pool"
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--question-len", type=int, default=40, help="tokens of each question")
    parser.add_argument("--output-len", type=int, default=16, help="tokens of each answer")
    parser.add_argument(
        "--system-prompt-len",
        type=int,
        default=None,
        help="default: what makes all final prefixes --prefix-to-pool times the pool",
    )
    parser.add_argument(
        "--prefix-to-pool",
        type=float,
        default=PREFIX_TO_POOL,
        help="all conversations' final prefixes over the pool, when the system prompt's "
        "length is derived",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    parser.add_argument(
        "--hicache-ratio",
        type=float,
        default=None,
        help=f"the host tier, in multiples of the pool's bytes (default: room for "
        f"{HOST_HEADROOM}x every conversation's final prefix, at least 2)",
    )
    parser.add_argument(
        "--dtypes",
        default="int8",
        help=f"narrower host tiers to run, comma-separated ({', '.join(NARROW_DTYPES)}; "
        "empty: none)",
    )
    parser.add_argument("--no-disk", action="store_true", help="skip the disk tier and replay")
    parser.add_argument(
        "--server-args", default="", help="more `radixserve serve` flags for every server"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="the servers' logs (default: a temp dir)")
    parser.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S)
    parser.add_argument("--output", default=None, help="a JSON of the results")


def parse_dtypes(text: str) -> list[str]:
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in NARROW_DTYPES]
    if unknown:
        raise ValueError(f"--dtypes: {', '.join(unknown)} not among {', '.join(NARROW_DTYPES)}")
    return list(dict.fromkeys(dtypes))


def workload_size(args: argparse.Namespace) -> WorkloadSize:
    if args.system_prompt_len is None:
        return size_workload(args.max_total_tokens, args.conversations, args.turns,
                             args.question_len, args.output_len, args.prefix_to_pool)  # fmt: skip
    return WorkloadSize(args.conversations, args.turns, args.system_prompt_len,
                        args.question_len, args.output_len)  # fmt: skip


def check_args(args: argparse.Namespace) -> str | None:
    """A user error, said plainly; None if the arguments make a run."""
    if min(args.conversations, args.turns, args.concurrency, args.max_total_tokens) < 1:
        return "--conversations, --turns, --concurrency and --max-total-tokens must be >= 1"
    if args.question_len < 1 or args.output_len < 1:
        return "--question-len and --output-len must be >= 1"
    if args.system_prompt_len is not None and args.system_prompt_len < 0:
        return "--system-prompt-len must be >= 0"
    if args.hicache_ratio is not None and args.hicache_ratio <= 0:
        return "--hicache-ratio must be > 0"
    try:
        parse_dtypes(args.dtypes)
        workload_size(args)
    except ValueError as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    problem = check_args(args)
    if problem:
        print(f"radixserve bench hicache: error: {problem}", file=sys.stderr)
        return 2
    import httpx2

    from radixserve.bench.vs_vllm import StartError

    try:
        return Bench(args).run()
    except (StartError, serving.SetupError, httpx2.HTTPError) as e:  # the warm-up failed...
        print(f"radixserve bench hicache: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


class Bench:
    """Every configuration's server in turn, one loaded at a time."""

    def __init__(self, args: argparse.Namespace) -> None:
        from radixserve.config import default_model_cache_dir
        from radixserve.model.loader import resolve_model_folder

        self.args = args
        self.size = workload_size(args)
        self.pool = args.max_total_tokens
        self.ratio = args.hicache_ratio or default_hicache_ratio(self.size, self.pool)
        self.folder = resolve_model_folder(args.model_path, Path(default_model_cache_dir()))
        self.tokenizer = serving.load_tokenizer(str(self.folder))
        self.workload = build_conversations(self.tokenizer, self.size, args.seed)
        warm = WorkloadSize(1, 1, 0, self.size.question_len, self.size.output_len)
        self.warmup = build_conversations(self.tokenizer, warm, args.seed + WARMUP_SEED_OFFSET)
        self.base_flags = [f"--max-total-tokens={self.pool}", *shlex.split(args.server_args)]
        self.temp = tempfile.TemporaryDirectory(prefix="bench-hicache-")
        self.log_dir = Path(args.log_dir or self.temp.name) / "logs"

    def configurations(self) -> list[Configuration]:
        return configurations(parse_dtypes(self.args.dtypes), self.ratio, not self.args.no_disk)

    def run(self, configs: Sequence[Configuration] | None = None) -> int:
        """Every configuration (default: those the arguments ask for), then the report."""
        from radixserve.hardware import cpu_info

        args = self.args
        started = time.perf_counter()
        print(f"CPU: {cpu_info().summary()}")
        print(f"model: {self.folder.name}, {args.dtype}; greedy (temperature 0), EOS ignored")
        print(describe(self.size, self.pool, args.concurrency, self.ratio), flush=True)
        if not concurrency_fits(self.size, args.concurrency, self.pool):
            print(f"note: {args.concurrency} final turns do not fit in the pool at once")
        results: list[RunResult] = []
        with self.temp:
            for config in self.configurations() if configs is None else configs:
                results += self.one_configuration(config)
        rows = self.rows(results)
        replay_x = replay_speedup(
            *(next((r for r in rows if r.name == n), None) for n in ("disk", "disk replay"))
        )
        seconds = time.perf_counter() - started
        print(self.report(rows, replay_x, seconds))
        if args.output:
            self.write_json(args.output, rows, results, replay_x, seconds)
        return 0 if all(r.failed == 0 for r in rows) else 1

    def one_configuration(self, config: Configuration) -> list[RunResult]:
        """The workload on the configuration's server; for the disk tier, also the first
        turns again on a new server on the same folder."""
        flags = list(config.tier_flags)
        if config.disk:
            flags.append(f"--hicache-storage-dir={Path(self.temp.name) / 'disk'}")
        cold = self.on_server(config.name, flags, self.workload)
        if not config.disk:
            return [cold]
        # the first server has stopped, so its queued page writes have landed; what it
        # wrote is what the replay's optimum starts from
        replay = self.on_server("disk replay", flags, first_turns(self.workload))
        replay.cached_before += cold.records
        return [cold, replay]

    def on_server(self, name: str, flags: list[str], workload: list[Conversation]) -> RunResult:
        """Start a server, run `workload` on it, stop it (SIGTERM; waits for it to exit)."""
        from radixserve.bench.vs_vllm import (
            ServerProcess,
            StartError,
            _free_port,
            log_tail,
            radixserve_command,
        )

        port = _free_port()
        cmd = radixserve_command(self.folder, self.args.dtype, port, [*self.base_flags, *flags])
        log = self.log_dir / f"{name.replace(' ', '-')}.log"
        with ServerProcess(name, cmd, dict(os.environ), port, log) as server:
            try:
                startup = server.start(self.args.startup_timeout)
            except StartError:
                print(f"--- the last lines of {log} ---\n{log_tail(log)}\n---", file=sys.stderr)
                raise
            print(f"({name}) ready in {startup:.0f} s", flush=True)
            args = self.args
            run = run_workload(
                server.url, name, self.tokenizer, workload, self.warmup, args.concurrency, args.seed
            )
            result = asyncio.run(run)
        failed = sum(not r.success for r in result.records)
        note = f", {failed} FAILED (log {log})" if failed else ""
        print(f"({name}) {len(result.records)} requests in {result.duration:.1f} s{note}",
              flush=True)  # fmt: skip
        return result

    def rows(self, results: list[RunResult]) -> list[Row]:
        reference = next((r for r in results if r.name == "host"), None)
        return [make_row(r, reference) for r in results]

    def report(self, rows: list[Row], replay_x: float | None, seconds: float) -> str:
        by_name = {r.name: r for r in rows}
        cold, replay = by_name.get("disk"), by_name.get("disk replay")
        parts = [
            "",
            f"{' bench hicache ':=^{LABEL_WIDTH + CELL_WIDTH * len(rows)}}",
            format_table(rows),
            "(disk replay: the first turn of every conversation, sent again to a new server "
            "on the disk tier's folder)",
            "",
            format_ratios(rows),
        ]
        if cold is not None and replay is not None:
            parts += [
                "",
                f"disk: first-turn TTFT p50 cold {_fmt(cold.ttft_p50_first_ms, '.0f')} ms, "
                f"first replay {_fmt(replay.ttft_p50_first_ms, '.0f')} ms: "
                f"{_fmt(replay_x, '.2f')}x",
            ]
        parts += ["", format_targets(targets(rows, replay_x)), "",
                  f"{seconds:.0f} s in all (server starts included)"]  # fmt: skip
        return "\n".join(parts)

    def write_json(
        self,
        path: str,
        rows: list[Row],
        results: list[RunResult],
        replay_x: float | None,
        seconds: float,
    ) -> None:
        from radixserve.hardware import cpu_info

        config = vars(self.args) | {"hicache_ratio": self.ratio, "model": self.folder.name}
        out = {
            "config": config,
            "cpu": cpu_info().as_dict(),
            "workload": asdict(self.size),
            "rows": [asdict(r) | {"hit_of_optimum": r.hit_of_optimum} for r in rows],
            "ratios_vs_off": {k: asdict(v) for k, v in ratios_vs_off(rows).items()},
            "disk_replay_x": replay_x,
            "targets": [asdict(t) for t in targets(rows, replay_x)],
            "server_counters": {r.name: r.counters for r in results},
            "seconds": seconds,
        }
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)
