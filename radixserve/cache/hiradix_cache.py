"""The hierarchical radix cache: eviction demotes a node to the host tier instead of
dropping it, and a later match loads it back.

A node's tokens have KV on the device pool (`value`), in the host tier (`host_value`), or
both; never neither. The device-resident nodes form a prefix-closed set (a device node's
parent is a device node), so a match is a device-resident prefix followed by a host-only
continuation, and loading that continuation back extends the device prefix.

Contract, on top of `RadixCache`'s:
- `match_prefix` returns the device-resident prefix (slots, `last_node`, as the plain tree
  does) and the host-only continuation (`host_length`, `host_last_node`).
- `load_back(match)` gives that continuation fresh device slots and copies its KV in, all
  or nothing; a continuation shorter than `load_back_threshold` is left to be recomputed.
  On CUDA the copies run on a side stream; `take_loads()` hands their handles to the next
  forward, whose attention waits for each layer's rows just before reading them.
- `evict(n)` frees device slots from least-recently-used unlocked nodes with no device
  child: a node with a host copy keeps living there; one without is copied first under the
  write-back policy (dropped under the others, or when the host tier is full).
- The host tier is freed least-recently-used first, host-only leaves only; a host copy
  being loaded back (`host_ref`) is never freed.
- Write policies: `write_back` copies at eviction; `write_through` copies every new node
  at insert; `write_through_selective` copies a node once `hit_count` admissions matched it.
- Accounting, per tier: the device counters (`evictable_size`, `protected_size`) count
  device-resident tokens only; `host_size` counts tokens with a host copy, and with the
  host allocator's free slots it sums to the host pool. `check()` recomputes all of it.
- `insert_host(tokens, start, block)` adds a host-only continuation for tokens[start:]
  (the disk tier's pages on their way up).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

from radixserve.cache.allocator import SlotAllocator
from radixserve.cache.host_pool import HostKVPool, LoadHandle
from radixserve.cache.kv_block import KVBlock
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.radix_cache import MatchResult, RadixCache, TreeNode

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
LOAD_BACK_THRESHOLD = 16  # host tokens worth a copy instead of a recompute
SELECTIVE_HITS = 2  # admissions that make a node hot (write_through_selective)


@dataclass
class TierStats:
    """What moved between the tiers (cumulative)."""

    load_back_tokens: int = 0
    load_back_bytes: int = 0
    load_back_seconds: float = 0.0
    write_back_tokens: int = 0
    write_back_bytes: int = 0
    write_back_seconds: float = 0.0
    host_evicted_tokens: int = 0
    dropped_tokens: int = 0  # device tokens evicted with no copy anywhere

    def moved(self, kind: str, tokens: int, nbytes: int, since: float) -> None:
        """Count a copy of `kind` (load_back, write_back) that began at `since`."""
        setattr(self, f"{kind}_tokens", getattr(self, f"{kind}_tokens") + tokens)
        setattr(self, f"{kind}_bytes", getattr(self, f"{kind}_bytes") + nbytes)
        seconds = getattr(self, f"{kind}_seconds") + time.perf_counter() - since
        setattr(self, f"{kind}_seconds", seconds)


class HiRadixCache(RadixCache):
    def __init__(
        self,
        allocator: SlotAllocator,
        device_pool: KVPool,
        host_pool: HostKVPool,
        page_size: int = 1,
        write_policy: str = "write_through_selective",
        load_back_threshold: int = LOAD_BACK_THRESHOLD,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"hicache write policy must be one of {', '.join(WRITE_POLICIES)}, "
                f"got {write_policy!r}"
            )
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.write_policy = write_policy
        self.load_back_threshold = load_back_threshold
        self.tier_stats = TierStats()
        self.pending_loads: list[LoadHandle] = []  # load backs the next forward waits for
        super().__init__(allocator, page_size)

    def reset(self) -> None:
        super().reset()
        self.host_size = 0

    @property
    def host_allocator(self) -> SlotAllocator:
        return self.host_pool.allocator

    # -- lookup ---------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        node = self._root(extra_key)
        now = next(self._clock)
        node.last_access = now
        parts: list[torch.Tensor] = []
        host_length, deepest = 0, None
        for child, n in self._edges(node, self._aligned(tokens)):
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if child.value is not None:  # prefix-closed: only before any host-only node
                parts.append(child.value)
                node = child
            else:
                host_length += len(child.key)
                deepest = child
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return MatchResult(slots, node, host_length, deepest)

    def record_hit(self, node: TreeNode) -> None:
        """An admission matched the path up to `node`: count it, and copy nodes that just
        became hot to the host tier (write_through_selective)."""
        while node.parent is not None:
            node.hit_count += 1
            if (
                self.write_policy == "write_through_selective"
                and node.hit_count >= SELECTIVE_HITS
                and node.host_value is None
                and node.value is not None
            ):
                self._backup(node)
            node = node.parent

    def load_back(self, match: MatchResult) -> int:
        """Bring the host-only continuation of `match` onto the device; returns the tokens
        loaded (0 when it is short, or the device pool cannot take it all)."""
        if match.host_last_node is None or match.host_length < self.load_back_threshold:
            return 0
        path: list[TreeNode] = []
        node = match.host_last_node
        while node is not match.last_node:
            assert node.parent is not None and node.value is None
            path.append(node)
            node = node.parent
        path.reverse()
        for node in path:  # neither the copies nor the device prefix may go meanwhile
            node.host_ref += 1
        self.lock(match.last_node)
        try:
            short = match.host_length - self.allocator.num_free
            if short > 0:
                self.evict(short)
            slots = self.allocator.alloc(match.host_length)
        finally:
            self.unlock(match.last_node)
            for node in path:
                node.host_ref -= 1
        if slots is None:
            return 0
        start = time.perf_counter()
        moved, offset = 0, 0
        for node in path:
            n = len(node.key)
            node.value = slots[offset : offset + n]
            load = self.host_pool.load_async(node.host_value, self.device_pool, node.value)
            self.pending_loads.append(load)
            moved += load.nbytes
            offset += n
            self.evictable_size += n
        self.tier_stats.moved("load_back", offset, moved, start)
        return offset

    def take_loads(self) -> list[LoadHandle]:
        """The load backs still in flight, for the next forward to wait on layer by layer
        (on CUDA; on CPU they are done and waiting is free)."""
        loads, self.pending_loads = self.pending_loads, []
        return loads

    # -- update ---------------------------------------------------------------------------
    def _on_new_node(self, node: TreeNode) -> None:
        if self.write_policy == "write_through":
            self._backup(node)

    def insert_host(
        self, tokens: Sequence[int], start: int, block: KVBlock, extra_key: Hashable = None
    ) -> int:
        """Cache tokens[start:] (their KV in `block`, storage format) as a host-only
        continuation of tokens[:start], where the tree already holds at least tokens[:start];
        returns the tokens added (0 when the host tier cannot take them)."""
        aligned = self._aligned(tokens)
        node = self._root(extra_key)
        pos = 0
        for child, n in self._edges(node, aligned):
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        if pos < start or pos >= len(aligned):
            return 0
        count = len(aligned) - pos
        node.host_ref += 1  # a host-only parent must not be freed to make room
        try:
            host_slots = self._alloc_host(count)
        finally:
            node.host_ref -= 1
        if host_slots is None:
            return 0
        self.host_pool.store(host_slots, block.slice(pos - start, len(aligned) - start))
        child = TreeNode(
            aligned[pos:], None, node, last_access=next(self._clock), host_value=host_slots
        )
        node.children[self._child_key(child.key)] = child
        self.host_size += count
        if self.events is not None:  # a data-parallel dispatcher's mirror holds it too
            self.events.inserted(extra_key, aligned)
        return count

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots (see the module contract)."""
        freed = 0
        for node in self._lru(self._device_evictable):
            if freed >= num_tokens:
                break
            n = len(node.key)
            if node.host_value is None and (
                self.write_policy == "write_through_selective" or not self._backup(node)
            ):
                self.tier_stats.dropped_tokens += self._drop(node)
            else:
                self.allocator.free(node.value)
                node.value = None
                self.evictable_size -= n
            freed += n
        return freed

    def evict_all(self) -> int:
        """Drop every unlocked node from both tiers (flush); locked paths stay."""
        freed = self.evictable_size
        for root in self.roots.values():
            for child in list(root.children.values()):
                self._drop_unlocked(child)
        return freed

    # -- helpers --------------------------------------------------------------------------
    def _device_evictable(self, node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.value is not None
            and node.lock_ref == 0
            and all(c.value is None for c in node.children.values())
        )

    def _backup(self, node: TreeNode) -> bool:
        """Copy a device node's KV to the host tier; False when the host tier is full."""
        assert node.value is not None and node.host_value is None
        n = len(node.key)
        node.host_ref += 1
        try:
            host_slots = self._alloc_host(n)
        finally:
            node.host_ref -= 1
        if host_slots is None:
            return False
        start = time.perf_counter()
        moved = self.host_pool.backup(self.device_pool, node.value, host_slots)
        node.host_value = host_slots
        self.host_size += n
        self.tier_stats.moved("write_back", n, moved, start)
        return True

    def _alloc_host(self, n: int) -> torch.Tensor | None:
        short = n - self.host_allocator.num_free
        if short > 0:
            self._evict_host(short)
        return self.host_allocator.alloc(n)

    def _evict_host(self, num_tokens: int) -> int:
        """Free host slots of least-recently-used host-only leaves (the node goes)."""
        freed = 0
        for node in self._lru(self._host_evictable):
            if freed >= num_tokens:
                break
            freed += len(node.key)
            self.tier_stats.host_evicted_tokens += self._drop(node)
        return freed

    def _lru(self, evictable: Callable[[TreeNode], bool]) -> Iterator[TreeNode]:
        """The nodes `evictable` accepts, least recently used first; a parent is offered
        once its last child has gone (after the caller's loop body ran)."""
        heap = [n for n in self._nodes() if evictable(n)]
        heapq.heapify(heap)
        while heap:
            node = heapq.heappop(heap)
            if not evictable(node):  # changed since it was pushed
                continue
            yield node
            parent = node.parent
            if parent is not None and evictable(parent):
                heapq.heappush(heap, parent)

    def _host_evictable(self, node: TreeNode) -> bool:
        return (
            node.parent is not None and node.value is None and node.host_ref == 0 and node.is_leaf
        )

    def _drop(self, node: TreeNode) -> int:
        """Remove an unlocked node and its (host-only) subtree from the tree, freeing the
        slots of every tier it holds; returns the tokens removed."""
        if self.events is not None:  # a data-parallel dispatcher's mirror forgets it too
            self._record_eviction(node)
        stack, removed = [node], 0
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            removed += len(n.key)
            assert n.lock_ref == 0 and n.host_ref == 0, "dropping a node in use"
            if n.value is not None:
                self.allocator.free(n.value)
                self.evictable_size -= len(n.key)
            if n.host_value is not None:
                self.host_allocator.free(n.host_value)
                self.host_size -= len(n.key)
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key)]
        return removed

    def _drop_unlocked(self, node: TreeNode) -> None:
        if node.lock_ref == 0:
            self._drop(node)
            return
        for child in list(node.children.values()):
            self._drop_unlocked(child)
        if node.host_value is not None:  # a locked node keeps its device KV only
            self.host_allocator.free(node.host_value)
            self.host_size -= len(node.key)
            node.host_value = None

    # -- accounting -----------------------------------------------------------------------
    def check(self) -> None:
        """Recount every tier from the nodes and compare with the counters (a test aid)."""
        evictable = protected = host = 0
        for node in self._nodes():
            n = len(node.key)
            assert node.value is not None or node.host_value is not None, "a node in no tier"
            if node.value is not None:
                assert node.parent is not None
                assert node.parent.parent is None or node.parent.value is not None, (
                    "a device node under a host-only node"
                )
                if node.lock_ref:
                    protected += n
                else:
                    evictable += n
            else:
                assert node.lock_ref == 0, "a locked host-only node"
            if node.host_value is not None:
                host += n
        assert (evictable, protected) == (self.evictable_size, self.protected_size), (
            f"device counters {self.evictable_size}/{self.protected_size}, "
            f"nodes {evictable}/{protected}"
        )
        assert host == self.host_size, f"host counter {self.host_size}, nodes {host}"
        assert self.host_allocator.num_free + host == self.host_pool.size, (
            f"host accounting broken: free {self.host_allocator.num_free} + tree {host} "
            f"!= {self.host_pool.size}"
        )
