"""The one owner of KV memory as the scheduler sees it: the slot allocator, the
request→token table (through `BatchBuilder`) and the radix tree.

A request's tokens, `all_ids = input_ids + output_ids`, fall in three regions:

    | tree (locked, shared)  | own (computed, not yet in the tree) | new (this step) ...
    0                  tree_len                                kv_len

`match` fills the tree region from the cache, a forward appends to the own region, `cache`
moves what is computed into the tree (re-locking the request on it), and `release` hands
everything to the tree (or frees it) and gives back the table row. The scheduler asks
yes/no questions (`ensure_free`, `has_free_row`) and never touches a slot tensor.

Accounting (`check`): free slots + slots held by the tree + slots held only by live
requests == pool size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from radixserve.cache import ReqToTokenPool, SlotAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.core.batch import ForwardBatch
from radixserve.core.req import Req
from radixserve.scheduler.batch_builder import BatchBuilder


class KVManager:
    def __init__(
        self,
        allocator: SlotAllocator,
        req_to_token: ReqToTokenPool,
        device: torch.device,
        use_radix_cache: bool = True,
        page_size: int = 1,
    ) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.builder = BatchBuilder(allocator, req_to_token, device)
        self.tree = RadixCache(allocator, page_size) if use_radix_cache else None

    # -- questions ------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Slots a new request could get: free now, or evictable from the tree."""
        evictable = self.tree.evictable_size if self.tree is not None else 0
        return self.allocator.num_free + evictable

    @property
    def has_free_row(self) -> bool:
        return self.req_to_token.num_free > 0

    def peek_prefix_len(self, tokens: Sequence[int], req: Req) -> int:
        """How many leading `tokens` the tree holds for `req`'s namespace (read-only)."""
        if self.tree is None:
            return 0
        return self.tree.peek_prefix(tokens, req.extra_key).length

    def ensure_free(self, n: int) -> bool:
        """Make at least n slots free, evicting from the tree if needed."""
        short = n - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.allocator.num_free >= n

    # -- a request's prefix ---------------------------------------------------------------
    def match(self, req: Req) -> None:
        """Take the request's cached prefix from the tree (locked) into its table row."""
        if self.tree is None:
            self.builder.attach_prefix(req, torch.empty(0, dtype=torch.int64))
            return
        match = self.tree.match_prefix(req.all_ids[: req.max_cacheable_prefix], req.extra_key)
        self.tree.lock(match.last_node)
        req.last_node = match.last_node
        self.builder.attach_prefix(req, match.slots.to(self.builder.device))
        if not req.output_ids:
            req.cached_tokens = match.length

    def unmatch(self, req: Req) -> None:
        """Undo `match` for a request that was not admitted after all."""
        self._unlock(req)
        self.builder.release(req)

    def cache(self, req: Req) -> None:
        """Insert the tokens computed so far into the tree and re-lock the request on them,
        so requests admitted later share them (the request keeps running)."""
        if self.tree is None or req.row is None:
            return
        n = req.kv_len
        own = self.req_to_token.slots(req.row, 0, n)
        inserted = self.tree.insert(req.all_ids[:n], own, req.extra_key)
        if inserted.prefix_len > req.tree_len:  # another request cached some first: use its
            self.allocator.free(own[req.tree_len : inserted.prefix_len].clone())
        self.req_to_token.write(req.row, 0, inserted.slots.to(own.device))
        self.tree.lock(inserted.last_node)
        self._unlock(req)
        req.last_node, req.tree_len = inserted.last_node, inserted.length

    def release(self, req: Req) -> None:
        """The request is done with its KV (finished, aborted or retracted): hand it to the
        tree (or free it) and give back its row."""
        if req.row is None:
            return
        self.cache(req)
        self._unlock(req)
        self.builder.release(req)

    def _unlock(self, req: Req) -> None:
        if self.tree is not None and req.last_node is not None:
            self.tree.unlock(req.last_node)
            req.last_node = None

    # -- batches --------------------------------------------------------------------------
    def extend_batch(
        self,
        reqs: Sequence[Req],
        new_tokens: Sequence[Sequence[int]],
        all_logits: Sequence[bool] | None = None,
    ) -> ForwardBatch:
        """Slots for `new_tokens[i]` after each request's KV; logits for the last new token
        of each request, or for all of them where `all_logits` says so."""
        return self.builder.extend(reqs, new_tokens, all_logits)

    def decode_batch(self, reqs: Sequence[Req]) -> ForwardBatch:
        return self.builder.decode(reqs)

    def verify_batch(
        self, reqs: Sequence[Req], drafts: Sequence[Sequence[int]]
    ) -> tuple[ForwardBatch, list[int]]:
        """A decode step with drafted tokens (see BatchBuilder.verify)."""
        return self.builder.verify(reqs, drafts)

    def keep_verified(self, req: Req, draft: Sequence[int]) -> None:
        """After a step that ran the request's pending token and then `draft`: keep the KV
        of the drafted tokens its sequence now agrees with, release the rest (the rejected
        ones), so only committed tokens ever reach the tree. A running request keeps its
        last token pending, as a decode step needs."""
        start = req.kv_len - len(draft)  # where the draft's KV begins
        tokens = req.all_ids
        valid = 0
        while (
            valid < len(draft)
            and start + valid < len(tokens)
            and tokens[start + valid] == draft[valid]
        ):
            valid += 1
        limit = len(tokens) if req.finished else len(tokens) - 1
        self.builder.truncate(req, max(min(start + valid, limit), req.tree_len))

    # -- the whole pool -------------------------------------------------------------------
    def flush(self) -> None:
        """Empty the cache (only with no live request: the caller checks)."""
        if self.tree is not None:
            self.tree.evict_all()
            self.tree.reset()
        self.allocator.clear()

    def usage(self, live: Iterable[Req]) -> dict[str, int]:
        """Where every slot is: free, in the tree (evictable / locked), or held only by a
        live request."""
        tree = self.tree
        return {
            "kv_total": self.allocator.size,
            "kv_free": self.allocator.num_free,
            "kv_tree_evictable": tree.evictable_size if tree is not None else 0,
            "kv_tree_protected": tree.protected_size if tree is not None else 0,
            "kv_held_by_requests": sum(r.kv_len - r.tree_len for r in live if r.row is not None),
        }

    def check(self, live: Iterable[Req]) -> None:
        """free + tree + held only by live requests == pool size (a leak is a bug)."""
        s = self.usage(live)
        in_tree = s["kv_tree_evictable"] + s["kv_tree_protected"]
        assert s["kv_free"] + in_tree + s["kv_held_by_requests"] == s["kv_total"], (
            f"KV accounting broken: free {s['kv_free']} + tree {in_tree} + "
            f"requests {s['kv_held_by_requests']} != {s['kv_total']}"
        )
