"""The same shared-prefix workload through the HTTP server (`radixserve serve`, a subprocess,
native /generate from concurrent clients) and through the offline Engine, alternating in one
run; prints each side's output throughput and the server's share of the Engine's."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from radixserve.bench.offline import PARTS, Row, add_workload_args, workload_prompts
from radixserve.config import add_config_args, config_from_args

STARTUP_TIMEOUT_S = 300


def add_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    parser.add_argument("--concurrency", type=int, default=64, help="clients at once")
    parser.add_argument("--stream", action="store_true", help="clients stream their results")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side")
    add_config_args(parser, PARTS)


def run(args: argparse.Namespace) -> int:
    from radixserve.engine import Engine

    config = config_from_args(args, PARTS)
    engine_kwargs = _options(config)
    params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    flags = server_flags(config)
    engine_rows: list[Row] = []
    server_rows: list[Row] = []
    prompts: list[list[int]] = []
    for round_ in range(args.rounds):
        with Engine(progress=round_ == 0, **engine_kwargs) as engine:
            prompts = prompts or workload_prompts(args, engine.runner.vocab_size)
            engine.generate(input_ids=prompts[0][:16], sampling_params=params)  # warm-up
            engine.flush_cache()
            start = time.perf_counter()
            results = engine.generate(input_ids=prompts, sampling_params=params)
            engine_rows.append(
                Row.of_results("offline Engine", time.perf_counter() - start, results)
            )
            engine_steps = _steps(engine.get_server_info())
        with Server(flags) as url:
            server_rows.append(
                serve_round(url, "HTTP server", prompts, params, args.concurrency, args.stream)
            )
            server_steps = _steps(
                json.loads(urllib.request.urlopen(url + "/get_server_info").read())
            )
        print(
            f"round {round_ + 1}: engine {engine_rows[-1].output_throughput:.1f} out tok/s, "
            f"server {server_rows[-1].output_throughput:.1f} out tok/s; "
            f"prefill batches / decode steps: engine {engine_steps}, server {server_steps}",
            flush=True,
        )
    _print(args, engine_rows, server_rows)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"engine": [asdict(r) for r in engine_rows],
                       "server": [asdict(r) for r in server_rows]}, f, indent=2)  # fmt: skip
    return 0


def _options(config) -> dict:
    """The config's model, cache and scheduler fields, by name."""
    flat = config.to_flat()
    return {k: flat[k] for part in PARTS for k in part.__dataclass_fields__}


def server_flags(config) -> list[str]:
    """`radixserve serve` flags for the config's model, cache and scheduler fields."""
    options = _options(config)
    valued = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in options.items()
        if v is not None and not isinstance(v, bool)
    ]
    return valued + [f"--{k.replace('_', '-')}" for k, v in options.items() if v is True]


def _steps(info: dict) -> str:
    state = info["internal_states"][0]
    return f"{state['prefill_batches']}/{state['decode_steps']}"


def serve_round(
    url: str, name: str, prompts: list[list[int]], params: dict, concurrency: int, stream: bool
) -> Row:
    """One timed run of `prompts` against the server at `url` from `concurrency` clients,
    after a warm-up request and a cache flush."""
    post(url, {"input_ids": prompts[0][:16], "sampling_params": params})  # warm-up
    post(url + "/flush_cache", None)
    body = {"sampling_params": params, "stream": stream}
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: post(url, {**body, "input_ids": p}), prompts))
    return Row.of_results(name, time.perf_counter() - start, results)


def post(url: str, body: dict | None) -> dict:
    """POST to /generate (or `url` itself when body is None); for a stream, the last chunk."""
    if body is None:
        urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=60).read()
        return {}
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url + "/generate", data, {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        if not body.get("stream"):
            return json.loads(response.read())
        last = None
        for line in response:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                last = json.loads(line[6:])
        return last


class Server:
    """`radixserve serve` on a free loopback port, stopped on exit."""

    def __init__(self, flags: list[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "radixserve", "--log-level", "warning", "serve"]
        self.cmd = [*cmd, "--port", str(self.port), *flags]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        # a SIGTERM (SystemExit: cli._run_bench) waits until self.proc is set: the server
        # is stopped whenever it comes
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            self.proc = subprocess.Popen(self.cmd, env=os.environ)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            return self._wait_healthy()
        except BaseException:  # (SIGTERM or Ctrl-C meanwhile too): no server left running
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            self.__exit__()
            raise

    def _wait_healthy(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=10)
                return self.url
            except (urllib.error.URLError, OSError):  # refused, 503 while loading, timeout
                time.sleep(0.5)
        raise RuntimeError("the server did not become healthy")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _print(args: argparse.Namespace, engine: list[Row], server: list[Row]) -> None:
    e = statistics.median(r.output_throughput for r in engine)
    s = statistics.median(r.output_throughput for r in server)
    hit = [r.cached_tokens / r.prompt_tokens for r in server]
    print(
        f"\nshared-prefix workload: {args.num_groups} groups x {args.prompts_per_group} prompts, "
        f"system {args.system_prompt_len} + question {args.question_len} tokens, "
        f"{args.output_len} output tokens; server clients: {args.concurrency} concurrent, "
        f"{'streaming' if args.stream else 'non-streaming'}; medians of {args.rounds} rounds"
    )
    print(f"{'run':<18}{'out tok/s':>11}{'rounds':>30}")
    print(f"{'offline Engine':<18}{e:>11.1f}   {[round(r.output_throughput, 1) for r in engine]}")
    print(f"{'HTTP server':<18}{s:>11.1f}   {[round(r.output_throughput, 1) for r in server]}")
    print(f"server / engine: {s / e:.2f}  (server cache hit rate {statistics.median(hit):.1%})")
