"""The disk tier as the KV manager uses it: write a finished sequence's full pages, and
prefetch a queued request's pages into the host tier of the tree.

Pages are `PAGE_TOKENS` tokens at fixed positions (0, 64, 128, ...) of a sequence, keyed by
a chained hash of every token up to the page's end (`disk_store.page_keys`), so a key names
a whole prefix and a restarted server finds the same keys for the same tokens. The tree
never holds disk-only nodes: what is only on disk is found by its keys, and a prefetch
turns it into a host-only continuation (`HiRadixCache.insert_host`) that admission loads
back like any other.

Cost per request: one blake2b per 64 tokens of its sequence at queueing (to look its pages
up) and at release (to write the new ones); writes and reads run on the store's threads,
the scheduler only encodes the pages it writes (a copy of their KV) and, at admission,
waits at most the prefetch timeout for a read still running.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from radixserve.cache.disk_store import DiskStore, page_keys
from radixserve.cache.hiradix_cache import HiRadixCache
from radixserve.cache.kv_block import KVBlock

PAGE_TOKENS = 64
MIN_PREFETCH_PAGES = 1

logger = logging.getLogger(__name__)


@dataclass
class Prefetch:
    """A queued request's read of its pages from disk."""

    start: int  # the first token the pages cover (a page boundary)
    end: int  # one past the last
    future: concurrent.futures.Future


class StorageTier:
    def __init__(
        self, store: DiskStore, tree: HiRadixCache, namespace: str, page_tokens: int = PAGE_TOKENS
    ) -> None:
        self.store = store
        self.tree = tree
        self.namespace = namespace
        self.page_tokens = page_tokens
        self.prefetched_tokens = 0  # tokens prefetches brought into the host tier
        self.prefetch_timeouts = 0
        self.errors = 0  # disk tier faults (logged): a miss or a lost write, never a failure

    @staticmethod
    def namespace_of(model: str, dtype: str, num_layers: int, kv_heads: int, head_dim: int) -> str:
        """What makes pages interchangeable: the model and the storage format."""
        digest = hashlib.blake2b(model.encode(), digest_size=8).hexdigest()
        return f"{digest}/{dtype}/{num_layers}x{kv_heads}x{head_dim}/p{PAGE_TOKENS}"

    def keys(self, tokens: Sequence[int], extra_key: Hashable) -> list[str]:
        return page_keys(tokens, self.page_tokens, self.namespace, extra_key)

    # -- writing --------------------------------------------------------------------------
    def write(self, tokens: Sequence[int], slots: torch.Tensor, extra_key: Hashable) -> int:
        """Queue the full pages of `tokens` (their KV in device `slots`) the disk lacks;
        returns the pages queued. A fault is logged and the pages are not written."""
        try:
            return self._write(tokens, slots, extra_key)
        except Exception:
            self.errors += 1
            logger.exception("disk tier: pages not written")
            return 0

    def _write(self, tokens: Sequence[int], slots: torch.Tensor, extra_key: Hashable) -> int:
        keys = self.keys(tokens, extra_key)
        queued = 0
        tree = self.tree
        for i, key in enumerate(keys):
            if self.store.contains(key):
                continue
            page = slots[i * self.page_tokens : (i + 1) * self.page_tokens]
            block = tree.host_pool.encode(tree.device_pool, page)
            self.store.put_async(key, block)
            queued += 1
        return queued

    # -- reading --------------------------------------------------------------------------
    def start_prefetch(self, tokens: Sequence[int], extra_key: Hashable) -> Prefetch | None:
        """Start reading the pages of `tokens` past what the tree holds, if the disk has
        any (the leading run of them). A fault is logged: no prefetch."""
        try:
            return self._start_prefetch(tokens, extra_key)
        except Exception:
            self.errors += 1
            logger.exception("disk tier: no prefetch")
            return None

    def _start_prefetch(self, tokens: Sequence[int], extra_key: Hashable) -> Prefetch | None:
        cached = self.tree.peek_prefix(tokens, extra_key).length
        keys = self.keys(tokens, extra_key)
        first = cached // self.page_tokens
        last = first
        while last < len(keys) and self.store.contains(keys[last]):
            last += 1
        if last - first < MIN_PREFETCH_PAGES:
            return None
        future = self.store.prefetch(keys[first:last])
        return Prefetch(first * self.page_tokens, last * self.page_tokens, future)

    def finish_prefetch(
        self, prefetch: Prefetch, tokens: Sequence[int], extra_key: Hashable, timeout: float
    ) -> int:
        """Put what a prefetch read into the tree's host tier, waiting at most `timeout`
        seconds for it; returns the tokens added."""
        try:
            blocks = prefetch.future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            self.prefetch_timeouts += 1
            prefetch.future.cancel()
            return 0
        except Exception:  # a read that failed is a miss, not a failed request
            self.errors += 1
            logger.exception("disk tier: a prefetch failed")
            return 0
        if not blocks:
            return 0
        end = prefetch.start + len(blocks) * self.page_tokens
        added = self.tree.insert_host(tokens[:end], prefetch.start, KVBlock.cat(blocks), extra_key)
        self.prefetched_tokens += added
        return added

    def close(self) -> None:
        self.store.close()
