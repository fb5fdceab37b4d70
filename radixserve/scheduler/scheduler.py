"""The scheduler: continuous batching over a radix prefix cache, composed of small parts.

    KVManager        slots, the request→token table and the radix tree (kv_manager.py)
    PrefillAdder     admission under the step's token and KV budgets (prefill.py)
    OutputProcessor  sampling, grammar, logprobs, stop checks, outputs (postprocess.py)
    Speculator       n-gram drafts verified in the decode step, when on (speculative.py)
    order_waiting    the admission order policy (policy.py)

Each `step()`: end aborted requests; then admit waiting requests into a prefill (extend)
batch when the KV budget allows (the last prompt may be a chunk), with the running requests'
decode step in the same batch under mixed chunks; else run one decode step of the running
batch. After the forward every request that changed gets one `ReqOutput`. Prompts are
inserted into the tree as soon as they are computed (so requests admitted later share
them); finished requests hand all their KV to the tree.

A request with a constraint not compiled yet waits apart while its grammar compiles on
another thread (constrained/grammars.py); `compiled()` queues it, or hands back the error
that refuses it.

The transport (`scheduler/loop.py`) only calls `add_request`, `compiled`, `abort`, `step`,
`flush_cache`, `state` and reads `has_work` and `can_step`; the model is reached only through the
runner's `forward`.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import time
from collections.abc import Callable, Sequence

import msgspec
import torch

from radixserve.config import Config, HiCacheConfig, SchedulerConfig, SpeculativeConfig
from radixserve.constrained.grammars import Grammars
from radixserve.core.batch import HiddenRows
from radixserve.core.output import FinishReason, ReqOutput, SchedulerStats
from radixserve.core.req import Req
from radixserve.model.loader import ModelLoadError
from radixserve.model.runner import ModelRunner
from radixserve.scheduler import embedding
from radixserve.scheduler.adapters import Adapters
from radixserve.scheduler.kv_manager import KVManager, build_tiers
from radixserve.scheduler.logprobs import record_input_logprobs, wants_prompt_logits
from radixserve.scheduler.policy import order_waiting
from radixserve.scheduler.postprocess import (
    OutputProcessor,
    Update,
    fail_request,
    make_output,
    record_hidden,
)
from radixserve.scheduler.prefill import Admission, OutputReserve, PrefillAdder, outranks_claim
from radixserve.scheduler.speculative import Speculator
from radixserve.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)

Prefill = tuple[list[Req], list[list[int]]]  # requests and the tokens each extends by


RATE_WINDOW_S = 10.0  # how far back RecentRate looks
# the flex cap holds this long after the last request of another tier ran or waited: the
# rows it took back are not readmitted between interactive requests a second apart (and
# taken back again at the next one)
FLEX_CAP_GRACE_S = 1.0


class RecentRate:
    """The rate of a growing count over about the last RATE_WINDOW_S seconds, from the
    readings `update` is given (the scheduler's state is read every ~0.7 s)."""

    def __init__(self) -> None:
        self._readings: collections.deque[tuple[float, int]] = collections.deque()

    def update(self, count: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        readings = self._readings
        readings.append((now, count))
        while len(readings) > 2 and now - readings[1][0] >= RATE_WINDOW_S:
            readings.popleft()  # the oldest kept is the last at or past the window's start
        start, first = readings[0]
        return max(count - first, 0) / (now - start) if now > start else 0.0


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        config: SchedulerConfig,
        page_size: int = 1,
        speculative: SpeculativeConfig | None = None,
        hicache: HiCacheConfig | None = None,
    ) -> None:
        self.runner = runner
        self.config = config
        self.gen_rate = RecentRate()  # output tokens a second (SchedulerStats.gen_throughput)
        self.info = runner.model_info()
        self.page_size = page_size
        use_tree = not config.disable_radix_cache
        tiers = None
        if hicache is not None and hicache.enable_hierarchical_cache and use_tree:
            tiers = build_tiers(
                hicache, runner.allocator, runner.kv_pool, page_size, self.info.model_path
            )
        self.kv = KVManager(
            runner.allocator,
            runner.req_to_token,
            runner.device,
            use_tree,
            page_size,
            tiers,
            hicache.hicache_prefetch_timeout if hicache is not None else 0.0,
        )
        self.stats = SchedulerStats()
        self.grammars = Grammars(
            runner.tokenizer,
            self.info.vocab_size,
            config.grammar_backend,
            jump_forward=not config.disable_jump_forward,
        )
        stops = StopChecker(runner.tokenizer, runner.eos_token_ids, self.info, self.grammars)
        self.post = OutputProcessor(self.grammars, stops, self.info, runner.device, self.stats)
        self.reserve = OutputReserve(config.init_new_token_ratio, config.min_new_token_ratio)
        self.adapters = Adapters(runner)  # LoRA: which adapters requests may name
        # the adapter of a waiting request that found no slot (--max-loras-per-batch)
        self.lora_waiting: int | None = None
        # the latest prefill batch's sequences, new tokens, and the cached tokens those it
        # admitted found (the log lines')
        self.last_prefill = (0, 0, 0)
        # when a request outside the flex tier last ran or waited, and how long after it
        # the flex cap still holds (--flex-max-running-requests)
        self.others_seen_at = -math.inf
        self.flex_cap_grace_s = FLEX_CAP_GRACE_S
        self.spec: Speculator | None = None
        if speculative is not None and speculative.enabled:
            self.spec = Speculator(speculative, self.stats, self.info.context_length)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the request whose prompt is being prefilled in chunks
        self.rng = random.Random(0)
        self._aborted: dict[str, str] = {}
        self.last_step: str | None = None  # "prefill", "mixed", "decode" or None (idle)

    @classmethod
    def from_config(cls, runner: ModelRunner, config: Config) -> Scheduler:
        return cls(
            runner, config.scheduler, config.cache.page_size, config.speculative, config.hicache
        )

    # -- the transport's interface --------------------------------------------------------
    def add_request(self, req: Req) -> bool:
        """Queue a request: True if it waits for its turn, False if first for its grammar to
        compile (`compiled` hands it back). Raises ValueError if it can never run on this
        engine (GrammarError, for a constraint refused before, included)."""
        req.check_fits(self.info)
        self.adapters.attach(req)
        if not self.grammars.attach(req):
            return False
        self._queue(req)
        return True

    def compiled(self) -> list[tuple[Req, ValueError | None]]:
        """The requests whose grammar finished compiling: queued (None), or refused with the
        error (GrammarError) that says why."""
        done = self.grammars.compiled()
        for req, error in done:
            if error is None:
                self._queue(req)
        return done

    def _queue(self, req: Req) -> None:
        self.waiting.append(req)
        self.kv.queued(req)

    def abort(self, rid: str | None = None, message: str = "aborted") -> None:
        """Abort one request by rid, or all (rid None); takes effect at the next step."""
        for req in self.live():
            if rid is None or req.rid == rid:
                self._aborted[req.rid] = message

    @property
    def has_work(self) -> bool:
        """Any request held, even one only waiting for its grammar."""
        return self.can_step or bool(self.grammars.compiling)

    @property
    def holds_kv(self) -> bool:
        """A request is running or being chunked (its K/V are in the pool)."""
        return bool(self.running or self.chunked)

    def retract_all(self) -> int:
        """Every running request, and the one whose prompt is being chunked, back to the
        front of the waiting queue, generated tokens kept (pause_generation's retract
        mode): their K/V go to the tree, for their admission to reuse unless a weight update
        flushes it. Returns how many."""
        reqs = self.holding
        for req in reversed(reqs):  # (what a chunked prompt gathered holds: its input
            # logprobs record each position once, mean pooling restarts at position 0)
            self.kv.release(req)
            req.retractions += 1
            self.waiting.insert(0, req)
        self.running.clear()
        self.chunked = None
        return len(reqs)

    def settle_aborts(self) -> list[ReqOutput]:
        """End the requests aborted since the last step, without stepping (while paused)."""
        return self._finish_aborted()

    @property
    def can_step(self) -> bool:
        """A request is waiting for its turn, running, or being chunked."""
        return bool(self.waiting or self.running or self.chunked)

    def step(self) -> list[ReqOutput]:
        """One forward pass: a prefill (extend) batch of admitted requests, or a decode step
        of the running ones, or with mixed chunks both in one batch."""
        outputs = self._finish_aborted()
        self.last_step, run = self._next_batch()
        return outputs + run() if run is not None else outputs

    def map_idle_pages(self) -> bool:
        """Nothing to run: map a few MB of the KV pool's pages (cache/kv_pool.py,
        IDLE_MAPPING); True while some remain."""
        return self.runner.kv_pool.map_idle_pages()

    def keep_alive(self) -> None:
        """Once per loop iteration: the other tensor-parallel ranks hear from rank 0 at least
        every second, forward passes or not."""
        self.runner.keep_alive()

    def close(self) -> None:
        """The loop ended: let the disk tier's queued writes land, release the other
        tensor-parallel ranks."""
        self.grammars.close()
        self.kv.close()
        self.runner.close()

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests are live."""
        if self.has_work:
            return False
        self.kv.flush()
        return True

    def update_weights(self, model_path: str) -> str:
        """Serve a checkpoint of the same model in place of the loaded weights (only with no
        request holding K/V: the caller waits for that), then empty the prefix cache, whose K/V the
        old weights computed. Raises ModelLoadError (nothing changed) if it cannot; returns
        the folder read."""
        self._check_weights_may_change()
        folder = self.runner.update_weights(model_path)
        self.kv.flush()
        self.info = msgspec.structs.replace(self.info, model_path=str(folder))
        return str(folder)

    def update_weights_from_tensors(
        self, named: Sequence[tuple[str, torch.Tensor]], flush_cache: bool = True
    ) -> int:
        """Serve these tensors in place of the loaded ones (`ModelRunner.
        update_weights_from_tensors`), then empty the prefix cache unless `flush_cache` is
        false (SGLang's: a caller whose update barely changes the K/V keeps them). Returns
        how many tensors were given."""
        self._check_weights_may_change()
        count = self.runner.update_weights_from_tensors(named)
        if flush_cache:
            self.kv.flush()
        return count

    def _check_weights_may_change(self) -> None:
        assert not self.holds_kv, "weights change only with no request's K/V in the pool"
        if self.kv.storage is not None:  # its pages outlive the process, keyed by model path
            raise ModelLoadError(
                "updating weights is not supported with the hierarchical cache's disk tier"
            )

    def state(self) -> SchedulerStats:
        """Counters, constrained-decoding figures and where every KV slot is."""
        stats = self.stats
        for key, value in self.kv.usage(self.live()).items():
            setattr(stats, key, value)
        stats.num_running = len(self.running) + (self.chunked is not None)
        stats.num_waiting = len(self.waiting)
        stats.num_grammar_queue = len(self.grammars.compiling)
        queued = self.waiting + self.grammars.compiling
        stats.num_waiting_tokens = sum(len(r.input_ids) + len(r.output_ids) for r in queued)
        stats.num_retracted_waiting = sum(bool(r.output_ids) for r in self.waiting)
        running = self.holding
        stats.lora_adapters_running = len({r.lora_id for r in running if r.lora_id})
        stats.gen_throughput = self.gen_rate.update(stats.generated_tokens)
        stats.kv_unmapped_bytes = self.runner.kv_pool.unmapped_bytes
        stats.grammar = self.grammars.stats.as_dict()
        stats.hicache = self.kv.tier_usage()
        return msgspec.structs.replace(  # a snapshot
            stats,
            spec_drafted_by_position=list(stats.spec_drafted_by_position),
            spec_accepted_by_position=list(stats.spec_accepted_by_position),
        )

    def check_kv_accounting(self) -> None:  # raises AssertionError on a leak
        self.kv.check(self.live())

    # -- which batch runs next ------------------------------------------------------------
    def _next_batch(self) -> tuple[str | None, Callable[[], list[ReqOutput]] | None]:
        mixed = self.config.enable_mixed_chunk and bool(self.running)
        if mixed:
            self._make_room_for_decode()
            mixed = bool(self.running)
        if mixed or not (self.last_step == "prefill" and self.running):
            preempted = self._preempt_for_waiting() + self._cap_flex()
            mixed = mixed and bool(self.running)
            decode_tokens = sum(map(_pending, self.running)) if mixed else 0
            prefill = self._schedule_prefill(decode_tokens, preempted)
            if prefill is not None:
                decoding = self.running if mixed else []
                run = lambda: self._run_prefill(*prefill, decoding)  # noqa: E731
                return ("mixed" if mixed else "prefill"), run
        if self.running:
            return "decode", self._run_decode
        return None, None

    def _schedule_prefill(self, decode_tokens: int, held: Sequence[Req] = ()) -> Prefill | None:
        """Requests to extend now and the tokens each extends by (see prefill.py); those
        `held` (just preempted) wait for a later step."""
        if not self.waiting and self.chunked is None:
            return None
        first = self._lora_waiting()  # (the oldest request of the adapter waiting for a slot)
        held_for = None if first is None else first.lora_id
        adder = PrefillAdder.for_step(
            self.config, self.info, self.kv, self.reserve, self.page_size, self.running,
            decode_tokens, self.adapters.per_batch, held_for,
        )  # fmt: skip
        if self.chunked is not None:
            adder.add_chunked(self.chunked)
        adder.flex_rows_left = self._flex_rows_left()
        policy = self.config.schedule_policy
        order = order_waiting(policy, self.waiting, self.kv.tree, self.rng)
        adder.by_priority = policy == "priority"
        if first is not None:  # its oldest request first (no budget runs out before it),
            # or under the priority policy, after those that outrank it only
            order.remove(first)
            ahead = sum(r.priority > first.priority for r in order) if adder.by_priority else 0
            order.insert(ahead, first)
            adder.waiting_priority = first.priority if adder.by_priority else None
            adder.waiting_deferred = first.deferred
        order.sort(key=lambda r: r.deferred)  # (stable) the flex tier after the others
        held_ids = {id(r) for r in held}
        for req in order:
            if id(req) in held_ids:
                continue
            result = adder.try_add(req)
            if result is Admission.STOP:
                break
            if result is Admission.ADDED:
                self.waiting.remove(req)
        self.chunked = adder.chunked
        if not adder.reqs:
            self.lora_waiting = adder.waiting_adapter
            return None
        if not self.kv.ensure_free(adder.num_tokens):  # a continued chunk that cannot fit
            for req in adder.reqs:
                self._requeue(req)
            return None  # (the request that waits for a slot keeps its claim)
        admitted = [r for r in adder.reqs if r is not adder.chunked_before]
        cached = sum(r.kv_len for r in admitted)  # (their matched prefixes, not yet extended)
        self.last_prefill = (len(adder.reqs), sum(map(len, adder.extends)), cached)
        # one still without a slot keeps the next steps' other adapters waiting
        self.lora_waiting = adder.waiting_adapter
        return adder.reqs, adder.extends

    def _lora_waiting(self) -> Req | None:
        """The oldest waiting request of the adapter that found no slot in an earlier step
        (None once none of its requests waits)."""
        waiter = self.lora_waiting
        first = (
            None if waiter is None else next((r for r in self.waiting if r.lora_id == waiter), None)
        )
        if first is None:
            self.lora_waiting = None
        return first

    # -- running batches ------------------------------------------------------------------
    def _run_prefill(
        self, reqs: list[Req], extends: list[list[int]], decoding: list[Req]
    ) -> list[ReqOutput]:
        """Extend `reqs` by `extends`; `decoding` (a mixed step) take their decode step in
        the same batch, after the prefill rows."""
        self.stats.prefill_batches += 1
        if decoding:
            self.stats.mixed_steps += 1
            self.stats.decode_steps += 1
        want_all = [wants_prompt_logits(r) for r in reqs]
        hidden = [_hidden_rows(r, ends_prompt=r is not self.chunked) for r in reqs + decoding]
        starts = [r.kv_len for r in reqs + decoding]
        to_sample = [r for r in reqs if r is not self.chunked and r.params.max_new_tokens > 0]
        masks = self.grammars.start_masks(decoding + to_sample)  # computed during the forward
        any_hidden = any(h is not None for h in hidden)
        batch = self.kv.extend_batch(
            reqs + decoding,
            extends + [r.all_ids[r.kv_len :] for r in decoding],
            want_all + [False] * len(decoding),
            hidden if any_hidden else None,
        )
        start = time.perf_counter()
        out = self.runner.forward(batch)
        logits = out.logits
        self.stats.prefill_forward_seconds += time.perf_counter() - start
        self.stats.prefill_forward_tokens += sum(map(len, extends))
        if any_hidden:
            self._take_hidden(reqs + decoding, hidden, starts, out.hidden)
        last_rows, num_rows = self._after_prefill(reqs, extends, want_all, starts, logits)
        done = [r for r in reqs if r is not self.chunked]
        outputs = [self._finish(r) for r in done if r.finished]
        sampled = [r for r in to_sample if not r.finished]
        rows = list(range(num_rows, num_rows + len(decoding)))
        rows += [last_rows[id(r)] for r in sampled]
        if rows:
            outputs += self._updates(decoding + sampled, logits[torch.tensor(rows)], masks)
        stepped = {id(r) for r in decoding}  # the running requests this batch decoded
        kept = [r for r in self.running if id(r) not in stepped]
        self.running = kept + [r for r in decoding + sampled if not r.finished]
        if decoding:
            self.reserve.decay()
        return outputs

    def _after_prefill(
        self, reqs: list[Req], extends: list[list[int]], want_all: list[bool], starts, logits
    ) -> tuple[dict[int, int], int]:
        """Prompt logprobs, counters, computed tokens into the tree, prefill-only requests
        finished; returns each request's last logits row (by id) and the rows they take."""
        last_rows: dict[int, int] = {}
        row = 0
        for req, ext, full, start in zip(reqs, extends, want_all, starts):
            n = len(ext) if full else int(req.embed is None)  # embeddings take no logits
            if full:
                try:  # a fault confined to this request (postprocess.py)
                    record_input_logprobs(req, logits[row : row + n], start)
                except Exception as e:
                    fail_request(req, self.stats, "its prompt logprobs", e)
                    if req is self.chunked:
                        self.chunked = None
            row += n
            last_rows[id(req)] = row - 1
            self.kv.cache(req)
            if req is self.chunked:
                continue
            if not req.output_ids:
                self.stats.prompt_tokens += len(req.input_ids)
                self.stats.cached_tokens += req.cached_tokens
                self.kv.count_cached(req)
            if req.embed is not None and not req.finished:
                req.embedding = embedding.finish(req)
            if req.params.max_new_tokens == 0 and not req.finished:
                req.finish_reason = FinishReason.of_length(0)
        return last_rows, row

    def _take_hidden(self, reqs: list[Req], hidden: list, starts: list[int], rows) -> None:
        """Each request's hidden-state rows (in the batch's order): an embedding request's
        fold into its pooling (scheduler/embedding.py), a generation request's are recorded
        by position (return_hidden_states)."""
        offset = 0
        for req, wanted, start in zip(reqs, hidden, starts):
            n = {None: 0, "none": 0, "last": 1, "all": req.kv_len - start}[wanted]
            if n and req.embed is not None:
                embedding.accumulate(req, rows[offset : offset + n], start, req.kv_len)
            elif n:
                record_hidden(req, start, rows[offset : offset + n])
            offset += n

    def _run_decode(self) -> list[ReqOutput]:
        """One token per running request — more where a drafted continuation is verified
        (speculative decoding), or where jump-forward appended forced tokens (those run in
        the same pass: the batch is then an extend batch)."""
        self._make_room_for_decode()
        if not self.running:
            return []
        self.stats.decode_steps += 1
        reqs = self.running
        pending = [_pending(r) for r in reqs]
        drafts = self._drafts(reqs, pending)
        masks = self.grammars.start_masks(reqs)  # computed while the forward runs
        first_rows = None
        wants_hidden = any(r.return_hidden_states for r in reqs)  # (rare: no step pays for it)
        starts = [r.kv_len for r in reqs] if wants_hidden else []
        if any(drafts):
            batch, first_rows = self.kv.verify_batch(reqs, drafts)
        elif all(n == 1 for n in pending):
            batch = self.kv.decode_batch(reqs)
        else:
            batch = self.kv.extend_batch(reqs, [r.all_ids[r.kv_len :] for r in reqs])
        hidden: list[HiddenRows | None] = []
        if wants_hidden:
            hidden = [_hidden_rows(r, ends_prompt=False) for r in reqs]
            counts = [n + len(d) for n, d in zip(pending, drafts, strict=True)]  # rows of each
            batch.hidden_indices = _all_rows_of(hidden, counts, batch.input_ids.device)
        start = time.perf_counter()
        out = self.runner.forward(batch)
        logits = out.logits
        seconds = time.perf_counter() - start
        if batch.hidden_indices is not None:
            self._take_hidden(reqs, hidden, starts, out.hidden)
        self.stats.decode_forward_seconds += seconds
        if self.spec is not None:
            self.spec.observe_forward(batch.input_ids.numel(), seconds)
        if first_rows is None:
            outputs = self._updates(reqs, logits, masks)
        else:
            outputs = self._verified(reqs, drafts, logits, first_rows, masks)
        self.running = [r for r in reqs if not r.finished]
        self.reserve.decay()
        return outputs

    def _drafts(self, reqs: list[Req], pending: list[int]) -> list[list[int]]:
        """Each request's drafted tokens to verify (none without speculation), within the
        KV a step may take beyond its pending tokens (free or evictable, never retracting)."""
        if self.spec is None:
            return [[] for _ in reqs]
        queued = bool(self.waiting) or self.chunked is not None
        drafts = self.spec.propose(reqs, pending, self.kv.available - sum(pending), queued)
        if not self.kv.ensure_free(sum(pending) + sum(map(len, drafts))):
            return [[] for _ in reqs]
        return drafts

    def _verified(self, reqs, drafts, logits, first_rows, masks) -> list[ReqOutput]:
        """After a step with drafts: keep what a decode step would have produced, release
        the KV of the drafted tokens that were not (see OutputProcessor.verify)."""
        assert self.spec is not None
        updates, accepted = self.post.verify(reqs, logits, first_rows, drafts, masks)
        for req, draft, kept in zip(reqs, drafts, accepted):
            if draft:
                self.kv.keep_verified(req, draft)
            self.spec.record(req, len(draft), kept)
        return self._report(updates)

    def _updates(self, reqs: list[Req], logits: torch.Tensor, masks) -> list[ReqOutput]:
        """Sample and update `reqs`; finished ones give their KV to the tree."""
        return self._report(self.post.process(reqs, logits, masks))

    def _report(self, updates: list[Update]) -> list[ReqOutput]:
        return [
            self._finish(u.req, u) if u.req.finished else self._output(u.req, u) for u in updates
        ]

    def _make_room_for_decode(self) -> None:
        """A slot per pending token: evict from the tree, then retract the requests that
        lose least (deferred ones first, then fewest outputs, then longest prompt) back to
        the waiting queue with their generated tokens; their KV goes to the tree, for
        whatever survives."""
        while self.running and not self.kv.ensure_free(sum(map(_pending, self.running))):
            req = min(self.running, key=_least_lost)
            self._take_back(req)
            self.reserve.bump()
            self.stats.retractions += 1
            logger.info("retracted %s after %d output tokens", req.rid, len(req.output_ids))

    def _preempt_for_waiting(self) -> list[Req]:
        """With every running row taken, running requests (and a prompt being chunked)
        give theirs to waiting requests that outrank them (`_outranks`), the most urgent
        first, each taking the row of the one that ranks lowest (then loses least): back to
        the queue with its KV in the tree, which its readmission reuses. A waiting request
        whose LoRA adapter finds no slot (--max-loras-per-batch) first takes back every
        holder of an adapter whose holders it all outranks (`_slot_for`), freeing that slot;
        with none such it takes no row (it would not start). The ones taken back."""
        config = self.config
        if config.disable_priority_preemption or not self.waiting:
            return []
        by_priority = config.schedule_policy == "priority"
        threshold = config.priority_scheduling_preemption_threshold

        def rank(req: Req) -> tuple[bool, int]:
            return (not req.deferred, req.priority if by_priority else 0)

        def outranks(req: Req, running: Req) -> bool:
            return _outranks(req, running, by_priority, threshold)

        holding = self.holding
        free = self.info.max_running_requests - len(holding)
        in_use = {r.lora_id for r in holding if r.lora_id}
        per_batch = self.adapters.per_batch
        slots_full = per_batch is not None and len(in_use) >= per_batch
        if not (by_priority or any(r.deferred for r in holding)):
            return []  # (none that any could outrank: the common steps)
        if free >= len(self.waiting) and not slots_full:
            return []  # (a row and an adapter slot for each)
        # (not one whose work so far its readmission could not reuse: its whole prompt
        # again, each time, might never end)
        reusable = [r for r in holding if r.kv_len <= r.max_cacheable_prefix]
        victims = sorted(reusable, key=lambda r: (rank(r), _least_lost(r)))
        claim = self._lora_waiting()  # (a request waiting for an adapter slot)
        holders_of: dict[int, list[Req]] = collections.defaultdict(list)  # adapter's holders
        for r in holding:
            if r.lora_id:
                holders_of[r.lora_id].append(r)
        counted_on: set[int] = set()  # adapters the requests gone through here will use
        no_slot: set[tuple[bool, int]] = set()  # ranks no adapter slot could be freed for
        taken: list[Req] = []

        def take_back(victim: Req, req: Req) -> None:
            victims[:] = [v for v in victims if v is not victim]
            if victim.lora_id:
                left = holders_of[victim.lora_id]
                left[:] = [r for r in left if r is not victim]
                if not left and victim.lora_id not in counted_on:  # its slot is free now
                    in_use.discard(victim.lora_id)
            self._take_back(victim)
            self.stats.preemptions += 1
            taken.append(victim)
            no_slot.clear()
            logger.info(
                "preempted %s (%s) after %d output tokens, for %s",
                victim.rid, "flex" if victim.deferred else f"priority {victim.priority}",
                len(victim.output_ids), req.rid,
            )  # fmt: skip

        for req in sorted(self.waiting, key=rank, reverse=True):
            lowest = victims[0] if victims else None
            if req.lora_id and per_batch is not None:  # as the adder will see it
                claimed = claim is not None and req.lora_id != claim.lora_id
                held = claimed and not outranks_claim(
                    req, claim.deferred, claim.priority if by_priority else None
                )
                if held:
                    continue
                if req.lora_id not in in_use and len(in_use) >= per_batch:
                    # (one that does not outrank the lowest-ranked victim outranks no
                    # adapter's every holder either)
                    if lowest is None or not outranks(req, lowest) or rank(req) in no_slot:
                        continue
                    holders = _slot_for(req, holders_of, counted_on, victims, outranks)
                    if holders is None:
                        no_slot.add(rank(req))
                        continue
                    free += len(holders)
                    for victim in list(holders):  # (an adapter's every holder: its slot)
                        take_back(victim, req)
                in_use.add(req.lora_id)
                counted_on.add(req.lora_id)
            if free > 0:  # (a row it may get without anyone leaving)
                free -= 1
                continue
            if not victims or not outranks(req, victims[0]):
                break
            take_back(victims[0], req)
        return taken

    def _flex_rows_left(self) -> int | None:
        """How many more flex requests may hold running rows: None (any number) unless
        --flex-max-running-requests is set and requests outside the flex tier run or wait,
        or did less than FLEX_CAP_GRACE_S ago (so a stream of interactive requests does not
        take the flex rows back at each arrival); negative when more hold rows than it
        allows."""
        cap = self.config.flex_max_running_requests
        if cap < 0:
            return None
        holding = self.holding
        now = time.monotonic()
        if not all(r.deferred for r in holding) or not all(r.deferred for r in self.waiting):
            self.others_seen_at = now
        elif now - self.others_seen_at > self.flex_cap_grace_s:
            return None
        return cap - sum(r.deferred for r in holding)

    def _cap_flex(self) -> list[Req]:
        """Flex requests past --flex-max-running-requests, while requests outside the flex
        tier run or wait, go back to the queue (the lowest priority first under the priority
        policy, then those that lose least; only those whose work so far their readmission
        reuses), their KV to the tree; under the priority policy a waiting flex request
        also takes the row of a running one it outranks by more than the threshold, as
        `_preempt_for_waiting` does when every row is taken. The ones taken back."""
        left = self._flex_rows_left()
        config = self.config
        if left is None or config.disable_priority_preemption:
            return []
        by_priority = config.schedule_policy == "priority"
        holding = self.holding
        flex = [r for r in holding if r.deferred and r.kv_len <= r.max_cacheable_prefix]
        flex.sort(key=lambda r: (r.priority if by_priority else 0, _least_lost(r)))
        taken = flex[:-left] if left < 0 else []
        del flex[: len(taken)]
        if by_priority:
            threshold = config.priority_scheduling_preemption_threshold
            waiting = sorted((r for r in self.waiting if r.deferred), key=lambda r: -r.priority)
            per_batch = self.adapters.per_batch
            gone = {id(r) for r in taken}
            in_use = {r.lora_id for r in holding if r.lora_id and id(r) not in gone}
            for req in waiting:
                if req.lora_id and per_batch is not None and req.lora_id not in in_use:
                    if len(in_use) >= per_batch:  # (it would not start: it takes no row)
                        continue
                    in_use.add(req.lora_id)
                if left > 0:  # (a flex row it may get without anyone leaving)
                    left -= 1
                elif flex and req.priority - flex[0].priority > threshold:
                    taken.append(flex.pop(0))
                else:
                    break
        for req in taken:
            self._take_back(req)
            self.stats.preemptions += 1
        if taken:
            logger.info(
                "preempted %d flex requests: at most %d run beside other tiers",
                len(taken), config.flex_max_running_requests,
            )  # fmt: skip
        return taken

    def _take_back(self, req: Req) -> None:
        """A running request (or the one being chunked) back to the front of the queue, its
        KV to the tree."""
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        self.kv.release(req)
        self.waiting.insert(0, req)
        req.retractions += 1

    def _requeue(self, req: Req) -> None:
        self.kv.unmatch(req)
        if req is self.chunked:
            self.chunked = None
        if req not in self.waiting:
            self.waiting.insert(0, req)

    # -- ending requests ------------------------------------------------------------------
    def _output(self, req: Req, update: Update | None = None) -> ReqOutput:
        return make_output(req, update, self.spec.counts(req) if self.spec else None)

    def _finish(self, req: Req, update: Update | None = None) -> ReqOutput:
        self.kv.release(req)
        output = self._output(req, update)
        if self.spec is not None:
            self.spec.finished(req)
        return output

    def _finish_aborted(self) -> list[ReqOutput]:
        outputs = []
        for req in [r for r in self.live() if r.rid in self._aborted]:
            req.finish_reason = FinishReason.abort(self._aborted.pop(req.rid))
            if req in self.waiting:
                self.waiting.remove(req)
            self.grammars.forget(req)
            if req in self.running:
                self.running.remove(req)
            if req is self.chunked:
                self.chunked = None
            outputs.append(self._finish(req))
        self._aborted.clear()
        return outputs

    @property
    def holding(self) -> list[Req]:
        """The requests that hold running rows: those running, and the one being chunked."""
        return self.running + ([self.chunked] if self.chunked is not None else [])

    def live(self) -> list[Req]:
        """Every request the scheduler holds: waiting (for its grammar, or its turn),
        running, being chunked."""
        live = self.grammars.compiling + self.waiting + self.running
        return live + [self.chunked] if self.chunked is not None else live


def _hidden_rows(req: Req, ends_prompt: bool) -> HiddenRows | None:
    """The rows of a step's tokens whose hidden states `req` wants: an embedding request's
    (scheduler/embedding.py), all of a request's with return_hidden_states, else none."""
    if req.embed is not None:
        return embedding.hidden_rows(req, ends_prompt)
    return "all" if req.return_hidden_states else None


def _all_rows_of(
    hidden: list[HiddenRows | None], counts: list[int], device: torch.device
) -> torch.Tensor:
    """The flat rows of the requests wanting all theirs (`hidden`), each taking `counts[i]`
    rows of the batch in order."""
    rows: list[int] = []
    offset = 0
    for wanted, n in zip(hidden, counts, strict=True):
        if wanted == "all":
            rows.extend(range(offset, offset + n))
        offset += n
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _slot_for(
    req: Req,
    holders_of: dict[int, list[Req]],
    counted_on: set[int],
    victims: list[Req],
    outranks: Callable[[Req, Req], bool],
) -> list[Req] | None:
    """The requests to take back so that `req`'s adapter gets a slot: every holder of an
    adapter in use that no request gone through before it counts on, each of them one that
    may be taken back (`victims`) and that `req` outranks; of such adapters the one with
    the fewest holders. None if there is none."""
    movable = {id(r) for r in victims}
    best: list[Req] | None = None
    for lora_id, holders in holders_of.items():
        if not holders or lora_id in counted_on:
            continue
        if best is not None and len(holders) >= len(best):
            continue
        if all(id(r) in movable and outranks(req, r) for r in holders):
            best = holders
    return best


def _outranks(req: Req, running: Req, by_priority: bool, threshold: int) -> bool:
    """`req` may take `running`'s row: it is not deferred and `running` is (the flex tier),
    or, under the priority policy and in the same tier, its priority is higher by more
    than the threshold."""
    if req.deferred != running.deferred:
        return running.deferred
    return by_priority and req.priority - running.priority > threshold


def _least_lost(req: Req) -> tuple[bool, int, int]:
    """The order in which running requests give up their KV: deferred ones first, then
    those with fewest outputs, then the longest prompts (the most of their KV is cached)."""
    return (not req.deferred, len(req.output_ids), -len(req.input_ids))


def _pending(req: Req) -> int:
    """Tokens of the request not yet in the KV pool (1, or more after a jump-forward)."""
    return len(req.input_ids) + len(req.output_ids) - req.kv_len
