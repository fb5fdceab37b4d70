"""The disk tier: page keys, the file format's checks, restart, namespaces, LRU, the
background writer, prefetch and two stores sharing one directory."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from radixserve.cache import disk_store
from radixserve.cache.disk_store import DiskStore, page_keys
from radixserve.cache.kv_block import KVBlock

PAGE = 4  # tokens per page
LAYERS, HEADS, DIM = 2, 2, 8
NS = "tiny-llama|float32|page4"


def make_block(seed: int, dtype: str = "float32", tokens: int = PAGE) -> KVBlock:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, tokens, HEADS, DIM)  # (L, T, H, D)
    if dtype == "int8":
        return KVBlock(
            torch.randint(-128, 128, shape, generator=g, dtype=torch.int8),
            torch.randint(-128, 128, shape, generator=g, dtype=torch.int8),
            torch.rand(shape[:3], generator=g),  # (L, T, H)
            torch.rand(shape[:3], generator=g),
        )
    t = getattr(torch, dtype)
    return KVBlock(torch.randn(shape, generator=g).to(t), torch.randn(shape, generator=g).to(t))


def same(a: KVBlock | None, b: KVBlock) -> bool:
    if a is None:
        return False
    parts = zip((a.k, a.v, a.k_scale, a.v_scale), (b.k, b.v, b.k_scale, b.v_scale))
    return all(
        (x is None and y is None)
        or (x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y))
        for x, y in parts
    )


def keys_for(n: int, seed: int = 0) -> list[str]:
    return page_keys(list(range(seed, seed + n * PAGE)), PAGE, NS)


@pytest.fixture
def open_store(tmp_path):
    stores = []

    def make(max_bytes: int | None = None, namespace: str = NS, **kw) -> DiskStore:
        stores.append(DiskStore(tmp_path, namespace, PAGE, max_bytes, **kw))
        return stores[-1]

    yield make
    for s in stores:
        s.close()


def page_file(store: DiskStore, key: str) -> Path:
    return store.directory / f"{key}.kv"


# --- page keys -------------------------------------------------------------------------


def test_page_keys_are_chained():
    tokens = list(range(100, 120))  # 5 pages
    keys = page_keys(tokens, PAGE, NS)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert all(len(k) == 32 for k in keys)
    assert page_keys(tokens, PAGE, NS) == keys  # deterministic

    first = tokens.copy()
    first[1] += 1
    assert all(a != b for a, b in zip(page_keys(first, PAGE, NS), keys))

    third = tokens.copy()
    third[2 * PAGE] += 1
    changed = page_keys(third, PAGE, NS)
    assert changed[:2] == keys[:2]
    assert all(a != b for a, b in zip(changed[2:], keys[2:]))


def test_page_keys_namespace_extra_key_and_partial_page():
    tokens = list(range(10))  # 2 full pages + 2 tokens
    keys = page_keys(tokens, PAGE, NS)
    assert len(keys) == 2
    assert keys == page_keys(tokens[:8], PAGE, NS)  # the partial page adds nothing
    assert page_keys(tokens[:3], PAGE, NS) == []
    for other in (page_keys(tokens, PAGE, NS + "x"), page_keys(tokens, PAGE, NS, "salt")):
        assert all(a != b for a, b in zip(other, keys))
    assert page_keys(tokens, PAGE, NS, None) == keys


# --- round trips, restart, namespaces ----------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_put_get_round_trip(open_store, dtype):
    store = open_store()
    key = keys_for(1)[0]
    block = make_block(1, dtype)
    assert not store.contains(key)
    assert store.put(key, block)
    assert store.contains(key)
    assert not store.put(key, block)  # already there
    assert same(store.get(key), block)
    assert store.num_pages == 1 and store.used_bytes == page_file(store, key).stat().st_size
    s = store.stats
    assert (s.pages_written, s.pages_read, s["corrupt_skipped"]) == (1, 1, 0)
    assert s.bytes_written == s.bytes_read == store.used_bytes


def test_views_of_a_larger_block_round_trip(open_store):
    store = open_store()
    big = make_block(2, "int8", tokens=3 * PAGE)
    keys = keys_for(3)
    for i, key in enumerate(keys):
        store.put(key, big.slice(i * PAGE, (i + 1) * PAGE))  # non-contiguous views
    assert same(KVBlock.cat(store.get_many(keys)), big)


def test_put_rejects_wrong_page_size_and_bad_keys(open_store):
    store = open_store()
    with pytest.raises(ValueError):
        store.put(keys_for(1)[0], make_block(0, tokens=PAGE + 1))
    with pytest.raises(ValueError):
        store.put("../escape", make_block(0))


def test_restart_sees_pages(open_store):
    keys = keys_for(3)
    first = open_store()
    for i, key in enumerate(keys):
        first.put(key, make_block(i))
    first.close()

    second = open_store()
    assert all(second.contains(k) for k in keys)
    assert second.num_pages == 3 and second.used_bytes == first.used_bytes
    assert all(same(second.get(k), make_block(i)) for i, k in enumerate(keys))


def test_other_namespace_is_invisible(open_store, tmp_path, caplog):
    key = keys_for(1)[0]
    open_store().put(key, make_block(0))
    other = open_store(namespace="other-model|float32|page4")
    assert not other.contains(key) and other.get(key) is None and other.num_pages == 0

    # A file of another namespace put where this one looks: the header check catches it.
    mine = open_store()
    (other.directory / f"{key}.kv").write_bytes(page_file(mine, key).read_bytes())
    with caplog.at_level(logging.WARNING, logger=disk_store.__name__):
        assert other.get(key) is None
    assert "namespace" in caplog.text and other.stats.corrupt_skipped == 1


# --- bad files ---------------------------------------------------------------------------


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the payload's end: tensor data
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])


@pytest.mark.parametrize("damage", [flip_last_byte, truncate], ids=["flipped", "torn"])
def test_bad_file_is_skipped_logged_and_counted(open_store, caplog, damage):
    store = open_store()
    key = keys_for(1)[0]
    store.put(key, make_block(0))
    path = page_file(store, key)
    damage(path)
    with caplog.at_level(logging.WARNING, logger=disk_store.__name__):
        assert store.get(key) is None
    assert path.name in caplog.text
    assert store.stats.corrupt_skipped == 1
    assert not store.contains(key) and store.used_bytes == 0
    assert not path.exists()
    assert store.put(key, make_block(0))  # can be written again
    assert same(store.get(key), make_block(0))


@pytest.mark.parametrize(
    "content", [b"", b"RSKVPAGE", b"\x00" * 100, b"RSKVPAGE\x01\x00\xff\xff\xff\x7f{"]
)
def test_garbage_files_never_raise(open_store, content):
    store = open_store()
    key = keys_for(1)[0]
    page_file(store, key).write_bytes(content)
    reopened = open_store()
    assert reopened.contains(key)  # the scan does not read files
    assert reopened.get(key) is None
    assert reopened.stats.corrupt_skipped == 1


def test_temp_files_are_never_read_and_stale_ones_are_removed(open_store):
    store = open_store()
    key, other = keys_for(2)
    store.put(key, make_block(0))
    good = page_file(store, key).read_bytes()
    page_file(store, key).unlink()
    fresh = store.directory / f"{key}.999.abcd1234.tmp"
    stale = store.directory / f"{other}.999.beef0000.tmp"
    fresh.write_bytes(good)
    stale.write_bytes(good)
    old = time.time() - 3600
    os.utime(stale, (old, old))

    reopened = open_store()
    assert not reopened.contains(key) and reopened.get(key) is None
    assert reopened.num_pages == 0
    assert fresh.exists() and not stale.exists()  # a live writer's file is left alone


# --- LRU cap -----------------------------------------------------------------------------


def test_lru_cap_keeps_most_recently_used(open_store, tmp_path):
    probe = open_store()
    probe.put(keys_for(1, seed=1000)[0], make_block(0))
    page_bytes = probe.used_bytes
    probe.close()
    for f in probe.directory.iterdir():
        f.unlink()

    store = open_store(max_bytes=3 * page_bytes + page_bytes // 2)
    a, b, c, d, e = keys_for(5)
    for i, key in enumerate((a, b, c)):
        store.put(key, make_block(i))
    assert same(store.get(a), make_block(0))  # a is now the most recently used
    store.put(d, make_block(3))
    store.put(e, make_block(4))
    kept = {a, d, e}
    assert {k for k in (a, b, c, d, e) if store.contains(k)} == kept
    assert {p.stem for p in store.directory.glob("*.kv")} == kept
    assert store.used_bytes == 3 * page_bytes and store.stats.evicted_files == 2


def test_restart_evicts_by_file_mtime(open_store):
    keys = keys_for(4)
    first = open_store()
    for i, key in enumerate(keys):
        first.put(key, make_block(i))
    page_bytes = first.used_bytes // 4
    first.close()
    base = time.time() - 100
    for age, key in zip((3, 0, 2, 1), keys):  # oldest use first: keys[1], keys[3], ...
        os.utime(page_file(first, key), (base + age, base + age))

    second = open_store(max_bytes=2 * page_bytes)
    assert [k for k in keys if second.contains(k)] == [keys[0], keys[2]]
    assert second.stats.evicted_files == 2


def test_cap_never_evicts_the_page_just_written(open_store):
    store = open_store(max_bytes=1)  # smaller than any page
    a, b = keys_for(2)
    assert store.put(a, make_block(0)) and store.contains(a)
    assert store.put(b, make_block(1)) and store.contains(b) and not store.contains(a)


# --- background writer and prefetch ------------------------------------------------------


def test_put_async_and_flush(open_store):
    store = open_store()
    keys = keys_for(6)
    for i, key in enumerate(keys):
        store.put_async(key, make_block(i))
        store.put_async(key, make_block(i))  # a duplicate while queued: skipped
    store.flush(timeout=10)
    assert all(store.contains(k) for k in keys)
    assert store.stats.pages_written == 6 and store.stats.writes_dropped == 0
    store.put_async(keys[0], make_block(0))  # already present: skipped
    store.flush(timeout=10)
    assert store.stats.pages_written == 6
    assert all(same(store.get(k), make_block(i)) for i, k in enumerate(keys))


def test_put_async_drops_when_queue_is_full(open_store, monkeypatch):
    release = threading.Event()
    writing = threading.Event()
    real_encode = disk_store.encode_page

    def slow_encode(*args):
        writing.set()
        release.wait(10)
        return real_encode(*args)

    monkeypatch.setattr(disk_store, "encode_page", slow_encode)
    store = open_store(queue_size=1)
    k0, k1, k2 = keys_for(3)
    store.put_async(k0, make_block(0))
    assert writing.wait(10)  # the writer holds k0
    store.put_async(k1, make_block(1))  # fills the queue
    store.put_async(k2, make_block(2))  # dropped
    release.set()
    store.flush(timeout=10)
    assert store.stats.writes_dropped == 1
    assert [store.contains(k) for k in (k0, k1, k2)] == [True, True, False]


def test_close_flushes_and_is_idempotent(open_store, tmp_path):
    store = open_store()
    keys = keys_for(3)
    for i, key in enumerate(keys):
        store.put_async(key, make_block(i))
    store.close()
    store.close()
    assert all(page_file(store, k).exists() for k in keys)
    with pytest.raises(RuntimeError):
        store.put_async(keys_for(1, seed=500)[0], make_block(0))


def test_prefetch_returns_leading_run_of_good_pages(open_store):
    store = open_store()
    keys = keys_for(5)
    for i, key in enumerate(keys):
        store.put(key, make_block(i))
    full = store.prefetch(keys).result(timeout=10)
    assert len(full) == 5 and all(same(b, make_block(i)) for i, b in enumerate(full))

    missing = keys[:2] + keys_for(1, seed=777) + keys[2:]
    assert len(store.prefetch(missing).result(timeout=10)) == 2
    assert store.prefetch(keys_for(1, seed=777) + keys).result(timeout=10) == []

    flip_last_byte(page_file(store, keys[2]))
    run = store.prefetch(keys).result(timeout=10)
    assert len(run) == 2 and same(run[1], make_block(1))
    assert store.stats.corrupt_skipped == 1


def test_get_many_is_all_or_none(open_store):
    store = open_store()
    keys = keys_for(3)
    for i, key in enumerate(keys):
        store.put(key, make_block(i))
    assert all(same(b, make_block(i)) for i, b in enumerate(store.get_many(keys)))
    assert store.get_many(keys + keys_for(1, seed=777)) is None
    assert store.get_many([]) == []


# --- two servers, one directory ----------------------------------------------------------


def test_two_stores_writing_the_same_keys_never_read_a_bad_page(open_store):
    stores = [open_store(), open_store()]
    keys = keys_for(40)
    blocks = [make_block(i) for i in range(len(keys))]
    start = threading.Barrier(4)
    bad = []

    def writer(store: DiskStore) -> None:  # both write every key, in the same order
        start.wait()
        for key, block in zip(keys, blocks):
            store.put(key, block)

    def reader(store: DiskStore) -> None:
        start.wait()
        for _ in range(20):
            for key, block in zip(keys, blocks):
                got = store.get(key)
                if got is not None and not same(got, block):
                    bad.append(key)

    threads = [threading.Thread(target=f, args=(s,)) for s in stores for f in (writer, reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not bad
    assert all(s.stats.corrupt_skipped == 0 for s in stores)
    assert all(same(stores[1].get(k), b) for k, b in zip(keys, blocks))
    assert not list(stores[0].directory.glob("*.tmp"))


def test_get_finds_a_page_another_store_wrote(open_store):
    mine, theirs = open_store(), open_store()
    key = keys_for(1)[0]
    theirs.put(key, make_block(0))
    assert not mine.contains(key)  # the index is this store's own view
    assert same(mine.get(key), make_block(0))
    assert mine.contains(key)
