"""The host tier's KV pool: round trips between the device pool and host rows are exact
where the storage dtype is, within the rounding bound where it is narrower, and the
per-layer path (backup / load) and the block path (encode / store / gather / decode_into)
put the same bytes in the device pool."""

from __future__ import annotations

import pytest
import torch

from radixserve.cache import KVPool
from radixserve.cache.host_pool import HostKVPool, LoadHandle

LAYERS, HEADS, HEAD_DIM = 4, 2, 8
DEVICE_SLOTS, HOST_SLOTS = 64, 48
DTYPES = ("float32", "bfloat16", "float16", "int8")

# Rows of the device pool to back up and the rows to load them back into (disjoint).
SOURCE = torch.tensor([3, 17, 5, 40, 41, 9, 22])
TARGET = torch.tensor([50, 12, 60, 33, 1, 28, 7])
# Host slots: one contiguous run (read in place), and sets that must be gathered.
HOST_RUNS = {
    "run": torch.arange(10, 17),
    "scattered": torch.tensor([30, 2, 47, 11, 25, 8, 19]),
    "almost_a_run": torch.tensor([10, 11, 12, 14, 13, 15, 16]),  # spans 7 slots, out of order
}


def device_pool(dtype: torch.dtype = torch.float32, seed: int = 0) -> KVPool:
    """A CPU device pool whose rows 1.. hold random K/V of varied magnitudes, and one
    all-zero token (row 9)."""
    pool = KVPool(DEVICE_SLOTS, LAYERS, HEADS, HEAD_DIM, dtype, "cpu", prefault=False)
    gen = torch.Generator().manual_seed(seed)
    for buf in (*pool.k, *pool.v):
        magnitude = 10 ** torch.empty(DEVICE_SLOTS, HEADS, 1).uniform_(-3, 2, generator=gen)
        buf[1:] = torch.randn(DEVICE_SLOTS, HEADS, HEAD_DIM, generator=gen) * magnitude
        buf[9] = 0
    return pool


def host_pool(dtype: str, device_dtype: torch.dtype = torch.float32) -> HostKVPool:
    return HostKVPool(HOST_SLOTS, LAYERS, HEADS, HEAD_DIM, dtype, device_dtype)


def rows(pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
    """(2, layers, T, heads, head_dim): K then V of `slots` for every layer."""
    return torch.stack([torch.stack([buf[slots] for buf in bufs]) for bufs in (pool.k, pool.v)])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that equality is bit-exactness (and -0.0 != 0.0)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("host_slots", HOST_RUNS.values(), ids=HOST_RUNS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backup_then_load_is_bit_exact_in_the_device_dtype(dtype, host_slots):
    pool = device_pool(dtype)
    host = host_pool(str(dtype).removeprefix("torch."), dtype)
    untouched = torch.tensor([0, 2, 4, 63])
    before = rows(pool, untouched).clone()
    host.backup(pool, SOURCE, host_slots)
    host.load(host_slots, pool, TARGET)
    assert torch.equal(bits(rows(pool, TARGET)), bits(rows(pool, SOURCE)))
    assert torch.equal(bits(rows(pool, untouched)), bits(before))


@pytest.mark.parametrize("dtype, rel", [("float16", 2**-11), ("bfloat16", 2**-8)])
def test_half_storage_rounds_within_half_an_ulp(dtype, rel):
    pool = device_pool()
    host = host_pool(dtype)
    host.backup(pool, SOURCE, HOST_RUNS["scattered"])
    host.load(HOST_RUNS["scattered"], pool, TARGET)
    source, loaded = rows(pool, SOURCE), rows(pool, TARGET)
    error = (loaded - source).abs()
    # Relative rounding for normal numbers; float16's subnormals (< 6.1e-5) round absolutely.
    assert (error <= rel * source.abs() + 2**-25).all()
    assert error.max() > 0  # the storage really is narrower


def test_int8_storage_error_is_at_most_half_a_scale():
    pool = device_pool()
    host = host_pool("int8")
    host.backup(pool, SOURCE, HOST_RUNS["run"])
    host.load(HOST_RUNS["run"], pool, TARGET)
    source, loaded = rows(pool, SOURCE), rows(pool, TARGET)
    amax = source.abs().amax(dim=-1, keepdim=True)  # per token and kv head
    error = (loaded - source).abs()
    assert (error <= amax / 254 * (1 + 1e-5) + 1e-12).all()
    assert error.max() > 0
    # The largest element of each token-head is exact up to float rounding (q = +-127).
    peak = source.abs().argmax(dim=-1, keepdim=True)
    assert torch.allclose(loaded.gather(-1, peak), source.gather(-1, peak), rtol=1e-6, atol=0)
    zero_token = SOURCE.tolist().index(9)
    assert torch.equal(loaded[:, :, zero_token], torch.zeros_like(loaded[:, :, zero_token]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_path_agrees_with_backup_and_load(dtype):
    pool = device_pool()
    host = host_pool(dtype)
    by_layers, by_block = torch.arange(32, 39), HOST_RUNS["scattered"]
    host.backup(pool, SOURCE, by_layers)
    block = host.encode(pool, SOURCE)
    assert block.k.shape == (LAYERS, len(SOURCE), HEADS, HEAD_DIM)
    assert block.k.dtype == host.storage_dtype and block.k.device.type == "cpu"
    assert (block.k_scale is not None) == (dtype == "int8")
    host.store(by_block, block)

    gathered, backed_up = host.gather(by_block), host.gather(by_layers)
    for field in ("k", "v", "k_scale", "v_scale"):
        a, b, c = getattr(block, field), getattr(gathered, field), getattr(backed_up, field)
        if a is None:
            assert b is None and c is None
        else:
            assert torch.equal(bits(a), bits(b)) and torch.equal(bits(a), bits(c))

    host.load(by_layers, pool, TARGET)
    loaded = rows(pool, TARGET).clone()
    other = torch.tensor([44, 45, 46, 47, 48, 49, 51])
    host.decode_into(gathered, pool, other)
    assert torch.equal(bits(rows(pool, other)), bits(loaded))


def test_gather_returns_a_copy():
    host = host_pool("float32")
    host.backup(device_pool(), SOURCE, HOST_RUNS["run"])
    kept = host.gather(HOST_RUNS["run"]).k.clone()
    host.gather(HOST_RUNS["run"]).k.zero_()
    assert torch.equal(host.gather(HOST_RUNS["run"]).k, kept) and kept.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_per_token_and_bytes_moved(dtype):
    host = host_pool(dtype)
    per_token = HostKVPool.bytes_per_token(LAYERS, HEADS, HEAD_DIM, dtype)
    assert host.nbytes == per_token * (HOST_SLOTS + 1)
    pool = device_pool()
    n = len(SOURCE)
    assert host.backup(pool, SOURCE, HOST_RUNS["run"]) == n * per_token
    assert host.load(HOST_RUNS["run"], pool, TARGET) == n * per_token
    assert host.encode(pool, SOURCE).nbytes == n * per_token


def test_int8_is_a_quarter_of_float32_plus_its_scales():
    fp32 = HostKVPool.bytes_per_token(LAYERS, HEADS, HEAD_DIM, "float32")
    int8 = HostKVPool.bytes_per_token(LAYERS, HEADS, HEAD_DIM, "int8")
    scales = 2 * LAYERS * HEADS * 4  # one float32 per token, layer, K/V and head
    assert int8 == fp32 // 4 + scales
    assert HostKVPool.bytes_per_token(LAYERS, HEADS, HEAD_DIM, "bfloat16") == fp32 // 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_slots_are_independent(dtype):
    pool = device_pool()
    host = host_pool(dtype)
    first, second = torch.tensor([1, 2, 3]), torch.tensor([4, 40, HOST_SLOTS])
    host.backup(pool, SOURCE[:3], first)
    kept = host.gather(first)
    host.store(second, host.encode(device_pool(seed=1), SOURCE[3:6]))
    host.backup(pool, SOURCE[3:6], second)  # rewriting neighbours and the last slot
    again = host.gather(first)
    assert torch.equal(bits(again.k), bits(kept.k)) and torch.equal(bits(again.v), bits(kept.v))
    # The unused row 0 decodes to zeros, like the device pool's padding slot.
    zero = torch.tensor([0])
    host.load(zero, pool, torch.tensor([5]))
    assert not rows(pool, torch.tensor([5])).any()


def test_allocator_covers_the_host_slots():
    host = host_pool("float16")
    assert host.size == HOST_SLOTS and host.dtype_name == "float16"
    assert host.allocator.size == HOST_SLOTS and host.allocator.num_free == HOST_SLOTS
    slots = host.allocator.alloc(HOST_SLOTS)
    assert sorted(slots.tolist()) == list(range(1, HOST_SLOTS + 1))
    assert host.allocator.alloc(1) is None


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_load_async_on_cpu_is_done_when_it_returns(dtype):
    pool = device_pool()
    host = host_pool(dtype)
    host.backup(pool, SOURCE, HOST_RUNS["scattered"])
    expected = host.gather(HOST_RUNS["scattered"])
    handle = host.load_async(HOST_RUNS["scattered"], pool, TARGET)
    assert isinstance(handle, LoadHandle) and handle.events == []
    assert handle.nbytes == len(SOURCE) * host.bytes_per_token(LAYERS, HEADS, HEAD_DIM, dtype)
    # Done before any wait: the rows read back through the block path are the same.
    other = torch.tensor([44, 45, 46, 47, 48, 49, 51])
    host.decode_into(expected, pool, other)
    assert torch.equal(bits(rows(pool, TARGET)), bits(rows(pool, other)))
    for layer in range(LAYERS):
        handle.wait_layer(layer)
    handle.wait()
    with pytest.raises(IndexError):
        handle.wait_layer(LAYERS)


@pytest.mark.parametrize("dtype", ["auto", "fp8", "float64"])
def test_bad_dtype_names_the_allowed_ones(dtype):
    with pytest.raises(ValueError, match="float32, bfloat16, float16, int8"):
        host_pool(dtype)


def test_mismatched_shapes_are_refused():
    host = host_pool("int8")
    pool = device_pool()
    with pytest.raises(ValueError, match="device slots"):
        host.backup(pool, SOURCE, HOST_RUNS["run"][:3])
    with pytest.raises(ValueError, match="does not match"):
        host.backup(device_pool(torch.bfloat16), SOURCE, HOST_RUNS["run"])
    with pytest.raises(ValueError, match="host format"):
        host.store(HOST_RUNS["run"], host_pool("float32").encode(pool, SOURCE))
    with pytest.raises(ValueError, match="expected"):
        host.store(HOST_RUNS["run"][:3], host.encode(pool, SOURCE))
