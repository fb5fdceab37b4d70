"""The scheduler: continuous batching over a radix prefix cache.

Each `step()`: admit waiting requests into a prefill (extend) batch when the KV budget
allows (the last prompt may be a chunk), else run one decode step of the running batch; a
chunked prefill alternates with decode steps so running requests keep streaming. After a
forward: sample, check stop conditions, and hand back one `ReqOutput` per request that
changed. Prompts are inserted into the tree as soon as they are computed (so requests
admitted later share them); finished requests insert everything and unlock.

KV accounting (checked by `check_kv_accounting`): free slots + slots held by the tree +
slots held only by live requests == pool size.

The transport (in-process Engine thread, or the server's scheduler process) only calls
`add_request`, `abort`, `step`, `flush_cache` and reads `has_work`.
"""

from __future__ import annotations

import logging
import random
import re
import time
from typing import Any

import torch

from radixserve.cache.radix_cache import RadixCache
from radixserve.config import SchedulerConfig
from radixserve.constrained import Grammars
from radixserve.constrained.grammars import MaskJob
from radixserve.core.output import FinishReason, LogprobEntry, ReqOutput
from radixserve.core.req import Req
from radixserve.model.runner import ModelRunner
from radixserve.model.sampler import SampleOutput, Sampler, SamplingBatch
from radixserve.scheduler.batch_builder import BatchBuilder
from radixserve.scheduler.policy import order_waiting

logger = logging.getLogger(__name__)

IN_BATCH_PREFIX_MIN = 32  # shared uncached tokens that make a request wait one round
NEW_TOKEN_RESERVE_CAP = 4096  # at most this many future tokens reserved per request
RATIO_DECAY = 0.001  # per decode step


class Scheduler:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig, page_size: int = 1) -> None:
        self.runner = runner
        self.config = config
        self.tokenizer = runner.tokenizer
        self.builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
        self.tree = None if config.disable_radix_cache else RadixCache(runner.allocator, page_size)
        self.page_size = page_size
        self.sampler = Sampler()
        self.grammars = Grammars(
            runner.tokenizer,
            runner.vocab_size,
            config.grammar_backend,
            jump_forward=not config.disable_jump_forward,
        )
        self.eos_ids = runner.eos_token_ids
        self.max_running = runner.max_running_requests
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the request whose prompt is being prefilled in chunks
        self.new_token_ratio = config.init_new_token_ratio
        self.rng = random.Random(0)
        self._aborted: dict[str, str] = {}
        self._last_was_prefill = False
        self.last_step: str | None = None  # "prefill", "decode" or None (nothing ran)
        self.stats = {
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "generated_tokens": 0,
            "retractions": 0,
            "prefill_batches": 0,
            "decode_steps": 0,
            "mixed_steps": 0,  # prefill chunks that carried the running requests' decode step
            # where decode time goes: the forward pass vs the whole step (batch building,
            # sampling, stop checks, grammar, outputs)
            "decode_step_seconds": 0.0,
            "decode_forward_seconds": 0.0,
        }

    # -- the transport's interface --------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request; raises ValueError if it can never run on this engine."""
        vocab = self.runner.vocab_size
        bad = [t for t in req.input_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"input_ids must be token ids in [0, {vocab}), got {bad[:5]}")
        req.params.verify_vocab(vocab)
        need = len(req.input_ids) + req.params.max_new_tokens
        if need > self.runner.context_len:
            raise ValueError(
                f"prompt ({len(req.input_ids)} tokens) + max_new_tokens "
                f"({req.params.max_new_tokens}) = {need} exceeds the context length "
                f"{self.runner.context_len}"
            )
        if need > self.runner.max_total_tokens:
            raise ValueError(
                f"the request needs {need} KV tokens but the KV pool holds only "
                f"{self.runner.max_total_tokens}"
            )
        self.grammars.attach(req)  # an invalid constraint raises GrammarError (a ValueError)
        self.waiting.append(req)

    def abort(self, rid: str | None = None, message: str = "aborted") -> None:
        """Abort one request by rid, or all (rid None); takes effect at the next step."""
        for req in self._live():
            if rid is None or req.rid == rid:
                self._aborted[req.rid] = message

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def step(self) -> list[ReqOutput]:
        """One forward pass: a prefill (extend) batch of admitted requests, or a decode step
        of the running ones, or with mixed chunks both in one batch."""
        start = time.perf_counter()
        outputs = self._finish_aborted()
        mixed = self.config.enable_mixed_chunk and bool(self.running)
        if mixed:
            self._make_room_for_decode()
            mixed = bool(self.running)
        prefill = None
        if mixed or not (self._last_was_prefill and self.running):
            decode_tokens = sum(map(self._pending, self.running)) if mixed else 0
            prefill = self._schedule_prefill(decode_tokens)
        self.last_step = None
        if prefill:
            outputs += self._run_prefill(*prefill, decoding=self.running if mixed else [])
            self.last_step = "mixed" if mixed else "prefill"
        elif self.running:
            outputs += self._run_decode()
            self.last_step = "decode"
            self.stats["decode_step_seconds"] += time.perf_counter() - start
        self._last_was_prefill = self.last_step == "prefill"
        return outputs

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests are live."""
        if self.has_work:
            return False
        if self.tree is not None:
            self.tree.evict_all()
            self.tree.reset()
        self.runner.allocator.clear()
        return True

    def state(self) -> dict[str, Any]:
        """Counters, constrained-decoding figures and KV accounting, for reports."""
        grammar = {f"grammar_{k}": v for k, v in self.grammars.stats.as_dict().items()}
        return {**self.stats, **grammar, **self.kv_state()}

    def kv_state(self) -> dict[str, int]:
        """Where every KV slot is, and how many requests run and wait."""
        tree = self.tree
        return {
            "kv_total": self.runner.allocator.size,
            "kv_free": self.runner.allocator.num_free,
            "kv_tree_evictable": tree.evictable_size if tree is not None else 0,
            "kv_tree_protected": tree.protected_size if tree is not None else 0,
            "kv_held_by_requests": sum(
                r.kv_len - r.tree_len for r in self._live() if r.row is not None
            ),
            "num_running": len(self.running) + (self.chunked is not None),
            "num_waiting": len(self.waiting),
        }

    def check_kv_accounting(self) -> None:
        """free + tree + held only by live requests == pool size (a leak is a bug)."""
        s = self.kv_state()
        in_tree = s["kv_tree_evictable"] + s["kv_tree_protected"]
        assert s["kv_free"] + in_tree + s["kv_held_by_requests"] == s["kv_total"], (
            f"KV accounting broken: free {s['kv_free']} + tree {in_tree} + "
            f"requests {s['kv_held_by_requests']} != {s['kv_total']}"
        )

    # -- admission ------------------------------------------------------------------------
    def _schedule_prefill(self, decode_tokens: int = 0) -> tuple[list[Req], list[list[int]]] | None:
        """Requests to extend now and the tokens each extends by (the last may be a chunk).

        Each admitted request is charged its uncached tokens plus a reserve for its future
        output against free + evictable KV (minus what running requests reserve). In a
        mixed step the running requests' `decode_tokens` ride in the same batch: they count
        against the chunk's token budget and keep their free slots.
        """
        if not self.waiting and self.chunked is None:
            return None
        chunk = self.config.chunk_size
        token_budget = min(self.config.max_prefill_tokens, chunk or self.config.max_prefill_tokens)
        token_budget = max(token_budget - decode_tokens, 1)
        kv_budget = self._available_kv() - self._running_reserve()
        reqs: list[Req] = []
        extends: list[list[int]] = []

        def admit(req: Req, reserve: int) -> None:
            nonlocal token_budget, kv_budget
            piece = self._take(req, token_budget, chunk)
            reqs.append(req)
            extends.append(piece)
            token_budget -= len(piece)
            kv_budget -= len(piece) + reserve

        if self.chunked is not None:  # a chunked prompt continues before anything new
            req, self.chunked = self.chunked, None
            admit(req, self._reserve(req))
        for req in order_waiting(self.config.schedule_policy, self.waiting, self.tree, self.rng):
            if self.chunked is not None or token_budget <= 0:
                break
            if len(self.running) + len(reqs) >= self.max_running:
                break
            if self._shares_uncached_prefix(req, [r.all_ids for r in reqs]):
                continue  # it will reuse that prefix next round
            if self.runner.req_to_token.num_free == 0:
                break
            self._match(req)
            remaining = len(req.all_ids) - req.kv_len
            reserve = self._reserve(req)
            alone = not reqs and not self.running
            too_big = remaining > token_budget and chunk is None
            if not alone and (remaining + reserve > kv_budget or too_big):
                self._unmatch(req)
                break
            needed = decode_tokens + sum(map(len, extends)) + min(remaining, token_budget)
            if not self._ensure_free(needed):
                self._unmatch(req)
                break
            self.waiting.remove(req)
            admit(req, reserve)
        if not reqs:
            return None
        if not self._ensure_free(decode_tokens + sum(map(len, extends))):  # a continued chunk
            for req in reqs:
                self._requeue(req)
            return None
        return reqs, extends

    def _take(self, req: Req, budget: int, chunk: int | None) -> list[int]:
        """The tokens `req` extends by now; marks it chunked if its prompt does not fit."""
        rest = req.all_ids[req.kv_len :]
        if chunk is not None and len(rest) > budget:
            size = max(budget - budget % self.page_size, 1)
            self.chunked = req
            return rest[:size]
        return rest

    def _shares_uncached_prefix(self, req: Req, admitted: list[list[int]]) -> bool:
        """True if a request admitted this round will compute a prefix `req` could reuse."""
        if self.tree is None or not admitted:
            return False
        cached = self.tree.match_prefix(req.all_ids, req.extra_key).length
        ids = req.all_ids
        for other in admitted:
            n = 0
            for a, b in zip(ids, other):
                if a != b:
                    break
                n += 1
            if n - cached >= IN_BATCH_PREFIX_MIN:
                return True
        return False

    def _match(self, req: Req) -> None:
        """Take the request's cached prefix from the tree (locked) into its table row."""
        if self.tree is None:
            self.builder.attach_prefix(req, torch.empty(0, dtype=torch.int64))
            return
        match = self.tree.match_prefix(req.all_ids[: req.max_cacheable_prefix], req.extra_key)
        self.tree.lock(match.last_node)
        req.last_node = match.last_node
        self.builder.attach_prefix(req, match.slots.to(self.runner.device))
        if not req.output_ids:
            req.cached_tokens = match.length

    def _unmatch(self, req: Req) -> None:
        """Undo `_match` for a request that was not admitted after all."""
        if self.tree is not None and req.last_node is not None:
            self.tree.unlock(req.last_node)
            req.last_node = None
        self.builder.release(req)

    def _requeue(self, req: Req) -> None:
        self._unmatch(req)
        if req is self.chunked:
            self.chunked = None
        if req not in self.waiting:
            self.waiting.insert(0, req)

    def _reserve(self, req: Req) -> int:
        left = req.params.max_new_tokens - len(req.output_ids)
        return int(min(left, NEW_TOKEN_RESERVE_CAP) * self.new_token_ratio)

    def _running_reserve(self) -> int:
        return sum(self._reserve(r) for r in self.running)

    def _available_kv(self) -> int:
        evictable = self.tree.evictable_size if self.tree is not None else 0
        return self.runner.allocator.num_free + evictable

    def _ensure_free(self, n: int) -> bool:
        """Make at least n slots free, evicting from the tree if needed."""
        short = n - self.runner.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.runner.allocator.num_free >= n

    # -- running batches ------------------------------------------------------------------
    def _run_prefill(
        self, reqs: list[Req], extends: list[list[int]], decoding: list[Req] | None = None
    ) -> list[ReqOutput]:
        """Extend `reqs` by `extends`; with `decoding` (a mixed step) the running requests
        take their decode step in the same batch, after the prefill rows."""
        decoding = decoding or []
        self.stats["prefill_batches"] += 1
        if decoding:
            self.stats["mixed_steps"] += 1
            self.stats["decode_steps"] += 1
        want_all = [self._wants_prompt_logits(r) for r in reqs]
        starts = [r.kv_len for r in reqs]
        to_sample = [r for r in reqs if r is not self.chunked and r.params.max_new_tokens > 0]
        masks = self.grammars.start_masks(decoding + to_sample)  # computed during the forward
        batch = self.builder.extend(
            reqs + decoding,
            extends + [r.all_ids[r.kv_len :] for r in decoding],
            all_logits=want_all + [False] * len(decoding),
        )
        logits = self.runner.forward(batch).logits
        done: list[Req] = []
        done_rows: list[int] = []
        row = 0
        for req, ext, full, start in zip(reqs, extends, want_all, starts):
            n = len(ext) if full else 1
            if full:
                self._record_input_logprobs(req, logits[row : row + n], start)
            if req is not self.chunked:
                done.append(req)
                done_rows.append(row + n - 1)
            row += n
            if req.row is not None:
                self._cache_computed(req)
        decode_rows = list(range(row, row + len(decoding)))
        for req in reqs:
            if req is not self.chunked and not req.output_ids:
                self.stats["prompt_tokens"] += len(req.input_ids)
                self.stats["cached_tokens"] += req.cached_tokens
        outputs = []
        prefill_only = [r for r in done if r.params.max_new_tokens == 0]
        for req in prefill_only:
            req.finish_reason = FinishReason.of_length(0)
            outputs.append(self._finish(req))
        sample = [(r, i) for r, i in zip(done, done_rows) if r.params.max_new_tokens > 0]
        sample_reqs = [r for r, _ in sample]
        assert sample_reqs == to_sample
        if sample or decoding:
            rows = torch.tensor(decode_rows + [i for _, i in sample], device=logits.device)
            outputs += self._sample_and_update(decoding + sample_reqs, logits[rows], masks)
        stepped = {id(r) for r in decoding}  # the running requests this batch decoded
        kept = [r for r in self.running if id(r) not in stepped]
        self.running = kept + [r for r in decoding + sample_reqs if not r.finished]
        if decoding:
            self._decay_reserve_ratio()
        return outputs

    def _run_decode(self) -> list[ReqOutput]:
        """One token per running request; a request that jump-forward extended runs all its
        forced tokens in the same pass (the batch is then an extend batch)."""
        self._make_room_for_decode()
        if not self.running:
            return []
        self.stats["decode_steps"] += 1
        reqs = self.running
        masks = self.grammars.start_masks(reqs)  # computed while the forward runs
        if all(self._pending(r) == 1 for r in reqs):
            batch = self.builder.decode(reqs)
        else:
            batch = self.builder.extend(reqs, [r.all_ids[r.kv_len :] for r in reqs])
        start = time.perf_counter()
        logits = self.runner.forward(batch).logits
        self.stats["decode_forward_seconds"] += time.perf_counter() - start
        outputs = self._sample_and_update(reqs, logits, masks)
        self.running = [r for r in reqs if not r.finished]
        self._decay_reserve_ratio()
        return outputs

    def _decay_reserve_ratio(self) -> None:
        """After a decode step that needed no retraction, reserve a little less KV."""
        self.new_token_ratio = max(
            self.config.min_new_token_ratio, self.new_token_ratio - RATIO_DECAY
        )

    @staticmethod
    def _pending(req: Req) -> int:
        """Tokens of the request not yet in the KV pool (1, or more after a jump-forward)."""
        return len(req.input_ids) + len(req.output_ids) - req.kv_len

    def _make_room_for_decode(self) -> None:
        """A slot per pending token: evict from the tree, then retract requests."""
        while self.running and not self._ensure_free(sum(map(self._pending, self.running))):
            # retract the request that loses least: fewest outputs, then longest prompt
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            self.running.remove(victim)
            self._retract(victim)

    def _retract(self, req: Req) -> None:
        """Back to the waiting queue with its generated tokens; its KV goes to the tree
        (evictable) so a later admission can reuse whatever survives."""
        self.stats["retractions"] += 1
        req.retractions += 1
        self._release(req)
        self.waiting.insert(0, req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        logger.info("retracted %s after %d output tokens", req.rid, len(req.output_ids))

    # -- after a forward ------------------------------------------------------------------
    def _sample_and_update(
        self, reqs: list[Req], logits: torch.Tensor, masks: MaskJob
    ) -> list[ReqOutput]:
        want_lp = any(r.return_logprob for r in reqs)
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        batch = self._sampling_batch(reqs)
        batch.allowed = masks.result()
        out = self.sampler(logits, batch, want_lp, top_n)
        outputs = []
        for i, (req, token) in enumerate(zip(reqs, out.next_ids.tolist())):
            new = self._accept(req, token)
            req.output_ids += new
            self.stats["generated_tokens"] += len(new)
            new_lp, new_top = self._record_output_logprobs(req, out, i) if new else ([], [])
            if new:
                self._check_finished(req, len(new))
            if req.finished:
                outputs.append(self._finish(req, new, new_lp, new_top))
            else:
                outputs.append(self._output(req, new, new_lp, new_top))
        return outputs

    def _accept(self, req: Req, token: int) -> list[int]:
        """The tokens a sampled token becomes: itself, or with jump-forward the forced text
        after it; [] (and the request aborted) if its grammar refuses the token."""
        if req.grammar is None:
            return [token]
        room = min(
            req.params.max_new_tokens - len(req.output_ids),
            self.runner.context_len - len(req.input_ids) - len(req.output_ids),
        )
        new = self.grammars.accept(req, token, room)
        if new is None:  # only when every allowed token was banned (e.g. by logit_bias)
            req.finish_reason = FinishReason.abort("no token the grammar allows")
            return []
        return new

    def _sampling_batch(self, reqs: list[Req]) -> SamplingBatch:
        return SamplingBatch.for_requests(
            reqs, self.eos_ids, self.runner.vocab_size, self.runner.device
        )

    def _check_finished(self, req: Req, num_new: int = 1) -> None:
        """Grammar complete, else eos / stop token / stop string / stop regex (once past
        min_new_tokens, and for a grammar only where its document is complete), else length."""
        p = req.params
        n = len(req.output_ids)
        grammar = req.grammar
        if grammar is not None and grammar.is_finished:
            token = req.output_ids[-1]
            matched = token if token in req.stop_ids(self.eos_ids) else None
            req.finish_reason = FinishReason.stop(matched)
            return
        if grammar is None:
            stopped = n >= p.min_new_tokens and self._hit_stop(req, num_new)
        else:
            stopped = n >= p.min_new_tokens and grammar.is_accepting and self._grammar_stop(req)
        if not stopped and (n >= p.max_new_tokens or len(req.all_ids) >= self.runner.context_len):
            req.finish_reason = FinishReason.of_length(n)

    def _hit_stop(self, req: Req, num_new: int) -> bool:
        """Sets the finish reason if the num_new latest tokens end in a stop token, or bring
        a stop string or a stop regex match."""
        p = req.params
        token = req.output_ids[-1]
        if token in req.stop_ids(self.eos_ids):
            req.finish_reason = FinishReason.stop(token)
            return True
        if p.stop:  # a character is at most 4 byte-level tokens: this tail must hold it
            longest = max(len(s.encode()) for s in p.stop)
            tail = self.tokenizer.decode(
                req.output_ids[-(longest + num_new) :], skip_special_tokens=p.skip_special_tokens
            )
            for stop in p.stop:
                if stop in tail:
                    req.finish_reason = FinishReason.stop(stop)
                    return True
        if p.stop_regex:  # a match may span any length: search the whole output
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
            for pattern in p.stop_regex:
                match = re.search(pattern, text)
                if match and match.group(0):
                    req.finish_reason = FinishReason.stop(match.group(0))
                    return True
        return False

    def _grammar_stop(self, req: Req) -> bool:
        """`_hit_stop` for a constrained request: a stop token, string or regex ends it only
        where the text before it is a complete document. (Stop strings are trimmed at their
        first occurrence, so that occurrence is the one that must follow a document.)"""
        p = req.params
        skip = p.skip_special_tokens
        if req.output_ids[-1] in req.stop_ids(self.eos_ids):
            before = self.tokenizer.decode(req.output_ids[:-1], skip_special_tokens=skip)
            matched: str | int = req.output_ids[-1]
            at = len(before)
            text = before
        else:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=skip)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            for pattern in p.stop_regex:
                match = re.search(pattern, text)
                if match and match.group(0):
                    hits.append((match.start(), match.group(0)))
            if not hits:
                return False
            at, matched = min(hits)
        if not self.grammars.completes(req, text[:at]):
            return False
        req.finish_reason = FinishReason.stop(matched)
        return True

    def _wants_prompt_logits(self, req: Req) -> bool:
        return req.wants_input_logprobs and not req.input_logprobs

    def _record_input_logprobs(self, req: Req, logits: torch.Tensor, start: int) -> None:
        """Logprobs of prompt tokens start+1..start+len(logits) (each from the logits of the
        position before it); the first prompt token has none."""
        ids = req.input_ids
        lp_all = torch.log_softmax(logits.float(), dim=-1)
        if start == 0 and not req.input_logprobs and req.logprob_start_len == 0:
            req.input_logprobs.append((None, ids[0]))
            req.input_top_logprobs.append([])
        targets = [p + 1 for p in range(start, start + len(logits))]
        keep = [(i, t) for i, t in enumerate(targets) if req.logprob_start_len <= t < len(ids)]
        if not keep:
            return
        rows = torch.tensor([i for i, _ in keep])
        tokens = torch.tensor([ids[t] for _, t in keep])
        chosen = lp_all[rows, tokens].tolist()
        req.input_logprobs += [(lp, ids[t]) for lp, (_, t) in zip(chosen, keep)]
        if req.top_logprobs_num:
            top_lp, top_ids = lp_all[rows].topk(req.top_logprobs_num, dim=-1)
            req.input_top_logprobs += [
                list(zip(lps, tids)) for lps, tids in zip(top_lp.tolist(), top_ids.tolist())
            ]

    def _record_output_logprobs(self, req: Req, out: SampleOutput, i: int):
        if not req.return_logprob or out.logprobs is None:
            return [], []
        entry = (float(out.logprobs[i]), req.output_ids[-1])
        req.output_logprobs.append(entry)
        top: list[list[LogprobEntry]] = []
        if req.top_logprobs_num and out.top_logprobs is not None and out.top_ids is not None:
            k = req.top_logprobs_num
            top = [list(zip(out.top_logprobs[i, :k].tolist(), out.top_ids[i, :k].tolist()))]
            req.output_top_logprobs += top
        return [entry], top

    # -- ending requests ------------------------------------------------------------------
    def _cache_computed(self, req: Req) -> None:
        """Insert the tokens computed so far into the tree and re-lock the request on them,
        so requests admitted later share them (the request keeps running)."""
        if self.tree is None:
            return
        n = req.kv_len
        tokens = req.all_ids[:n]
        slots = self.runner.req_to_token.slots(req.row, 0, n)
        already = self.tree.insert(tokens, slots, req.extra_key)
        if already > req.tree_len:  # another request cached some of these first: use its
            self.runner.allocator.free(slots[req.tree_len : already].clone())
        match = self.tree.match_prefix(tokens, req.extra_key)
        self.runner.req_to_token.write(req.row, 0, match.slots.to(slots.device))
        self.tree.lock(match.last_node)
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        req.last_node, req.tree_len = match.last_node, match.length

    def _release(self, req: Req) -> None:
        """Hand the request's KV to the tree (or free it) and give back its row."""
        if req.row is not None:
            self._cache_computed(req)
            if self.tree is not None and req.last_node is not None:
                self.tree.unlock(req.last_node)
                req.last_node = None
            self.builder.release(req)

    def _finish(self, req: Req, new_ids=None, new_lp=None, new_top=None) -> ReqOutput:
        self._release(req)
        return self._output(req, new_ids or [], new_lp or [], new_top or [])

    def _finish_aborted(self) -> list[ReqOutput]:
        outputs = []
        for req in [r for r in self._live() if r.rid in self._aborted]:
            message = self._aborted.pop(req.rid)
            req.finish_reason = FinishReason.abort(message)
            if req in self.waiting:
                self.waiting.remove(req)
            if req in self.running:
                self.running.remove(req)
            if req is self.chunked:
                self.chunked = None
            outputs.append(self._finish(req))
        self._aborted.clear()
        return outputs

    def _output(self, req: Req, new_ids, new_lp, new_top) -> ReqOutput:
        first = len(req.output_ids) <= len(new_ids) or req.finished
        return ReqOutput(
            rid=req.rid,
            new_ids=list(new_ids),
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.input_ids),
            cached_tokens=req.cached_tokens,
            completion_tokens=len(req.output_ids),
            new_logprobs=list(new_lp),
            new_top_logprobs=list(new_top),
            input_logprobs=list(req.input_logprobs) if first and req.return_logprob else None,
            input_top_logprobs=(
                list(req.input_top_logprobs) if first and req.return_logprob else None
            ),
        )

    def _live(self) -> list[Req]:
        live = self.waiting + self.running
        return live + [self.chunked] if self.chunked is not None else live
