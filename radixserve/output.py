"""Turning a request's stream of `ReqOutput` deltas into the native API's result dict:
`{"text", "output_ids", "meta_info"}` with cumulative text, stop strings trimmed, and
logprobs as `[logprob | None, token_id, text | None]` triples (see the wire contract)."""

from __future__ import annotations

import time
from typing import Any

from radixserve.core.output import LogprobEntry, ReqOutput
from radixserve.core.sampling_params import SamplingParams


class RequestState:
    def __init__(
        self,
        rid: str,
        params: SamplingParams,
        tokenizer: Any,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
    ) -> None:
        self.rid = rid
        self.params = params
        self.tokenizer = tokenizer
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.return_text_in_logprobs = return_text_in_logprobs
        self.start = time.perf_counter()
        self.output_ids: list[int] = []
        self.output_logprobs: list[LogprobEntry] = []
        self.output_top_logprobs: list[list[LogprobEntry]] = []
        self.input_logprobs: list[LogprobEntry] = []
        self.input_top_logprobs: list[list[LogprobEntry]] = []
        self.last: ReqOutput | None = None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None

    def update(self, out: ReqOutput) -> None:
        self.output_ids += out.new_ids
        self.output_logprobs += out.new_logprobs
        self.output_top_logprobs += out.new_top_logprobs
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs
            self.input_top_logprobs = out.input_top_logprobs or []
        self.last = out

    def text(self) -> str:
        """The output text so far: stop trimmed when finished; while running, any tail that
        could still become a stop string or an incomplete character is held back."""
        ids = self.output_ids
        reason = self.last.finish_reason if self.last else None
        matched = reason.matched if reason else None
        if isinstance(matched, int) and not self.params.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        if isinstance(matched, str):
            if not self.params.no_stop_trim:
                text = text[: text.find(matched)] if matched in text else text
            return text
        if reason is None:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - _partial_stop_len(text, self.params.stop)]
        return text

    def result(self) -> dict[str, Any]:
        out = self.last
        assert out is not None
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": out.finish_reason.to_dict() if out.finish_reason else None,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
        }
        if out.finish_reason is not None:
            meta["e2e_latency"] = time.perf_counter() - self.start
        if self.return_logprob:
            meta["input_token_logprobs"] = self._triples(self.input_logprobs)
            meta["output_token_logprobs"] = self._triples(self.output_logprobs)
            if self.top_logprobs_num:
                meta["input_top_logprobs"] = [self._triples(t) for t in self.input_top_logprobs]
                meta["output_top_logprobs"] = [self._triples(t) for t in self.output_top_logprobs]
        return {"text": self.text(), "output_ids": list(self.output_ids), "meta_info": meta}

    def _triples(self, entries: list[LogprobEntry]) -> list[list[Any]]:
        if not self.return_text_in_logprobs:
            return [[lp, tid, None] for lp, tid in entries]
        return [[lp, tid, self.tokenizer.decode([tid])] for lp, tid in entries]


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
