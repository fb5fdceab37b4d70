"""Load on any running server, native or OpenAI-compatible: a workload (random text or ids,
generated shared prefixes, multi-turn chats, ShareGPT) streamed at a Poisson rate under a
concurrency cap; prints throughput, TTFT / ITL / TPOT / end-to-end latency (and TTFT by turn
of multi-turn chats), goodput under SLOs, and the server's prefix-cache hit rate next to the
workload's optimum: what an unbounded prefix cache could have served."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import random
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import numpy as np
from tqdm import tqdm

from radixserve.bench import datasets
from radixserve.bench.datasets import Conversation, Prompt

DATASETS = ("random", "random-ids", "generated-shared-prefix", "multi-turn", "sharegpt")
CONNECT_TIMEOUT_S = 30
READ_TIMEOUT_S = 3600  # the longest a request may wait for its next byte (queued on a slow server)
FLUSH_RETRIES = 10  # /flush_cache answers 400 while requests still run: retry once a second
ERRORS_SHOWN = 5
PLOT_MAX_BINS = 100  # of the throughput-over-time plot


def add_args(parser: argparse.ArgumentParser) -> None:
    _add_endpoint_args(parser)
    _add_dataset_args(parser)
    _add_traffic_args(parser)
    _add_output_args(parser)


def _add_endpoint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="radixserve",
        help="radixserve: native /generate; openai: /v1/completions; "
        "openai-chat: /v1/chat/completions",
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a bearer token (default: $OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer folder or .gguf (default: the server's own when it "
        "names a local folder, else the default model's)",
    )


def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", choices=DATASETS, default="random")
    parser.add_argument(
        "--num-prompts", type=int, default=64, help="requests of random, random-ids and sharegpt"
    )
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * ratio, len]",
    )
    parser.add_argument("--gsp-num-groups", type=int, default=8)
    parser.add_argument("--gsp-prompts-per-group", type=int, default=8)
    parser.add_argument("--gsp-system-prompt-len", type=int, default=512)
    parser.add_argument("--gsp-question-len", type=int, default=32)
    parser.add_argument("--gsp-output-len", type=int, default=32)
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--multi-turn-question-len", type=int, default=64)
    parser.add_argument("--multi-turn-output-len", type=int, default=32)
    parser.add_argument(
        "--multi-turn-system-prompt-len",
        type=int,
        default=0,
        help="tokens of a random system prompt before each conversation's first question (0: none)",
    )
    parser.add_argument(
        "--multi-turn-conversations-per-system",
        type=int,
        default=1,
        help="consecutive conversations sharing one system prompt",
    )
    parser.add_argument("--dataset-path", default=None, help="a ShareGPT JSON file")
    parser.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="default: the token length of each gpt answer",
    )
    parser.add_argument("--seed", type=int, default=0)


def _add_traffic_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests (conversations) started per second, Poisson; inf = all at once",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most"
    )
    parser.add_argument("--warmup-requests", type=int, default=1)
    parser.add_argument(
        "--flush-cache", action="store_true", help="POST /flush_cache after the warm-up"
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--slo-e2e-ms", type=float, default=None)


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output-file", default=None, help="JSON: config, figures and one record per request"
    )
    parser.add_argument(
        "--plot-dir",
        default=None,
        help="PNG latency histograms and throughput over time (matplotlib)",
    )


# -- backends: what each API is sent and how its stream is read ------------------------------
@dataclass(frozen=True)
class Usage:
    """Token counts a server reports; None where it reports nothing."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Chunk:
    """One event of a stream: the text it adds, the counts it carries, or an error."""

    text: str = ""
    usage: Usage | None = None
    error: str | None = None


History = list[tuple[str, str]]  # earlier (question, answer) turns of a conversation


class Backend(ABC):
    """An API that streams a completion: where to POST, what to send, how to read events."""

    path: str  # the route requests are POSTed to

    def prompt(self, history: History, question: Prompt) -> Any:
        """The text so far (earlier turns with their answers) followed by the question."""
        if not history:
            return question
        assert isinstance(question, str)
        return "".join(q + a for q, a in history) + question

    @abstractmethod
    def body(self, prompt: Any, output_len: int, model: str | None) -> dict[str, Any]:
        """A streamed, greedy request for exactly `output_len` tokens (EOS ignored)."""

    @abstractmethod
    def read(self, event: dict[str, Any], text: str) -> Chunk:
        """The chunk in `event` (one `data:` payload), given the `text` received before it."""


class NativeBackend(Backend):
    """POST /generate; every event carries the cumulative text and meta_info."""

    path = "/generate"

    def body(self, prompt: Any, output_len: int, model: str | None) -> dict[str, Any]:
        params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
        key = "text" if isinstance(prompt, str) else "input_ids"
        return {key: prompt, "sampling_params": params, "stream": True}

    def read(self, event: dict[str, Any], text: str) -> Chunk:
        if "error" in event:
            return Chunk(error=_error_message(event["error"]))
        meta = event.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "abort":
            return Chunk(error=f"aborted: {finish.get('message')}")
        usage = Usage(
            meta.get("prompt_tokens"), meta.get("completion_tokens"), meta.get("cached_tokens")
        )
        return Chunk(event.get("text", "")[len(text) :], usage)


class CompletionsBackend(Backend):
    """POST /v1/completions; text deltas, usage in a last event without choices."""

    path = "/v1/completions"

    def body(self, prompt: Any, output_len: int, model: str | None) -> dict[str, Any]:
        return {"model": model, "prompt": prompt, **_openai_fields(output_len)}

    def read(self, event: dict[str, Any], text: str) -> Chunk:
        return _openai_chunk(event, lambda choice: choice.get("text"))


class ChatBackend(Backend):
    """POST /v1/chat/completions; earlier turns are sent as user/assistant messages."""

    path = "/v1/chat/completions"

    def prompt(self, history: History, question: Prompt) -> Any:
        messages = []
        for q, a in history:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return [*messages, {"role": "user", "content": question}]

    def body(self, prompt: Any, output_len: int, model: str | None) -> dict[str, Any]:
        return {"model": model, "messages": prompt, **_openai_fields(output_len)}

    def read(self, event: dict[str, Any], text: str) -> Chunk:
        return _openai_chunk(event, lambda choice: (choice.get("delta") or {}).get("content"))


BACKENDS: dict[str, type[Backend]] = {
    "radixserve": NativeBackend,
    "openai": CompletionsBackend,
    "openai-chat": ChatBackend,
}


def _openai_fields(output_len: int) -> dict[str, Any]:
    return {
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _openai_chunk(event: dict[str, Any], text_of: Callable[[dict], str | None]) -> Chunk:
    if "error" in event:
        return Chunk(error=_error_message(event["error"]))
    choices = event.get("choices") or []
    if choices and choices[0].get("finish_reason") == "abort":
        return Chunk(error="aborted")
    usage = event.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        usage = Usage(
            usage.get("prompt_tokens"), usage.get("completion_tokens"), details.get("cached_tokens")
        )
    return Chunk((text_of(choices[0]) or "") if choices else "", usage or None)


def _error_message(error: Any) -> str:
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


# -- sending requests ---------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, `start` from the run's start."""

    conversation: int
    turn: int
    prompt_len: int  # tokens of the prompt by the client's tokenizer (chat: the contents)
    expected_output_len: int
    start: float = 0.0
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # between chunks that added text
    output_len: int = 0  # the server's count, else the client's count of the text
    prompt_tokens: int | None = None  # the server's count
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache
    # The prompt (None: chat messages) and the generated text as token ids by the client's
    # tokenizer, for the optimum cache hit rate; not written out.
    prompt_ids: list[int] | None = field(default=None, repr=False)
    output_ids: list[int] | None = field(default=None, repr=False)

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        if self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


@dataclass
class Session:
    """What every request of a run shares: the client, the API, the limits."""

    client: httpx2.AsyncClient
    backend: Backend
    base_url: str
    model: str | None
    tokenizer: Any
    limit: asyncio.Semaphore | None
    t0: float = 0.0  # perf_counter at the start of the timed run

    async def conversation(self, index: int, conv: Conversation, bar: tqdm) -> list[RequestRecord]:
        """The turns of `conv` one after another; after a failed turn the rest are failed."""
        history: History = []
        records = []
        for turn, (question, n_out) in enumerate(zip(conv.questions, conv.output_lens)):
            if records and not records[-1].success:
                records.append(RequestRecord(index, turn, 0, n_out, error="an earlier turn failed"))
            else:
                record, answer = await self.turn(index, turn, history, question, n_out)
                records.append(record)
                if isinstance(question, str):  # only text conversations have several turns
                    history.append((question, answer))
            bar.update(1)
        return records

    async def turn(
        self, index: int, turn: int, history: History, question: Prompt, output_len: int
    ) -> tuple[RequestRecord, str]:
        prompt = self.backend.prompt(history, question)
        ids = prompt_ids(self.tokenizer, prompt)
        n_in = count_tokens(self.tokenizer, prompt) if ids is None else len(ids)
        record = RequestRecord(index, turn, n_in, output_len, prompt_ids=ids)
        body = self.backend.body(prompt, output_len, self.model)
        async with self.limit or contextlib.nullcontext():
            record.start = time.perf_counter() - self.t0
            text = await self._stream(body, record)
        if record.success:
            record.output_ids = self.tokenizer.encode(text, add_special_tokens=False)
            record.output_len = record.output_len or len(record.output_ids)  # none reported
        return record, text

    async def _stream(self, body: dict[str, Any], record: RequestRecord) -> str:
        """Send `body`, fill the record's times and counts; the generated text."""
        start = last = time.perf_counter()
        text = ""
        try:
            async with self.client.stream(
                "POST", self.base_url + self.backend.path, json=body
            ) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:300]
                    record.error = f"HTTP {response.status_code}: {detail}"
                    return text
                async for event in _events(response):
                    chunk = self.backend.read(event, text)
                    if chunk.error:
                        record.error = chunk.error
                        return text
                    if chunk.usage:
                        _take_usage(record, chunk.usage)
                    if chunk.text:
                        now = time.perf_counter()
                        if text:
                            record.itl.append(now - last)
                        else:
                            record.ttft = now - start
                        text, last = text + chunk.text, now
        except (httpx2.HTTPError, ValueError) as e:  # ValueError: not JSON, or cut short
            record.error = f"{type(e).__name__}: {e}"
            return text
        record.e2e = time.perf_counter() - start
        record.ttft = record.ttft or record.e2e  # nothing but empty text: the end is the first
        record.success = True
        return text


async def _events(response: httpx2.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of `data:` lines until `data: [DONE]`, which must come."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)
    raise ValueError("the stream ended before `data: [DONE]`")


def _take_usage(record: RequestRecord, usage: Usage) -> None:
    if usage.prompt_tokens is not None:
        record.prompt_tokens = usage.prompt_tokens
    if usage.completion_tokens is not None:
        record.output_len = usage.completion_tokens
    if usage.cached_tokens is not None:
        record.cached_tokens = usage.cached_tokens


def prompt_ids(tokenizer: Any, prompt: Any) -> list[int] | None:
    """A prompt's token ids: ids as they are, text by the tokenizer; None for chat messages,
    whose tokens depend on the server's chat template."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    if prompt and isinstance(prompt[0], dict):
        return None
    return list(prompt)


def count_tokens(tokenizer: Any, prompt: Any) -> int:
    """Tokens of a prompt: ids as they are, text by the tokenizer, chat by message contents."""
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt, add_special_tokens=False))
    if prompt and isinstance(prompt[0], dict):
        return sum(count_tokens(tokenizer, m["content"]) for m in prompt)
    return len(prompt)


async def send_workload(
    session: Session, workload: list[Conversation], request_rate: float, seed: int, bar: tqdm
) -> list[RequestRecord]:
    """Start each conversation after a Poisson gap (none at an infinite rate); all records."""
    gaps = random.Random(seed)
    tasks = []
    for index, conv in enumerate(workload):
        tasks.append(asyncio.create_task(session.conversation(index, conv, bar)))
        if math.isfinite(request_rate):
            await asyncio.sleep(gaps.expovariate(request_rate))
    return [record for records in await asyncio.gather(*tasks) for record in records]


# -- figures ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Latency:
    """Milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(seconds: Sequence[float]) -> Latency | None:
        if not seconds:
            return None
        ms = np.asarray(seconds) * 1000
        p50, p90, p99 = np.percentile(ms, [50, 90, 99]).tolist()
        return Latency(float(ms.mean()), p50, p90, p99)


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives in milliseconds; None = not asked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met_by(self, r: RequestRecord) -> bool:
        tpot = r.tpot
        return (
            (self.ttft_ms is None or r.ttft * 1000 <= self.ttft_ms)
            and (self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms)
            and (self.e2e_ms is None or r.e2e * 1000 <= self.e2e_ms)
        )


@dataclass(frozen=True)
class Figures:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests per second
    input_throughput: float  # tokens per second
    output_throughput: float
    concurrency: float  # mean requests in flight: the sum of latencies over the duration
    ttft_ms: Latency | None
    itl_ms: Latency | None
    tpot_ms: Latency | None
    e2e_ms: Latency | None
    goodput: float | None  # requests per second that met every SLO given; None: no SLO
    cache_hit_rate: float | None  # cached / prompt tokens; None: the server reports none
    optimum_cache_hit_rate: float | None  # see `optimum_cache_hit_rate`; None: chat prompts
    ttft_ms_by_turn: list[TurnTtft] | None  # first turns, second turns...; None: single turns
    errors: list[str]  # the first few distinct messages


@dataclass(frozen=True)
class TurnTtft:
    """TTFT of the completed requests of one turn of every conversation, milliseconds."""

    requests: int
    mean: float | None  # None: no request of this turn completed
    p50: float | None


def compute_figures(
    records: list[RequestRecord],
    duration: float,
    slo: Slo,
    cached_before: Sequence[RequestRecord] = (),
) -> Figures:
    """The run's figures; `cached_before`: requests whose prompts and outputs the server's
    cache held when the run started (the warm-up, unless the cache was flushed)."""
    done = [r for r in records if r.success]
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.output_len for r in done)
    return Figures(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration,
        input_throughput=input_tokens / duration,
        output_throughput=output_tokens / duration,
        concurrency=sum(r.e2e for r in done) / duration,
        ttft_ms=Latency.of([r.ttft for r in done]),
        itl_ms=Latency.of([t for r in done for t in r.itl]),
        tpot_ms=Latency.of([r.tpot for r in done if r.tpot is not None]),
        e2e_ms=Latency.of([r.e2e for r in done]),
        goodput=sum(map(slo.met_by, done)) / duration if slo.given() else None,
        cache_hit_rate=_cache_hit_rate(done),
        optimum_cache_hit_rate=optimum_cache_hit_rate(done, cached_before),
        ttft_ms_by_turn=ttft_by_turn(records),
        errors=list(dict.fromkeys(r.error for r in records if not r.success))[:ERRORS_SHOWN],
    )


def _cache_hit_rate(done: list[RequestRecord]) -> float | None:
    reported = [r for r in done if r.cached_tokens is not None]
    prompt = sum(r.input_tokens for r in reported)
    return sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else None


def ttft_by_turn(records: list[RequestRecord]) -> list[TurnTtft] | None:
    """TTFT of each turn index across conversations (entry k: turn k of the records, the
    (k+1)-th turn); None unless some conversation has several turns."""
    turns = max((r.turn for r in records), default=0) + 1
    if turns < 2:
        return None
    by_turn = []
    for turn in range(turns):
        ttfts = [r.ttft for r in records if r.success and r.turn == turn]
        stats = Latency.of(ttfts)
        if stats is None:
            by_turn.append(TurnTtft(0, None, None))
        else:
            by_turn.append(TurnTtft(len(ttfts), stats.mean, stats.p50))
    return by_turn


# -- the workload's optimum cache hit rate ------------------------------------------------------
@dataclass
class _Edge:
    ids: list[int]  # a run of tokens, the first of which keys the edge in its parent
    children: dict[int, _Edge]


class TokenTrie:
    """Token sequences in a radix tree: an edge holds a run of ids, so time and memory grow
    with the tokens inserted (a node per token would not fit thousands of long prompts)."""

    def __init__(self) -> None:
        self.root: dict[int, _Edge] = {}

    def match(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` some inserted sequence starts with."""
        children, n = self.root, 0
        while n < len(ids) and (edge := children.get(ids[n])) is not None:
            k = _common_prefix_len(edge.ids, ids, n)
            n += k
            if k < len(edge.ids):
                break
            children = edge.children
        return n

    def insert(self, ids: list[int]) -> None:
        children, n = self.root, 0
        while n < len(ids):
            edge = children.get(ids[n])
            if edge is None:
                children[ids[n]] = _Edge(ids[n:], {})
                return
            k = _common_prefix_len(edge.ids, ids, n)
            if k < len(edge.ids):  # `ids` leaves the edge midway: split it there
                rest = _Edge(edge.ids[k:], edge.children)
                edge.ids, edge.children = edge.ids[:k], {rest.ids[0]: rest}
            n += k
            children = edge.children


def _common_prefix_len(run: list[int], ids: list[int], start: int) -> int:
    """How many leading tokens of `run` equal those of `ids` from `start` on."""
    n = min(len(run), len(ids) - start)
    if run[:n] == ids[start : start + n]:  # the usual case, compared in C
        return n
    return next(i for i in range(n) if run[i] != ids[start + i])


def optimum_cache_hit_rate(
    done: list[RequestRecord], cached_before: Sequence[RequestRecord] = ()
) -> float | None:
    """The share of the prompt tokens of the completed requests `done` that an unbounded
    prefix cache could have served, on the client's token ids.

    The cache starts holding the prompts and outputs of `cached_before`. A request's prompt
    enters it when the request is sent (a server caches a prompt once it is prefilled), its
    prompt followed by its output when it finishes. Each request is served the longest prefix
    its prompt shares with the cache when it is sent, but for the last token, which must be
    computed. None where prompts are chat messages (their tokens are the server's)."""
    if not done or any(r.prompt_ids is None or r.output_ids is None for r in done):
        return None
    trie = TokenTrie()
    for r in cached_before:
        if r.prompt_ids is not None and r.output_ids is not None:
            trie.insert(r.prompt_ids + r.output_ids)
    finish, send = 0, 1  # at the same instant, a request finishes before another is sent
    events = sorted(
        [(r.start, send, i) for i, r in enumerate(done)]
        + [(r.start + r.e2e, finish, i) for i, r in enumerate(done)]
    )
    served = total = 0
    for _, kind, i in events:
        prompt, output = done[i].prompt_ids or [], done[i].output_ids or []
        if kind == send:
            served += min(trie.match(prompt), max(len(prompt) - 1, 0))
            total += len(prompt)
            trie.insert(prompt)
        else:
            trie.insert(prompt + output)
    return served / total if total else None


# -- the run ------------------------------------------------------------------------------------
class SetupError(Exception):
    """The run cannot start: no model name, no tokenizer, a failed warm-up."""


def run(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem:
        print(f"radixserve bench serving: error: {problem}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args))
    except httpx2.HTTPError as e:  # setting up; a request's own errors are in its record
        print(
            f"radixserve bench serving: error: cannot reach {args.base_url}: "
            f"{type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 2
    except SetupError as e:
        print(f"radixserve bench serving: error: {e}", file=sys.stderr)
        return 2


def _check_args(args: argparse.Namespace) -> str | None:
    if args.backend == "openai-chat" and args.dataset_name == "random-ids":
        return "openai-chat sends messages: use a text dataset, not random-ids"
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        return "--dataset-name sharegpt needs --dataset-path"
    if args.multi_turn_system_prompt_len < 0 or args.multi_turn_conversations_per_system < 1:
        return (
            "--multi-turn-system-prompt-len must be >= 0 and "
            "--multi-turn-conversations-per-system >= 1"
        )
    if args.max_concurrency is not None and args.max_concurrency < 1:
        return "--max-concurrency must be >= 1"
    if not args.request_rate > 0:
        return "--request-rate must be > 0 (inf: all at once)"
    if args.plot_dir and importlib.util.find_spec("matplotlib") is None:
        return "--plot-dir needs matplotlib: pip install matplotlib"
    return None


async def _run(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx2.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S, pool=None)
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx2.AsyncClient(
        headers=headers, timeout=timeout, limits=limits, trust_env=False
    ) as client:
        model = args.model or await _first_model(client, args.base_url, args.backend)
        tokenizer, tokenizer_path = await _tokenizer(client, args)
        workload = build_workload(args, tokenizer)
        if not workload:
            raise SetupError("the workload is empty (no ShareGPT entry fits?)")
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        session = Session(client, BACKENDS[args.backend](), args.base_url, model, tokenizer, limit)
        warm_up = await _warm_up(session, workload, args.warmup_requests)
        flushed = await _flush_cache(client, args.base_url) if args.flush_cache else None
        before = await _scheduler_state(client, args.base_url)
        records, duration = await _timed_run(session, workload, args)
        after = await _scheduler_state(client, args.base_url)
    config = {k: _jsonable(v) for k, v in vars(args).items()}
    config |= {"model": model, "tokenizer": tokenizer_path, "cache_flushed": flushed}
    config["server_decode"] = decode_breakdown(before, after)
    config["api_key"] = "<set>" if args.api_key else None  # never written out
    figures = _report(args, config, records, duration, [] if flushed else warm_up)
    return 0 if figures.failed == 0 else 1


def _report(
    args: argparse.Namespace,
    config: dict[str, Any],
    records: list[RequestRecord],
    duration: float,
    cached_before: list[RequestRecord],
) -> Figures:
    """Figures printed, and written where asked."""
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    figures = compute_figures(records, duration, slo, cached_before)
    print_report(config, figures)
    if args.output_file:
        write_results(args.output_file, config, figures, records)
    if args.plot_dir:
        write_plots(Path(args.plot_dir), records, figures)
    return figures


def build_workload(args: argparse.Namespace, tokenizer: Any) -> list[Conversation]:
    name = args.dataset_name
    if name in ("random", "random-ids"):
        return datasets.random_workload(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
            as_ids=name == "random-ids",
        )
    if name == "generated-shared-prefix":
        return datasets.shared_prefix_workload(
            tokenizer,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            args.seed,
        )
    if name == "multi-turn":
        return datasets.multi_turn_workload(
            tokenizer,
            args.num_conversations,
            args.num_turns,
            args.multi_turn_question_len,
            args.multi_turn_output_len,
            args.seed,
            system_prompt_len=args.multi_turn_system_prompt_len,
            conversations_per_system=args.multi_turn_conversations_per_system,
        )
    return datasets.sharegpt_workload(
        tokenizer, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed
    )


async def _first_model(client: httpx2.AsyncClient, base_url: str, backend: str) -> str | None:
    """The first id of /v1/models; the native API needs none, so there it may be missing."""
    response = await client.get(base_url + "/v1/models")
    if response.status_code == 200:
        data = response.json().get("data") or []
        if data:
            return data[0]["id"]
    if backend == "radixserve":
        return None
    raise SetupError(
        f"{base_url}/v1/models gave no model (HTTP {response.status_code}): name one with --model"
    )


async def _tokenizer(client: httpx2.AsyncClient, args: argparse.Namespace) -> tuple[Any, str]:
    """--tokenizer; else the server's tokenizer folder when it lies on this machine; else the
    default model's, the way `radixserve serve` finds it."""
    from radixserve.config import default_model_cache_dir
    from radixserve.model.loader import ModelLoadError, resolve_model_folder

    source = args.tokenizer or await _server_tokenizer_path(client, args.base_url)
    try:
        if source is None or source.endswith(".gguf"):
            source = str(resolve_model_folder(source, Path(default_model_cache_dir())))
        return load_tokenizer(source), source
    except (ModelLoadError, OSError, ValueError) as e:
        raise SetupError(f"cannot load a tokenizer ({e}); name one with --tokenizer") from e


def load_tokenizer(source: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


async def _server_tokenizer_path(client: httpx2.AsyncClient, base_url: str) -> str | None:
    """The tokenizer folder /get_model_info names, when it lies on this machine."""
    response = await client.get(base_url + "/get_model_info")
    if response.status_code in (404, 405):  # not a radixserve or SGLang server
        return None
    if response.status_code != 200:
        raise SetupError(f"{base_url}/get_model_info: HTTP {response.status_code} {response.text}")
    path = response.json().get("tokenizer_path")
    return path if path and Path(path).is_dir() else None


async def _warm_up(session: Session, workload: list[Conversation], n: int) -> list[RequestRecord]:
    """The first turns of the first `n` conversations, at once; any failure stops the run."""
    convs = [Conversation(c.questions[:1], c.output_lens[:1]) for c in workload[:n]]
    session.t0 = time.perf_counter()
    with tqdm(total=len(convs), disable=True) as bar:
        results = await asyncio.gather(*(session.conversation(-1, c, bar) for c in convs))
    failed = [r.error for records in results for r in records if not r.success]
    if failed:
        raise SetupError(f"the warm-up request failed: {failed[0]}")
    return [r for records in results for r in records]


async def _flush_cache(client: httpx2.AsyncClient, base_url: str) -> bool:
    """POST /flush_cache, retried while the server still runs requests; whether it was done."""
    for _ in range(FLUSH_RETRIES):
        response = await client.post(base_url + "/flush_cache")
        if response.status_code == 200:
            return True
        if response.status_code != 400:
            print(f"note: the server did not flush its cache (HTTP {response.status_code})")
            return False
        await asyncio.sleep(1)
    print("note: the server kept refusing to flush its cache (requests still running)")
    return False


async def _scheduler_state(client: httpx2.AsyncClient, base_url: str) -> dict | None:
    """A radixserve scheduler's counters (`/get_server_info`), or None for other servers."""
    try:
        response = await client.get(base_url + "/get_server_info")
        info = response.json() if response.status_code == 200 else {}
    except (httpx2.HTTPError, ValueError):
        return None
    states = info.get("internal_states") if isinstance(info, dict) else None
    state = states[0] if isinstance(states, list) and states else {}
    return state if isinstance(state, dict) and "decode_forward_seconds" in state else None


def decode_breakdown(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """Where the server's decode-only steps went during the run: the model's forward pass,
    the rest of the scheduler's step (batch building, sampling, stop checks, outputs), and
    the process loop around it (receiving requests, sending outputs). (A mixed step, a
    prefill chunk carrying the running requests' decode, counts as a prefill batch.) With
    the prefill batches' forward time per prompt token, where the server reports it."""
    if before is None or after is None:
        return None
    mixed = after.get("mixed_steps", 0) - before.get("mixed_steps", 0)
    steps = after["decode_steps"] - before["decode_steps"] - mixed
    forward = after["decode_forward_seconds"] - before["decode_forward_seconds"]
    step = after["decode_step_seconds"] - before["decode_step_seconds"]
    key = "decode_loop_seconds"
    loop = after[key] - before[key] if key in after and key in before else step
    if steps <= 0 or loop <= 0:
        return None
    figures = {
        "decode_steps": steps,
        "ms_per_step": 1000 * loop / steps,
        "forward_share": forward / loop,
        "scheduler_share": (step - forward) / loop,
        "loop_share": (loop - step) / loop,
    }
    tokens = after.get("prefill_forward_tokens", 0) - before.get("prefill_forward_tokens", 0)
    if tokens > 0:
        prefill = after["prefill_forward_seconds"] - before["prefill_forward_seconds"]
        figures |= {
            "prefill_batches": after["prefill_batches"] - before["prefill_batches"],
            "mixed_steps": mixed,
            "prefill_forward_s": prefill,
            "prefill_ms_per_token": 1000 * prefill / tokens,
        }
    return figures


async def _timed_run(
    session: Session, workload: list[Conversation], args: argparse.Namespace
) -> tuple[list[RequestRecord], float]:
    total = sum(c.num_turns for c in workload)
    with tqdm(total=total, desc="requests", unit="req") as bar:
        session.t0 = time.perf_counter()
        records = await send_workload(session, workload, args.request_rate, args.seed, bar)
        duration = time.perf_counter() - session.t0
    return records, duration


# -- output -------------------------------------------------------------------------------------
def print_report(config: dict[str, Any], f: Figures) -> None:
    def line(name: str, value: Any, fmt: str = "") -> None:
        print(f"{name + ':':<40}{'n/a' if value is None else format(value, fmt):>14}")

    print(f"\n{' Serving benchmark ':=^54}")
    line("Backend", config["backend"])
    line("Model", config["model"] or "-")
    line("Tokenizer", Path(config["tokenizer"]).name)
    line("Dataset", config["dataset_name"])
    line("Request rate (req/s)", config["request_rate"])
    line("Max concurrency", config["max_concurrency"] or "-")
    line("Completed requests", f.completed)
    line("Failed requests", f.failed)
    line("Duration (s)", f.duration_s, ".2f")
    line("Total input tokens", f.total_input_tokens)
    line("Total output tokens", f.total_output_tokens)
    line("Request throughput (req/s)", f.request_throughput, ".2f")
    line("Input token throughput (tok/s)", f.input_throughput, ".2f")
    line("Output token throughput (tok/s)", f.output_throughput, ".2f")
    line("Mean concurrency", f.concurrency, ".2f")
    line("Goodput (req/s)", f.goodput, ".2f")
    line("Cache hit rate", f.cache_hit_rate, ".1%")
    optimum = f.optimum_cache_hit_rate
    if optimum is not None:
        line("  optimum (unbounded cache)", optimum, ".1%")
        if f.cache_hit_rate is not None and optimum > 0:
            line("  measured / optimum", f.cache_hit_rate / optimum, ".1%")
    decode = config.get("server_decode")
    if decode:
        if "prefill_batches" in decode:
            line("Server prefill batches", decode["prefill_batches"])
            line("  with the running requests' decode", decode["mixed_steps"])
            line("  forward (s)", decode["prefill_forward_s"], ".1f")
            line("  forward per prompt token (ms)", decode["prefill_ms_per_token"], ".2f")
        line("Server decode-only steps", decode["decode_steps"])
        line("Server decode step (ms)", decode["ms_per_step"], ".1f")
        line("  in the forward pass", decode["forward_share"], ".1%")
        line("  scheduler outside the forward", decode["scheduler_share"], ".1%")
        line("  process loop (IPC)", decode["loop_share"], ".1%")
    for title, stats in (
        ("TTFT", f.ttft_ms),
        ("ITL", f.itl_ms),
        ("TPOT", f.tpot_ms),
        ("E2E latency", f.e2e_ms),
    ):
        print(f"{' ' + title + ' (ms) ':-^54}")
        for name in ("mean", "p50", "p90", "p99"):
            line(name, None if stats is None else getattr(stats, name), ".2f")
    if f.ttft_ms_by_turn:
        print_ttft_by_turn(f.ttft_ms_by_turn)
    print("=" * 54)
    for message in f.errors:
        print(f"error: {message}")


def print_ttft_by_turn(by_turn: list[TurnTtft]) -> None:
    def cell(value: float | None) -> str:
        return f"{'n/a' if value is None else format(value, '.2f'):>14}"

    print(f"{' TTFT by turn (ms) ':-^54}")
    print(f"{'turn':<12}{'requests':>14}{'mean':>14}{'p50':>14}")
    for turn, t in enumerate(by_turn, start=1):
        print(f"{turn:<12}{t.requests:>14}{cell(t.mean)}{cell(t.p50)}")


def _jsonable(value: Any) -> Any:
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def write_results(
    path: str, config: dict[str, Any], figures: Figures, records: list[RequestRecord]
) -> None:
    token_ids = ("prompt_ids", "output_ids")
    requests = [
        {k: v for k, v in vars(r).items() if k not in token_ids} | {"tpot": r.tpot} for r in records
    ]
    with open(path, "w") as out:
        json.dump(
            {"config": config, "figures": asdict(figures), "requests": requests},
            out,
            indent=1,
            default=str,
        )


def write_plots(folder: Path, records: list[RequestRecord], figures: Figures) -> None:
    """ttft.png, itl.png, e2e.png: histograms; throughput.png: output tokens/s over time."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.success]
    for name, values in (
        ("ttft", [r.ttft for r in done]),
        ("itl", [t for r in done for t in r.itl]),
        ("e2e", [r.e2e for r in done]),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.hist(np.asarray(values) * 1000, bins=40)
        ax.set(
            xlabel=f"{name.upper()} (ms)", ylabel="count", title=f"{name.upper()}, n={len(values)}"
        )
        fig.savefig(folder / f"{name}.png", dpi=100, bbox_inches="tight")
        plt.close(fig)
    times, tokens = token_arrivals(done)
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = min(PLOT_MAX_BINS, max(10, math.ceil(figures.duration_s)))  # 1 s each, or finer
    width = figures.duration_s / bins
    ax.hist(times, bins=bins, range=(0, figures.duration_s), weights=np.asarray(tokens) / width)
    ax.set(xlabel="time since start (s)", ylabel="output tokens/s", title="output throughput")
    fig.savefig(folder / "throughput.png", dpi=100, bbox_inches="tight")
    plt.close(fig)


def token_arrivals(records: list[RequestRecord]) -> tuple[list[float], list[float]]:
    """When output arrived (seconds from the start) and how many tokens each time, spreading a
    request's tokens evenly over the chunks that carried its text."""
    times: list[float] = []
    tokens: list[float] = []
    for r in records:
        arrivals = (r.start + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])).tolist()
        times += arrivals
        tokens += [r.output_len / len(arrivals)] * len(arrivals)
    return times, tokens
