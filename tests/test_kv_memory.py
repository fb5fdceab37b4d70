"""The KV allocator and the request→token table: slots are never handed out twice, never
lost, and the padding slot is never allocated."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import KVPool, ReqToTokenPool, SlotAllocator, kv_pool
from radixserve.cache.allocator import PADDING_SLOT

POOL = 64


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=60))
def test_allocator_never_double_allocates_or_leaks(ops):
    alloc = SlotAllocator(POOL)
    held: list[torch.Tensor] = []
    for is_alloc, n in ops:
        if is_alloc:
            slots = alloc.alloc(n)
            if n > POOL - sum(len(h) for h in held):
                assert slots is None
            else:
                assert slots is not None and len(slots) == n
                held.append(slots)
        elif held:
            alloc.free(held.pop(n % len(held)))
        owned = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert len(set(owned.tolist())) == len(owned), "a slot was handed out twice"
        assert PADDING_SLOT not in owned.tolist()
        assert alloc.num_free + len(owned) == POOL
        assert all(1 <= s <= POOL for s in owned.tolist())
    for h in held:
        alloc.free(h)
    assert alloc.num_free == POOL


def test_req_to_token_rows_and_table():
    table = ReqToTokenPool(num_rows=2, max_context_len=8, device="cpu")
    a, b = table.alloc(), table.alloc()
    assert {a, b} == {0, 1} and table.alloc() is None
    table.write(a, 0, torch.tensor([5, 6, 7]))
    table.write(a, 3, torch.tensor([9]))
    assert table.slots(a, 0, 4).tolist() == [5, 6, 7, 9]
    with pytest.raises(ValueError, match="context length"):
        table.write(b, 6, torch.tensor([1, 2, 3]))
    table.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        table.free(a)
    assert table.alloc() == a


def test_kv_pool_padding_slot_is_zero_and_writes_land():
    pool = KVPool(
        size=4, num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float32, device="cpu"
    )
    assert all(buf[PADDING_SLOT].abs().sum() == 0 for buf in (*pool.k, *pool.v))
    k, v = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    pool.write(1, torch.tensor([2, 4]), k, v)
    assert torch.equal(pool.k[1][[2, 4]], k) and torch.equal(pool.v[1][[2, 4]], v)
    assert KVPool.bytes_per_token(2, 3, 8, torch.float32) == 2 * 2 * 3 * 8 * 4


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=80))
def test_allocator_hands_out_the_most_recently_freed_slots_first(ops):
    """Against a plain list as the model of the free stack: every alloc returns exactly the
    slots the model predicts (the last freed first, in the order they were freed)."""
    alloc = SlotAllocator(POOL)
    model = list(range(1, POOL + 1))  # free slots, the next to hand out first
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            slots = alloc.alloc(n)
            if n > len(model):
                assert slots is None
                continue
            assert slots is not None and slots.dtype == torch.int64
            assert slots.tolist() == model[:n]
            held.append(model[:n])
            del model[:n]
        elif held:
            slots = held.pop(n % len(held))
            alloc.free(torch.tensor(slots))
            model[:0] = slots
        owned = [s for h in held for s in h]
        assert sorted(owned + model) == list(range(1, POOL + 1)), "a slot was lost or doubled"
        assert alloc.num_free == len(model)


def test_allocator_reuses_freed_slots_and_never_aliases_them():
    alloc = SlotAllocator(POOL)
    first, second = alloc.alloc(4), alloc.alloc(3)
    assert first.tolist() == [1, 2, 3, 4] and second.tolist() == [5, 6, 7]
    alloc.free(first)
    assert second.tolist() == [5, 6, 7], "an allocation must not change under its owner"
    assert alloc.alloc(2).tolist() == [1, 2]
    alloc.free(torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="only 5 are allocated"):
        alloc.free(torch.arange(10, 16))
    alloc.clear()
    assert alloc.num_free == POOL and alloc.alloc(2).tolist() == [1, 2]


# Run in a fresh interpreter: in the long test process, memory other tests freed (and
# malloc settings some set) can hand the pool pages that are already resident.
RESIDENCY_SCRIPT = """
import json, logging, sys, psutil, torch
from radixserve.cache import KVPool
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
layers, slots, prefault = 2, 40 * 2**20 // (64 * 4), sys.argv[1] == "1"
before = psutil.Process().memory_info().rss
pool = KVPool(slots, layers, 1, 64, torch.float32, "cpu", prefault=prefault)
idle = pool.mapping  # Linux 5.14+: left to map in the scheduler loop's idle time
while pool.map_idle_pages():
    pass
grown = psutil.Process().memory_info().rss - before
padding = sum(float(buf[0].abs().sum()) for buf in (*pool.k, *pool.v))
print(json.dumps({"grown": grown, "nbytes": pool.nbytes, "idle": idle,
                  "padding": padding, "slots": slots, "layers": layers}))
"""


@pytest.mark.parametrize("prefault", [True, False])
def test_kv_pool_prefault_makes_the_pool_resident_at_once(prefault):
    # each buffer (40 MiB) is above glibc's largest mmap threshold: fresh, untouched pages
    run = subprocess.run(
        [sys.executable, "-c", RESIDENCY_SCRIPT, "1" if prefault else "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    layers, slots = out["layers"], out["slots"]
    assert out["nbytes"] == 2 * layers * (slots + 1) * 64 * 4
    if prefault:
        assert out["grown"] > 0.9 * out["nbytes"], out
    else:
        assert out["grown"] < 0.5 * out["nbytes"] and not out["idle"], out
    assert out["padding"] == 0
    assert f"KV pool: {slots} tokens x {layers} layers, 0.16 GiB (float32)" in run.stderr
    prefaulted = "pre-faulted in" in run.stderr or "mapped while the server is idle" in run.stderr
    assert prefaulted == prefault
    assert ("every page mapped" in run.stderr) == (prefault and out["idle"])


def test_idle_mapping_keeps_what_is_written_meanwhile():
    """MADV_POPULATE_WRITE maps pages without writing them: K/V stored before the pool's
    pages are all mapped stay as written."""
    slots = 40 * 2**20 // (64 * 4)
    pool = KVPool(slots, 2, 1, 64, torch.float32, "cpu", prefault=True)
    where = torch.arange(1, slots + 1, 997)
    values = torch.randn(len(where), 1, 64)
    for layer in range(2):
        pool.write(layer, where, values, values * 2)
    while pool.map_idle_pages():
        pass
    for layer in range(2):
        assert torch.equal(pool.k[layer][where], values)
        assert torch.equal(pool.v[layer][where], values * 2)


def test_idle_mapping_takes_two_chunks_per_call():
    """The scheduler loop's idle time is spent MAPPING_THREADS chunks at a time, mapped at
    once (a request arriving waits for about one madvise at most)."""
    slots = 40 * 2**20 // (64 * 4)  # 40 MiB a buffer: 20 chunks of 2 MiB, or 21 unaligned
    pool = KVPool(slots, 2, 1, 64, torch.float32, "cpu", prefault=True)
    if not pool.mapping:
        pytest.skip("this kernel cannot map pages without writing them (Linux 5.14+)")
    left = [(a, e) for _, a, e in pool._unmapped]
    assert all(e - a <= kv_pool.POPULATE_CHUNK for a, e in left)
    covered = sum(e - a for a, e in left)
    assert covered >= 3 * pool.nbytes // 4 - 3 * kv_pool.SMALL_PAGE  # all but the first buffer
    assert pool.unmapped_bytes == covered
    for _ in range(5):
        assert pool.map_idle_pages()
    assert len(pool._unmapped) == len(left) - 5 * kv_pool.MAPPING_THREADS
    assert pool.unmapped_bytes == sum(e - a for _, a, e in pool._unmapped)
    while pool.map_idle_pages():  # the rest
        pass
    assert not pool.mapping and pool.unmapped_bytes == 0
    assert pool._helper is None  # its thread let go once all is mapped
    assert not pool.map_idle_pages()  # nothing left: a no-op


def test_a_step_maps_the_pages_of_the_slots_it_writes_first():
    """`map_for_slots`: every buffer's chunks up to the step's highest slot are mapped
    before it runs (the step's K/V copy would fault them in), the rest left to idle time;
    what the step then writes and reads is what it wrote."""
    row = 64 * 4  # one KV head of 64 fp32 per slot: 8,192 slots a chunk
    pool = KVPool(40 * 2**20 // row, 2, 1, 64, torch.float32, "cpu", prefault=True)
    if not pool.mapping:
        pytest.skip("this kernel cannot map pages without writing them (Linux 5.14+)")
    before = len(pool._unmapped)
    slots = torch.tensor([5, 9_000, 20_000])  # in each buffer's chunks 0, 1 and 2
    pool.map_for_slots(slots)
    assert all(offset >= 3 * kv_pool.POPULATE_CHUNK for offset, _, _ in pool._unmapped)
    assert before - len(pool._unmapped) >= 3 * 3  # three chunks of the three unmapped buffers
    pool.map_for_slots(torch.tensor([7, 100]))  # already mapped: nothing to do
    assert len(pool._unmapped) >= before - 3 * 4
    k = torch.randn(3, 1, 64)
    pool.write(1, slots, k, -k)
    assert torch.equal(pool.k[1][slots], k) and torch.equal(pool.v[1][slots], -k)
    while pool.map_idle_pages():
        pass
    pool.map_for_slots(slots)  # all mapped: a no-op


def test_idle_mapping_maps_the_first_slots_of_every_layer_first():
    """Slots are handed out from the lowest up: each buffer's first chunk is mapped before
    any buffer's second."""
    slots = 40 * 2**20 // (64 * 4)
    pool = KVPool(slots, 2, 1, 64, torch.float32, "cpu", prefault=True)
    if not pool.mapping:
        pytest.skip("this kernel cannot map pages without writing them (Linux 5.14+)")
    bufs = (*pool.k, *pool.v)[1:]  # the first is mapped at once
    firsts = {kv_pool.page_span(buf)[0] for buf in bufs}
    order = [address for _, address, _ in reversed(pool._unmapped)]
    assert set(order[: len(bufs)]) == firsts
