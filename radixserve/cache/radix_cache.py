"""RadixAttention's prefix cache: a radix tree over token sequences whose nodes hold the KV
slots of their tokens.

Contract (what callers may rely on):
- `match_prefix(tokens)` returns the longest cached prefix, page-aligned: its slots (a
  tensor, safe to use while the returned node is locked) and the last node of the match. A
  match ending inside an edge splits that node so the node returned covers it exactly. The
  access time of every node on the path is refreshed.
- `peek_prefix(tokens)` is the read-only form of `match_prefix` for policies that only want
  a length and a node to group by: it splits nothing and touches no access time.
- `insert(tokens, slots)` caches a page-aligned prefix of `tokens` with their slots and
  returns an `InsertResult`: how many leading tokens were already cached (the caller owns,
  and must free, its own slots for those: the tree keeps its copies), the tree's slots for
  the whole inserted prefix, and the node it ends at (to lock), so nobody re-walks the tree.
- `lock(node)` / `unlock(node)` add / remove a reference on every node from `node` up to the
  root. A locked node is never evicted.
- `evict(n)` frees at least `n` tokens (or all it can) from least-recently-used unlocked
  leaves, cascading to parents that become unlocked leaves.
- `evictable_size + protected_size` is the number of slots the tree holds; with the
  allocator's free slots and the slots held only by running requests they sum to the pool.
- `extra_key` namespaces the tree (e.g. a cache salt or adapter id): sequences under
  different keys never share.
Nothing here imports the model, the scheduler or the server.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from radixserve.cache.allocator import SlotAllocator


@dataclass(eq=False)
class TreeNode:
    key: tuple[int, ...] = ()  # the edge's tokens
    # device slots of the edge's tokens; None once the node lives only in a lower tier
    value: torch.Tensor | None = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    # The hierarchical cache's fields (hiradix_cache.py); the plain tree leaves them alone.
    host_value: torch.Tensor | None = None  # host-tier slots of the edge's tokens, if copied
    hit_count: int = 0  # admissions that matched this node (write-through-selective)
    host_ref: int = 0  # > 0: the host copy is in use (a load back), not to be evicted

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


INSERTED = -1  # a CacheEventLog entry's `keep` for a sequence now cached


@dataclass
class CacheEventLog:
    """What the tree inserted and evicted since the last `take`, in order, for a
    data-parallel dispatcher that mirrors the tree's token paths (`server/dispatcher.py`),
    each under the `extra_key` of its namespace: (key, a sequence now cached, INSERTED), or
    (key, the path from the root to an evicted node's end, how many of its tokens stay).
    The order matters: a step may evict a path and cache it again."""

    entries: list[tuple[Hashable, list[int], int]] = field(default_factory=list)

    def inserted(self, extra_key: Hashable, tokens: Sequence[int]) -> None:
        self.entries.append((extra_key, list(tokens), INSERTED))

    def evicted(self, extra_key: Hashable, path: list[int], keep: int) -> None:
        """A node evicted (with whatever lay below it): the evictions just before it of
        nodes below it say nothing more (a chain evicted leaf first goes as one entry)."""
        while self.entries:
            key, last, last_keep = self.entries[-1]
            below = last_keep >= 0 and key == extra_key and len(last) > len(path)
            if not below or last[: len(path)] != path:
                break
            self.entries.pop()
        self.entries.append((extra_key, path, keep))

    def take(self) -> list[tuple[Hashable, list[int], int]]:
        out, self.entries = self.entries, []
        return out

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass
class MatchResult:
    slots: torch.Tensor  # (L,) int64, KV slots of the matched prefix
    last_node: TreeNode  # lock this while the slots are in use
    # The hierarchical cache: the match's continuation below `last_node` held only in the
    # host tier (its tokens, and the node it ends at); 0 / None in the plain tree.
    host_length: int = 0
    host_last_node: TreeNode | None = None

    @property
    def length(self) -> int:
        return int(self.slots.numel())


@dataclass
class InsertResult:
    prefix_len: int  # leading tokens that were cached before this insert
    slots: torch.Tensor  # (L,) int64, the tree's slots for every inserted token
    last_node: TreeNode  # the node the inserted prefix ends at

    @property
    def length(self) -> int:
        return int(self.slots.numel())


@dataclass
class PeekResult:
    length: int  # cached tokens (page-aligned)
    node: TreeNode  # the deepest node the match reaches (it may end inside its edge)


class RadixCache:
    def __init__(self, allocator: SlotAllocator, page_size: int = 1) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self._clock = itertools.count(1)
        self.events: CacheEventLog | None = None  # set to record inserts and evictions
        self.reset()

    def reset(self) -> None:
        """Drop every node (the caller frees the slots first with `evict` or a pool reset)."""
        self.roots: dict[Hashable, TreeNode] = {}
        self.evictable_size = 0
        self.protected_size = 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # -- lookup ---------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        node = self._root(extra_key)
        now = next(self._clock)
        node.last_access = now
        parts: list[torch.Tensor] = []
        for child, n in self._edges(node, self._aligned(tokens)):
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.value)
            node = child
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return MatchResult(slots, node)

    def peek_prefix(self, tokens: Sequence[int], extra_key: Hashable = None) -> PeekResult:
        """The cached length of `tokens` and the deepest node reached; splits no node and
        touches no access time."""
        node = self._root(extra_key)
        length = 0
        for child, n in self._edges(node, self._aligned(tokens)):
            node, length = child, length + n
        return PeekResult(length, node)

    def _edges(self, node: TreeNode, tokens: tuple[int, ...]):
        """The edges `tokens` follows down from `node`, as (child, tokens of its edge
        matched); only the last may be matched in part (the caller may split it)."""
        pos = 0
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens[pos:]))
            if child is None:
                return
            n = self._common_len(child.key, tokens[pos:])
            partial = n < len(child.key)  # decided before the caller splits the edge
            yield child, n
            if partial:
                return
            node, pos = child, pos + n

    def _aligned(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[: len(tokens) - len(tokens) % self.page_size])

    # -- update ---------------------------------------------------------------------------
    def insert(
        self, tokens: Sequence[int], slots: torch.Tensor, extra_key: Hashable = None
    ) -> InsertResult:
        """Cache the page-aligned prefix of `tokens` (see the module contract)."""
        aligned = len(tokens) - len(tokens) % self.page_size
        tokens, slots = tuple(tokens[:aligned]), slots[:aligned]
        node = self._root(extra_key)
        now = next(self._clock)
        parts: list[torch.Tensor] = []
        pos = 0
        prefix_len = None
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens[pos:]))
            if child is None:
                prefix_len = pos if prefix_len is None else prefix_len
                child = TreeNode(tokens[pos:], slots[pos:].clone(), node, last_access=now)
                node.children[self._child_key(child.key)] = child
                self.evictable_size += len(child.key)
                self._on_new_node(child)
                parts.append(child.value)
                node, pos = child, len(tokens)
                break
            n = self._common_len(child.key, tokens[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if child.value is None:  # only in a lower tier: the caller's slots take its place
                prefix_len = pos if prefix_len is None else prefix_len
                child.value = slots[pos : pos + n].clone()
                self.evictable_size += n
            parts.append(child.value)
            node, pos = child, pos + n
        tree_slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        if self.events is not None and prefix_len is not None:
            self.events.inserted(extra_key, tokens)
        return InsertResult(pos if prefix_len is None else prefix_len, tree_slots, node)

    def _on_new_node(self, node: TreeNode) -> None:
        """Called by `insert` for each node it creates (the hierarchical cache's
        write-through); nothing here."""

    def lock(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without a matching lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from LRU unlocked leaves; returns slots freed."""
        heap = [n for n in self._nodes() if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            if self.events is not None:
                self._record_eviction(leaf)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key)]
            if parent.parent is not None and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _record_eviction(self, leaf: TreeNode) -> None:
        keys = []
        node = leaf
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        path = [t for key in reversed(keys) for t in key]
        extra_key = next(k for k, root in self.roots.items() if root is node)
        assert self.events is not None
        self.events.evicted(extra_key, path, len(path) - len(leaf.key))

    def evict_all(self) -> int:
        """Free every unlocked node (used by flush); locked paths stay."""
        return self.evict(self.evictable_size)

    def nodes_by_access(self) -> list[TreeNode]:
        """Every node but the roots, least recently used first."""
        return sorted(self._nodes(), key=lambda n: n.last_access)

    # -- helpers --------------------------------------------------------------------------
    def _root(self, extra_key: Hashable) -> TreeNode:
        root = self.roots.get(extra_key)
        if root is None:
            root = self.roots[extra_key] = TreeNode(lock_ref=1)
        return root

    def _child_key(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[: self.page_size])

    def _common_len(self, a: Sequence[int], b: Sequence[int]) -> int:
        """Length of the common prefix, rounded down to whole pages."""
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n - n % self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; returns the new upper node (same lock state)."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(
            child.key[:n],
            _head(child.value, n),
            parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
            host_value=_head(child.host_value, n),
            hit_count=child.hit_count,
            host_ref=child.host_ref,
        )
        parent.children[self._child_key(upper.key)] = upper
        child.key, child.parent = child.key[n:], upper
        child.value, child.host_value = _tail(child.value, n), _tail(child.host_value, n)
        upper.children[self._child_key(child.key)] = child
        return upper

    def _nodes(self):
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _head(slots: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if slots is None else slots[:n]


def _tail(slots: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if slots is None else slots[n:]
