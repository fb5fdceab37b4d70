"""The disk tier of the hierarchical KV cache: one file per page, named by a chained hash.

A page is `page_tokens` tokens of KV (a `KVBlock`). Its key, from `page_keys`, hashes the
page's tokens together with the key of the page before it, so a key names a page *and*
everything before it: two prompts share a key exactly when they share that whole prefix.

Contract (what callers may rely on):
- `contains(key)` is an index lookup; it never touches the disk.
- `get(key)` returns the page or None: missing, torn, corrupt or of another namespace are
  all None (bad files are logged, counted, dropped from the index and deleted); it never
  raises for a bad file. A hit refreshes the page's use, so eviction keeps pages in use.
- `put` writes synchronously; `put_async` queues the write for one background thread and
  drops it (counted) when the queue is full. A queued block is written later: the caller
  hands it over and must not write to its tensors afterwards (pass clones of reused memory).
- `prefetch(keys)` loads the longest leading run of keys that load fine, on a small pool.
- Files of another namespace (model, storage dtype, page size: the caller builds the
  string) are never returned: each namespace lives in its own subdirectory and each file's
  header repeats its namespace and key, checked on read.
- Writes go to `<key>.<pid>.<random>.tmp` in the same directory and are renamed onto
  `<key>.kv`; readers only open final names, so servers sharing a directory never see a
  partial write. A page another server wrote is found by `get` even if this index lacks it.
- `max_bytes` bounds the bytes this store's index accounts for; after each write the least
  recently used files are deleted (never the one just written).

File layout:

    [ magic 8B | version u16 | header length u32 ][ JSON header ][ payload: safetensors ]

The JSON header holds namespace, key, num_tokens, payload_bytes and the payload's blake2b
checksum; the payload holds k, v and, with int8 storage, k_scale and v_scale.
Nothing here imports the model, the scheduler or the server.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from radixserve.cache.kv_block import KVBlock

logger = logging.getLogger(__name__)

MAGIC = b"RSKVPAGE"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHI")  # magic, format version, JSON header length
_DIGEST_SIZE = 16  # 32 hex chars: collisions are out of reach for any cache size
_KEY_RE = re.compile(r"[0-9a-f]{32}")
_STALE_TMP_SECONDS = 60.0  # a temp file this old belongs to a writer that died
_TENSOR_NAMES = ("k", "v", "k_scale", "v_scale")


def page_keys(
    tokens: Sequence[int], page_tokens: int, namespace: str, extra_key: object = None
) -> list[str]:
    """One key per full page of `tokens`: key_i = blake2b(key_{i-1} + page i's token ids as
    little-endian int64), with key_{-1} = blake2b(namespace + repr(extra_key)). A partial
    last page gets no key."""
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
    prev = hashlib.blake2b(
        (namespace + repr(extra_key)).encode(), digest_size=_DIGEST_SIZE
    ).digest()
    keys = []
    for start in range(0, len(tokens) // page_tokens * page_tokens, page_tokens):
        page = [int(t) for t in tokens[start : start + page_tokens]]
        h = hashlib.blake2b(prev, digest_size=_DIGEST_SIZE)
        h.update(struct.pack(f"<{page_tokens}q", *page))
        prev = h.digest()
        keys.append(h.hexdigest())
    return keys


@dataclass
class DiskStoreStats:
    """Counters since the store opened (seconds are wall time spent in file I/O + coding)."""

    pages_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    pages_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    corrupt_skipped: int = 0  # files that failed to verify (torn, corrupt, other namespace)
    writes_dropped: int = 0  # put_async calls dropped because the queue was full
    write_errors: int = 0  # writes that failed with an OS error (disk full, permissions)
    evicted_files: int = 0

    def __getitem__(self, name: str) -> int | float:
        return getattr(self, name)

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


class CorruptPage(Exception):
    """A page file that does not verify; the message says why."""


def encode_page(namespace: str, key: str, block: KVBlock) -> bytes:
    """The bytes of a page file for `block`."""
    tensors = {
        name: t.detach().to("cpu").contiguous()
        for name in _TENSOR_NAMES
        if (t := getattr(block, name)) is not None
    }
    payload = save_tensors(tensors)
    header = json.dumps(
        {
            "namespace": namespace,
            "key": key,
            "num_tokens": block.num_tokens,
            "payload_bytes": len(payload),
            "checksum": _checksum(payload),
        }
    ).encode()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + payload


def decode_page(data: bytes, namespace: str, key: str, page_tokens: int) -> KVBlock:
    """The block in a page file's bytes; raises CorruptPage if anything does not check."""
    if len(data) < _PREFIX.size:
        raise CorruptPage(f"{len(data)} bytes is shorter than the file prefix")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptPage("bad magic bytes")
    if version != FORMAT_VERSION:
        raise CorruptPage(f"format version {version}, expected {FORMAT_VERSION}")
    payload_start = _PREFIX.size + header_len
    try:
        header = json.loads(data[_PREFIX.size : payload_start])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptPage(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise CorruptPage("header is not an object")
    if header.get("namespace") != namespace:
        raise CorruptPage(f"namespace {header.get('namespace')!r}, expected {namespace!r}")
    if header.get("key") != key:
        raise CorruptPage(f"header names key {header.get('key')!r}")
    payload = data[payload_start:]
    if len(payload) != header.get("payload_bytes"):
        raise CorruptPage(
            f"payload is {len(payload)} bytes, header says "
            f"{header.get('payload_bytes')} (torn write?)"
        )
    if _checksum(payload) != header.get("checksum"):
        raise CorruptPage("payload checksum mismatch")
    try:
        tensors = load_tensors(payload)
    except SafetensorError as e:
        raise CorruptPage(f"unreadable payload: {e}") from None
    if "k" not in tensors or "v" not in tensors or set(tensors) - set(_TENSOR_NAMES):
        raise CorruptPage(f"unexpected tensors {sorted(tensors)}")
    block = KVBlock(**tensors)
    if block.num_tokens != header.get("num_tokens") or block.num_tokens != page_tokens:
        raise CorruptPage(f"{block.num_tokens} tokens, expected {page_tokens}")
    return block


def _checksum(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=_DIGEST_SIZE).hexdigest()


class DiskStore:
    """Pages of KV on disk under `directory`, at most `max_bytes` of them (None: no cap)."""

    def __init__(
        self,
        directory: str | Path,
        namespace: str,
        page_tokens: int,
        max_bytes: int | None,
        *,
        queue_size: int = 64,  # pages waiting for the writer; beyond it put_async drops
        prefetch_threads: int = 2,  # readers for prefetch (disk reads release the GIL)
    ) -> None:
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.namespace = namespace
        self.page_tokens = page_tokens
        self.max_bytes = max_bytes
        ns_hash = hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()
        self.directory = Path(directory) / ns_hash
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stats = DiskStoreStats()

        self._lock = threading.Lock()  # guards _index, _used_bytes, _pending and stats
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size; LRU first
        self._used_bytes = 0
        self._scan()
        self._evict(keep=None)

        self._pending: set[str] = set()  # keys queued or being written by the writer
        self._drained = threading.Condition(self._lock)  # notified when _pending empties
        self._queue: queue.Queue[tuple[str, KVBlock] | None] = queue.Queue(queue_size)
        self._writer_alive = True
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="disk-kv-writer", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(prefetch_threads, thread_name_prefix="disk-kv-read")

    # --- queries -------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used_bytes

    @property
    def num_pages(self) -> int:
        with self._lock:
            return len(self._index)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    # --- writes --------------------------------------------------------------------------

    def put(self, key: str, block: KVBlock) -> bool:
        """Write the page now; False if it is already stored (or the write failed)."""
        self._check(key, block)
        if self.contains(key):
            return False
        return self._write(key, block)

    def put_async(self, key: str, block: KVBlock) -> None:
        """Queue the page for the background writer (see the module's contract)."""
        self._check(key, block)
        with self._lock:
            if self._closed or not self._writer_alive:
                raise RuntimeError("the disk store is closed or its writer thread died")
            if key in self._index or key in self._pending:
                return
            self._pending.add(key)
        try:
            self._queue.put_nowait((key, block))
        except queue.Full:
            with self._lock:
                self.stats.writes_dropped += 1
                self._done_pending(key)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write has landed; TimeoutError if `timeout` runs out."""
        with self._drained:
            if not self._drained.wait_for(lambda: not self._pending, timeout):
                raise TimeoutError(f"{len(self._pending)} disk writes still pending")

    def close(self) -> None:
        """Flush, then stop the writer and the readers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush()
        if self._writer.is_alive():
            self._queue.put(None)
        self._writer.join()
        self._readers.shutdown(wait=True)

    def _check(self, key: str, block: KVBlock) -> None:
        if not _KEY_RE.fullmatch(key):
            raise ValueError(f"not a page key: {key!r}")
        if block.num_tokens != self.page_tokens:
            raise ValueError(f"a page is {self.page_tokens} tokens, got {block.num_tokens}")

    def _write_loop(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                key, block = item
                try:
                    if not self.contains(key):
                        self._write(key, block)
                finally:
                    with self._lock:
                        self._done_pending(key)
        finally:  # also when a bug kills the thread: flush must not wait forever
            with self._lock:
                self._writer_alive = False
                self._pending.clear()
                self._drained.notify_all()

    def _done_pending(self, key: str) -> None:  # caller holds the lock
        self._pending.discard(key)
        if not self._pending:
            self._drained.notify_all()

    def _write(self, key: str, block: KVBlock) -> bool:
        start = time.perf_counter()
        data = encode_page(self.namespace, key, block)
        final = self._path(key)
        tmp = self.directory / f"{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError as e:
            logger.warning("disk KV cache: writing %s failed: %s", final, e)
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.stats.write_errors += 1
            return False
        with self._lock:
            self._add(key, len(data))
            self.stats.pages_written += 1
            self.stats.bytes_written += len(data)
            self.stats.write_seconds += time.perf_counter() - start
        self._evict(keep=key)
        return True

    # --- reads ---------------------------------------------------------------------------

    def get(self, key: str) -> KVBlock | None:
        """The page, or None if it is missing or does not verify (see the module's contract)."""
        if not _KEY_RE.fullmatch(key):
            raise ValueError(f"not a page key: {key!r}")
        start = time.perf_counter()
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:  # never written, or evicted by a server sharing the dir
            self._forget(key)
            return None
        try:
            block = decode_page(data, self.namespace, key, self.page_tokens)
        except CorruptPage as e:
            logger.warning("disk KV cache: skipping %s: %s", path, e)
            with self._lock:
                self.stats.corrupt_skipped += 1
            self._forget(key)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # the use a restart's scan sees
            still_there = True
        except FileNotFoundError:  # evicted while we read it: the bytes are still good
            still_there = False
        with self._lock:
            if still_there:  # refreshes use; indexes a page another server wrote
                self._add(key, len(data))
            self.stats.pages_read += 1
            self.stats.bytes_read += len(data)
            self.stats.read_seconds += time.perf_counter() - start
        return block

    def get_many(self, keys: Iterable[str]) -> list[KVBlock] | None:
        """Every page in order, or None if any is missing or bad."""
        blocks = []
        for key in keys:
            if (block := self.get(key)) is None:
                return None
            blocks.append(block)
        return blocks

    def prefetch(self, keys: list[str]) -> Future[list[KVBlock]]:
        """A future of the pages of the longest leading run of `keys` that load fine."""
        return self._readers.submit(self._load_leading_run, list(keys))

    def _load_leading_run(self, keys: list[str]) -> list[KVBlock]:
        blocks = []
        for key in keys:
            if (block := self.get(key)) is None:
                break
            blocks.append(block)
        return blocks

    # --- the index -----------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.kv"

    def _add(self, key: str, size: int) -> None:  # caller holds the lock; most recent use
        self._used_bytes += size - self._index.pop(key, 0)
        self._index[key] = size

    def _forget(self, key: str) -> None:
        with self._lock:
            self._used_bytes -= self._index.pop(key, 0)

    def _scan(self) -> None:
        """Index the final files, oldest use first (file mtime); drop stale temp files."""
        now = time.time()
        found = []
        for entry in os.scandir(self.directory):
            name = entry.name
            try:
                st = entry.stat()
            except FileNotFoundError:  # removed by another server meanwhile
                continue
            if name.endswith(".tmp"):
                if now - st.st_mtime > _STALE_TMP_SECONDS:
                    Path(entry.path).unlink(missing_ok=True)
            elif name.endswith(".kv") and _KEY_RE.fullmatch(name[:-3]):
                found.append((st.st_mtime_ns, name[:-3], st.st_size))
        for _, key, size in sorted(found):
            self._add(key, size)

    def _evict(self, keep: str | None) -> None:
        """Delete least recently used files until used_bytes <= max_bytes, never `keep`."""
        if self.max_bytes is None:
            return
        victims = []
        with self._lock:
            for key in list(self._index):
                if self._used_bytes <= self.max_bytes:
                    break
                if key == keep:
                    continue
                self._used_bytes -= self._index.pop(key)
                victims.append(key)
            self.stats.evicted_files += len(victims)
        for key in victims:
            self._path(key).unlink(missing_ok=True)
