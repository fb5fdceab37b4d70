"""The radix tree against a simple reference model: the set of cached sequences.

Random interleavings of insert / match / lock / unlock / evict keep match results, sizes and
the accounting invariant exact; eviction never touches a locked path; pages stay aligned.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import SlotAllocator
from radixserve.cache.radix_cache import RadixCache

POOL = 400

# Prefixes of a few related sequences plus a random tail: matches end inside edges often.
BASES = [(0, 1, 2, 3, 4, 5, 6, 7), (0, 1, 2, 3, 9, 9), (0, 1, 8), (5, 5, 5, 5, 5, 5)]
sequences = st.builds(
    lambda base, cut, tail: list(BASES[base][:cut]) + tail,
    st.integers(0, len(BASES) - 1),
    st.integers(0, 8),
    st.lists(st.integers(0, 3), max_size=4),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), sequences, st.sampled_from([None, "salt"])),
        st.tuples(st.just("match_lock"), sequences, st.sampled_from([None, "salt"])),
        st.tuples(st.just("unlock"), st.integers(0, 50), st.none()),
        st.tuples(st.just("evict"), st.integers(0, 30), st.none()),
    ),
    min_size=10,
    max_size=60,
)


class Reference:
    """What the tree should hold: every cached prefix (page-aligned) → its slots."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.cached: dict[tuple, tuple[int, ...]] = {}

    def aligned(self, seq):
        return tuple(seq[: len(seq) - len(seq) % self.page])

    def match(self, key, seq) -> tuple[int, ...]:
        seq = self.aligned(seq)
        for n in range(len(seq), 0, -self.page):
            if (key, seq[:n]) in self.cached:
                return self.cached[(key, seq[:n])]
        return ()


def tree_contents(cache: RadixCache) -> dict[tuple, tuple[int, ...]]:
    """Every cached prefix (at page boundaries) → its slots, read from the tree."""
    out = {}
    for key, root in cache.roots.items():
        stack = [(child, (), ()) for child in root.children.values()]
        while stack:
            node, toks, slots = stack.pop()
            toks, slots = toks + node.key, slots + tuple(node.value.tolist())
            for n in range(
                len(toks) - len(node.key) + cache.page_size, len(toks) + 1, cache.page_size
            ):
                out[(key, toks[:n])] = slots[:n]
            stack.extend((c, toks, slots) for c in node.children.values())
    return out


@settings(max_examples=300, deadline=None)
@given(operations, st.sampled_from([1, 2, 4]))
def test_radix_tree_matches_reference_model(ops, page):
    alloc = SlotAllocator(POOL)
    cache = RadixCache(alloc, page_size=page)
    ref = Reference(page)
    locks = []  # (node, key, prefix) locked by "requests"
    for op, arg, key in ops:
        if op == "insert":
            seq = arg
            slots = alloc.alloc(len(seq))
            inserted = cache.insert(seq, slots, extra_key=key)
            already = inserted.prefix_len
            assert already == len(ref.match(key, seq)), "insert reported the wrong cached length"
            aligned = ref.aligned(seq)
            for n in range(page, len(aligned) + 1, page):
                if (key, aligned[:n]) not in ref.cached:
                    head = ref.cached.get((key, aligned[: n - page]), ())
                    ref.cached[(key, aligned[:n])] = head + tuple(slots[n - page : n].tolist())
            # the result names the tree's slots for the whole prefix and the node to lock
            assert tuple(inserted.slots.tolist()) == ref.match(key, seq)
            assert cache.match_prefix(seq, extra_key=key).last_node is inserted.last_node
            alloc.free(slots[:already])  # duplicates are the caller's to free
            alloc.free(slots[len(aligned) :])  # the unaligned tail is never cached
        elif op == "match_lock":
            peek = cache.peek_prefix(arg, extra_key=key)
            result = cache.match_prefix(arg, extra_key=key)
            expected = ref.match(key, arg)
            assert peek.length == result.length, "peek and match disagree on the length"
            assert tuple(result.slots.tolist()) == expected
            assert result.length % page == 0
            cache.lock(result.last_node)
            locks.append((result.last_node, key, ref.aligned(arg)[: result.length]))
        elif op == "unlock" and locks:
            node, _, _ = locks.pop(arg % len(locks))
            cache.unlock(node)
        elif op == "evict":
            before = tree_contents(cache)
            freed = cache.evict(arg)
            after = tree_contents(cache)
            assert freed >= arg or cache.evictable_size == 0
            assert len(before) - len(after) == freed // page
            assert all(before.get(k) == v for k, v in after.items()), "eviction changed slots"
            for _, key_, prefix in locks:  # locked paths are untouched
                for n in range(page, len(prefix) + 1, page):
                    assert (key_, prefix[:n]) in after
            ref.cached = dict(after)
        contents = tree_contents(cache)
        assert contents == ref.cached
        assert cache.total_size == len(contents) * page
        assert alloc.num_free + cache.total_size == POOL, "a slot leaked"
        locked_tokens = {(k, p[:n]) for _, k, p in locks for n in range(page, len(p) + 1, page)}
        assert cache.protected_size == len(locked_tokens) * page
    for node, _, _ in locks:
        cache.unlock(node)
    cache.evict_all()
    assert alloc.num_free == POOL and cache.total_size == 0


def test_split_keeps_slots_and_last_node_covers_the_match():
    alloc = SlotAllocator(32)
    cache = RadixCache(alloc)
    slots = alloc.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], slots).prefix_len == 0
    peek = cache.peek_prefix([1, 2, 3, 9])
    assert peek.length == 3 and len(peek.node.key) == 6, "a peek splits nothing"
    match = cache.match_prefix([1, 2, 3, 9])
    assert match.slots.tolist() == slots[:3].tolist()
    assert match.last_node.key == (1, 2, 3)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).slots.tolist() == slots.tolist()


def test_lru_eviction_order():
    alloc = SlotAllocator(32)
    cache = RadixCache(alloc)
    cache.insert([1, 1], alloc.alloc(2))
    cache.insert([2, 2], alloc.alloc(2))
    cache.match_prefix([1, 1])  # touch: [2, 2] is now least recently used
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).length == 0 and cache.match_prefix([1, 1]).length == 2
    assert torch.is_tensor(cache.match_prefix([]).slots)


def test_a_split_keeps_the_lock_of_the_path_it_cuts():
    alloc = SlotAllocator(32)
    cache = RadixCache(alloc)
    cache.insert([0, 1, 2, 3], alloc.alloc(4))
    deep = cache.match_prefix([0, 1, 2, 3]).last_node
    cache.lock(deep)
    shallow = cache.match_prefix([0, 1]).last_node  # splits the locked edge
    cache.lock(shallow)
    assert cache.protected_size == 4 and cache.evictable_size == 0
    assert cache.evict(4) == 0
    cache.unlock(deep)
    assert cache.protected_size == 2 and cache.evict(4) == 2
    cache.unlock(shallow)
    assert cache.evict(4) == 2 and alloc.num_free == 32
