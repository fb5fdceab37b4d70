"""The KV pool: K and V tensors for every layer, allocated once at start-up.

Layout per layer: (num_slots + 1, num_kv_heads, head_dim); row 0 is the padding slot and is
kept zero so that a masked-out padded position can never inject NaN into attention. With
hybrid sliding-window memory (swa_pool.py) the `window_layers` get (window_slots + 1) rows
instead, indexed by window slot rather than by full slot.

On CPU the pool is pre-faulted by default, so the process's RSS is soon its RSS for good
instead of climbing as slots are first used: on Linux 5.14+ the scheduler loop maps its pages
a few MB at a time whenever it has nothing else to do (`map_idle_pages`, MADV_POPULATE_WRITE,
which writes nothing, so it is safe while the pool is already in use), and start-up does not
wait; elsewhere every page is written once before the pool is used (seconds per GiB on these
VMs).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from radixserve.cache.allocator import PADDING_SLOT

HUGE_PAGE = 2 << 20
SMALL_PAGE = 4096
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+: map pages writable without touching their contents
# IDLE_MAPPING: the pool's pages were first mapped by a background thread at SCHED_IDLE, 256
# MB per madvise. Its madvise holds the process's mmap lock; preempted by the forward's
# threads, it kept every allocation that needed the lock (malloc's mmaps and brk) waiting:
# AMD EPYC Zen 4, SmolLM2 fp32, 64 shared-prefix requests started as the pool was created:
# 18.9-20.4 s, against 14.8 s with the pool mapped before and 15.1 s not mapped at all. The
# scheduler loop maps them itself now, between steps, when idle: 2 MB per call takes ~5-6 ms
# on these VMs (pages are zeroed at ~330 MB/s), the most a request arriving then waits. The
# same run: 14.95 s. Through the server (`bench serving`, the same workload, started at the
# ready line): 3.80 -> 4.31 req/s, a decode step 42.1 -> 36.9 ms, of which the scheduler's
# part outside the forward (where the stalls landed) 21.5% -> 5.3%.
POPULATE_CHUNK = 2 << 20  # bytes per madvise call: one huge page
# MAPPING_THREADS: the VM backs a page the guest maps for the first time at ~150 MB/s per
# vCPU, and two vCPUs at twice that (AMD EPYC Zen 4 guest, 768 MB of fresh pages in 2 MB
# madvise calls: one thread 156 MB/s, two 270-314). So the pool maps two chunks at once, the
# caller's and a helper thread's: when idle (one chunk's wait for an arriving request, as
# before), and before a step that writes slots on pages not yet mapped (`map_for_slots`),
# which would otherwise fault them in one by one in the step's K/V copy (one thread; the
# other core waits). A fresh 20,000-token pool of SmolLM2's shape (fp32, 880 MB) written in
# 1,024-slot steps through a one-thread copy, each run in a new process 20 s after the last
# (pages the VM just backed for an earlier run map ~20x faster): faulted in 4.55-4.66 s,
# mapped first 2.47-2.69 s (benchmarks/kv_pool_mapping.py). Through the server, no-sharing
# at the ready line (a fresh 60,000-token pool; 1.7 GB of K/V written): 1.17, 1.26 -> 1.26,
# 1.28 req/s (alternated; memory freed by the previous run blurs it), 1.29 mapped first.
MAPPING_THREADS = 2

logger = logging.getLogger(__name__)


class KVPool:
    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        prefault: bool = True,
        window_layers: Sequence[int] = (),
        window_slots: int = 0,
    ) -> None:
        self.size = size
        self.window_layers = frozenset(window_layers)
        self.window_slots = window_slots if self.window_layers else 0
        rows = [
            (self.window_slots if layer in self.window_layers else size) + 1
            for layer in range(num_layers)
        ]
        start = time.perf_counter()
        # torch.empty: pages are only mapped when first written (here, or by the first token
        # stored in them when `prefault` is off).
        self.k = [torch.empty(n, num_kv_heads, head_dim, dtype=dtype, device=device) for n in rows]
        self.v = [torch.empty(n, num_kv_heads, head_dim, dtype=dtype, device=device) for n in rows]
        bufs = (*self.k, *self.v)
        cpu = self.k[0].device.type == "cpu"
        for buf in bufs:
            advise_huge_pages(buf)
            buf[0].zero_()
        # (offset in its buffer, address, end) of the pages left to map, last first
        # (`map_idle_pages` pops them): every buffer's first chunk, then every buffer's
        # second, ..., as slots are handed out from the lowest up
        self._unmapped: list[tuple[int, int, int]] = []
        self._mapping_seconds = 0.0
        self._helper: ThreadPoolExecutor | None = None  # maps beside the caller (MAPPING_THREADS)
        # a slot's K/V lie at slot * row_bytes in every buffer (not so in window layers)
        self._row_bytes = 0 if self.window_layers else self.k[0][0].nbytes
        how = ""
        if prefault and cpu and populate_pages(bufs[0]):
            chunks = []
            for index, buf in enumerate(bufs[1:]):
                start, end = page_span(buf)
                for a in range(start, end, POPULATE_CHUNK):
                    chunks.append((a - start, index, a, min(a + POPULATE_CHUNK, end)))
            self._unmapped = [(o, a, end) for o, _, a, end in sorted(chunks, reverse=True)]
            self._helper = ThreadPoolExecutor(MAPPING_THREADS - 1, "kv-pool-mapping")
            how = ", pages being mapped while the server is idle"
        elif prefault and cpu:
            for buf in bufs:
                touch_pages(buf)
            how = f", pre-faulted in {time.perf_counter() - start:.1f} s"
        logger.info(
            "KV pool: %d tokens x %d layers, %.2f GiB (%s)%s",
            size,
            num_layers,
            self.nbytes / 2**30,
            str(dtype).removeprefix("torch."),
            how,
        )
        if self.window_layers:
            logger.info(
                "KV pool: %d of the layers are sliding-window layers holding %d tokens each",
                len(self.window_layers),
                self.window_slots,
            )

    @property
    def mapping(self) -> bool:
        """Pages of the pool are left for `map_idle_pages` to map."""
        return bool(self._unmapped)

    @property
    def unmapped_bytes(self) -> int:
        """Bytes of the pool `map_idle_pages` has still to map (some of them may have been
        mapped since by the pool's users writing them first)."""
        return sum(end - address for _, address, end in self._unmapped)

    def map_idle_pages(self) -> bool:
        """Map the next MAPPING_THREADS chunks of the pool's unmapped pages at once; True
        while some remain. For the scheduler loop's idle time (IDLE_MAPPING): a page the
        pool's users write first is mapped by that write."""
        count = min(MAPPING_THREADS, len(self._unmapped))
        return self._map([self._unmapped.pop() for _ in range(count)])

    def map_for_slots(self, slots: torch.Tensor) -> None:
        """Before a step writes K/V into `slots`: map every unmapped chunk of every layer up
        to the highest of them now, MAPPING_THREADS at a time, rather than let the step's
        K/V copy fault the pages in. Slots go out from the lowest up, so this is the next
        few chunks, the ones the idle loop would have mapped next. (Window layers index
        their slots otherwise: their pool's pages are left to the idle loop and to faults.)"""
        if not self._unmapped or not self._row_bytes or not slots.numel():
            return
        # a buffer's data starts within a page of its first chunk
        limit = (int(slots.max()) + 1) * self._row_bytes + SMALL_PAGE
        chunks = []
        while self._unmapped and self._unmapped[-1][0] < limit:
            chunks.append(self._unmapped.pop())
        if chunks:
            self._map(chunks)

    def _map(self, chunks: list[tuple[int, int, int]]) -> bool:
        """Map the chunks, the helper thread taking every other one (madvise lets go of the
        GIL); True while chunks remain unmapped."""
        if not chunks:
            return False
        start = time.perf_counter()
        theirs = self._helper.submit(_populate_all, chunks[1::2]) if self._helper else None
        mapped = _populate_all(chunks[0::2] if theirs else chunks)
        if theirs is not None:
            mapped = theirs.result() and mapped
        self._mapping_seconds += time.perf_counter() - start
        if not mapped:  # out of memory, say
            logger.warning("KV pool: its pages are left to be mapped as first written")
            self._unmapped.clear()
        elif not self._unmapped:
            logger.info("KV pool: every page mapped (%.1f s of mapping)", self._mapping_seconds)
        if not self._unmapped and self._helper is not None:
            self._helper.shutdown(wait=False)
            self._helper = None
        return bool(self._unmapped)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's K and V, the padding slot included."""
        return sum(buf.numel() * buf.element_size() for buf in (*self.k, *self.v))

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def clear_padding_slot(self) -> None:
        """Zero the padding slot of every layer again (a CUDA graph's padding rows write
        their K/V there: model/cuda_graph.py)."""
        torch._foreach_zero_([t[PADDING_SLOT] for t in (*self.k, *self.v)])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of new tokens: k, v (T, kv_heads, head_dim) into `slots` (T,),
        rounded to the pool's dtype when it is narrower."""
        pool_k, pool_v = self.k[layer], self.v[layer]
        pool_k.index_copy_(0, slots, k.to(pool_k.dtype))
        pool_v.index_copy_(0, slots, v.to(pool_v.dtype))


def advise_huge_pages(buf: torch.Tensor) -> None:
    """Ask Linux to back a CPU tensor, not yet touched, with 2 MB pages. Decode attention
    reads rows scattered over a pool far larger than the TLB covers with 4 kB pages; with
    huge pages the batch-64 decode attention kernel measured ~1.3x faster on cold data.
    A no-op elsewhere, and where transparent huge pages are off."""
    if buf.device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    start = buf.data_ptr()
    end = start + buf.numel() * buf.element_size()
    first = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    last = end // HUGE_PAGE * HUGE_PAGE
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE)


def populate_pages(buf: torch.Tensor) -> bool:
    """Map every page of a CPU tensor now without writing to it (MADV_POPULATE_WRITE);
    False where the kernel cannot (before Linux 5.14, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    start, end = page_span(buf)
    return all(
        _populate_range(chunk, min(POPULATE_CHUNK, end - chunk))
        for chunk in range(start, end, POPULATE_CHUNK)
    )


def page_span(buf: torch.Tensor) -> tuple[int, int]:
    """(first page's address, end address) of a contiguous CPU tensor."""
    start = buf.data_ptr() // SMALL_PAGE * SMALL_PAGE
    return start, buf.data_ptr() + buf.numel() * buf.element_size()


def _populate_all(chunks: Sequence[tuple[int, int, int]]) -> bool:
    """MADV_POPULATE_WRITE over each (offset, address, end): True where all were mapped."""
    return all(_populate_range(address, end - address) for _, address, end in chunks)


def _populate_range(address: int, length: int) -> bool:
    """MADV_POPULATE_WRITE over [address, address + length): True where it mapped them."""
    advice = MADV_POPULATE_WRITE
    return not _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice)


def touch_pages(buf: torch.Tensor) -> None:
    """Write one element per 4 kB page of a contiguous tensor, so that the kernel maps (and
    zeroes) all of it now. Cheaper than `zero_()`, which writes every byte once more."""
    flat = buf.view(-1)
    flat[:: max(1, SMALL_PAGE // buf.element_size())].zero_()


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
