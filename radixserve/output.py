"""From a request's stream of `ReqOutput` token deltas to the native API's result dict
`{"text", "output_ids", "meta_info"}` (or `{"embedding", "meta_info"}` for an embedding
request; cumulative text, stop strings trimmed, logprobs as
`[logprob | None, token_id, text | None]` triples; see the wire contract), in two halves
that each cost only what a step adds:

    ReqOutput ──RequestState──► StrOut (text and logprob deltas) ──ResultAccumulator──► result

The detokenizer process runs the first half (`Detokenizer`: one `RequestState` per request)
and the main process the second; the in-process Engine runs both in `RequestState.result`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from radixserve.core.output import FinishReason, LogprobEntry, LogprobTriple, ReqOutput, StrOut
from radixserve.core.sampling_params import SamplingParams
from radixserve.text_stream import TextStream

logger = logging.getLogger(__name__)


class RequestState:
    """One request on its way from ids to text: `update` takes each step's output,
    `take_delta` gives what is new since the previous take (decoding only the new ids), and
    `result` the cumulative native result."""

    def __init__(
        self,
        rid: str,
        params: SamplingParams,
        tokenizer: Any,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        token_ids_logprob: bool = False,
    ) -> None:
        self.rid = rid
        self.tokenizer = tokenizer
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = token_ids_logprob  # the request named tokens to report
        self.return_text_in_logprobs = return_text_in_logprobs
        self.text = TextStream(tokenizer, params)
        self.results = ResultAccumulator(  # for result()
            rid, return_logprob, top_logprobs_num, token_ids_logprob
        )
        self.start = time.perf_counter()
        self.last: ReqOutput | None = None
        # what arrived since the previous take
        self.new_ids: list[int] = []
        self.new_logprobs: list[LogprobEntry] = []
        self.new_top_logprobs: list[list[LogprobEntry]] = []
        self.new_token_ids_logprobs: list[list[LogprobEntry]] = []
        self.input_logprobs: list[LogprobEntry] | None = None
        self.input_top_logprobs: list[list[LogprobEntry]] = []
        self.input_token_ids_logprobs: list[list[LogprobEntry]] = []

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None

    def update(self, out: ReqOutput) -> None:
        self.new_ids += out.new_ids
        self.new_logprobs += out.new_logprobs
        self.new_top_logprobs += out.new_top_logprobs
        self.new_token_ids_logprobs += out.new_token_ids_logprobs
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs
            self.input_top_logprobs = out.input_top_logprobs or []
            self.input_token_ids_logprobs = out.input_token_ids_logprobs or []
        self.last = out

    def take_delta(self) -> StrOut:
        """Everything new since the previous take, as one StrOut."""
        last = self.last
        assert last is not None, "take_delta before any output"
        text = self.text.advance(self.new_ids, last.finish_reason)
        delta = self._counts(last, text, self.new_ids)
        if self.return_logprob:
            self._add_logprobs(delta)
        self.new_ids, self.new_logprobs, self.new_top_logprobs = [], [], []
        self.new_token_ids_logprobs = []
        self.input_logprobs, self.input_top_logprobs, self.input_token_ids_logprobs = None, [], []
        return delta

    def progress(self) -> StrOut:
        """The counts alone (what a non-stream sends while it runs)."""
        assert self.last is not None, "progress before any output"
        return self._counts(self.last, "", [])

    def _counts(self, last: ReqOutput, text: str, ids: list[int]) -> StrOut:
        return StrOut(
            self.rid,
            text,
            ids,
            last.finish_reason,
            last.prompt_tokens,
            last.cached_tokens,
            last.completion_tokens,
            spec=last.spec,
            cached_tiers=last.cached_tiers,
            embedding=last.embedding,
            hidden_states=last.hidden_states,
        )

    def _add_logprobs(self, delta: StrOut) -> None:
        delta.new_logprobs = self._triples(self.new_logprobs)
        if self.top_logprobs_num:
            delta.new_top_logprobs = [self._triples(t) for t in self.new_top_logprobs]
        if self.token_ids_logprob:
            delta.new_token_ids_logprobs = [self._triples(t) for t in self.new_token_ids_logprobs]
        if self.input_logprobs is not None:
            delta.input_logprobs = self._triples(self.input_logprobs)
            if self.top_logprobs_num:
                delta.input_top_logprobs = [self._triples(t) for t in self.input_top_logprobs]
            if self.token_ids_logprob:
                delta.input_token_ids_logprobs = [
                    self._triples(t) for t in self.input_token_ids_logprobs
                ]

    def result(self) -> dict[str, Any]:
        """The cumulative native result so far."""
        latency = time.perf_counter() - self.start if self.finished else None
        return self.results.add(self.take_delta(), latency).result

    def _triples(self, entries: list[LogprobEntry]) -> list[LogprobTriple]:
        if not self.return_text_in_logprobs:
            return [(lp, tid, None) for lp, tid in entries]
        return [(lp, tid, self.tokenizer.decode([tid])) for lp, tid in entries]


class Detokenizer:
    """The detokenizer process's work: each batch of token outputs to the StrOuts to send.
    Streams get every step's delta; other requests their counts while they run and all
    their text at the end. A request whose detokenization fails ends alone, with an error."""

    def __init__(self) -> None:
        self.states: dict[str, tuple[RequestState, bool]] = {}  # rid → (state, streaming)
        self.failed: set[str] = set()  # rids whose outputs are dropped until their last one

    def register(self, state: RequestState, stream: bool) -> None:
        self.states[state.rid] = (state, stream)

    def process(self, outputs: list[ReqOutput]) -> list[StrOut]:
        deltas = (self._step(out) for out in outputs)
        return [delta for delta in deltas if delta is not None]

    def _step(self, out: ReqOutput) -> StrOut | None:
        if out.rid in self.failed:
            if out.finished:
                self.failed.discard(out.rid)
            return None
        state, stream = self.states[out.rid]
        try:
            state.update(out)
            delta = state.take_delta() if stream or state.finished else state.progress()
        # The tokenizer is third-party code whose failures cannot be listed (an id outside
        # its vocabulary alone raises OverflowError, TypeError or a Rust panic); whatever it
        # raises for one request must end that request alone, not every stream being served.
        except Exception as e:
            logger.exception("detokenizing request %s failed; ending it with an error", out.rid)
            return self._fail(out, f"detokenizing the output failed: {type(e).__name__}: {e}")
        if state.finished:
            del self.states[out.rid]
        return delta

    def _fail(self, out: ReqOutput, message: str) -> StrOut:
        del self.states[out.rid]
        if not out.finished:  # the scheduler still runs it: drop the rest of its outputs
            self.failed.add(out.rid)
        reason = FinishReason.error(message)
        return StrOut(
            out.rid, "", [], reason, out.prompt_tokens, out.cached_tokens, out.completion_tokens
        )


class ResultAccumulator:
    """One request's cumulative native result, grown from its StrOut deltas. Its lists only
    grow (the text too: what was shown is never cut), so the result as of one delta is fixed
    by a few lengths: `add` returns those, and the dict is built only when asked."""

    def __init__(
        self,
        rid: str,
        return_logprob: bool,
        top_logprobs_num: int,
        token_ids_logprob: bool = False,
    ) -> None:
        self.rid = rid
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = token_ids_logprob
        self.pieces: list[str] = []  # the text, in the deltas' pieces
        self.ids: list[int] = []
        self.logprobs: list[LogprobTriple] = []
        self.top_logprobs: list[list[LogprobTriple]] = []
        self.input_logprobs: list[LogprobTriple] = []
        self.input_top_logprobs: list[list[LogprobTriple]] = []
        self.token_ids_logprobs: list[list[LogprobTriple]] = []
        self.input_token_ids_logprobs: list[list[LogprobTriple]] = []
        self.embedding: list[float] | None = None  # an embedding request's, at the end

    def add(self, delta: StrOut, e2e_latency: float | None = None) -> ResultUpdate:
        """Apply one delta; `e2e_latency` goes into the final result's meta_info."""
        if delta.text_delta:
            self.pieces.append(delta.text_delta)
        self.ids += delta.new_ids
        self.logprobs += delta.new_logprobs
        self.top_logprobs += delta.new_top_logprobs
        self.token_ids_logprobs += delta.new_token_ids_logprobs
        if delta.input_logprobs is not None:
            self.input_logprobs = delta.input_logprobs
            self.input_top_logprobs = delta.input_top_logprobs or []
            self.input_token_ids_logprobs = delta.input_token_ids_logprobs or []
        if delta.embedding is not None:
            self.embedding = delta.embedding
        return ResultUpdate(
            delta,
            e2e_latency,
            self,
            len(self.pieces),
            len(self.ids),
            len(self.logprobs),
        )

    def build(self, update: ResultUpdate) -> dict[str, Any]:
        """The native result dict as of `update`."""
        out = update.delta
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": out.finish_reason.to_dict() if out.finish_reason else None,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
        }
        if out.cached_tiers is not None:
            meta["cached_tokens_details"] = out.cached_tiers.details(out.cached_tokens)
        if out.spec is not None:
            meta.update(out.spec.meta_info())
        if update.e2e_latency is not None:
            meta["e2e_latency"] = update.e2e_latency
        if self.return_logprob:
            meta["input_token_logprobs"] = list(self.input_logprobs)
            meta["output_token_logprobs"] = self.logprobs[: update.num_logprobs]
            if self.top_logprobs_num:
                meta["input_top_logprobs"] = list(self.input_top_logprobs)
                meta["output_top_logprobs"] = self.top_logprobs[: update.num_logprobs]
            if self.token_ids_logprob:  # SGLang's names
                meta["input_token_ids_logprobs"] = list(self.input_token_ids_logprobs)
                meta["output_token_ids_logprobs"] = self.token_ids_logprobs[: update.num_logprobs]
        # return_hidden_states: on the last delta alone (a result built later, of an earlier
        # delta of a stream, must not show them), SGLang's shape: the prompt's rows, then
        # one row a step
        if out.hidden_states is not None:
            rows, prompt = out.hidden_states, out.prompt_tokens
            meta["hidden_states"] = [rows[:prompt], *rows[prompt:]]
        if self.embedding is not None:  # an embedding request: /encode's shape
            return {"embedding": self.embedding, "meta_info": meta}
        text = "".join(self.pieces[: update.num_pieces])
        return {"text": text, "output_ids": self.ids[: update.num_ids], "meta_info": meta}


@dataclass(eq=False)
class ResultUpdate:
    """One delta applied to a request's result: what it added (`text_delta`) and the
    cumulative native `result` as of it (built on first access: a stream that only forwards
    deltas never pays for it)."""

    delta: StrOut
    e2e_latency: float | None
    accumulator: ResultAccumulator = field(repr=False)
    num_pieces: int
    num_ids: int
    num_logprobs: int

    @property
    def rid(self) -> str:
        return self.delta.rid

    @property
    def finished(self) -> bool:
        return self.delta.finished

    @property
    def completion_tokens(self) -> int:
        return self.delta.completion_tokens

    @property
    def text_delta(self) -> str:
        return self.delta.text_delta

    @cached_property
    def result(self) -> dict[str, Any]:
        return self.accumulator.build(self)
