"""Speculative decoding in the decode step: drafts, the controller's choice of how many to
verify, and the counters.

    propose   each running request's n-gram draft (spec/ngram.py), cut to what the
              controller expects to pay (spec/controller.py) and to the free KV
    (forward) the drafted tokens run as extra one-token rows (BatchBuilder.verify)
    (verify)  OutputProcessor.verify keeps the drafted tokens a decode step would have
              produced; KVManager.keep_verified releases the KV of the others
    record    acceptance per request (for the controller) and per draft position

Requests with tokens pending after a jump-forward, or one token short of their limit, draft
nothing that step; mixed prefill+decode steps do not speculate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from radixserve.config import SpeculativeConfig
from radixserve.core.output import SchedulerStats, SpecCounts
from radixserve.core.req import Req
from radixserve.spec.controller import (
    Acceptance,
    CostModel,
    MatchStats,
    plan,
    room_for_drafts,
)
from radixserve.spec.ngram import Draft, NgramDrafter, OwnTokens


@dataclass
class SpecState:
    """What the speculator keeps per request (in `Req.spec`)."""

    own: OwnTokens
    acceptance: Acceptance = field(default_factory=Acceptance)
    counts: SpecCounts = field(default_factory=SpecCounts)
    draft: Draft | None = None  # this step's draft, until it is recorded


class Speculator:
    def __init__(self, config: SpeculativeConfig, stats: SchedulerStats, context_len: int):
        self.max_draft = config.speculative_num_draft_tokens
        self.drafter = NgramDrafter(
            config.speculative_ngram_min_match_window_size,
            config.speculative_ngram_max_match_window_size,
            config.speculative_ngram_capacity,
        )
        self.cost = CostModel()
        self.matches = MatchStats()
        self.stats = stats
        self.context_len = context_len
        stats.spec_drafted_by_position = [0] * self.max_draft
        stats.spec_accepted_by_position = [0] * self.max_draft

    def state(self, req: Req) -> SpecState:
        if req.spec is None:
            req.spec = SpecState(self.drafter.own_tokens())
        return req.spec

    def propose(
        self, reqs: list[Req], pending: list[int], free_slots: int, queued: bool = True
    ) -> list[list[int]]:
        """Drafted tokens to verify this step, per request (most often none); `queued`:
        requests wait behind the running ones (see `plan`'s `alone`)."""
        alone = not queued and len(reqs) > 1
        if not room_for_drafts(self.cost.seconds, sum(pending), alone):
            for req in reqs:
                self.state(req).draft = None
            return [[] for _ in reqs]  # their own tokens are indexed when next looked up
        found: list[Draft | None] = []
        for req, n in zip(reqs, pending, strict=True):
            # the step's own token plus the drafts must stay within the request's limits
            limit = min(self.max_draft, req.tokens_left(self.context_len) - 1)
            state = self.state(req)
            state.draft = None
            if n == 1 and limit > 0:
                state.draft = self.drafter.propose(state.own, req.input_ids, req.output_ids, limit)
            found.append(state.draft)
        if not any(found):
            return [[] for _ in reqs]
        rates = [
            0.0 if d is None else r.spec.acceptance.rate(self.matches.rate(*_kind(d)))
            for r, d in zip(reqs, found)
        ]
        lengths = [0 if d is None else len(d.tokens) for d in found]
        line = self.cost.coefficients()  # refitted only when it is used
        self.stats.spec_cost_model = list(line)
        take = plan(rates, lengths, sum(pending), line, free_slots, self.cost.seconds, alone)
        return [[] if d is None else d.tokens[:k] for d, k in zip(found, take)]

    def observe_forward(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)
        self.matches.advance()

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """Request `req` verified `drafted` tokens this step and `accepted` of them."""
        state = self.state(req)
        state.counts.verify_ct += drafted > 0
        if not drafted:
            return
        assert state.draft is not None
        self.matches.record(*_kind(state.draft), drafted, accepted)
        state.acceptance.record(drafted, accepted)
        state.counts.draft_tokens += drafted
        state.counts.accepted_tokens += accepted
        stats = self.stats
        stats.spec_verify_steps += 1
        stats.spec_draft_tokens += drafted
        stats.spec_accepted_tokens += accepted
        for j in range(drafted):
            stats.spec_drafted_by_position[j] += 1
        for j in range(accepted):
            stats.spec_accepted_by_position[j] += 1

    def counts(self, req: Req) -> SpecCounts:
        """A copy of the request's counts (outputs may be read after the next step)."""
        return msgspec.structs.replace(self.state(req).counts)

    def finished(self, req: Req) -> None:
        """A finished request's sequence joins the shared index."""
        reason = req.finish_reason
        if reason is not None and reason.type in ("stop", "length"):
            self.drafter.finished(req.all_ids)
        req.spec = None


def _kind(draft: Draft) -> tuple[str, int]:
    return draft.source, draft.match_len
