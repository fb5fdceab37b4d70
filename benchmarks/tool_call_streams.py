"""What reading tool calls out of a streamed output costs the server's main process, per
token, as the output grows: the chat route's `ToolStream` and the Responses API's
`OutputBuilder` (with logprobs) are fed a synthetic Hermes output token by token, and whole.
Each parse reads the whole text so far; `--baseline` also runs them with the Hermes parser's
cache of decoded blocks off (every closed block decoded again at every token, as before),
alternating, so the cache's gain is a ratio within one run. Prints medians of `--rounds`.

    .venv/bin/python benchmarks/tool_call_streams.py --calls 20 170 --baseline
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from radixserve.hardware import cpu_info
from radixserve.server import responses_api as rapi
from radixserve.server import tool_calls
from radixserve.server.tool_calls import Tool, ToolPlan

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def turn(n: int) -> list[str]:
    """One turn of the output, 24 tokens: some text, a call (its own arguments: each block
    is decoded once, as a real output's), more text."""
    return [
        *("Sure", " thing", ".", "\n", "<tool_call>", '\n{"name": "get_weather", '),
        *(f'"arguments": {{"city": "X{n}"}}}}', "\n</tool_call>", "\n"),
        *[" word"] * 15,
    ]


class _NoCache(dict):
    """A cache of decoded blocks that keeps nothing."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


PLAN = ToolPlan("auto", tuple(Tool.model_validate(t) for t in rapi.chat_tools([WEATHER])))


def _parser(cache: bool) -> tool_calls.ToolParser:
    parser = PLAN.parser()
    if not cache:
        parser.blocks = _NoCache()  # type: ignore[union-attr]
    return parser


def _entries(tokens: list[str]) -> Callable[[dict, int], list[dict]]:
    entries = [
        {"token": t, "logprob": -1.0, "bytes": list(t.encode()), "top_logprobs": []} for t in tokens
    ]
    return lambda meta, start: entries[start : meta["n"]]


def _builder(tokens: list[str], cache: bool) -> rapi.OutputBuilder:
    builder = rapi.OutputBuilder(None, PLAN, _entries(tokens))
    builder.parser = _parser(cache)
    return builder


def chat_stream(tokens: list[str], cache: bool) -> None:
    stream = tool_calls.ToolStream(_parser(cache))
    for i, token in enumerate(tokens):
        stream.feed(token, final=i == len(tokens) - 1)


def responses_stream(tokens: list[str], cache: bool) -> None:
    builder = _builder(tokens, cache)
    for i, token in enumerate(tokens):
        builder.feed(token, {"n": i + 1}, final=i == len(tokens) - 1)
    builder.close(incomplete=False)


def responses_whole(tokens: list[str], cache: bool) -> None:
    builder = _builder(tokens, cache)
    builder.feed("".join(tokens), {"n": len(tokens)}, final=True)
    builder.close(incomplete=False)


WORKLOADS = {
    "chat stream": chat_stream,
    "responses stream": responses_stream,
    "responses whole": responses_whole,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[20, 170])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", action="store_true", help="also without the block cache")
    args = parser.parse_args()
    print(cpu_info().summary())
    variants = {"cached": True, **({"uncached": False} if args.baseline else {})}
    heads = "  ".join(f"{v + ' ms/token':>18}" for v in variants)
    print(f"{'calls':>5} {'tokens':>6}  {'workload':<17} {heads}" + ("  ratio" * args.baseline))
    for calls in args.calls:
        tokens = [token for n in range(calls) for token in turn(n)]
        for name, run in WORKLOADS.items():
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for variant, cache in variants.items():  # alternating
                    start = time.perf_counter()
                    run(tokens, cache)
                    times[variant].append((time.perf_counter() - start) / len(tokens) * 1e3)
            medians = {v: statistics.median(t) for v, t in times.items()}
            row = "  ".join(f"{m:>18.3f}" for m in medians.values())
            ratio = f"  {medians['uncached'] / medians['cached']:.1f}x" if args.baseline else ""
            print(f"{calls:>5} {len(tokens):>6}  {name:<17} {row}{ratio}")


if __name__ == "__main__":
    main()
