"""The Batch API against concurrent clients, on one server in one run: the same
shared-prefix completions (greedy, fixed output length) sent by `--concurrency` clients to
/v1/completions, and as one batch (/v1/files, /v1/batches, polled until it ends); rounds
alternate the two, each after a cache flush. Prints each side's output tok/s, their medians
and the batch / clients ratio, and checks that both gave the same texts.

With `--interactive N`, it measures instead what a batch costs interactive clients: while
the batch runs, up to N streamed completions (unique prompts) are sent, one every
`--interactive-interval` seconds, each on its own, and rounds alternate the batch's lines
in the "default" and the "flex" service tier. Prints the interactive requests' time to
first token and latency, the batch's output tok/s, and how many batch texts differ between
the tiers (none in fp32; bf16 rounding may flip a greedy choice where the batches differ).
`--flex-caps 32,-1` runs the flex tier on one server per --flex-max-running-requests value,
all started at once and taken in turn."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx2

from radixserve.bench.offline import PARTS, add_workload_args, workload_prompts
from radixserve.bench.server_vs_engine import Server, server_flags
from radixserve.config import add_config_args, config_from_args

POLL_S = 0.1


def add_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    parser.add_argument("--concurrency", type=int, default=64, help="clients at once")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both, alternating")
    parser.add_argument(
        "--interactive",
        type=int,
        default=0,
        help="N > 0: up to N interactive requests while the batch runs (one every "
        "--interactive-interval s), the batch's lines in the default vs the flex tier",
    )
    parser.add_argument("--interactive-output-len", type=int, default=16)
    parser.add_argument(
        "--interactive-interval", type=float, default=1.0, help="seconds between them"
    )
    parser.add_argument(
        "--flex-caps",
        default=None,
        help="with --interactive: comma-separated --flex-max-running-requests values, one "
        "server each, the batch run in the flex tier on each (e.g. 32,-1)",
    )
    add_config_args(parser, PARTS)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from radixserve.model.loader import resolve_model_folder

    config = config_from_args(args, PARTS)
    folder = resolve_model_folder(config.model.model_path, config.model.cache_dir)
    prompts = workload_prompts(args, AutoConfig.from_pretrained(folder).vocab_size)
    body = {"model": "m", "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    bodies = [{**body, "prompt": p} for p in prompts]
    if args.interactive > 0:
        return _tiers(args, config, bodies, AutoConfig.from_pretrained(folder).vocab_size)
    if args.flex_caps:
        print("--flex-caps compares caps with --interactive N only", file=sys.stderr)
        return 2
    rates: dict[str, list[float]] = {"clients": [], "batch": []}
    texts: dict[str, list[str]] = {}
    with Server(server_flags(config)) as url, httpx2.Client(base_url=url, timeout=3600) as http:
        http.post("/v1/completions", json={**bodies[0], "max_tokens": 1})  # warm-up
        for round_ in range(args.rounds):
            for side in ("clients", "batch"):
                http.post("/flush_cache")
                start = time.perf_counter()
                if side == "clients":
                    answers = _clients(http, bodies, args.concurrency)
                else:
                    answers = _batch(http, bodies)
                seconds = time.perf_counter() - start
                tokens = sum(a["usage"]["completion_tokens"] for a in answers)
                rates[side].append(tokens / seconds)
                texts.setdefault(side, [a["choices"][0]["text"] for a in answers])
            print(
                f"round {round_ + 1}: clients {rates['clients'][-1]:.1f}, "
                f"batch {rates['batch'][-1]:.1f} out tok/s",
                flush=True,
            )
    clients, batch = (statistics.median(rates[s]) for s in ("clients", "batch"))
    print(
        f"\nshared-prefix completions: {len(prompts)} requests ({args.num_groups} groups x "
        f"{args.prompts_per_group}; system {args.system_prompt_len} + question "
        f"{args.question_len} tokens; {args.output_len} out); {args.concurrency} clients; "
        f"medians of {args.rounds} rounds"
    )
    print(f"{'side':<10}{'out tok/s':>11}   rounds")
    for side in ("clients", "batch"):
        print(f"{side:<10}{statistics.median(rates[side]):>11.1f}   {rates[side]}")
    same = texts["clients"] == texts["batch"]
    print(f"batch / clients: {batch / clients:.2f}; same texts: {same}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"rates": rates, "ratio": batch / clients, "same_texts": same}, f)
    return 0 if same else 1


def _clients(http: httpx2.Client, bodies: list[dict], concurrency: int) -> list[dict]:
    def one(body: dict) -> dict:
        response = http.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, bodies))


def _tiers(args: argparse.Namespace, config, bodies: list[dict], vocab_size: int) -> int:
    rng = random.Random(args.seed + 1)
    scheduler = config.scheduler
    caps = [scheduler.flex_max_running_requests]
    if args.flex_caps:
        caps = list(dict.fromkeys(int(c) for c in args.flex_caps.split(",")))  # (each once)
    # sides: the batch's tier on a server with that flex cap
    sides = [("default", caps[0])] + [("flex", cap) for cap in caps]
    names = ["default"] + (["flex"] if len(caps) == 1 else [f"flex cap {c}" for c in caps])
    ttft: dict[str, list[float]] = {name: [] for name in names}
    latency: dict[str, list[float]] = {name: [] for name in names}
    rates: dict[str, list[float]] = {name: [] for name in names}
    texts: dict[str, list[str]] = {}
    with contextlib.ExitStack() as stack:
        urls = {}
        for cap in caps:
            capped = replace(scheduler, flex_max_running_requests=cap)
            urls[cap] = stack.enter_context(Server(server_flags(replace(config, scheduler=capped))))
        http = {
            cap: stack.enter_context(httpx2.Client(base_url=url, timeout=3600))
            for cap, url in urls.items()
        }
        for client in http.values():
            client.post("/v1/completions", json={**bodies[0], "max_tokens": 1})  # warm-up
        for round_ in range(args.rounds):
            for name, (tier, cap) in zip(names, sides):
                timed, answers, rate = _tier_round(args, http[cap], bodies, tier, vocab_size, rng)
                ttft[name] += [first for first, _ in timed]
                latency[name] += [whole for _, whole in timed]
                rates[name].append(rate)
                texts.setdefault(name, [a["choices"][0]["text"] for a in answers])
                print(
                    f"round {round_ + 1} {name}: {len(timed)} interactive requests, TTFT p50 "
                    f"{_ms([f for f, _ in timed])} ms, latency p50 "
                    f"{_ms([w for _, w in timed])} ms; batch {rate:.1f} out tok/s",
                    flush=True,
                )
    print(
        f"\ninteractive completions (32 prompt tokens, {args.interactive_output_len} out), one "
        f"sent every {args.interactive_interval} s while a batch of {len(bodies)} shared-prefix "
        f"completions runs ({args.output_len} out); all of {args.rounds} rounds"
    )
    width = max(12, *(len(n) + 2 for n in names))
    header = f"{'batch tier':<{width}}{'sent':>6}{'TTFT p50 ms':>12}{'TTFT max ms':>12}"
    print(header + f"{'latency p50 ms':>16}{'batch out tok/s':>17}")
    for name in names:
        worst = f"{1000 * max(ttft[name]):.0f}" if ttft[name] else "-"
        print(
            f"{name:<{width}}{len(ttft[name]):>6}{_ms(ttft[name]):>12}{worst:>12}"
            f"{_ms(latency[name]):>16}{statistics.median(rates[name]):>17.1f}"
        )
    differ = {}
    for name in names[1:]:
        differ[name] = sum(a != b for a, b in zip(texts["default"], texts[name]))
        print(
            f"batch texts that differ between default and {name}: {differ[name]} of {len(bodies)}"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            summary = {"ttft": ttft, "latency": latency, "rates": rates, "differ": differ}
            json.dump(summary, f)
    return 0


def _tier_round(
    args: argparse.Namespace,
    http: httpx2.Client,
    bodies: list[dict],
    tier: str,
    vocab_size: int,
    rng: random.Random,
) -> tuple[list[tuple[float, float]], list[dict], float]:
    """One round: the batch's lines in `tier`, interactive requests sent while it runs.
    Their (TTFT, latency) pairs, the batch's answers, and its output tok/s."""
    http.post("/flush_cache")
    lines = [{**body, "service_tier": tier} for body in bodies]
    start = time.perf_counter()
    with ThreadPoolExecutor(1 + args.interactive) as pool:
        running = pool.submit(_batch, http, lines)
        while not _batch_running(http) and not running.done():
            time.sleep(POLL_S)
        asked = []  # one every interval while the batch runs, each on its own
        while len(asked) < args.interactive and not running.done():
            prompt = [rng.randrange(100, vocab_size - 100) for _ in range(32)]
            asked.append(pool.submit(_streamed, http, prompt, args.interactive_output_len))
            time.sleep(args.interactive_interval)
        answers = running.result()
        seconds = time.perf_counter() - start
        timed = [a.result() for a in asked]
    return timed, answers, sum(a["usage"]["completion_tokens"] for a in answers) / seconds


def _batch_running(http: httpx2.Client) -> bool:
    """The batch's lines are in the scheduler (some run)."""
    states = http.get("/get_server_info").json()["internal_states"]
    return sum(s["num_running"] for s in states) > 0


def _streamed(http: httpx2.Client, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """A streamed greedy completion: seconds to its first token, and to its end."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    assert first is not None, "the stream gave no token"
    return first, time.perf_counter() - start


def _ms(seconds: list[float]) -> str:
    return f"{1000 * statistics.median(seconds):.0f}" if seconds else "-"


def _batch(http: httpx2.Client, bodies: list[dict]) -> list[dict]:
    lines = [
        {"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": body}
        for i, body in enumerate(bodies)
    ]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    upload = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    made = {"input_file_id": upload.json()["id"], "endpoint": "/v1/completions"}
    batch = http.post("/v1/batches", json={**made, "completion_window": "24h"}).json()
    from radixserve.server.batches import ENDED  # (not at the top: `radixserve` loads fast)

    while batch["status"] not in ENDED:
        time.sleep(POLL_S)
        batch = http.get(f"/v1/batches/{batch['id']}").json()
    if batch["status"] != "completed" or batch["error_file_id"]:
        raise RuntimeError(f"the batch did not complete cleanly: {batch}")
    content = http.get(f"/v1/files/{batch['output_file_id']}/content").text
    entries = {e["custom_id"]: e for e in map(json.loads, content.splitlines())}
    return [entries[str(i)]["response"]["body"] for i in range(len(bodies))]
