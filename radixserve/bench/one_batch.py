"""One static batch: prefill tokens/s and decode tokens/s of the model runner, next to
transformers (the same weights, fp32 on CPU) measured in the same run. With --quantization
the unquantized runner is measured in the same run too."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from radixserve.config import CacheConfig, ModelConfig, add_config_args, config_from_args

PARTS = (ModelConfig, CacheConfig)


@dataclass
class Figure:
    name: str
    radixserve: float
    baseline: float | None
    unquantized: float | None = None  # the runner without --quantization, when it is set

    @property
    def ratio(self) -> float | None:
        return None if not self.baseline else self.radixserve / self.baseline


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=512, help="prefill length")
    parser.add_argument(
        "--decode-context-len", type=int, default=128, help="prompt length before decoding"
    )
    parser.add_argument("--output-len", type=int, default=32, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=5, help="the median of this many runs")
    parser.add_argument("--baseline", choices=["transformers", "none"], default="transformers")
    parser.add_argument("--output-json", default=None, help="also write the figures here")
    add_config_args(parser, PARTS)


def run(args: argparse.Namespace) -> int:
    from radixserve.model.runner import ModelRunner

    config = config_from_args(args, PARTS)
    runner = ModelRunner(config)
    ours = RunnerWorkload(runner)
    unquantized = None
    if config.model.quantization != "none":
        plain = dataclasses.replace(config.model, quantization="none")
        unquantized = RunnerWorkload(ModelRunner(dataclasses.replace(config, model=plain)))
    theirs = None
    if args.baseline == "transformers":
        theirs = TransformersWorkload(runner.model_folder, runner.dtype, runner.device)
    gen = torch.Generator().manual_seed(0)

    def prompts(batch: int, length: int) -> list[list[int]]:
        ids = torch.randint(100, runner.vocab_size, (batch, length), generator=gen)
        return ids.tolist()

    figures = []
    prefill = prompts(1, args.input_len)
    figures.append(
        _figure(
            f"prefill {args.input_len} tokens (tok/s)",
            lambda w: args.input_len / w.prefill_seconds(prefill[0]),
            [ours, unquantized, theirs],
            args.repeats,
        )
    )
    for batch in args.batch_sizes:
        batch_prompts = prompts(batch, args.decode_context_len)
        figures.append(
            _figure(
                f"decode batch {batch} (tok/s)",
                lambda w, p=batch_prompts: (
                    len(p) * args.output_len / w.decode_seconds(p, args.output_len)
                ),
                [ours, unquantized, theirs],
                args.repeats,
            )
        )
    _print_table(figures, runner, args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(fig) | {"ratio": fig.ratio} for fig in figures], f, indent=2)
    return 0


def _figure(name: str, measure: Callable, workloads: list, repeats: int) -> Figure:
    """Medians of `repeats` runs of each workload (ours, ours unquantized, the baseline; None
    where absent), alternating so that drifts in the machine's speed hit all alike."""
    present = [w for w in workloads if w is not None]
    samples: dict[int, list[float]] = {id(w): [] for w in present}
    for w in present:
        measure(w)  # warm-up
    for _ in range(repeats):
        for w in present:
            samples[id(w)].append(measure(w))
    ours, unquantized, theirs = (
        None if w is None else statistics.median(samples[id(w)]) for w in workloads
    )
    return Figure(name, ours, theirs, unquantized)


def _print_table(figures: list[Figure], runner, args: argparse.Namespace) -> None:
    quantization = runner.config.model.quantization
    print(
        f"\nmodel {runner.model_folder.name}  device {runner.device}  dtype {runner.dtype}  "
        f"quantization {quantization}  threads {torch.get_num_threads()}  "
        f"median of {args.repeats}"
    )
    quantized = quantization != "none"
    ours = f"radixserve {quantization}" if quantized else "radixserve"
    plain = f"{'radixserve none':>16}" if quantized else ""
    print(f"{'figure':<32}{ours:>16}{plain}{'transformers':>14}{'ratio':>8}")
    for fig in figures:
        base = "-" if fig.baseline is None else f"{fig.baseline:.1f}"
        ratio = "-" if fig.ratio is None else f"{fig.ratio:.2f}x"
        plain = f"{fig.unquantized:>16.1f}" if quantized else ""
        print(f"{fig.name:<32}{fig.radixserve:>16.1f}{plain}{base:>14}{ratio:>8}")


class RunnerWorkload:
    """Times the runner directly: one extend batch, then decode steps with greedy sampling."""

    def __init__(self, runner) -> None:
        from radixserve.model.sampler import Sampler
        from radixserve.scheduler.batch_builder import BatchBuilder

        self.runner = runner
        self.builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
        self.sampler = Sampler()

    def prefill_seconds(self, prompt: list[int]) -> float:
        [req] = self._reqs([prompt])
        try:
            start = time.perf_counter()
            self.runner.forward(self.builder.extend([req], [prompt]))
            _sync(self.runner.device)
            return time.perf_counter() - start
        finally:
            self.builder.release(req)

    def decode_seconds(self, prompts: list[list[int]], steps: int) -> float:
        from radixserve.model.sampler import SamplingBatch

        reqs = self._reqs(prompts)
        try:
            batch = self.builder.extend(reqs, prompts)
            sampling = SamplingBatch.build(
                [r.params for r in reqs],
                [r.seed for r in reqs],
                prompts,
                [[] for _ in reqs],
                self.runner.vocab_size,
                self.runner.device,
            )
            self._step(reqs, batch, sampling)
            _sync(self.runner.device)
            start = time.perf_counter()
            for _ in range(steps):
                self._step(reqs, self.builder.decode(reqs), sampling)
            _sync(self.runner.device)
            return time.perf_counter() - start
        finally:
            for req in reqs:
                self.builder.release(req)

    def _step(self, reqs, batch, sampling) -> None:
        logits = self.runner.forward(batch).logits
        for req, token in zip(reqs, self.sampler(logits, sampling).next_ids.tolist()):
            req.output_ids.append(token)

    def _reqs(self, prompts):
        from radixserve.core.req import Req
        from radixserve.core.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, ignore_eos=True)
        return [Req(f"bench-{i}", p, params) for i, p in enumerate(prompts)]


class TransformersWorkload:
    """The baseline: transformers' model on the same folder; prefill computes only the last
    position's logits, decode is `generate` (greedy, static batch)."""

    def __init__(self, folder, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()

    @torch.inference_mode()
    def prefill_seconds(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt], device=self.device)
        start = time.perf_counter()
        self.model(ids, logits_to_keep=1)
        _sync(self.device)
        return time.perf_counter() - start

    def decode_seconds(self, prompts: list[list[int]], steps: int) -> float:
        """Time of `steps` decode steps: generate(steps + 1) minus generate(1)."""
        return self._generate_seconds(prompts, steps + 1) - self._generate_seconds(prompts, 1)

    @torch.inference_mode()
    def _generate_seconds(self, prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts, device=self.device)
        start = time.perf_counter()
        self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        _sync(self.device)
        return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
