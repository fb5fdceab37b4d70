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
requests == pool size; with the hierarchical cache, the tree also recounts its host tier.

With hybrid sliding-window memory (cache/swa_pool.py) the allocator also gives every slot
a window slot. Window K/V no request can see any more stays as cache until the window pool
runs short; then `_reclaim_windows` drops it: first the running requests' own positions
before their last W, then the tree's, least recently used node first and each node from
its first position on (its tail window, what a later match ends on, goes last), never a
live request's last W positions. `match` truncates a cached prefix to the last point whose
preceding W positions still have window K/V (the tree splits there). `ensure_free` makes
room in both pools, so a shortage of either takes the same path (wait, evict, retract).
Accounting adds: free window slots + slots mapped to one == window pool size, and every
live request holds window K/V for its last min(L, W) positions.

With the hierarchical cache (`tiers`), `match` first puts what a disk prefetch read into
the host tier, then loads the host-only continuation of the match back onto the device, so
the request finds it like any cached prefix; `release` writes the sequence's new full
pages to the disk tier. Cached tokens are told apart by where they came from.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

import torch

from radixserve.cache import KVPool, ReqToTokenPool, SlotAllocator
from radixserve.cache.disk_store import DiskStore
from radixserve.cache.hiradix_cache import HiRadixCache
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.radix_cache import MatchResult, RadixCache
from radixserve.cache.storage_tier import PAGE_TOKENS, StorageTier
from radixserve.cache.swa_pool import HybridSlotAllocator, usable_prefix_len
from radixserve.config import HiCacheConfig
from radixserve.core.batch import ForwardBatch, HiddenRows
from radixserve.core.req import Req
from radixserve.scheduler.batch_builder import BatchBuilder

GB = 10**9
DISK_QUEUE_PAGES = 256  # pages waiting for the disk writer at most (more are dropped)
RECLAIM_SHARE = 8  # a window reclaim frees at least 1/8 of the window pool (amortized)
logger = logging.getLogger(__name__)


def build_tiers(
    config: HiCacheConfig,
    allocator: SlotAllocator,
    kv_pool: KVPool,
    page_size: int,
    model_path: str,
) -> tuple[HiRadixCache, StorageTier | None]:
    """The hierarchical cache the flags ask for: the host tier (sized in bytes, by
    --hicache-size or --hicache-ratio x the KV pool) and the disk tier under it."""
    layers, (_, kv_heads, head_dim) = len(kv_pool.k), kv_pool.k[0].shape
    dtype = config.hicache_dtype
    if dtype == "auto":
        dtype = str(kv_pool.k[0].dtype).removeprefix("torch.")
    nbytes = config.hicache_size * GB or config.hicache_ratio * kv_pool.nbytes
    per_token = HostKVPool.bytes_per_token(layers, kv_heads, head_dim, dtype)
    pin = kv_pool.k[0].device.type == "cuda"
    host = HostKVPool(
        max(int(nbytes // per_token), 1), layers, kv_heads, head_dim, dtype, kv_pool.k[0].dtype, pin
    )
    tree = HiRadixCache(allocator, kv_pool, host, page_size, config.hicache_write_policy)
    logger.info(
        "hierarchical cache: host tier of %d tokens (%.2f GB, %s), %s",
        host.size,
        host.nbytes / GB,
        dtype,
        config.hicache_write_policy,
    )
    if not config.hicache_storage_dir:
        return tree, None
    namespace = StorageTier.namespace_of(model_path, dtype, layers, kv_heads, head_dim)
    cap = int(config.hicache_storage_size * GB) or None
    store = DiskStore(
        config.hicache_storage_dir, namespace, PAGE_TOKENS, cap, queue_size=DISK_QUEUE_PAGES
    )
    logger.info(
        "disk tier: %s, %d pages found (%.2f GB)",
        config.hicache_storage_dir,
        store.num_pages,
        store.used_bytes / GB,
    )
    return tree, StorageTier(store, tree, namespace)


class KVManager:
    def __init__(
        self,
        allocator: SlotAllocator | HybridSlotAllocator,
        req_to_token: ReqToTokenPool,
        device: torch.device,
        use_radix_cache: bool = True,
        page_size: int = 1,
        tiers: tuple[HiRadixCache, StorageTier | None] | None = None,
        prefetch_timeout: float = 0.5,
    ) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.builder = BatchBuilder(allocator, req_to_token, device)
        self.tree: RadixCache | None = None
        self.hitree: HiRadixCache | None = None
        self.storage: StorageTier | None = None
        if tiers is not None:
            self.tree = self.hitree = tiers[0]
            self.storage = tiers[1]
        elif use_radix_cache:
            self.tree = RadixCache(allocator, page_size)
        self.prefetch_timeout = prefetch_timeout
        self.cached_by_tier = {"device": 0, "host": 0, "disk": 0}  # prompt tokens, cumulative
        self.swa: HybridSlotAllocator | None = None
        if isinstance(allocator, HybridSlotAllocator):
            assert self.hitree is None, "hybrid window memory does not go with the host tier"
            self.swa = allocator
            allocator.reclaimer = self._reclaim_windows

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
        """Make at least n slots free (and n window slots, with hybrid window memory),
        evicting from the tree if needed."""
        short = n - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        if self.swa is not None and not self.swa.ensure_window(n):
            return False
        return self.allocator.num_free >= n

    def window_room(self) -> int | None:
        """Window slots a batch may surely still take: the window pool less the last
        min(L, W) positions of every request holding a row (at least what reclaim must
        keep; less where requests share positions); None without hybrid window memory."""
        if self.swa is None:
            return None
        window = self.swa.window
        held = sum(min(r.kv_len, window) for r in self.builder.holders.values())
        return self.swa.window_size - held

    def window_hold(self, req: Req, more: int = 0) -> int:
        """Window slots `req` holds for sure once it has `more` tokens past its KV: its last
        min(L, W) positions (0 without hybrid window memory)."""
        return 0 if self.swa is None else min(req.kv_len + more, self.swa.window)

    def _reclaim_windows(self, need: int) -> None:
        """Drop window K/V nobody can see now (see the module docstring): max(`need`,
        1/RECLAIM_SHARE of the pool) window slots, or all it can, so reclaims are rare."""
        assert self.swa is not None
        window, table = self.swa.window, self.req_to_token.table
        holders = list(self.builder.holders.values())
        protected = [table[r.row, max(0, r.kv_len - window) : r.kv_len] for r in holders]
        own_dead = [table[r.row, r.tree_len : max(r.tree_len, r.kv_len - window)] for r in holders]
        nodes = self.tree.nodes_by_access() if self.tree is not None else []
        candidates = own_dead + [n.value for n in nodes if n.value is not None]
        empty = torch.empty(0, dtype=torch.int64, device=self.swa.device)
        self.swa.reclaim(
            max(need, self.swa.window_size // RECLAIM_SHARE),
            torch.cat(protected) if protected else empty,
            candidates,
        )

    # -- a request's prefix ---------------------------------------------------------------
    def queued(self, req: Req) -> None:
        """A request joined the waiting queue: start reading its pages from disk."""
        if self.storage is not None:
            req.prefetch = self.storage.start_prefetch(
                req.all_ids[: req.max_cacheable_prefix], req.extra_key
            )

    def match(self, req: Req) -> None:
        """Take the request's cached prefix from the tree (locked) into its table row."""
        if self.tree is None:
            self.builder.attach_prefix(req, torch.empty(0, dtype=torch.int64))
            return
        tokens = req.all_ids[: req.max_cacheable_prefix]
        match = self.tree.match_prefix(tokens, req.extra_key)
        if self.swa is not None:
            usable = self.usable_match_len(match.slots)
            if usable < match.length:  # window K/V dropped: resume where it is whole
                match = self.tree.match_prefix(tokens[:usable], req.extra_key)
        req.loaded_back = 0
        if self.hitree is not None:
            match = self._load_lower_tiers(req, tokens, match)
        self.tree.lock(match.last_node)
        req.last_node = match.last_node
        self.builder.attach_prefix(req, match.slots.to(self.builder.device))
        if not req.output_ids and not req.retractions:  # (retracted: its first count holds)
            req.cached_tokens = match.length
            if req.cached_lower is not None:  # what this request loaded, within its prefix
                host, disk = req.cached_lower
                disk = min(disk, match.length)
                req.cached_lower = (min(host, match.length - disk), disk)

    def usable_match_len(self, slots: torch.Tensor) -> int:
        """How much of a cached prefix (its full slots) a request can resume after: up to
        the last page-aligned point whose preceding W positions still have window K/V."""
        assert self.swa is not None
        if not slots.numel():
            return 0
        has = self.swa.has_window(slots.to(self.swa.device))
        page = self.tree.page_size if self.tree is not None else 1
        return usable_prefix_len(has, self.swa.window, page)

    def _load_lower_tiers(self, req: Req, tokens: list[int], match: MatchResult) -> MatchResult:
        """Put what the request's disk prefetch read in the host tier, then load the host
        continuation of its match back onto the device; the match as it then stands.
        Tokens loaded are counted by the tier they came from across admission attempts
        (a request not admitted this round finds them on the device the next)."""
        assert self.hitree is not None and self.tree is not None
        host, disk = req.cached_lower or (0, 0)
        taken = self._take_prefetch(req, tokens)
        req.disk_pending += taken
        if taken:
            match = self.tree.match_prefix(tokens, req.extra_key)
        if match.host_length and self.hitree.load_back(match):
            device = match.length
            match = self.tree.match_prefix(tokens, req.extra_key)
            req.loaded_back = match.length - device
            from_disk = min(req.disk_pending, req.loaded_back)
            req.disk_pending -= from_disk
            host, disk = host + req.loaded_back - from_disk, disk + from_disk
        if not req.output_ids:  # a retracted request's reload is not its prompt's cache hit
            req.cached_lower = (host, disk)
        self.hitree.record_hit(match.last_node)
        return match

    def _take_prefetch(self, req: Req, tokens: list[int]) -> int:
        """What the request's disk prefetch read, put in the host tier (0 if nothing)."""
        prefetch, req.prefetch = req.prefetch, None
        if prefetch is None or self.storage is None:
            return 0
        return self.storage.finish_prefetch(prefetch, tokens, req.extra_key, self.prefetch_timeout)

    def count_cached(self, req: Req) -> None:
        """An admitted request's cached prompt tokens, by tier (cumulative figures)."""
        host, disk = req.cached_lower or (0, 0)
        by_tier = self.cached_by_tier
        by_tier["host"] += host
        by_tier["disk"] += disk
        by_tier["device"] += req.cached_tokens - host - disk

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
            duplicates = own[req.tree_len : inserted.prefix_len].clone()
            if self.swa is not None:  # the tree's copies may have lost their window K/V
                tree_copies = inserted.slots[req.tree_len : inserted.prefix_len]
                self.swa.adopt_window(tree_copies.to(duplicates.device), duplicates)
            self.allocator.free(duplicates)
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
        if self.storage is not None and req.tree_len:
            slots = self.req_to_token.slots(req.row, 0, req.tree_len)
            self.storage.write(req.all_ids[: req.tree_len], slots, req.extra_key)
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
        hidden_rows: Sequence[HiddenRows | None] | None = None,
    ) -> ForwardBatch:
        """Slots for `new_tokens[i]` after each request's KV; logits for the last new token
        of each request, or for all of them where `all_logits` says so; hidden states
        instead where `hidden_rows` says so (embedding requests)."""
        batch = self.builder.extend(reqs, new_tokens, all_logits, hidden_rows)
        return self._with_loads(batch)

    def decode_batch(self, reqs: Sequence[Req]) -> ForwardBatch:
        return self._with_loads(self.builder.decode(reqs))

    def verify_batch(
        self, reqs: Sequence[Req], drafts: Sequence[Sequence[int]]
    ) -> tuple[ForwardBatch, list[int]]:
        """A decode step with drafted tokens (see BatchBuilder.verify)."""
        batch, first_rows = self.builder.verify(reqs, drafts)
        return self._with_loads(batch), first_rows

    def _with_loads(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch waits, layer by layer, for the load backs still in flight."""
        if self.hitree is not None:
            batch.kv_loads = self.hitree.take_loads()
        return batch

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
    def close(self) -> None:
        """Let the disk tier's queued writes land (shutdown)."""
        if self.storage is not None:
            self.storage.close()

    def flush(self) -> None:
        """Empty the cache (only with no live request: the caller checks)."""
        if self.tree is not None:
            self.tree.evict_all()
            self.tree.reset()
        if self.hitree is not None:
            self.hitree.host_allocator.clear()
        self.allocator.clear()

    def used_slots(self) -> int:
        """Slots neither free nor evictable: held by requests or locked in the tree by them
        (SGLang's token usage)."""
        evictable = self.tree.evictable_size if self.tree is not None else 0
        return self.allocator.size - self.allocator.num_free - evictable

    def usage(self, live: Iterable[Req]) -> dict[str, int]:
        """Where every slot is: free, in the tree (evictable / locked), or held only by a
        live request; and the window pool's size and free slots (hybrid window memory)."""
        tree = self.tree
        return {
            "kv_total": self.allocator.size,
            "kv_free": self.allocator.num_free,
            "kv_tree_evictable": tree.evictable_size if tree is not None else 0,
            "kv_tree_protected": tree.protected_size if tree is not None else 0,
            "kv_held_by_requests": sum(r.kv_len - r.tree_len for r in live if r.row is not None),
            "swa_total": self.swa.window_size if self.swa is not None else 0,
            "swa_free": self.swa.window_free if self.swa is not None else 0,
        }

    def tier_usage(self) -> dict[str, float]:
        """The hierarchical cache's figures (empty without it): tier sizes and use, what
        moved between tiers, cached prompt tokens by tier (all cumulative but the sizes)."""
        tree = self.hitree
        if tree is None:
            return {}
        out: dict[str, float] = {
            f"cached_tokens_{tier}": n for tier, n in self.cached_by_tier.items()
        }
        out |= {
            "host_total": tree.host_pool.size,
            "host_used": tree.host_size,
            "host_bytes": tree.host_pool.nbytes,
            **dataclasses.asdict(tree.tier_stats),
        }
        if self.storage is not None:
            store = self.storage.store
            out |= {
                "disk_used_bytes": store.used_bytes,
                "disk_pages": store.num_pages,
                "disk_page_tokens": self.storage.page_tokens,
                "prefetched_tokens": self.storage.prefetched_tokens,
                "prefetch_timeouts": self.storage.prefetch_timeouts,
                "disk_errors": self.storage.errors,
                **{f"disk_{k}": v for k, v in store.stats.as_dict().items()},
            }
        return out

    def check(self, live: Iterable[Req]) -> None:
        """free + tree + held only by live requests == pool size (a leak is a bug)."""
        if self.hitree is not None:
            self.hitree.check()
        s = self.usage(live)
        in_tree = s["kv_tree_evictable"] + s["kv_tree_protected"]
        assert s["kv_free"] + in_tree + s["kv_held_by_requests"] == s["kv_total"], (
            f"KV accounting broken: free {s['kv_free']} + tree {in_tree} + "
            f"requests {s['kv_held_by_requests']} != {s['kv_total']}"
        )
        if self.swa is not None:
            self._check_windows(live)

    def _check_windows(self, live: Iterable[Req]) -> None:
        """free window slots + slots mapped to one == window pool size; every live request
        holds window K/V for its last min(L, W) positions."""
        swa = self.swa
        assert swa is not None
        assert swa.window_free + swa.window_mapped == swa.window_size, (
            f"window KV accounting broken: free {swa.window_free} + mapped "
            f"{swa.window_mapped} != {swa.window_size}"
        )
        assert int(swa.full_to_swa[0]) == 0, "the padding slot holds window K/V"
        for req in live:
            if req.row is None:
                continue
            last = self.req_to_token.slots(req.row, max(0, req.kv_len - swa.window), req.kv_len)
            assert bool(swa.has_window(last).all()), (
                f"request {req.rid} lost window K/V of its last {swa.window} positions"
            )
