"""JSON-schema decoding on the offline Engine: one batch of extraction requests (a fixed-shape
record from a short text) with jump-forward on, off, and unconstrained generation of outputs
of the same lengths — all in one run, greedy; prints throughput, per-request latency, the
share of output tokens jump-forward appended, and the grammar mask's cost per token."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from radixserve.bench.offline import PARTS, engine_options
from radixserve.config import add_config_args as add_flags

DEFAULT_POOL = 32768  # KV tokens per engine unless --max-total-tokens says otherwise

RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "employment_status": {
            "enum": ["employed", "self-employed", "unemployed", "retired", "student"]
        },
        "interests": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "occupation", "employment_status", "interests"],
    "additionalProperties": False,
}
NAMES = ["Alice Martin", "Bob Chen", "Carla Diaz", "David Okafor", "Emma Novak", "Farid Haddad"]
CITIES = ["Paris", "Lagos", "Toronto", "Osaka", "Lima", "Berlin", "Nairobi", "Austin"]
JOBS = ["nurse", "teacher", "software engineer", "baker", "architect", "student", "pilot"]
HOBBIES = ["chess", "hiking", "painting", "cooking", "cycling", "jazz", "gardening"]
SYSTEM = (
    "You extract facts about a person from a short text and answer with one JSON object "
    "with the keys name, age, city, occupation, employment_status and interests."
)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each mode, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    add_flags(parser, PARTS)


def extraction_texts(n: int, seed: int) -> list[str]:
    """Short texts about made-up people, the same for a given seed."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        name, city, job = rng.choice(NAMES), rng.choice(CITIES), rng.choice(JOBS)
        likes = " and ".join(rng.sample(HOBBIES, 2))
        texts.append(
            f"{name} is {rng.randint(19, 80)} years old and works as a {job} in {city}. "
            f"In the evenings {name.split()[0]} enjoys {likes}."
        )
    return texts


@dataclass
class Run:
    mode: str
    seconds: float
    requests: int
    output_tokens: int
    decode_steps: int
    latencies: list[float] = field(repr=False)
    jump_tokens: int = 0
    mask_seconds: float = 0.0
    mask_rows: int = 0
    valid: int = 0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run(args: argparse.Namespace) -> int:
    from radixserve.engine import Engine

    flat = engine_options(args)
    flat["max_total_tokens"] = flat["max_total_tokens"] or DEFAULT_POOL
    engines = {
        "jump-forward": Engine(progress=True, **(flat | {"disable_jump_forward": False})),
        "no jump-forward": Engine(progress=False, **(flat | {"disable_jump_forward": True})),
    }
    try:
        prompts = _prompts(engines["jump-forward"].tokenizer, args)
        schema = json.dumps(RECORD_SCHEMA)
        constrained = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
        constrained["json_schema"] = schema
        for engine in engines.values():  # warm-up, then an empty cache for every run
            engine.generate(input_ids=prompts[0], sampling_params=constrained)
        runs: dict[str, list[Run]] = {}
        texts: dict[str, list[str]] = {}
        lengths: list[int] = []
        for _ in range(args.rounds):
            for mode, engine in engines.items():
                run_, outs = _run(engine, mode, prompts, [constrained] * len(prompts))
                runs.setdefault(mode, []).append(run_)
                texts[mode] = [o["text"] for o in outs]
                if mode == "no jump-forward":  # each output as decoded token by token
                    lengths = [o["meta_info"]["completion_tokens"] for o in outs]
            free = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
            run_, _ = _run(engines["jump-forward"], "unconstrained", prompts, free)
            runs.setdefault("unconstrained, same lengths", []).append(run_)
    finally:
        for engine in engines.values():
            engine.shutdown()
    medians = {mode: _median(rs) for mode, rs in runs.items()}
    _print(medians, texts, args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({m: [asdict(r) for r in rs] for m, rs in runs.items()}, f, indent=2)
    return 0


def _prompts(tokenizer: Any, args: argparse.Namespace) -> list[list[int]]:
    prompts = []
    for text in extraction_texts(args.num_requests, args.seed):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
        if tokenizer.chat_template:
            chat = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            prompts.append(tokenizer.encode(chat, add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(f"{SYSTEM}\n{text}\nJSON: "))
    return prompts


def _run(engine: Any, mode: str, prompts: list[list[int]], params: list[dict]):
    engine.flush_cache()
    before = engine.get_server_info()["internal_states"][0]
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    after = engine.get_server_info()["internal_states"][0]

    def delta(key: str) -> Any:
        return after[key] - before[key]

    return Run(
        mode=mode,
        seconds=seconds,
        requests=len(outs),
        output_tokens=sum(o["meta_info"]["completion_tokens"] for o in outs),
        decode_steps=delta("decode_steps"),
        latencies=sorted(o["meta_info"]["e2e_latency"] for o in outs),
        jump_tokens=delta("grammar_jump_tokens"),
        mask_seconds=delta("grammar_mask_seconds"),
        mask_rows=delta("grammar_mask_rows"),
        valid=sum(_valid(o["text"]) for o in outs),
    ), outs


def _valid(text: str) -> bool:
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and set(record) == set(RECORD_SCHEMA["required"])


def _median(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]


def _print(runs: dict[str, Run], texts: dict[str, list[str]], args: argparse.Namespace) -> None:
    base = runs["no jump-forward"]
    print(
        f"\nJSON-schema extraction: {args.num_requests} requests submitted at once, greedy, "
        f"threads {torch.get_num_threads()}, median of {args.rounds} round(s)"
    )
    print(
        f"{'mode':<30}{'s':>7}{'req/s':>8}{'out tok/s':>11}{'decode steps':>14}"
        f"{'lat p50':>9}{'lat p90':>9}{'valid':>7}{'vs no-jf':>10}"
    )
    for mode, r in runs.items():
        p50 = statistics.median(r.latencies)
        p90 = r.latencies[int(0.9 * (len(r.latencies) - 1))]
        print(
            f"{mode:<30}{r.seconds:>7.1f}{r.requests_per_s:>8.2f}{r.tokens_per_s:>11.1f}"
            f"{r.decode_steps:>14}{p50:>8.1f}s{p90:>8.1f}s{r.valid:>7}"
            f"{r.requests_per_s / base.requests_per_s:>9.2f}x"
        )
    jf = runs["jump-forward"]
    free = runs["unconstrained, same lengths"]
    print(
        f"jump-forward tokens: {jf.jump_tokens} of {jf.output_tokens} output tokens "
        f"({jf.jump_tokens / max(jf.output_tokens, 1):.1%})"
    )
    for mode in ("jump-forward", "no jump-forward"):
        r = runs[mode]
        print(
            f"mask cost ({mode}): {1e6 * r.mask_seconds / max(r.mask_rows, 1):.0f} us per "
            f"masked token, {r.mask_rows} masks, computed beside the forward pass"
        )
    print(
        f"jump-forward vs unconstrained generation of the same lengths: "
        f"{free.seconds / jf.seconds:.2f}x the speed"
    )
    on, off = texts["jump-forward"], texts["no jump-forward"]
    differ = [i for i, (a, b) in enumerate(zip(on, off)) if a != b]
    print(f"outputs identical with jump-forward on and off: {len(on) - len(differ)} of {len(on)}")
    if differ:
        i = differ[0]
        print(f"  e.g. request {i}:\n    on:  {on[i]}\n    off: {off[i]}")
