"""Admission: which waiting requests join the next prefill (extend) batch, and by how many
tokens each extends.

`PrefillAdder` holds the step's two budgets and applies the rules one request at a time:
- the token budget: at most --max-prefill-tokens new tokens per batch, at most one chunk
  (--chunked-prefill-size) when chunking is on, less the running requests' decode tokens
  when they ride in the same batch (mixed chunks);
- the KV budget: what is free or evictable, less the output reserve of every running
  request; each admitted request is charged its uncached tokens plus its own reserve.
Rules, each a method below: a lone request may exceed the KV budget (nothing else could
run, and it is retracted if decode runs out); a request that shares an uncached prefix with
one admitted this round waits a round to reuse it; a prompt longer than the token budget
is cut into a chunk (the adder's `chunked`), which ends the batch. With hybrid
sliding-window memory the window pool is a third budget (`KVManager.window_room`): a
prompt is also cut to what it surely leaves, chunking on or off, so no step runs short of
window slots mid-batch; and each request is charged what it will come to hold there (at
most W positions, its future output included: `KVManager.window_hold`) against what the
running requests leave, as the KV budget charges the full pool.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from radixserve.config import SchedulerConfig
from radixserve.core.output import ModelInfo
from radixserve.core.req import Req
from radixserve.core.tokens import common_prefix_len
from radixserve.scheduler.kv_manager import KVManager

# A request waits one round when one admitted this round computes an uncached prefix of it:
# at least IN_BATCH_PREFIX_MIN tokens, or at least IN_BATCH_SHARE_MIN that are half or more
# of what it would compute (the continuations of one scoring call: a short context each
# would otherwise compute again).
IN_BATCH_PREFIX_MIN = 32
IN_BATCH_SHARE_MIN = 8
NEW_TOKEN_RESERVE_CAP = 4096  # at most this many future tokens reserved per request
RATIO_DECAY = 0.001  # per decode step that needed no retraction
RATIO_BUMP = 0.1  # per retraction


class OutputReserve:
    """The share of a request's remaining max_new_tokens held back in KV for its future
    output: it starts high, decays while decoding runs smoothly, and rises on retraction."""

    def __init__(self, initial: float, floor: float) -> None:
        self.ratio = initial
        self.floor = floor

    def of(self, req: Req) -> int:
        left = req.params.max_new_tokens - len(req.output_ids)
        return int(min(left, NEW_TOKEN_RESERVE_CAP) * self.ratio)

    def decay(self) -> None:
        self.ratio = max(self.floor, self.ratio - RATIO_DECAY)

    def bump(self) -> None:
        self.ratio = min(1.0, self.ratio + RATIO_BUMP)


def outranks_claim(req: Req, deferred: bool, priority: int | None) -> bool:
    """`req` goes before the request waiting for an adapter slot (in the flex tier or not;
    its priority under the priority policy, else None): it is not in the flex tier and that
    one is, or (the same tier) its priority is higher."""
    if req.deferred != deferred:
        return deferred
    return priority is not None and req.priority > priority


class Admission(enum.Enum):
    ADDED = "added"
    SKIPPED = "skipped"  # not now, but later requests may still fit
    STOP = "stop"  # nothing more joins this batch


@dataclass
class PrefillAdder:
    kv: KVManager
    reserve: OutputReserve
    token_budget: int  # new tokens this batch may still take
    kv_budget: int  # KV slots admitted requests may still be charged
    chunk_size: int | None  # None: prompts are never cut
    page_size: int
    rows_left: int  # requests that may still start running
    decode_tokens: int = 0  # the running requests' tokens in the same batch (mixed step)
    has_running: bool = False
    reqs: list[Req] = field(default_factory=list)
    extends: list[list[int]] = field(default_factory=list)
    chunked: Req | None = None  # the request whose prompt this batch only starts
    # window slots admitted requests may still be charged (None: no hybrid window memory)
    window_budget: int | None = None
    chunked_before: Req | None = None  # the continued chunk (counted in window_room already)
    in_batch_sharing: bool = True  # hold back a request whose prefix this batch computes
    # LoRA: the adapters the running and admitted requests use, and how many they may be
    # (--max-loras-per-batch; None: no limit)
    adapters: set[int] = field(default_factory=set)
    max_adapters: int | None = None
    # the adapter of a request that found no slot (this step, or an earlier one where it is
    # still waiting): until it has one, no request of another adapter joins, unless (under
    # the priority policy: `by_priority`) it outranks the waiting request (`waiting_priority`)
    waiting_adapter: int | None = None
    waiting_priority: int | None = None
    waiting_deferred: bool = False  # the waiting request is in the flex tier
    by_priority: bool = False
    # flex requests that may still start running (None: any number; see
    # --flex-max-running-requests)
    flex_rows_left: int | None = None

    @classmethod
    def for_step(
        cls,
        config: SchedulerConfig,
        info: ModelInfo,
        kv: KVManager,
        reserve: OutputReserve,
        page_size: int,
        running: list[Req],
        decode_tokens: int = 0,
        max_adapters: int | None = None,
        waiting_adapter: int | None = None,
    ) -> PrefillAdder:
        """The adder of one step, its budgets taken from the config, the limits resolved at
        load (`info`) and the KV state."""
        chunk_size = info.chunked_prefill_size or None
        budget = min(config.max_prefill_tokens, chunk_size or config.max_prefill_tokens)
        window_budget = kv.window_room()
        if window_budget is not None:
            growth = (kv.window_hold(r, reserve.of(r)) - kv.window_hold(r) for r in running)
            window_budget -= sum(growth)
        return cls(
            kv,
            reserve,
            token_budget=max(budget - decode_tokens, 1),
            kv_budget=kv.available - sum(map(reserve.of, running)),
            chunk_size=chunk_size,
            page_size=page_size,
            rows_left=info.max_running_requests - len(running),
            decode_tokens=decode_tokens,
            has_running=bool(running),
            window_budget=window_budget,
            in_batch_sharing=not config.disable_in_batch_prefix_caching,
            adapters={r.lora_id for r in running if r.lora_id},
            max_adapters=max_adapters,
            waiting_adapter=waiting_adapter,
        )

    @property
    def num_tokens(self) -> int:
        """New tokens of the batch, the decode tokens riding in it included."""
        return self.decode_tokens + sum(map(len, self.extends))

    def add_chunked(self, req: Req) -> None:
        """A prompt being prefilled in chunks continues before anything new is admitted."""
        self.chunked_before = req
        self._admit(req)

    def try_add(self, req: Req) -> Admission:
        """Admit `req` (its prefix matched and locked, its extend recorded) if the budgets
        allow; else leave it untouched."""
        if self.chunked is not None or self.token_budget <= 0 or self.rows_left <= 0:
            return Admission.STOP
        if req.deferred and self.flex_rows_left is not None and self.flex_rows_left <= 0:
            return Admission.SKIPPED  # (before its adapter may claim a slot)
        if self._shares_uncached_prefix(req) or not self._adapter_fits(req):
            return Admission.SKIPPED
        if not self.kv.has_free_row:
            return Admission.STOP
        self.kv.match(req)
        self.kv_budget -= req.loaded_back  # slots the load back took
        remaining = len(req.all_ids) - req.kv_len
        limit = self._piece_limit()
        fits = limit >= 1 and self._fits(remaining + self.reserve.of(req), remaining, req)
        if not fits or not self.kv.ensure_free(self.num_tokens + min(remaining, limit)):
            self.kv.unmatch(req)
            return Admission.STOP
        self._admit(req)
        return Admission.ADDED

    def _fits(self, charge: int, remaining: int, req: Req) -> bool:
        """Within the KV budget (and the window budget), and within the token budget unless
        it can be chunked; a lone request (nothing admitted, nothing running) always fits."""
        if not self.reqs and not self.has_running:
            return True
        too_long = remaining > self.token_budget and self.chunk_size is None
        window_ok = self.window_budget is None or self._window_charge(req) <= self.window_budget
        return charge <= self.kv_budget and window_ok and not too_long

    def _window_charge(self, req: Req) -> int:
        """What `req` will hold in the window pool, its output reserve included, beyond
        what `window_room` already counted (the continued chunk's current positions)."""
        more = len(req.all_ids) - req.kv_len + self.reserve.of(req)
        counted = self.kv.window_hold(req) if req is self.chunked_before else 0
        return self.kv.window_hold(req, more) - counted

    def _admit(self, req: Req) -> None:
        piece = self._take(req)
        self.reqs.append(req)
        self.extends.append(piece)
        self.token_budget -= len(piece)
        self.kv_budget -= len(piece) + self.reserve.of(req)
        if self.window_budget is not None:
            self.window_budget -= self._window_charge(req)
        self.rows_left -= 1
        if req.deferred and self.flex_rows_left is not None:
            self.flex_rows_left -= 1
        if req.lora_id:
            self.adapters.add(req.lora_id)
            if req.lora_id == self.waiting_adapter:  # it has its slot: the others may join
                self.waiting_adapter = self.waiting_priority = None
                self.waiting_deferred = False

    def _adapter_fits(self, req: Req) -> bool:
        """Its adapter is one the batch uses already, or there is room for one more. Once a
        request found no room, requests of other adapters wait (the base model's still go),
        in this step and the next ones, until it has a slot: else a steady stream of the
        adapters in use (which the lpm and priority orders put first) would keep it waiting
        for good. A request that outranks the waiting one still goes (`_outranks_waiting`)."""
        if not req.lora_id or self.max_adapters is None:
            return True
        if self.waiting_adapter is not None and req.lora_id != self.waiting_adapter:
            if not self._outranks_waiting(req):
                return False
        if req.lora_id in self.adapters or len(self.adapters) < self.max_adapters:
            return True
        if self.waiting_adapter is None or self._outranks_waiting(req):  # the first without
            # a slot waits, or the most urgent
            self.waiting_adapter = req.lora_id
            self.waiting_priority = req.priority if self.by_priority else None
            self.waiting_deferred = req.deferred
        return False

    def _outranks_waiting(self, req: Req) -> bool:
        if self.waiting_adapter is None:
            return False
        return outranks_claim(req, self.waiting_deferred, self.waiting_priority)

    def _take(self, req: Req) -> list[int]:
        """The tokens `req` extends by now: the rest of its prompt, or a chunk of it (which
        makes it the batch's chunked request)."""
        rest = req.all_ids[req.kv_len :]
        budget = self._piece_limit()
        window_bound = budget < self.token_budget
        if (self.chunk_size is not None or window_bound) and len(rest) > budget:
            self.chunked = req
            return rest[: max(budget - budget % self.page_size, 1)]
        return rest

    def _piece_limit(self) -> int:
        """The most new tokens the next request may take: the token budget, and with hybrid
        window memory the window slots this batch surely leaves."""
        room = self.kv.window_room()
        if room is None:
            return self.token_budget
        return min(self.token_budget, room - self.num_tokens)

    def _shares_uncached_prefix(self, req: Req) -> bool:
        """True if a request admitted this round will compute a prefix `req` could reuse
        (IN_BATCH_PREFIX_MIN tokens past what the tree holds, or IN_BATCH_SHARE_MIN that
        are at least half of `req`'s uncached tokens): it waits a round. Only requests of
        its prefix-cache namespace (its LoRA adapter's) count: no other's K/V serve it."""
        kin = [other for other in self.reqs if other.extra_key == req.extra_key]
        if self.kv.tree is None or not kin or not self.in_batch_sharing:
            return False
        ids = req.all_ids
        cached = self.kv.peek_prefix_len(ids, req)
        shared = max(common_prefix_len(ids, other.all_ids) for other in kin) - cached
        return shared >= IN_BATCH_PREFIX_MIN or (
            shared >= IN_BATCH_SHARE_MIN and 2 * shared >= len(ids) - cached
        )
