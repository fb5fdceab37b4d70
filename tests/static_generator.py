"""Static-batch generation: one fixed batch prefilled together, then decoded step by step
until every request has finished (eos, stop token ids, max_new_tokens). No admission
control, no prefix cache, no stop strings: the runner-level path that the runner fidelity
tests drive. Serving goes through `Scheduler`, which builds on the same `BatchBuilder` and
`Sampler`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.model.runner import ModelRunner
from radixserve.model.sampler import SampleOutput, Sampler, SamplingBatch
from radixserve.scheduler.batch_builder import BatchBuilder


@dataclass
class GenerateResult:
    output_ids: list[int]
    finish_reason: str  # "stop" or "length"
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]]


class StaticGenerator:
    _rids = itertools.count()

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
        self.sampler = Sampler()
        self.eos_ids = runner.eos_token_ids

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        top_logprobs_num: int = 0,
        return_logprob: bool = False,
    ) -> list[GenerateResult]:
        """Generate for every prompt, all in one static batch."""
        reqs = []
        for prompt, p in zip(prompts, params, strict=True):
            p.verify_vocab(self.runner.vocab_size)
            if len(prompt) + p.max_new_tokens > self.runner.context_len:
                raise ValueError(
                    f"prompt ({len(prompt)} tokens) + max_new_tokens ({p.max_new_tokens}) "
                    f"exceeds the context length {self.runner.context_len}"
                )
            reqs.append(Req(f"static-{next(self._rids)}", list(prompt), p))
        # why each request ended, by rid (kept here, not in Req.finish_reason, so that this
        # runner-level path needs no msgspec: the GPU check runs it where msgspec is missing)
        reasons = {r.rid: "length" for r in reqs if r.params.max_new_tokens == 0}
        try:
            self._run(reqs, reasons, return_logprob, top_logprobs_num)
        finally:
            for req in reqs:
                self.builder.release(req)
        return [
            GenerateResult(r.output_ids, reasons[r.rid], r.output_logprobs, r.output_top_logprobs)
            for r in reqs
        ]

    def _run(self, reqs: list[Req], reasons: dict[str, str], return_logprob: bool, top_n: int):
        active = [r for r in reqs if r.rid not in reasons]
        if not active:
            return
        batch = self.builder.extend(active, [r.input_ids for r in active])
        while active:
            logits = self.runner.forward(batch).logits
            out = self.sampler(logits, self._sampling_batch(active), return_logprob, top_n)
            self._append(active, out, reasons)
            for req in active:
                if req.rid in reasons:
                    self.builder.release(req)
            active = [r for r in active if r.rid not in reasons]
            if active:
                batch = self.builder.decode(active)

    def _sampling_batch(self, reqs: list[Req]) -> SamplingBatch:
        return SamplingBatch.for_requests(
            reqs, self.eos_ids, self.runner.vocab_size, self.runner.device
        )

    def _append(self, reqs: list[Req], out: SampleOutput, reasons: dict[str, str]) -> None:
        next_ids = out.next_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        tops = None
        if out.top_logprobs is not None and out.top_ids is not None:
            tops = [
                list(zip(lp, ids, strict=True))
                for lp, ids in zip(out.top_logprobs.tolist(), out.top_ids.tolist(), strict=True)
            ]
        for i, (req, token) in enumerate(zip(reqs, next_ids, strict=True)):
            req.output_ids.append(token)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[i])
            if tops is not None:
                req.output_top_logprobs.append(tops[i])
            if token in req.stop_ids(self.eos_ids):  # banned until min_new_tokens is reached
                reasons[req.rid] = "stop"
            elif len(req.output_ids) >= req.params.max_new_tokens:
                reasons[req.rid] = "length"
