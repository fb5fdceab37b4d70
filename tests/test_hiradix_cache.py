"""The hierarchical radix tree against a reference model, for every write policy.

Random interleavings of insert / match (+ load back) / lock / unlock / evict / host
insert keep: every tier's accounting exact (the tree recounts itself), the device set
prefix-closed, the KV of every node where its slots say (each token's K is a value made
from its prefix, checked in the device pool and in the host tier after every operation),
locked paths on the device, and nothing lost but what the tree says it dropped.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import KVPool, SlotAllocator
from radixserve.cache.hiradix_cache import WRITE_POLICIES, HiRadixCache
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.kv_block import KVBlock
from radixserve.cache.radix_cache import CacheEventLog
from radixserve.server.dispatcher import TokenTrie

POOL = 48
BASES = [(0, 1, 2, 3, 4, 5, 6, 7, 8, 9), (0, 1, 2, 3, 9, 9, 9), (0, 1, 8), (5, 5, 5, 5, 5, 5)]
sequences = st.builds(
    lambda base, cut, tail: list(BASES[base][:cut]) + tail,
    st.integers(0, len(BASES) - 1),
    st.integers(0, 10),
    st.lists(st.integers(0, 3), max_size=5),
)
keys = st.sampled_from([None, "salt"])
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), sequences, keys),
        st.tuples(st.just("match_lock"), sequences, keys),
        st.tuples(st.just("match_load"), sequences, keys),
        st.tuples(st.just("unlock"), st.integers(0, 50), st.none()),
        st.tuples(st.just("evict"), st.integers(0, 30), st.none()),
        st.tuples(st.just("insert_host"), sequences, keys),
    ),
    min_size=10,
    max_size=40,
)


def expected_value(key, prefix: tuple[int, ...]) -> float:
    """The K of the last token of `prefix` (exact in float32)."""
    return float(hash((key, prefix)) % (1 << 20))


def make_tree(policy: str, page: int, host_size: int, threshold: int = 1):
    device = KVPool(POOL, 1, 1, 1, torch.float32, "cpu", prefault=False)
    host = HostKVPool(host_size, 1, 1, 1, "float32", torch.float32)
    alloc = SlotAllocator(POOL)
    tree = HiRadixCache(alloc, device, host, page, policy, load_back_threshold=threshold)
    return tree, alloc, device, host


def write_kv(device: KVPool, slots: torch.Tensor, key, seq, start: int = 0) -> None:
    values = torch.tensor(
        [expected_value(key, tuple(seq[: i + 1])) for i in range(start, start + slots.numel())]
    )
    device.k[0][slots, 0, 0] = values
    device.v[0][slots, 0, 0] = -values


def walk(tree: HiRadixCache):
    """(extra_key, tokens up to and including the node, node) for every node."""
    for key, root in tree.roots.items():
        stack = [(child, ()) for child in root.children.values()]
        while stack:
            node, toks = stack.pop()
            toks = toks + node.key
            yield key, toks, node
            stack.extend((c, toks) for c in node.children.values())


def contents(tree: HiRadixCache) -> set[tuple]:
    """Every cached (extra_key, prefix) at page boundaries, whatever its tier."""
    out = set()
    for key, toks, node in walk(tree):
        start = len(toks) - len(node.key)
        for n in range(start + tree.page_size, len(toks) + 1, tree.page_size):
            out.add((key, toks[:n]))
    return out


def check_kv_where_slots_say(tree: HiRadixCache, device: KVPool, host: HostKVPool) -> None:
    for key, toks, node in walk(tree):
        start = len(toks) - len(node.key)
        want = torch.tensor([expected_value(key, toks[: i + 1]) for i in range(start, len(toks))])
        if node.value is not None:
            assert torch.equal(device.k[0][node.value, 0, 0], want), "device KV moved"
            assert torch.equal(device.v[0][node.value, 0, 0], -want)
        if node.host_value is not None:
            block = host.gather(node.host_value)
            assert torch.equal(block.k[0, :, 0, 0], want), "host KV wrong"
            assert torch.equal(block.v[0, :, 0, 0], -want)


def device_len(tree: HiRadixCache, seq, key, any_tier: bool = False) -> int:
    """Cached tokens of seq on the device, or in any tier (read-only walk)."""
    node, length = tree.roots.get(key), 0
    if node is None:
        return 0
    aligned = tuple(seq[: len(seq) - len(seq) % tree.page_size])
    for child, n in tree._edges(node, aligned):
        if child.value is None and not any_tier:
            break
        length += n
    return length


def lost_tokens(tree: HiRadixCache) -> int:
    return tree.tier_stats.dropped_tokens + tree.tier_stats.host_evicted_tokens


@settings(max_examples=300, deadline=None)
@given(
    operations,
    st.sampled_from([1, 2, 4]),
    st.sampled_from(WRITE_POLICIES),
    st.sampled_from([8, 24, 96]),
)
def test_tiered_tree_matches_reference_model(ops, page, policy, host_size):
    tree, alloc, device, host = make_tree(policy, page, host_size)
    tree.events = CacheEventLog()  # as a data-parallel replica's: mirrored by the dispatcher
    mirrors = {None: TokenTrie(), "salt": TokenTrie()}
    locks = []  # (node, key, device prefix) locked by "requests"
    for op, arg, key in ops:
        before, lost_before = contents(tree), lost_tokens(tree)
        aligned = tuple(arg[: len(arg) - len(arg) % page]) if isinstance(arg, list) else ()
        if op == "insert":
            short = len(arg) - alloc.num_free
            if short > 0:
                tree.evict(short)
            slots = alloc.alloc(len(arg))
            if slots is None:
                continue
            before, lost_before = contents(tree), lost_tokens(tree)
            on_device = device_len(tree, arg, key)
            write_kv(device, slots, key, arg)
            inserted = tree.insert(arg, slots, extra_key=key)
            assert inserted.prefix_len == on_device, "insert reported the wrong cached length"
            assert inserted.length == len(aligned)
            assert device_len(tree, arg, key) == len(aligned), "the inserted prefix not on device"
            alloc.free(slots[: inserted.prefix_len])  # duplicates are the caller's to free
            alloc.free(slots[len(aligned) :])
            gained = {(key, aligned[:n]) for n in range(page, len(aligned) + 1, page)}
            after = contents(tree)  # write-through may free host leaves to copy new nodes
            assert gained <= after <= before | gained
        elif op in ("match_lock", "match_load"):
            match = tree.match_prefix(arg, extra_key=key)
            assert match.length == device_len(tree, arg, key)
            cached = sum(
                1 for n in range(page, len(aligned) + 1, page) if (key, aligned[:n]) in before
            )
            assert match.length + match.host_length == cached * page, "a tier missed in match"
            if op == "match_load" and match.host_length:
                loaded = tree.load_back(match)
                assert loaded in (0, match.host_length), "a load back is all or nothing"
                if loaded:
                    again = tree.match_prefix(arg, extra_key=key)
                    assert again.length == match.length + loaded and again.host_length == 0
                    match = again
            tree.record_hit(match.last_node)
            tree.lock(match.last_node)
            locks.append((match.last_node, key, aligned[: match.length]))
        elif op == "unlock" and locks:
            node, _, _ = locks.pop(arg % len(locks))
            tree.unlock(node)
        elif op == "evict":
            freed = tree.evict(arg)
            assert freed >= arg or tree.evictable_size == 0
        elif op == "insert_host" and aligned:
            # the disk tier's pages coming up: KV for tokens[start:] as a block
            start = device_len(tree, arg, key)
            start = max((n for n in range(0, start + 1, page)), default=0)
            count = len(aligned) - start
            if count <= 0:
                continue
            block = KVBlock(
                torch.tensor(
                    [expected_value(key, aligned[: i + 1]) for i in range(start, len(aligned))]
                ).view(1, count, 1, 1),
                -torch.tensor(
                    [expected_value(key, aligned[: i + 1]) for i in range(start, len(aligned))]
                ).view(1, count, 1, 1),
            )
            before, lost_before = contents(tree), lost_tokens(tree)
            added = tree.insert_host(aligned, start, block, extra_key=key)
            after = contents(tree)
            if added:
                assert {(key, aligned[:n]) for n in range(page, len(aligned) + 1, page)} <= after
        # invariants after every operation
        tree.check()
        held = sum(0 for _ in locks)  # requests hold no slots of their own here
        assert alloc.num_free + tree.total_size + held == POOL, "a device slot leaked"
        check_kv_where_slots_say(tree, device, host)
        for _, k, prefix in locks:  # locked paths stay on the device
            assert device_len(tree, prefix, k) == len(prefix)
        for k, path, keep in tree.events.take():  # in order, as the dispatcher reads them
            if keep < 0:
                mirrors[k].insert(path)
            else:
                mirrors[k].truncate(path, keep)
        for k, mirror in mirrors.items():  # the mirror holds what the tree holds, any tier
            for seq in [*BASES, arg if isinstance(arg, list) else []]:
                held = mirror.match(seq) // page * page  # (the tree matches whole pages)
                assert held == device_len(tree, seq, k, any_tier=True), (k, seq)
        after = contents(tree)
        gone = before - after
        assert len(gone) * page <= lost_tokens(tree) - lost_before, "a prefix vanished silently"
        if policy == "write_back" and host_size >= 96:  # room for everything: nothing lost
            assert lost_tokens(tree) == 0 and after >= before
    for node, _, _ in locks:
        tree.unlock(node)
    tree.evict_all()
    tree.check()
    assert alloc.num_free == POOL and host.allocator.num_free == host_size


@pytest.fixture
def small():
    return make_tree("write_back", 1, 32, threshold=4)


def test_eviction_demotes_and_a_match_loads_back(small):
    tree, alloc, device, host = small
    seq = list(range(10))
    slots = alloc.alloc(10)
    write_kv(device, slots, None, seq)
    tree.insert(seq, slots)
    assert tree.evict(10) == 10 and alloc.num_free == POOL
    assert tree.host_size == 10 and tree.evictable_size == 0
    match = tree.match_prefix(seq)
    assert match.length == 0 and match.host_length == 10
    assert tree.load_back(match) == 10
    again = tree.match_prefix(seq)
    assert again.length == 10 and again.host_length == 0
    assert tree.tier_stats.load_back_tokens == 10 and tree.tier_stats.write_back_tokens == 10
    check_kv_where_slots_say(tree, device, host)
    tree.check()


def test_short_continuations_are_recomputed_not_loaded(small):
    tree, alloc, device, _ = small
    slots = alloc.alloc(3)
    write_kv(device, slots, None, [1, 2, 3])
    tree.insert([1, 2, 3], slots)
    tree.evict(3)
    match = tree.match_prefix([1, 2, 3])
    assert match.host_length == 3 and tree.load_back(match) == 0  # threshold 4


def test_load_back_is_all_or_nothing_when_the_device_is_full(small):
    tree, alloc, device, _ = small
    seq = list(range(20))
    slots = alloc.alloc(20)
    write_kv(device, slots, None, seq)
    tree.insert(seq, slots)
    tree.evict(20)
    hog = alloc.alloc(POOL - 10)  # held by a "running request": not evictable
    match = tree.match_prefix(seq)
    assert tree.load_back(match) == 0
    assert tree.match_prefix(seq).host_length == 20, "a failed load back lost the copy"
    alloc.free(hog)
    assert tree.load_back(tree.match_prefix(seq)) == 20
    tree.check()


def test_write_through_copies_at_insert_and_selective_after_hits():
    tree, alloc, device, _ = make_tree("write_through", 1, 32)
    slots = alloc.alloc(4)
    write_kv(device, slots, None, [1, 2, 3, 4])
    tree.insert([1, 2, 3, 4], slots)
    assert tree.host_size == 4
    tree, alloc, device, _ = make_tree("write_through_selective", 1, 32)
    slots = alloc.alloc(4)
    write_kv(device, slots, None, [1, 2, 3, 4])
    tree.insert([1, 2, 3, 4], slots)
    assert tree.host_size == 0
    tree.record_hit(tree.match_prefix([1, 2, 3, 4]).last_node)
    assert tree.host_size == 0
    tree.record_hit(tree.match_prefix([1, 2, 3, 4]).last_node)
    assert tree.host_size == 4, "a node matched twice is hot: copied"
    # an unmatched node is dropped at eviction, not written
    other = alloc.alloc(3)
    write_kv(device, other, None, [7, 7, 7])
    tree.insert([7, 7, 7], other)
    tree.evict(POOL)
    assert tree.peek_prefix([7, 7, 7]).length == 0
    assert tree.peek_prefix([1, 2, 3, 4]).length == 4
    tree.check()


def test_a_full_host_tier_frees_its_least_recently_used_leaves():
    tree, alloc, device, _ = make_tree("write_back", 1, 8)
    for base in (10, 20, 30):
        seq = [base + i for i in range(4)]
        slots = alloc.alloc(4)
        write_kv(device, slots, None, seq)
        tree.insert(seq, slots)
        tree.evict(4)  # demoted: the host tier holds 8 tokens, so the oldest goes
    assert tree.host_size == 8 and tree.tier_stats.host_evicted_tokens == 4
    assert tree.peek_prefix([10, 11, 12, 13]).length == 0
    assert tree.peek_prefix([30, 31, 32, 33]).length == 4
    tree.check()


def test_bad_write_policy_is_refused():
    with pytest.raises(ValueError, match="write_back"):
        make_tree("sometimes", 1, 8)
