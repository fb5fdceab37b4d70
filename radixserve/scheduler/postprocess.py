"""After a forward: sample the next token of every request, let its grammar accept it (and
jump forward), record logprobs, check stop rules, and describe what changed as a
`ReqOutput`.

A fault confined to one request — its sampling parameters, its grammar, its logprobs, its
stop check — ends that request alone with an "error" finish reason and a log line naming
its rid; the batch's other requests carry on. (Faults in the forward pass or the KV pool
are not confined to a request and stop the engine, as they should.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from radixserve.constrained.grammars import Grammars, MaskJob
from radixserve.core.output import (
    CachedTiers,
    FinishReason,
    LogprobEntry,
    ModelInfo,
    ReqOutput,
    SchedulerStats,
    SpecCounts,
)
from radixserve.core.req import Req
from radixserve.model.sampler import SampleOutput, Sampler, SamplingBatch
from radixserve.scheduler.logprobs import record_output_logprobs
from radixserve.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)


@dataclass
class Update:
    """One request's step: the tokens it gained (and their logprobs)."""

    req: Req
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[LogprobEntry] = field(default_factory=list)
    new_top_logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    new_token_ids_logprobs: list[list[LogprobEntry]] = field(default_factory=list)


def fail_request(req: Req, stats: SchedulerStats, what: str, error: Exception) -> None:
    """End `req` alone after a fault in its own processing."""
    logger.exception("request %s failed in %s: %r", req.rid, what, error)
    stats.request_errors += 1
    req.finish_reason = FinishReason.error(f"internal error in {what}: {error!r}")


class OutputProcessor:
    def __init__(
        self,
        grammars: Grammars,
        stops: StopChecker,
        info: ModelInfo,
        device: torch.device,
        stats: SchedulerStats,
    ) -> None:
        self.sampler = Sampler()
        self.grammars = grammars
        self.stops = stops
        self.vocab_size = info.vocab_size
        self.device = device
        self.stats = stats

    def process(self, reqs: list[Req], logits: torch.Tensor, masks: MaskJob) -> list[Update]:
        """Sample one token per row of `logits` (B, V) and update each request with it."""
        sampled = self._sample(reqs, logits, masks)
        updates = []
        for req, (out, row) in zip(reqs, sampled):
            update = Update(req)
            if out is not None:
                try:  # a fault confined to this request (see the module docstring)
                    self._update(update, out, row)
                except Exception as e:
                    fail_request(req, self.stats, "its grammar, logprobs or stop check", e)
            updates.append(update)
        return updates

    def verify(
        self,
        reqs: list[Req],
        logits: torch.Tensor,
        first_rows: list[int],
        drafts: list[list[int]],
        masks: MaskJob,
    ) -> tuple[list[Update], list[int]]:
        """A decode step whose requests may have verified drafted tokens: logits rows
        first_rows[i] + j (j = 0 .. len(drafts[i])) follow request i's pending token and
        its first j drafted tokens. Position by position ("waves" over the requests still
        going), each request's next token is chosen exactly as a decode step would choose
        it, from the same state (penalties, grammar, min_tokens) and the same draw counter;
        a request goes on to its next row while the chosen token is its drafted one. So
        outputs are those of decoding without drafts, token for token, greedy or sampled.
        Returns each request's update (every token it gained) and its accepted drafts."""
        updates = [Update(r) for r in reqs]
        accepted = [0] * len(reqs)
        going = list(range(len(reqs)))
        j = 0
        while going:
            wave = [reqs[i] for i in going]
            rows = logits[torch.tensor([first_rows[i] + j for i in going])]
            wave_masks = masks if j == 0 else self.grammars.start_masks(wave)
            nxt = []
            for i, step in zip(going, self.process(wave, rows, wave_masks)):
                update = updates[i]
                update.new_ids += step.new_ids
                update.new_logprobs += step.new_logprobs
                update.new_top_logprobs += step.new_top_logprobs
                update.new_token_ids_logprobs += step.new_token_ids_logprobs
                draft = drafts[i]
                if j < len(draft) and not reqs[i].finished and step.new_ids == [draft[j]]:
                    accepted[i] += 1
                    nxt.append(i)
            going = nxt
            j += 1
        return updates, accepted

    def _update(self, update: Update, out: SampleOutput, row: int) -> None:
        req = update.req
        new = self._accept(req, int(out.next_ids[row]))
        req.output_ids += new
        self.stats.generated_tokens += len(new)
        update.new_ids = new
        if new:
            update.new_logprobs, update.new_top_logprobs, update.new_token_ids_logprobs = (
                record_output_logprobs(req, out, row)
            )
            req.finish_reason = self.stops.check(req)

    def _sample(
        self, reqs: list[Req], logits: torch.Tensor, masks: MaskJob
    ) -> list[tuple[SampleOutput | None, int]]:
        """(sampler output, its row) per request: one call for the batch; if it fails, one
        call per request, so that only the requests whose own sampling fails are ended."""
        try:  # a fault in sampling is confined to the rows that cause it: isolate them
            out = self._sample_rows(reqs, logits, masks.result())
            return [(out, i) for i in range(len(reqs))]
        except Exception:
            logger.warning("sampling a batch of %d failed; sampling each request alone", len(reqs))
        sampled: list[tuple[SampleOutput | None, int]] = []
        for i, req in enumerate(reqs):
            try:
                allowed = self.grammars.start_masks([req]).result()
                sampled.append((self._sample_rows([req], logits[i : i + 1], allowed), 0))
            except Exception as e:
                fail_request(req, self.stats, "sampling", e)
                sampled.append((None, 0))
        return sampled

    def _sample_rows(
        self, reqs: list[Req], logits: torch.Tensor, allowed: torch.Tensor | None
    ) -> SampleOutput:
        want_lp = any(r.return_logprob for r in reqs)
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        named = any(r.return_logprob and r.token_ids_logprob for r in reqs)
        batch = SamplingBatch.for_requests(reqs, self.stops.eos_ids, self.vocab_size, self.device)
        batch.allowed = allowed
        return self.sampler(logits, batch, want_lp, top_n, keep_logprobs=named)

    def _accept(self, req: Req, token: int) -> list[int]:
        """The tokens a sampled token becomes: itself, or with jump-forward the forced text
        after it; [] (and the request aborted) if its grammar refuses the token."""
        if req.grammar is None:
            return [token]
        new = self.grammars.accept(req, token, req.tokens_left(self.stops.context_len))
        if new is None:  # the mask allowed it: a matcher fault, or no allowed token was left
            said = req.grammar.error  # the matcher's own reason (its mask then allowed only EOS)
            message = f"the grammar cannot continue: {said}" if said else None
            req.finish_reason = FinishReason.abort(
                message or f"the grammar refused the sampled token {token}"
            )
            return []
        return new


def make_output(
    req: Req, update: Update | None = None, spec: SpecCounts | None = None
) -> ReqOutput:
    """What changed for `req` this step; its prompt logprobs ride on its first output."""
    update = update or Update(req)
    first = len(req.output_ids) <= len(update.new_ids) or req.finished
    with_prompt = first and req.return_logprob
    return ReqOutput(
        rid=req.rid,
        new_ids=list(update.new_ids),
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.input_ids),
        cached_tokens=req.cached_tokens,
        completion_tokens=len(req.output_ids),
        new_logprobs=list(update.new_logprobs),
        new_top_logprobs=list(update.new_top_logprobs),
        new_token_ids_logprobs=list(update.new_token_ids_logprobs),
        input_logprobs=list(req.input_logprobs) if with_prompt else None,
        input_top_logprobs=list(req.input_top_logprobs) if with_prompt else None,
        input_token_ids_logprobs=list(req.input_token_ids_logprobs) if with_prompt else None,
        spec=spec,
        cached_tiers=CachedTiers(*req.cached_lower) if req.cached_lower else None,
        embedding=req.embedding,
        hidden_states=hidden_states(req) if req.finished else None,
    )


@dataclass
class HiddenChunks:
    """A request's hidden-state rows (return_hidden_states): each step's chunk, on the CPU,
    joined once at the end; row p of them all is position p's."""

    chunks: list[torch.Tensor] = field(default_factory=list)
    rows: int = 0

    def cut(self, end: int) -> None:
        """Keep the rows of positions before `end`."""
        if end >= self.rows:
            return
        kept, held = [], 0
        for chunk in self.chunks:
            take = min(len(chunk), end - held)
            if take <= 0:
                break
            kept.append(chunk if take == len(chunk) else chunk[:take])
            held += take
        self.chunks, self.rows = kept, held


def record_hidden(req: Req, start: int, rows: torch.Tensor) -> None:
    """A step's hidden-state rows of `req`, of positions start, start + 1, ...: they replace
    whatever rows it had from `start` on (a rejected draft's, or those a retracted request
    runs again)."""
    if req.hidden is None:
        req.hidden = HiddenChunks()
    held: HiddenChunks = req.hidden
    held.cut(start)
    assert held.rows == start, "a hidden-state row was skipped"
    held.chunks.append(rows.to("cpu", copy=True))
    held.rows += len(rows)


def hidden_states(req: Req) -> list[list[float]] | None:
    """The hidden states a finished request reports: one row per position that ran with
    its final token (every prompt position, then each output token but the last)."""
    if not req.return_hidden_states or req.hidden is None:
        return None
    ran = len(req.input_ids) + max(len(req.output_ids) - 1, 0)
    held: HiddenChunks = req.hidden
    held.cut(ran)
    rows = torch.cat(held.chunks).tolist() if held.chunks else []
    req.hidden = None
    return rows
