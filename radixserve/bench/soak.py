"""A soak test of memory: a real server (`radixserve serve`, a loopback subprocess) under a
mixed load for a bounded time, sampling the RSS of its process tree; prints the series and
the RSS after the warm-up next to the RSS at the end, which should be flat (within 10%)."""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import psutil

from radixserve.bench.server_vs_engine import Server

KINDS = ("generate", "generate-stream", "completions", "completions-stream")
WORDS = tuple(
    "the of and a to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her would "
    "make like him into time has look two more write go see number no way could people my "
    "than first water been call who oil its now find long down day did get come made may "
    "part".split()
)
FLAT_WITHIN = 0.10  # the bar: RSS after warm-up vs at the end


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-path", default=None, help="the model to serve (default: the server's default)"
    )
    parser.add_argument("--duration", type=float, default=180, help="seconds of load")
    parser.add_argument(
        "--warmup", type=float, default=30, help="seconds of load before the baseline RSS"
    )
    parser.add_argument("--interval", type=float, default=5, help="seconds between RSS samples")
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once")
    parser.add_argument("--num-prefixes", type=int, default=4, help="shared system prompts")
    parser.add_argument(
        "--server-args",
        default="",
        help="extra flags of `radixserve serve`, one string (e.g. '--max-total-tokens 50000')",
    )
    parser.add_argument("--seed", type=int, default=0)


@dataclass
class Counters:
    done: int = 0
    errors: int = 0
    last_error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, error: str | None) -> None:
        with self.lock:
            if error is None:
                self.done += 1
            else:
                self.errors += 1
                self.last_error = error


@dataclass(frozen=True)
class Sample:
    t_s: float
    rss_mib: float
    done: int
    errors: int


def run(args: argparse.Namespace) -> int:
    if args.warmup >= args.duration:
        print("radixserve: error: --warmup must be shorter than --duration")
        return 2
    flags = shlex.split(args.server_args)
    if args.model_path:
        flags = ["--model-path", args.model_path, *flags]
    started = time.perf_counter()
    process = Server(flags)
    with process as url:
        ready_s = time.perf_counter() - started
        server = psutil.Process(process.proc.pid)
        print(f"server ready in {ready_s:.1f} s, RSS {tree_rss_mib(server):.0f} MiB", flush=True)
        samples = soak(url, server, args)
    print_summary(samples, args)
    return 0


def tree_rss_mib(proc: psutil.Process) -> float:
    """RSS of a process and all its descendants, MiB."""
    total = 0
    for p in (proc, *proc.children(recursive=True)):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def soak(url: str, server: psutil.Process, args: argparse.Namespace) -> list[Sample]:
    counters = Counters()
    stop = threading.Event()
    rng = random.Random(args.seed)
    prefixes = [
        " ".join(rng.choices(WORDS, k=rng.randint(100, 400))) for _ in range(args.num_prefixes)
    ]
    clients = [
        threading.Thread(
            target=client, args=(url, prefixes, args.seed + 1 + i, counters, stop), daemon=True
        )
        for i in range(args.concurrency)
    ]
    for c in clients:
        c.start()
    start = time.perf_counter()
    samples: list[Sample] = []
    print(f"{'t (s)':>7}{'RSS MiB':>10}{'done':>8}{'errors':>8}", flush=True)
    while True:
        now = time.perf_counter() - start
        samples.append(Sample(now, tree_rss_mib(server), counters.done, counters.errors))
        s = samples[-1]
        print(f"{s.t_s:>7.0f}{s.rss_mib:>10.0f}{s.done:>8}{s.errors:>8}", flush=True)
        if now >= args.duration:
            break
        time.sleep(min(args.interval, args.duration - now))
    stop.set()
    for c in clients:
        c.join(timeout=120)
    if counters.errors:
        print(f"last error: {counters.last_error}")
    return samples


def client(
    url: str, prefixes: list[str], seed: int, counters: Counters, stop: threading.Event
) -> None:
    """Requests one after another until `stop`: every kind, shared prefixes and fresh
    prompts of varied lengths, varied output lengths."""
    rng = random.Random(seed)
    while not stop.is_set():
        fresh = " ".join(rng.choices(WORDS, k=rng.randint(5, 300)))
        prompt = f"{rng.choice(prefixes)} {fresh}" if rng.random() < 0.6 else fresh
        params = {"max_new_tokens": rng.randint(8, 96), "temperature": 0.8, "ignore_eos": True}
        try:
            send(url, rng.choice(KINDS), prompt, params)
            counters.record(None)
        except OSError as e:  # refused, reset, HTTP errors (urllib's are OSErrors)
            counters.record(f"{type(e).__name__}: {e}")


def send(url: str, kind: str, prompt: str, params: dict) -> None:
    stream = kind.endswith("stream")
    if kind.startswith("generate"):
        path, body = "/generate", {"text": prompt, "sampling_params": params, "stream": stream}
    else:
        path = "/v1/completions"
        body = {
            "prompt": prompt,
            "max_tokens": params["max_new_tokens"],
            "temperature": params["temperature"],
            "ignore_eos": True,
            "stream": stream,
        }
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        for _ in response:  # read the whole answer (every chunk of a stream)
            pass


def print_summary(samples: list[Sample], args: argparse.Namespace) -> None:
    base = next(s for s in samples if s.t_s >= args.warmup)
    end = samples[-1]
    change = end.rss_mib / base.rss_mib - 1
    after = [s.rss_mib for s in samples if s.t_s >= args.warmup]
    verdict = "flat" if abs(change) <= FLAT_WITHIN else "NOT flat"
    print(
        f"\nRSS after {base.t_s:.0f} s of warm-up: {base.rss_mib:.0f} MiB; at the end "
        f"({end.t_s:.0f} s): {end.rss_mib:.0f} MiB ({change:+.1%}, {verdict} within "
        f"{FLAT_WITHIN:.0%}); max {max(after):.0f}, median {statistics.median(after):.0f} MiB"
    )
    rate = (end.done - base.done) / max(end.t_s - base.t_s, 1e-9)
    print(f"requests: {end.done} done, {end.errors} errors; {rate:.2f} req/s after warm-up")
