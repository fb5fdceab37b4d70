"""The data-parallel dispatcher without processes: its mirror of a replica's radix tree is
exact (checked against a real RadixCache's inserts and evictions), and its policies route
as documented: hits stick, misses spread, load wins when the replicas are unbalanced."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache.allocator import SlotAllocator
from radixserve.cache.radix_cache import CacheEventLog, RadixCache
from radixserve.core.messages import AbortReq, ControlReq, GenerateReq
from radixserve.core.sampling_params import SamplingParams
from radixserve.server.dispatcher import (
    BALANCE_ABS,
    MIN_HIT_TOKENS,
    SHARE_DECAY,
    STARVED_SHARE,
    Dispatcher,
    TokenTrie,
    _common,
)

tokens = st.lists(st.integers(0, 3), min_size=1, max_size=12)


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(a=tokens, b=tokens, shared=st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_length(a, b, shared):
    assert _common(shared + a, shared + b) == lcp(shared + a, shared + b)
    assert _common(tuple(shared + a), shared + b) == lcp(shared + a, shared + b)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), tokens, st.integers(0, 12)), max_size=30),
    queries=st.lists(tokens, min_size=1, max_size=5),
)
def test_the_trie_holds_what_was_inserted_less_what_was_cut(ops, queries):
    """A cut forgets the path's branch below `keep`, or below the deepest place past `keep`
    where another held sequence leaves the path (the tree's pages branch where the trie's
    tokens may not); a path not held whole is left alone."""
    trie, held = TokenTrie(), set()
    for insert, seq, keep in ops:
        seq = tuple(seq)
        if insert:
            trie.insert(seq)
            held.add(seq)
        elif keep < len(seq) and any(s[: len(seq)] == seq for s in held):
            trie.truncate(seq, keep)
            leaves = [
                j
                for j in range(keep, len(seq))
                if any(len(s) > j and s[:j] == seq[:j] and s[j] != seq[j] for s in held)
            ]
            cut = max(leaves, default=keep)
            held = {s[:cut] if s[: cut + 1] == seq[: cut + 1] else s for s in held}
        else:
            trie.truncate(seq, keep)
    for q in queries:
        assert trie.match(q) == max((lcp(s, q) for s in held), default=0)
    assert trie.tokens == len({s[:k] for s in held for k in range(1, len(s) + 1)})


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.booleans(), tokens, st.integers(1, 8), st.sampled_from([None, "a"])),
        max_size=25,
    ),
    queries=st.lists(tokens, min_size=1, max_size=5),
)
def test_the_mirror_of_a_radix_tree_is_exact(steps, queries):
    """Replaying a real tree's CacheEvents gives the tree's own match lengths, in each of
    its namespaces."""
    allocator = SlotAllocator(64)
    tree = RadixCache(allocator)
    tree.events = CacheEventLog()
    mirrors = {None: TokenTrie(), "a": TokenTrie()}
    for insert, seq, n, key in steps:
        if insert:
            need = len(seq)
            if allocator.num_free < need:
                tree.evict(need - allocator.num_free)
            if allocator.num_free < need:
                continue
            slots = allocator.alloc(need)
            result = tree.insert(seq, slots, extra_key=key)
            allocator.free(slots[: result.prefix_len])  # the tree kept its own copies
        else:
            tree.evict(n)
        for key, path, keep in tree.events.take():
            if keep < 0:
                mirrors[key].insert(path)
            else:
                mirrors[key].truncate(path, keep)
    for q in queries:
        for key, mirror in mirrors.items():
            assert mirror.match(q) == tree.peek_prefix(q, key).length


def test_a_chain_evicted_leaf_first_is_one_change():
    """Each eviction of a node makes those of the nodes below it, just before, say nothing
    more: a chain goes as one change, whatever its length."""
    allocator = SlotAllocator(64)
    tree = RadixCache(allocator)
    tree.events = CacheEventLog()
    for seq in (list(range(4)), list(range(8)), list(range(12)), list(range(16)), [0, 1, 9]):
        slots = allocator.alloc(len(seq))
        result = tree.insert(seq, slots)
        allocator.free(slots[: result.prefix_len])
    tree.events.take()
    assert tree.evict(12) == 12  # the chain's three deepest nodes: [12..15], [8..11], [4..7]
    assert tree.events.take() == [(None, list(range(8)), 4)]
    tree.evict(64)  # [2, 3], the sibling [9], then [0, 1] above both
    assert tree.events.take() == [(None, [0, 1], 0)]


class Recorder:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def request(rid: str, ids: list[int]) -> GenerateReq:
    return GenerateReq(rid, ids, SamplingParams(), 0)


def dispatcher(method: str, n: int = 2) -> tuple[Dispatcher, list[Recorder]]:
    recorders = [Recorder() for _ in range(n)]
    return Dispatcher(recorders, method), recorders


PREFIX = list(range(100, 100 + 4 * MIN_HIT_TOKENS))


def test_cache_aware_sends_a_prefix_where_it_is_cached():
    d, recorders = dispatcher("cache_aware")
    d.on_cache_events(1, [(0, PREFIX + [1, 2], -1)])
    for i in range(3):
        d.send(request(f"r{i}", PREFIX + [i]))
        d.done(f"r{i}")
    assert [len(r.sent) for r in recorders] == [0, 3]


def test_a_prefix_being_computed_counts_as_held():
    d, recorders = dispatcher("cache_aware")
    d.send(request("first", PREFIX + [1]))  # a miss: either replica
    owner = 0 if recorders[0].sent else 1
    d.send(request("second", PREFIX + [2]))  # still running: not yet in the tree
    assert len(recorders[owner].sent) == 2


def test_misses_spread_over_the_replicas_at_concurrency_one():
    d, recorders = dispatcher("cache_aware")
    for i in range(6):
        d.send(request(f"r{i}", [i] * 40))  # nothing in common
        d.done(f"r{i}")
    assert [len(r.sent) for r in recorders] == [3, 3]


def test_a_miss_goes_where_there_is_room():
    """A new prefix goes to the replica holding fewer tokens (cached or in flight), even a
    little busier, so prefix groups split over the pools instead of crowding one."""
    d, recorders = dispatcher("cache_aware")
    d.on_cache_events(0, [(0, [7] * 200, -1)])
    d.send(request("a", [1] * 40))
    d.send(request("b", [2] * 40))  # replica 1 is busier now, yet holds 80 tokens to 200
    assert [len(r.sent) for r in recorders] == [0, 2]
    d.send(request("c", [3] * 150))  # 80 to 200: replica 1 still
    d.send(request("d", [4] * 40))  # 230 to 200: replica 0 now
    assert [len(r.sent) for r in recorders] == [1, 3]


def test_a_prefix_shared_by_prompts_in_flight_counts_once_toward_room():
    """Room is what a replica holds plus what its prompts in flight add: six requests of
    one group are one prefix, three groups are three, so the next group goes to the
    replica with one group however busy it is."""
    d, recorders = dispatcher("cache_aware")
    groups = [[g] * 100 for g in range(4)]
    d.send(request("g0", groups[0] + [0]))  # a miss: either replica
    one = 0 if recorders[0].sent else 1
    for i in range(1, BALANCE_ABS):
        d.send(request(f"g0-{i}", groups[0] + [i]))  # hits on the replica computing it
    for g in (1, 2):
        d.send(request(f"g{g}", groups[g] + [0]))  # misses: the other replica has room
    assert len(recorders[one].sent) == BALANCE_ABS and len(recorders[1 - one].sent) == 2
    d.on_cache_events(one, [(0, groups[0] + [0], -1)])  # cached now: still counted once
    d.send(request("g3", groups[3] + [0]))
    assert len(recorders[one].sent) == BALANCE_ABS + 1


def starved_after() -> int:
    """Dispatches in a row to one of two replicas that starve the other (from even shares)."""
    share, n = 0.5, 0
    while share >= STARVED_SHARE / 2:
        share, n = share * (1 - SHARE_DECAY), n + 1
    return n


def test_a_burst_on_one_replica_keeps_its_hits():
    """Replicas unbalanced by a burst shorter than what starves the idle one: hits stick
    (moving a prefix to a replica whose pool is full of others would evict one of them)."""
    d, recorders = dispatcher("cache_aware")
    d.on_cache_events(0, [(0, PREFIX, -1)])
    burst = starved_after()
    assert burst > BALANCE_ABS + 1  # the replicas are unbalanced well before that
    for i in range(burst):
        d.send(request(f"r{i}", PREFIX + [i]))
    assert [len(r.sent) for r in recorders] == [burst, 0]


def test_load_wins_over_hits_when_a_replica_is_starved():
    """A hot prefix starves the other replica: once the idle one's share of recent dispatches
    falls that far, its requests go there, which then holds the prefix and shares the load
    (no death spiral on the replica that holds it first). The load dropping between the
    busy replica's batches (as its requests finish together) does not reset that."""
    d, recorders = dispatcher("cache_aware")
    d.on_cache_events(0, [(0, PREFIX, -1)])
    busy = starved_after()
    for i in range(busy):  # the busy replica's batch finishes twice on the way
        d.send(request(f"r{i}", PREFIX + [i]))
        if i in (1, busy - BALANCE_ABS - 2):
            for j in range(i + 1):
                d.done(f"r{j}")
    assert [len(r.sent) for r in recorders] == [busy, 0]
    d.send(request("spill", PREFIX + [busy]))
    assert [len(r.sent) for r in recorders] == [busy, 1]
    for i in range(4):
        d.send(request(f"s{i}", PREFIX + [busy + 1 + i]))  # held by both: the less loaded
    assert len(recorders[1].sent) == 5


def test_an_eviction_report_ends_the_stickiness():
    d, recorders = dispatcher("cache_aware")
    d.on_cache_events(1, [(0, PREFIX, -1)])
    d.on_cache_events(1, [(0, PREFIX, 0)])
    assert d.replicas[1].match(PREFIX, 0) == 0
    # in order: a path evicted and cached again within one step is held
    d.on_cache_events(1, [(0, PREFIX, -1), (0, PREFIX, 4), (0, PREFIX, -1)])
    assert d.replicas[1].match(PREFIX, 0) == len(PREFIX)


def test_a_prefix_is_a_hit_only_in_its_own_namespace():
    """A prefix cached (or being computed) under one LoRA adapter is no hit for another
    adapter's request nor the base model's; unloading the adapter drops its mirror."""
    d, recorders = dispatcher("cache_aware")
    d.on_cache_events(1, [(7, PREFIX, -1)])
    assert d.pick(PREFIX + [1], lora_id=7) == (1, len(PREFIX))
    assert d.pick(PREFIX + [1], lora_id=0)[1] == 0
    assert d.pick(PREFIX + [1], lora_id=8)[1] == 0
    d.send(GenerateReq("a", PREFIX + [2], SamplingParams(), 0, lora_id=8))  # computing it
    owner = 0 if recorders[0].sent else 1
    assert d.pick(PREFIX + [3], lora_id=8) == (owner, len(PREFIX))
    assert d.pick(PREFIX + [3], lora_id=0)[1] == 0
    d.on_cache_events(1, [(7, PREFIX, 8)])  # evicted in its own namespace only
    assert d.replicas[1].match(PREFIX, 7) == 8
    d.send(ControlReq(1, "unload_lora_adapter", {"uid": 7}))
    assert d.replicas[1].match(PREFIX, 7) == 0 and 7 not in d.replicas[1].cached
    footprint = d.replicas[1].footprint
    d.on_cache_events(1, [(7, PREFIX + [5], -1)])  # its last request's, after the unload
    assert 7 not in d.replicas[1].cached and d.replicas[1].footprint == footprint
    assert all(r.sent[-1].op == "unload_lora_adapter" for r in recorders)  # sent on to all


def test_round_robin_and_shortest_queue():
    d, recorders = dispatcher("round_robin", 3)
    for i in range(6):
        d.send(request(f"r{i}", PREFIX))
    assert [len(r.sent) for r in recorders] == [2, 2, 2]
    d, recorders = dispatcher("shortest_queue")
    d.send(request("a", [1]))
    d.send(request("b", [1]))
    d.done("a")
    d.send(request("c", [1]))  # the replica that ran "a" is idle again
    assert sorted(len(r.sent) for r in recorders) == [1, 2]
    assert {m.rid for r in recorders for m in r.sent if len(r.sent) == 2} >= {"c"}


def test_aborts_go_to_the_owner_and_controls_to_every_replica():
    d, recorders = dispatcher("cache_aware")
    d.send(request("x", [1, 2, 3]))
    owner = 0 if recorders[0].sent else 1
    d.send(AbortReq("x", "bye"))
    assert isinstance(recorders[owner].sent[-1], AbortReq)
    assert not any(isinstance(m, AbortReq) for m in recorders[1 - owner].sent)
    d.send(ControlReq(7, "flush_cache"))
    d.send(AbortReq(None, "all"))
    for r in recorders:
        assert [type(m) for m in r.sent[-2:]] == [ControlReq, AbortReq]
