"""Hybrid sliding-window memory (cache/swa_pool.py): window layers keep K/V in a smaller pool
of window slots mapped from the full slots, window K/V nobody can see is reclaimed only
under pressure, and a cached prefix is reused only up to where its window K/V is whole.

Unit tests of the allocator and the match truncation rule, then the tiny Gemma 3 (window
16) through the Engine: greedy outputs identical to transformers for prompts well longer
than the window, with a window pool as big as the default and one of two windows
(reclaim at work), the radix cache on and off, chunks of 7, pages of 4, retraction,
n-gram drafts verified and rejected (speculative decoding is on by default); the
accounting invariant after every scenario and everything free after flush_cache. Last,
the memory figure on the real Gemma 3 270M geometry."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve import Engine
from radixserve.cache import KVPool, ReqToTokenPool
from radixserve.cache.swa_pool import HybridSlotAllocator, swa_pool_size, usable_prefix_len
from radixserve.core.batch import ForwardBatch, ForwardMode
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.model.attention import TorchNativeAttention, decode_attention_kernel
from radixserve.scheduler.kv_manager import KVManager
from tests.conftest import FP32, TINY_GEMMA3_WINDOW
from tests.reference import greedy_of_folder, greedy_params, verification_free

W = TINY_GEMMA3_WINDOW
STEPS = 24
SHARED = [(7 * i) % 400 + 50 for i in range(50)]  # 50 tokens: three windows and more
LONG = [(13 * i) % 450 + 40 for i in range(90)]
PROMPTS = [
    SHARED + [11, 12, 13],
    SHARED + [21, 22],
    LONG,
    [5, 6, 7, 8, 9],
    SHARED[:30] + [99] * 9,
    [10, 11, 12, 13, 14] * 12,  # repeats: the n-gram speculator drafts (and some are rejected)
]


# -- units ------------------------------------------------------------------------------
def _has(length: int, missing: set[int]) -> torch.Tensor:
    return torch.tensor([i not in missing for i in range(length)], dtype=torch.bool)


def test_usable_prefix_len_needs_the_last_window_whole():
    assert usable_prefix_len(_has(20, set()), 4) == 20
    assert usable_prefix_len(_has(20, {3, 9}), 4) == 20  # only the last 4 positions matter
    assert usable_prefix_len(_has(20, {17, 18}), 4) == 17  # [13, 17) is whole
    assert usable_prefix_len(_has(20, {17, 18}), 4, page_size=4) == 16
    assert usable_prefix_len(_has(20, {1, 18}), 30) == 1  # the window reaches position 0
    assert usable_prefix_len(_has(20, set(range(20))), 4) == 0
    assert usable_prefix_len(_has(0, set()), 4) == 0


def test_hybrid_allocator_maps_frees_and_rolls_back():
    alloc = HybridSlotAllocator(size=10, window_size=4, window=2)
    a = alloc.alloc(3)
    assert a is not None and bool(alloc.has_window(a).all())
    assert alloc.window_free == 1 and alloc.num_free == 7
    assert alloc.alloc(2) is None, "window pool short, no reclaimer: nothing taken"
    assert alloc.num_free == 7 and alloc.window_free == 1
    assert alloc.free_window(a[:2]) == 2 and alloc.window_free == 3
    assert alloc.has_window(a).tolist() == [False, False, True]
    b = alloc.alloc(3)
    assert b is not None and alloc.window_free == 0
    alloc.free(a)  # frees the full slots and the one window slot a still held
    assert alloc.num_free == 7 and alloc.window_free == 1
    alloc.free(b)
    assert alloc.num_free == 10 and alloc.window_free == 4 and alloc.window_mapped == 0


def test_hybrid_allocator_reclaims_through_its_reclaimer_never_protected():
    alloc = HybridSlotAllocator(size=16, window_size=6, window=2)
    old = alloc.alloc(6)
    assert old is not None
    protected = old[4:]
    alloc.reclaimer = lambda need: alloc.reclaim(need, protected, [old])
    new = alloc.alloc(3)  # 3 short: exactly 3 go, front first
    assert new is not None
    assert alloc.has_window(old).tolist() == [False] * 3 + [True] * 3
    assert alloc.alloc(2) is None  # only old[3] may still go; the rest is protected
    assert alloc.has_window(old).tolist() == [False] * 4 + [True] * 2
    assert alloc.num_free == 16 - 9, "the failed alloc took no full slot"
    assert alloc.window_free + alloc.window_mapped == alloc.window_size


def test_adopt_window_moves_window_kv_to_the_tree_copy():
    alloc = HybridSlotAllocator(size=8, window_size=8, window=2)
    tree, own = alloc.alloc(2), alloc.alloc(2)
    alloc.free_window(tree[:1])
    alloc.adopt_window(tree, own)
    assert alloc.has_window(tree).all() and alloc.has_window(own).tolist() == [False, True]
    alloc.free(own)
    assert alloc.window_mapped == 2 and alloc.window_free == 6


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 12)), max_size=50))
def test_hybrid_allocator_accounting_holds_under_any_ops(ops):
    alloc = HybridSlotAllocator(size=32, window_size=12, window=3)
    held: list[torch.Tensor] = []
    alloc.reclaimer = lambda need: alloc.reclaim(need, torch.empty(0, dtype=torch.int64), held)
    for op, n in ops:
        if op == 0:
            slots = alloc.alloc(n)
            if slots is not None:
                assert bool(alloc.has_window(slots).all())
                held.append(slots)
        elif op == 1 and held:
            alloc.free(held.pop(n % len(held)))
        elif held:
            alloc.free_window(held[n % len(held)])
        owned = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert alloc.num_free + owned.numel() == alloc.size
        assert alloc.window_free + alloc.window_mapped == alloc.window_size
        assert int(alloc.has_window(owned).sum()) == alloc.window_mapped
    assert int(alloc.full_to_swa[0]) == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_is_truncated_where_window_kv_was_reclaimed(page_size):
    alloc = HybridSlotAllocator(size=64, window_size=64, window=4)
    kv = KVManager(alloc, ReqToTokenPool(2, 64, "cpu"), torch.device("cpu"), True, page_size)
    assert kv.tree is not None
    tokens = list(range(100, 120))
    slots = alloc.alloc(20)
    kv.tree.insert(tokens, slots)
    alloc.free_window(slots[17:19])  # reclaimed: positions 17 and 18 lost their window K/V
    req = Req("r", tokens + [7], SamplingParams(max_new_tokens=1))
    kv.match(req)
    usable = 17 if page_size == 1 else 16
    assert req.kv_len == req.tree_len == req.cached_tokens == usable
    assert kv.tree.protected_size == usable, "only the truncated path is locked"
    depth, node = 0, req.last_node
    while node.parent is not None:  # the tree was split where the usable prefix ends
        depth, node = depth + len(node.key), node.parent
    assert depth == usable
    kv.check([req])
    kv.unmatch(req)
    assert kv.tree.protected_size == 0
    kv.flush()
    assert alloc.num_free == 64 and alloc.window_free == 64


def test_reclaim_takes_the_least_recently_used_node_front_first():
    """Under window-pool pressure the tree's least recently used node loses its earliest
    positions' window K/V first: its tail window stays whole, so it is still reusable."""
    alloc = HybridSlotAllocator(size=64, window_size=24, window=4)
    kv = KVManager(alloc, ReqToTokenPool(2, 64, "cpu"), torch.device("cpu"))
    assert kv.tree is not None
    old, new = list(range(100, 110)), list(range(200, 210))
    old_slots, new_slots = alloc.alloc(10), alloc.alloc(10)
    kv.tree.insert(old, old_slots)
    kv.tree.insert(new, new_slots)  # more recent
    assert alloc.alloc(7) is not None  # 4 free: 3 reclaimed (the floor, 24 // 8)
    assert alloc.has_window(old_slots).tolist() == [False] * 3 + [True] * 7
    assert bool(alloc.has_window(new_slots).all())
    req = Req("r", old + [7], SamplingParams(max_new_tokens=1))
    kv.match(req)
    assert req.cached_tokens == 10, "the last 4 positions kept their window K/V"
    kv.unmatch(req)


# -- the attention backend --------------------------------------------------------------
@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens"),
    [
        ([0, 1, 5, 15, 16, 17, 40, 300], [1] * 8),  # decode rows around the window's edge
        ([0, 10, 33, 4, 0], [1, 6, 1, 3, 40]),  # mixed: kernel rows beside SDPA rows
        ([0, 0], [40, 9]),  # prompts with no prefix, one longer than the window
        ([3, 20], [2, 30]),  # cached prefixes with several new tokens
    ],
    ids=["decode", "mixed", "causal", "extend"],
)
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_window_layer_reads_and_writes_through_the_map(prefix_lens, extend_lens, use_kernel):
    """A window layer over a pool of window slots, scattered by a random full→window map
    in which the positions no query of the batch can see have no window K/V: the same
    output as the one-pool backend, and the new K/V land in the mapped window rows."""
    if use_kernel and decode_attention_kernel() is None:
        pytest.skip("the C++ decode kernel cannot be built here")
    gen = torch.Generator().manual_seed(len(prefix_lens))
    heads, dim, window = 4, 64, W
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    size = sum(seq_lens) + 7
    full = KVPool(size, 1, 1, dim, torch.float32, "cpu")
    full.k[0][1:] = torch.randn(size, 1, dim, generator=gen)
    full.v[0][1:] = torch.randn(size, 1, dim, generator=gen)
    window_slots = size + 3
    hybrid = KVPool(
        size, 1, 1, dim, torch.float32, "cpu", window_layers=[0], window_slots=window_slots
    )
    window_map = torch.zeros(size + 1, dtype=torch.int64)
    free_window = (torch.randperm(window_slots, generator=gen) + 1).tolist()
    table = ReqToTokenPool(len(seq_lens) + 1, 512, "cpu")
    slots = (torch.randperm(size, generator=gen) + 1).tolist()
    rows, out_slots = [], []
    for i, (prefix, n) in enumerate(zip(prefix_lens, seq_lens, strict=True)):
        row = len(seq_lens) - i
        taken, slots = slots[:n], slots[n:]
        table.write(row, 0, torch.tensor(taken))
        rows.append(row)
        out_slots += taken[prefix:]
        for s in taken[max(0, prefix - window) :]:  # what the batch's queries can see
            window_map[s] = free_window.pop()
            hybrid.k[0][window_map[s]] = full.k[0][s]
            hybrid.v[0][window_map[s]] = full.v[0][s]
    tokens = sum(extend_lens)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if set(extend_lens) == {1} else ForwardMode.EXTEND,
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        positions=torch.zeros(tokens, dtype=torch.int64),
        out_slots=torch.tensor(out_slots),
        req_rows=torch.tensor(rows),
        prefix_lens=list(prefix_lens),
        extend_lens=list(extend_lens),
        logits_indices=torch.zeros(1, dtype=torch.int64),
    )
    q = torch.randn(tokens, heads, dim, generator=gen)
    k, v = torch.randn(2, tokens, 1, dim, generator=gen)
    outs = []
    for pool, wmap in ((full, None), (hybrid, window_map)):
        backend = TorchNativeAttention(
            pool, table, dim**-0.5, heads, use_kernel=use_kernel, windows=[window], window_map=wmap
        )
        outs.append(backend.forward(0, q, k, v, backend.prepare(batch)))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-6, rtol=1e-5)
    written = window_map[batch.out_slots]
    assert bool((written != 0).all())
    assert torch.equal(hybrid.k[0][written], k) and torch.equal(hybrid.v[0][written], v)


# -- through the Engine -----------------------------------------------------------------
def greedy() -> dict:
    return greedy_params(STEPS)


@pytest.fixture(scope="module")
def expected(tiny_model_dirs) -> list[list[int]]:
    return greedy_of_folder(tiny_model_dirs["gemma3"], PROMPTS, STEPS)


def _engine(tiny_model_dirs, **config) -> Engine:
    """The tiny Gemma 3, drafting whatever its step times say (`verification_free`)."""
    config = {"max_total_tokens": 2048, **config}
    engine = Engine(str(tiny_model_dirs["gemma3"]), progress=False, dtype=FP32, **config)
    return verification_free(engine)


def _check_and_flush(engine: Engine) -> None:
    engine.check_kv_accounting()
    assert engine.flush_cache()
    alloc = engine.runner.allocator
    assert isinstance(alloc, HybridSlotAllocator)
    assert alloc.num_free == alloc.size
    assert alloc.window_free == alloc.window_size and alloc.window_mapped == 0
    state = engine.get_server_info()["internal_states"][0]
    assert state["swa_total"] == state["swa_free"] == alloc.window_size


SMALL_WINDOW_POOL = {"swa_full_tokens_ratio": 0.01}  # 2048 x 0.01 → the floor, 2 windows


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"disable_radix_cache": True},
        {"chunked_prefill_size": 7},
        {"page_size": 4},
        SMALL_WINDOW_POOL,
        {**SMALL_WINDOW_POOL, "chunked_prefill_size": 7},
        {**SMALL_WINDOW_POOL, "page_size": 4},
        {**SMALL_WINDOW_POOL, "disable_radix_cache": True},
        {"kernels": "torch"},
    ],
    ids=[
        "radix",
        "no-radix",
        "chunks-7",
        "page-4",
        "small-window-pool",
        "small-window-pool-chunks-7",
        "small-window-pool-page-4",
        "small-window-pool-no-radix",
        "torch-attention",
    ],
)
def test_hybrid_memory_greedy_identical_to_transformers(tiny_model_dirs, expected, config):
    engine = _engine(tiny_model_dirs, **config)
    try:
        alloc = engine.runner.allocator
        assert isinstance(alloc, HybridSlotAllocator) and alloc.window == W
        want_window = 2 * W if "swa_full_tokens_ratio" in config else int(0.8 * 2048)
        assert alloc.window_size == want_window
        pool = engine.runner.kv_pool
        assert pool.k[0].shape[0] == want_window + 1 and pool.k[2].shape[0] == 2048 + 1
        alone = [engine.generate(input_ids=p, sampling_params=greedy()) for p in PROMPTS]
        engine.check_kv_accounting()
        batched = engine.generate(input_ids=PROMPTS, sampling_params=greedy())
        for i, want in enumerate(expected):
            assert alone[i]["output_ids"] == want, f"prompt {i} alone"
            assert batched[i]["output_ids"] == want, f"prompt {i} batched"
        stats = engine.scheduler.stats
        assert stats.spec_draft_tokens > stats.spec_accepted_tokens > 0, "drafts verified"
        if not config.get("disable_radix_cache") and "swa_full_tokens_ratio" not in config:
            # the second prompt shares 50 tokens (three windows) with the first: all reused
            page = config.get("page_size", 1)
            assert alone[1]["meta_info"]["cached_tokens"] == len(SHARED) - len(SHARED) % page
        _check_and_flush(engine)
    finally:
        engine.shutdown()


def test_small_window_pool_truncates_reuse_but_keeps_what_is_whole(tiny_model_dirs, expected):
    """With two windows of window slots the first prompt's early window K/V is reclaimed
    while it decodes; the second prompt reuses only a prefix whose last W positions kept
    theirs (less than the 50 shared tokens), and still matches transformers."""
    engine = _engine(tiny_model_dirs, **SMALL_WINDOW_POOL)
    try:
        first = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy())
        second = engine.generate(input_ids=PROMPTS[1], sampling_params=greedy())
        assert first["output_ids"] == expected[0] and second["output_ids"] == expected[1]
        assert second["meta_info"]["cached_tokens"] < len(SHARED)
        _check_and_flush(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("window_pool", [{}, SMALL_WINDOW_POOL], ids=["default", "small"])
def test_hybrid_memory_retraction_keeps_outputs_identical(tiny_model_dirs, expected, window_pool):
    """A full pool too small for the batch's outputs: decode retracts requests, which later
    resume from what the tree (and its window K/V) still holds."""
    engine = _engine(tiny_model_dirs, max_total_tokens=200, **window_pool)
    try:
        batched = engine.generate(input_ids=PROMPTS, sampling_params=greedy())
        assert engine.scheduler.stats.retractions > 0, "the scenario should force a retraction"
        for i, want in enumerate(expected):
            assert batched[i]["output_ids"] == want, f"prompt {i}"
        _check_and_flush(engine)
    finally:
        engine.shutdown()


# -- the memory figure ------------------------------------------------------------------
GEMMA3_270M = dict(layers=18, kv_heads=1, head_dim=256, window=512, full_layers=(5, 11, 17))


@pytest.mark.parametrize("ratio", [0.8, 0.25])
def test_window_layers_cost_window_sized_memory_gemma3_270m(ratio, capsys):
    """KV bytes per token of a 4096-token context on the real Gemma 3 270M geometry (bf16),
    from the pools as allocated: window layers hold swa_pool_size(...) tokens, full layers
    4096."""
    g = GEMMA3_270M
    tokens = 4096
    window_layers = [i for i in range(g["layers"]) if i not in g["full_layers"]]
    window_slots = swa_pool_size(tokens, g["window"], ratio)
    args = (tokens, g["layers"], g["kv_heads"], g["head_dim"], torch.bfloat16, "meta")
    hybrid = KVPool(*args, window_layers=window_layers, window_slots=window_slots)
    flat = KVPool(*args)

    def per_token(pool: KVPool, layers: list[int]) -> float:
        return sum(pool.k[i].nbytes + pool.v[i].nbytes for i in layers) / len(layers) / tokens

    full_layer, window_layer = (
        per_token(hybrid, list(g["full_layers"])),
        per_token(hybrid, window_layers),
    )
    with capsys.disabled():
        print(
            f"\nGemma 3 270M, {tokens}-token pool, ratio {ratio}: window pool {window_slots} "
            f"tokens; per layer per token: full {full_layer:.1f} B, window "
            f"{window_layer:.1f} B; all layers {hybrid.nbytes / tokens:.0f} B/token "
            f"(one pool: {flat.nbytes / tokens:.0f} B/token, {flat.nbytes / 2**20:.1f} MiB "
            f"-> {hybrid.nbytes / 2**20:.1f} MiB)"
        )
    assert full_layer == pytest.approx(2 * 256 * 2 * (tokens + 1) / tokens)
    assert window_layer == pytest.approx(full_layer * (window_slots + 1) / (tokens + 1))
    assert hybrid.nbytes < flat.nbytes
