"""Speculative decoding on vs off, in one run, on the same machine: output tokens/s at
batch 1 on copy-heavy tasks (rewrite, extract fields, edit code, summarize: the output
overlaps the prompt) and on free-form generation, and with 16 concurrent mixed requests;
mean acceptance length and acceptance by draft position; and what verifying drafted tokens
costs a forward pass at several batch sizes (where speculation stops paying on this CPU).

Two servers (`radixserve serve`, speculation off and on) on the same weights, started side
by side, serve the same /generate requests alternately (their order swapped every
repetition); every repetition uses new texts, so no request drafts from an earlier copy of
itself. Texts are generated (no downloads)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jun"]
CITIES = ["Lisbon", "Osaka", "Denver", "Nairobi", "Oslo", "Lima", "Perth", "Seoul", "Tunis"]
ITEMS = ["lamps", "chairs", "kettles", "bicycles", "tents", "printers", "drills", "clocks"]
ANIMALS = ["fox", "whale", "owl", "tortoise", "otter", "falcon", "badger", "octopus"]
TOPICS = ["a refrigerator", "a rainbow", "a bicycle gear", "a vaccine", "a compass", "yeast"]


def passage(rng: random.Random, sentences: int = 6) -> str:
    out = []
    for _ in range(sentences):
        name, city, item = rng.choice(NAMES), rng.choice(CITIES), rng.choice(ITEMS)
        n, year = rng.randint(2, 90), rng.randint(1950, 2024)
        out.append(
            rng.choice(
                [
                    f"In {year}, {name} opened a small shop in {city} that sold {n} {item} a week.",
                    f"{name} moved to {city} in {year} and repaired {item} for the neighbours.",
                    f"The museum in {city} keeps {n} {item} that {name} collected since {year}.",
                    f"Every spring {name} sends {n} {item} from {city} to a school in the hills.",
                ]
            )
        )
    return " ".join(out)


def orders(rng: random.Random, count: int = 5) -> str:
    lines = []
    for _ in range(count):
        name, city, item = rng.choice(NAMES), rng.choice(CITIES), rng.choice(ITEMS)
        lines.append(
            f"Order {1000 + rng.randint(0, 8999)}: {name} from {city} bought "
            f"{rng.randint(1, 40)} {item} for {rng.randint(10, 900)} dollars."
        )
    return "\n".join(lines)


def code(rng: random.Random) -> str:
    fns = []
    for _ in range(3):
        fn, arg = rng.choice(["load", "scale", "merge", "count", "clean"]), rng.choice(ITEMS)
        k = rng.randint(2, 9)
        fns.append(
            f"def {fn}_{arg}({arg}):\n    total = 0\n    for item in {arg}:\n"
            f"        total += item * {k}\n    return total\n"
        )
    return "\n".join(fns)


def tasks(rng: random.Random) -> dict[str, str]:
    """One prompt per task kind, with fresh content."""
    return {
        "rewrite": f"Repeat the following text exactly, word for word:\n\n{passage(rng)}",
        "extract": "List the customer name, city and amount of every order below, one order "
        f"per line, in the same order:\n\n{orders(rng)}",
        "edit-code": "Rename the variable total to result in this code and output the whole "
        f"code:\n\n{code(rng)}",
        "summarize": f"Summarize the following text in a few sentences:\n\n{passage(rng)}",
        "free-form": rng.choice(
            [
                f"Write a short story about a {rng.choice(ANIMALS)} who wants to travel.",
                f"Explain how {rng.choice(TOPICS)} works, for a ten-year-old.",
            ]
        ),
    }


COPY_TASKS = ("rewrite", "extract", "edit-code", "summarize")


@dataclass
class Row:
    workload: str
    off_tok_s: float  # median output tokens/s, speculation off
    on_tok_s: float
    accept_length: float  # tokens committed per verified request-step (on)
    drafted_share: float  # share of the on-run's decode request-steps that verified a draft

    @property
    def ratio(self) -> float:
        return self.on_tok_s / self.off_tok_s if self.off_tok_s else 0.0


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--repeats",
        type=int,
        default=10,
        help="fresh prompts per task: a prompt's speed-up depends on how much of it the model "
        "copies (1.1x-5.5x over one task's prompts on an AMD EPYC Zen 4), so fewer than ~10 "
        "move the medians by tenths",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the generated texts")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--max-total-tokens", type=int, default=40000, help="each server's pool")
    parser.add_argument("--skip-cost", action="store_true", help="no verify-cost table")
    parser.add_argument("--output-json", default=None, help="also write the figures here")


def run(args: argparse.Namespace) -> int:
    from radixserve.bench.server_vs_engine import Server
    from radixserve.config import default_model_cache_dir
    from radixserve.hardware import cpu_info
    from radixserve.model.loader import resolve_model_folder
    from radixserve.tokenizer import load_tokenizer

    folder = resolve_model_folder(args.model_path, Path(default_model_cache_dir()))
    tokenizer = load_tokenizer(folder)
    flags = [f"--model-path={folder}", f"--dtype={args.dtype}", "--no-kv-prefault"]
    flags.append(f"--max-total-tokens={args.max_total_tokens}")
    spec = ["--speculative-algorithm=ngram"]
    spec.append(f"--speculative-num-draft-tokens={args.num_draft_tokens}")
    with Server([*flags, "--speculative-algorithm=none"]) as off, Server([*flags, *spec]) as on:
        rows, positions = measure({"off": off, "on": on}, tokenizer, args)
    cost = [] if args.skip_cost else verify_cost(folder, args)
    print(
        f"CPU: {cpu_info().summary()}; dtype {args.dtype}; up to {args.max_new_tokens} tokens; "
        f"{args.repeats} prompts per task, seed {args.seed}"
    )
    print_rows(rows, positions, cost)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {"rows": [asdict(r) | {"ratio": r.ratio} for r in rows], "positions": positions,
                 "verify_cost_ms": cost},
                f,
                indent=2,
            )  # fmt: skip
    return 0


def timed(url: str, prompts: list[str], max_new_tokens: int) -> tuple[float, list[dict]]:
    """Seconds for all `prompts` sent at once, and their results."""
    from radixserve.bench.server_vs_engine import post

    body = {"sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: post(url, {**body, "text": p}), prompts))
    return time.perf_counter() - start, outs


def measure(
    urls: dict[str, str], tokenizer: Any, args: argparse.Namespace
) -> tuple[list[Row], dict]:
    def chat(text: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    rng = random.Random(args.seed)
    for url in urls.values():  # warm-up
        timed(url, [chat("Say hello.")], 8)
    kinds = [*COPY_TASKS, "free-form"]
    batch = f"{args.concurrency} concurrent (mixed)"
    speeds: dict[str, dict[str, list[float]]] = {k: {"off": [], "on": []} for k in [*kinds, batch]}
    spec: dict[str, list[tuple[int, int, int]]] = {k: [] for k in [*kinds, batch]}
    for rep in range(args.repeats):
        order = ["off", "on"] if rep % 2 == 0 else ["on", "off"]
        prompts = tasks(rng)
        mixed = [tasks(rng)[kinds[i % len(kinds)]] for i in range(args.concurrency)]
        for kind, texts in [*((k, [t]) for k, t in prompts.items()), (batch, mixed)]:
            for side in order:
                seconds, outs = timed(urls[side], [chat(t) for t in texts], args.max_new_tokens)
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
                speeds[kind][side].append(tokens / seconds)
                if side == "on":
                    spec[kind] += [spec_counts(o["meta_info"]) for o in outs]
        print(f"repetition {rep + 1}/{args.repeats} done", flush=True)
    rows = [row(kind, speeds[kind], spec[kind]) for kind in [*kinds, batch]]
    copy = [r for r in rows if r.workload in COPY_TASKS]
    rows.insert(len(COPY_TASKS), Row(
        "copy-heavy (median of 4)",
        statistics.median(r.off_tok_s for r in copy),
        statistics.median(r.on_tok_s for r in copy),
        statistics.median(r.accept_length for r in copy),
        statistics.median(r.drafted_share for r in copy),
    ))  # fmt: skip
    with urllib.request.urlopen(urls["on"] + "/get_server_info", timeout=60) as response:
        state = json.loads(response.read())["internal_states"][0]
    positions = {
        "drafted": state["spec_drafted_by_position"],
        "accepted": state["spec_accepted_by_position"],
        "avg_spec_accept_length": state["avg_spec_accept_length"],
        "cost_model_a_b_seconds": state["spec_cost_model"],
    }
    return rows, positions


def spec_counts(meta: dict) -> tuple[int, int, int]:
    decode_steps = max(meta["completion_tokens"] - meta["spec_accepted_tokens"] - 1, 0)
    return meta["spec_verify_ct"], meta["spec_accepted_tokens"], decode_steps


def row(kind: str, speeds: dict[str, list[float]], counts: list[tuple[int, int, int]]) -> Row:
    verify = sum(c[0] for c in counts)
    accepted = sum(c[1] for c in counts)
    steps = sum(c[2] for c in counts)
    return Row(
        kind,
        statistics.median(speeds["off"]),
        statistics.median(speeds["on"]),
        (accepted + verify) / verify if verify else 0.0,
        verify / steps if steps else 0.0,
    )


def verify_cost(folder: Path, args: argparse.Namespace) -> list[dict]:
    """Forward milliseconds of a decode step of B requests (512-token contexts) with k drafted
    tokens each verified, k = 0 (a plain decode step), 2, 4, 8: the price of verification."""
    import torch

    from radixserve.config import Config
    from radixserve.core.batch import ForwardBatch, ForwardMode
    from radixserve.model.runner import ModelRunner

    config = Config.from_flat(
        model_path=str(folder), dtype=args.dtype, max_total_tokens=4096, kv_prefault=False
    )
    runner = ModelRunner(config, progress=False)
    context, table = 512, runner.req_to_token
    rows = [table.alloc() for _ in range(16)]
    base = runner.max_total_tokens - 16 * 9  # scratch slots at the end of the pool
    out = []
    try:
        for b in (1, 4, 16):
            for row_i in rows[:b]:
                table.table[row_i, :context] = torch.arange(context)
            figure = {"batch": b}
            for k in (0, 2, 4, 8):
                n = k + 1
                req_rows = [r for r in rows[:b] for _ in range(n)]
                prefix = [context + j for _ in range(b) for j in range(n)]
                slots = torch.arange(base, base + b * n)
                for i, r in enumerate(rows[:b]):
                    table.table[r, context : context + n] = slots[i * n : (i + 1) * n]
                batch = ForwardBatch(
                    ForwardMode.DECODE,
                    torch.randint(0, 1000, (b * n,)),
                    torch.tensor(prefix),
                    slots,
                    torch.tensor(req_rows),
                    prefix,
                    [1] * (b * n),
                    torch.arange(b * n),
                )
                times = []
                for _ in range(7):
                    start = time.perf_counter()
                    runner.forward(batch)
                    times.append(time.perf_counter() - start)
                figure[f"k={k}"] = round(statistics.median(times[2:]) * 1000, 1)
            out.append(figure)
    finally:
        for r in rows:
            table.free(r)
    return out


def print_rows(rows: list[Row], positions: dict, cost: list[dict]) -> None:
    print(f"{'workload':<26} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} "
          f"{'accept len':>10} {'drafted':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r.workload:<26} {r.off_tok_s:>10.1f} {r.on_tok_s:>10.1f} {r.ratio:>6.2f}x "
            f"{r.accept_length:>10.2f} {r.drafted_share:>7.0%}"
        )
    drafted, accepted = positions["drafted"], positions["accepted"]
    by_pos = [f"{a / d:.2f}" if d else "-" for d, a in zip(drafted, accepted)]
    print(f"acceptance by draft position (1..{len(drafted)}): {' '.join(by_pos)}")
    print(f"mean acceptance length (all on-runs): {positions['avg_spec_accept_length']:.2f}")
    a, b = positions["cost_model_a_b_seconds"] or (0.0, 0.0)
    print(f"controller's cost model: {a * 1000:.1f} ms per step + {b * 1000:.2f} ms per token")
    if cost:
        print("verify cost, forward ms (512-token contexts), k drafted tokens per request:")
        for figure in cost:
            b = figure["batch"]
            cells = " ".join(f"k={k}: {figure[f'k={k}']:>6.1f}" for k in (0, 2, 4, 8))
            print(f"  batch {b:>2}: {cells}   (k=4 costs {figure['k=4'] / figure['k=0']:.2f}x k=0)")
