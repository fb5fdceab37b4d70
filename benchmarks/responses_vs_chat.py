"""What the Responses API costs over the chat route it runs on, in one run on one server: the
same greedy conversation asked of `/v1/chat/completions` and of `/v1/responses`, whole and
streamed, alternating, with the official `openai` client; prints the medians and ratios.
Stored responses are on (the default), so the store's cost is in the figures; the second
half of the rounds continues a stored conversation (`previous_response_id`) against the
chat route given the same messages.

    .venv/bin/python benchmarks/responses_vs_chat.py --rounds 20
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
from server_ready import serving  # noqa: E402

from radixserve.hardware import cpu_info  # noqa: E402

QUESTION = "Name three rivers of Europe and one fact about each."
FOLLOW_UP = "Which of them is the longest?"
TOKENS = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("flags", nargs="*", help="extra `radixserve serve` flags, after --")
    args = parser.parse_args()
    print(cpu_info().summary())
    port = free_port()
    tree = Path(__file__).resolve().parent.parent
    with serving(tree, port, ["--dtype", "float32", *args.flags]) as ready:
        print(f"server ready in {ready:.1f} s")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        ask = [{"role": "user", "content": QUESTION}]
        chat = dict(model="m", temperature=0, max_tokens=TOKENS)
        responses = dict(model="m", temperature=0, max_output_tokens=TOKENS)
        first = client.responses.create(input=QUESTION, **responses)
        follow = [*ask, {"role": "assistant", "content": first.output_text}]
        follow.append({"role": "user", "content": FOLLOW_UP})
        cases = {
            "whole": (
                lambda: client.chat.completions.create(messages=ask, **chat),
                lambda: client.responses.create(input=QUESTION, **responses),
            ),
            "streamed": (
                lambda: list(client.chat.completions.create(messages=ask, stream=True, **chat)),
                lambda: list(client.responses.create(input=QUESTION, stream=True, **responses)),
            ),
            "continued": (
                lambda: client.chat.completions.create(messages=follow, **chat),
                lambda: client.responses.create(
                    input=FOLLOW_UP, previous_response_id=first.id, **responses
                ),
            ),
        }
        for chat_call, responses_call in cases.values():  # warm both paths
            chat_call()
            responses_call()
        print(f"{'case':<10} {'chat s':>8} {'responses s':>12} {'ratio':>6}")
        for name, (chat_call, responses_call) in cases.items():
            times: dict[str, list[float]] = {"chat": [], "responses": []}
            for _ in range(args.rounds):
                times["chat"].append(timed(chat_call))
                times["responses"].append(timed(responses_call))
            a, b = (statistics.median(t) for t in times.values())
            print(f"{name:<10} {a:>8.3f} {b:>12.3f} {b / a:>6.3f}")


if __name__ == "__main__":
    main()
