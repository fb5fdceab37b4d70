"""Streaming cost per output token at short and long outputs: the detokenizer's CPU time,
the bytes it sends the main process, and the main process's CPU time (decoding the message
and accumulating the result), for the incremental path next to a baseline in the same run
that re-decodes every id each step and sends the cumulative result each time (what
radixserve did before). Flat figures across lengths are the goal. Real tokenizer ids from
the model folder's tokenizer; no model is run."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

from radixserve.core.output import FinishReason, ReqOutput
from radixserve.core.sampling_params import SamplingParams
from radixserve.output import Detokenizer, RequestState, ResultAccumulator
from radixserve.server.messages import StrOutBatch, decode, encode
from radixserve.text_stream import REPLACEMENT, partial_stop_len
from radixserve.tokenizer import load_tokenizer

TEXT = Path(__file__).with_name("perplexity_text.txt")
RID = "bench"
PROMPT_TOKENS = 32


@dataclass
class Figure:
    output_len: int
    path: str  # "incremental" | "baseline"
    detok_us_per_token: float  # detokenizing and encoding the step's message
    ipc_bytes_per_token: float
    main_us_per_token: float  # decoding the message and accumulating the request's result
    main_result_us_per_token: float  # plus the cumulative result dict, as /generate streams


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--output-lens", type=int, nargs="+", default=[64, 4096])
    parser.add_argument("--stop", nargs="*", default=["\n\n\n"], help="stop strings held back")
    parser.add_argument("--output-json", default=None, help="also write the figures here")


def run(args: argparse.Namespace) -> int:
    from radixserve.config import default_model_cache_dir
    from radixserve.hardware import cpu_info
    from radixserve.model.loader import resolve_model_folder

    folder = resolve_model_folder(args.model_path, Path(default_model_cache_dir()))
    tokenizer = load_tokenizer(folder)
    params = SamplingParams(stop=args.stop)
    figures = []
    for n in args.output_lens:
        outputs = synthetic_outputs(tokenizer, n)
        figures.append(measure(n, "incremental", incremental_path(tokenizer, params), outputs))
        figures.append(measure(n, "baseline", baseline_path(tokenizer, params), outputs))
    cpu = cpu_info()
    isa = "AVX-512" if cpu.avx512 else "AVX2" if cpu.avx2 else cpu.torch_capability
    print(f"streaming, one request, tokenizer of {folder.name}; CPU: {cpu.model_name} ({isa})")
    print_table(figures)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps([asdict(f) for f in figures], indent=2))
    return 0


def synthetic_outputs(tokenizer: Any, n: int) -> list[ReqOutput]:
    """One ReqOutput per step, one real token each, the last one finishing by length."""
    ids = tokenizer.encode(TEXT.read_text())
    ids = (ids * (n // len(ids) + 1))[:n]
    return [
        ReqOutput(
            RID,
            [tid],
            FinishReason.of_length(n) if i == n - 1 else None,
            PROMPT_TOKENS,
            0,
            i + 1,
        )
        for i, tid in enumerate(ids)
    ]


# -- the two paths: a detokenizer step (output → message bytes), and a fresh main side -------
DetokStep = Callable[[ReqOutput], bytes]
MainStep = Callable[[bytes], None]


@dataclass
class StreamPath:
    detok: DetokStep
    main: Callable[[bool], MainStep]  # with or without building the cumulative result


def incremental_path(tokenizer: Any, params: SamplingParams) -> StreamPath:
    detokenizer = Detokenizer()
    detokenizer.register(RequestState(RID, params, tokenizer), stream=True)

    def detok(out: ReqOutput) -> bytes:
        return encode(StrOutBatch(detokenizer.process([out])))

    def main(want_result: bool) -> MainStep:
        results = ResultAccumulator(RID, False, 0)  # what tokenizer_manager keeps per request

        def step(data: bytes) -> None:
            batch = decode(data)
            assert isinstance(batch, StrOutBatch)
            for delta in batch.outputs:
                update = results.add(delta)
                if want_result:
                    update.result  # noqa: B018 (built on first access)

        return step

    return StreamPath(detok, main)


class CumulativeStrOut(msgspec.Struct, tag=True):
    """The baseline's message: the whole result so far, every step."""

    rid: str
    completion_tokens: int
    finished: bool
    result: dict[str, Any] | None


class CumulativeBatch(msgspec.Struct, tag=True):
    outputs: list[CumulativeStrOut]


def baseline_path(tokenizer: Any, params: SamplingParams) -> StreamPath:
    """Every step decodes all ids so far and sends the cumulative result."""
    ids: list[int] = []
    start = time.perf_counter()
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(CumulativeBatch)

    def detok(out: ReqOutput) -> bytes:
        ids.extend(out.new_ids)
        text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if out.finish_reason is None:
            text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - partial_stop_len(text, params.stop)]
        meta: dict[str, Any] = {
            "id": out.rid,
            "finish_reason": out.finish_reason.to_dict() if out.finish_reason else None,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
        }
        if out.finish_reason is not None:
            meta["e2e_latency"] = time.perf_counter() - start
        result = {"text": text, "output_ids": list(ids), "meta_info": meta}
        msg = CumulativeStrOut(out.rid, out.completion_tokens, out.finished, result)
        return encoder.encode(CumulativeBatch([msg]))

    def main(want_result: bool) -> MainStep:
        return decoder.decode  # the result dict arrives whole: nothing more to build

    return StreamPath(detok, main)


# -- measuring ------------------------------------------------------------------------------
def measure(n: int, name: str, path: StreamPath, outputs: list[ReqOutput]) -> Figure:
    """CPU time (process_time) of each side over the whole stream, per token."""
    begin = time.process_time()
    messages = [path.detok(out) for out in outputs]
    detok_s = time.process_time() - begin
    main_s = cpu_seconds(path.main(False), messages)
    main_result_s = cpu_seconds(path.main(True), messages)
    return Figure(
        output_len=n,
        path=name,
        detok_us_per_token=1e6 * detok_s / n,
        ipc_bytes_per_token=sum(map(len, messages)) / n,
        main_us_per_token=1e6 * main_s / n,
        main_result_us_per_token=1e6 * main_result_s / n,
    )


def cpu_seconds(step: MainStep, messages: list[bytes]) -> float:
    begin = time.process_time()
    for data in messages:
        step(data)
    return time.process_time() - begin


def print_table(figures: list[Figure]) -> None:
    head = ("output_len", "path", "detok us/tok", "IPC B/tok", "main us/tok", "main+result us/tok")
    print("  ".join(f"{h:>18}" for h in head))
    for f in figures:
        row = (
            f.output_len,
            f.path,
            f"{f.detok_us_per_token:.1f}",
            f"{f.ipc_bytes_per_token:.1f}",
            f"{f.main_us_per_token:.1f}",
            f"{f.main_result_us_per_token:.1f}",
        )
        print("  ".join(f"{v:>18}" for v in row))
