"""The host tier of the KV cache: a second KV store in host RAM, with its own slot allocator.

Its layout mirrors the device pool's: per layer, K and V of shape (size + 1, kv_heads,
head_dim), row 0 unused (so host slots are 1..size, like device slots). The storage dtype
may be narrower than the device pool's:

    float32 / bfloat16 / float16   a plain cast (float32 of a float32 pool is bit-exact)
    int8                           symmetric, one float32 scale per token and kv head:
                                   scale = amax(|x| over head_dim) / 127,
                                   q = round(x / scale) clamped to [-127, 127], x ~ q * scale

Two ways to move KV between the tiers:
- `backup` / `load` / `load_async` go layer by layer directly between the two pools'
  buffers, so their extra memory is one layer's rows at a time;
- `encode` / `decode_into` and `store` / `gather` go through a `KVBlock` of every layer,
  the format the disk tier keeps.
Conversion to and from the storage format runs on the device pool's device, so a narrower
storage dtype also means fewer bytes over the bus.

On CUDA, `load_async` issues each layer's host-to-device copy on a side stream and records
one event per layer, so the forward can start on layer 0 while later layers are in flight.
The source of each copy is pinned memory: the pool's own rows when the pool is pinned and
the host slots are one contiguous run, else a pinned staging copy gathered on the CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from radixserve.cache.allocator import SlotAllocator
from radixserve.cache.kv_block import KVBlock
from radixserve.cache.kv_pool import KVPool

STORAGE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}
INT8_MAX = 127
SCALE_DTYPE = torch.float32

logger = logging.getLogger(__name__)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> (q int8 (..., head_dim), scale float32 (...)), x ~ q * scale.
    An all-zero row gets scale 1, so it decodes to exact zeros."""
    x = x.to(SCALE_DTYPE)
    scale = x.abs().amax(dim=-1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / scale.unsqueeze(-1)).round_().clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_int8`, rounded to `dtype`."""
    return (q.to(SCALE_DTYPE) * scale.unsqueeze(-1)).to(dtype)


@dataclass
class LoadHandle:
    """A host-to-device load. Work queued on the current stream after `wait_layer(i)` sees
    layer i's rows in the device pool; `wait()` covers every layer. Without events (a CPU
    device pool) the copies were done before the handle was returned, and waits are no-ops."""

    num_layers: int
    nbytes: int  # host storage bytes read
    events: list[torch.cuda.Event] = field(default_factory=list)  # one per layer, on CUDA
    device: torch.device | None = None

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} of a load of {self.num_layers} layers")
        if self.events:
            self.events[layer].wait(torch.cuda.current_stream(self.device))

    def wait(self) -> None:
        if self.events:  # recorded in order on one stream: the last covers them all
            self.events[-1].wait(torch.cuda.current_stream(self.device))


class HostKVPool:
    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        device_dtype: torch.dtype,
        pin_memory: bool = False,
    ) -> None:
        if dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"host KV dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype!r}"
            )
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype_name = dtype
        self.storage_dtype = STORAGE_DTYPES[dtype]
        self.device_dtype = device_dtype  # the device pool's dtype, checked on every transfer
        self.quantized = dtype == "int8"
        # Pinned pages can be copied to and from the GPU asynchronously, without a bounce.
        self.pinned = pin_memory and torch.cuda.is_available()
        self.allocator = SlotAllocator(size)

        def buffers(shape: tuple[int, ...], dtype: torch.dtype, row0: float) -> list:
            bufs = [
                torch.empty(shape, dtype=dtype, pin_memory=self.pinned) for _ in range(num_layers)
            ]
            for buf in bufs:
                buf[0] = row0
            return bufs

        rows = (size + 1, num_kv_heads, head_dim)
        self.k = buffers(rows, self.storage_dtype, 0)
        self.v = buffers(rows, self.storage_dtype, 0)
        # Unused row 0 gets scale 1 and values 0: it decodes to zeros, like the padding slot.
        self.k_scale = buffers(rows[:2], SCALE_DTYPE, 1) if self.quantized else None
        self.v_scale = buffers(rows[:2], SCALE_DTYPE, 1) if self.quantized else None
        self._token_bytes = self.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        self._load_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending_loads: list[torch.cuda.Event] = []  # last event of each CUDA load
        logger.info(
            "host KV pool: %d tokens x %d layers, %.2f GiB (%s%s)",
            size,
            num_layers,
            self.nbytes / 2**30,
            dtype,
            ", pinned" if self.pinned else "",
        )

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
        """Host bytes of one token's K and V over every layer, int8 scales included."""
        values = 2 * num_layers * num_kv_heads * head_dim * STORAGE_DTYPES[dtype].itemsize
        scales = 2 * num_layers * num_kv_heads * SCALE_DTYPE.itemsize if dtype == "int8" else 0
        return values + scales

    @property
    def nbytes(self) -> int:
        """Bytes of every host buffer, the unused row 0 included."""
        bufs = [*self.k, *self.v, *(self.k_scale or ()), *(self.v_scale or ())]
        return sum(buf.numel() * buf.element_size() for buf in bufs)

    # --- through a KVBlock of every layer ---------------------------------------------------

    def encode(self, device_pool: KVPool, device_slots: torch.Tensor) -> KVBlock:
        """Rows `device_slots` of every layer of the device pool, in the storage format, on
        the host."""
        self._check_pool(device_pool)
        device_slots = device_slots.to(device_pool.k[0].device)
        layers = []  # per layer: [(k, k_scale), (v, v_scale)] on the host
        for layer in range(self.num_layers):
            kv = []
            for device_buf in (device_pool.k[layer], device_pool.v[layer]):
                data, scale = self._to_storage(device_buf.index_select(0, device_slots))
                kv.append((data.cpu(), None if scale is None else scale.cpu()))
            layers.append(kv)
        return _stack_layers(layers)

    def decode_into(self, block: KVBlock, device_pool: KVPool, device_slots: torch.Tensor) -> None:
        """Write a block (storage format) into device rows `device_slots`, converted to the
        device pool's dtype."""
        self._check_block(block, device_slots.numel())
        self._check_pool(device_pool)
        device = device_pool.k[0].device
        device_slots = device_slots.to(device)
        for layer in range(self.num_layers):
            device_bufs = (device_pool.k[layer], device_pool.v[layer])
            for device_buf, (data, scale) in zip(device_bufs, _block_layer(block, layer)):
                scale = None if scale is None else scale.to(device)
                rows = self._from_storage(data.to(device), scale, device_buf.dtype)
                device_buf.index_copy_(0, device_slots, rows)

    def store(self, host_slots: torch.Tensor, block: KVBlock) -> None:
        """Write a block (storage format) into host rows `host_slots`."""
        self._check_block(block, host_slots.numel())
        self._finish_pending_loads()
        host_slots = host_slots.cpu()
        for layer in range(self.num_layers):
            for (buf, scale_buf), (data, scale) in zip(
                self._host_layer(layer), _block_layer(block, layer)
            ):
                buf.index_copy_(0, host_slots, data)
                if scale_buf is not None:
                    scale_buf.index_copy_(0, host_slots, scale)

    def gather(self, host_slots: torch.Tensor) -> KVBlock:
        """Host rows `host_slots` of every layer as a block (a copy)."""
        host_slots = host_slots.cpu()
        layers = [
            [(buf.index_select(0, host_slots), _select(scales, host_slots)) for buf, scales in kv]
            for kv in map(self._host_layer, range(self.num_layers))
        ]
        return _stack_layers(layers)

    # --- directly between the pools, one layer at a time ------------------------------------

    def backup(
        self, device_pool: KVPool, device_slots: torch.Tensor, host_slots: torch.Tensor
    ) -> int:
        """Copy device rows `device_slots` into host rows `host_slots`; returns the host
        bytes written. Synchronous: the rows are on the host when it returns."""
        n = self._check_slots(device_slots, host_slots)
        self._check_pool(device_pool)
        self._finish_pending_loads()
        device_slots = device_slots.to(device_pool.k[0].device)
        host_slots = host_slots.cpu()
        for layer in range(self.num_layers):
            device_bufs = (device_pool.k[layer], device_pool.v[layer])
            for device_buf, (buf, scale_buf) in zip(device_bufs, self._host_layer(layer)):
                data, scale = self._to_storage(device_buf.index_select(0, device_slots))
                buf.index_copy_(0, host_slots, data.cpu())
                if scale_buf is not None:
                    scale_buf.index_copy_(0, host_slots, scale.cpu())
        return n * self._token_bytes

    def load(
        self, host_slots: torch.Tensor, device_pool: KVPool, device_slots: torch.Tensor
    ) -> int:
        """Copy host rows `host_slots` into device rows `device_slots`; returns the host bytes
        read. On CUDA the copies are ordered before later work on the current stream."""
        handle = self.load_async(host_slots, device_pool, device_slots)
        handle.wait()
        return handle.nbytes

    def load_async(
        self, host_slots: torch.Tensor, device_pool: KVPool, device_slots: torch.Tensor
    ) -> LoadHandle:
        """`load` without waiting. On CUDA each layer's copy runs on a side stream, after the
        work already queued on the current stream; `wait_layer(i)` orders layer i before
        later work on the current stream. On CPU the copies are done on return."""
        n = self._check_slots(device_slots, host_slots)
        self._check_pool(device_pool)
        device = device_pool.k[0].device
        cuda = device.type == "cuda" and torch.cuda.is_available()
        stream = self._load_stream(device) if cuda else None
        host_slots = host_slots.cpu()
        run = _contiguous_run(host_slots)
        # Without CUDA any source will do; with it, only pinned memory copies asynchronously.
        direct = run if run is not None and (self.pinned or not cuda) else None
        events: list[torch.cuda.Event] = []
        with torch.cuda.stream(stream):  # a no-op when stream is None
            device_slots = device_slots.to(device, non_blocking=True)
            if stream is not None:
                device_slots.record_stream(stream)  # it may belong to the current stream
            for layer in range(self.num_layers):
                device_bufs = (device_pool.k[layer], device_pool.v[layer])
                for device_buf, (buf, scale_buf) in zip(device_bufs, self._host_layer(layer)):
                    data = _read_rows(buf, host_slots, direct, pinned=cuda)
                    scale = None
                    if scale_buf is not None:
                        scale = _read_rows(scale_buf, host_slots, direct, pinned=cuda)
                        scale = scale.to(device, non_blocking=True)
                    data = data.to(device, non_blocking=True)
                    rows = self._from_storage(data, scale, device_buf.dtype)
                    device_buf.index_copy_(0, device_slots, rows)
                if stream is not None:
                    events.append(torch.cuda.Event())
                    events[-1].record(stream)
        if events:
            self._pending_loads = [e for e in self._pending_loads if not e.query()]
            self._pending_loads.append(events[-1])
        return LoadHandle(self.num_layers, n * self._token_bytes, events, device)

    # --- helpers ----------------------------------------------------------------------------

    def _to_storage(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Device rows (T, kv_heads, head_dim) -> (values, int8 scales (T, kv_heads) or None)."""
        if self.quantized:
            return quantize_int8(rows)
        return rows.to(self.storage_dtype), None

    def _from_storage(
        self, data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        return data.to(dtype) if scale is None else dequantize_int8(data, scale, dtype)

    def _host_layer(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """[(values, scales or None)] of the layer's K, then V, host buffers."""
        k_scale = None if self.k_scale is None else self.k_scale[layer]
        v_scale = None if self.v_scale is None else self.v_scale[layer]
        return [(self.k[layer], k_scale), (self.v[layer], v_scale)]

    def _load_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of loads onto `device`, made to wait for the current stream so a
        load never overtakes work already queued on the rows it overwrites."""
        if device not in self._load_streams:
            self._load_streams[device] = torch.cuda.Stream(device=device)
        stream = self._load_streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def _finish_pending_loads(self) -> None:
        """Before host rows are rewritten: a load reading a pinned pool's rows directly may
        still be in flight, so wait until every load issued so far is done."""
        for event in self._pending_loads:
            event.synchronize()
        self._pending_loads.clear()

    def _check_slots(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        n = host_slots.numel()
        if device_slots.numel() != n:
            raise ValueError(f"{device_slots.numel()} device slots for {n} host slots")
        return n

    def _check_pool(self, device_pool: KVPool) -> None:
        got = (len(device_pool.k), *device_pool.k[0].shape[1:], device_pool.k[0].dtype)
        expected = (self.num_layers, self.num_kv_heads, self.head_dim, self.device_dtype)
        if got != expected:
            raise ValueError(
                f"device pool (layers, kv_heads, head_dim, dtype) {got} does not "
                f"match the host pool's {expected}"
            )

    def _check_block(self, block: KVBlock, num_slots: int) -> None:
        expected = (self.num_layers, num_slots, self.num_kv_heads, self.head_dim)
        if tuple(block.k.shape) != expected or tuple(block.v.shape) != expected:
            raise ValueError(f"block of shape {tuple(block.k.shape)}, expected {expected}")
        if block.k.dtype != self.storage_dtype or (block.k_scale is not None) != self.quantized:
            raise ValueError(f"block is {block.k.dtype}, not in the host format {self.dtype_name}")


def _contiguous_run(slots: torch.Tensor) -> slice | None:
    """slots as a slice when they are one ascending run (a, a+1, ..., a+n-1), else None."""
    if slots.numel() == 0:
        return None
    first = int(slots[0])
    if slots.numel() > 1 and not bool((slots.diff() == 1).all()):
        return None
    return slice(first, first + slots.numel())


def _read_rows(
    buf: torch.Tensor, slots: torch.Tensor, run: slice | None, pinned: bool
) -> torch.Tensor:
    """buf[slots]: a view when `run` gives them as a slice, else a gathered copy, in pinned
    memory when `pinned` (the caching host allocator holds it until its copy is done)."""
    if run is not None:
        return buf[run]
    if not pinned:
        return buf.index_select(0, slots)
    out = torch.empty((slots.numel(), *buf.shape[1:]), dtype=buf.dtype, pin_memory=True)
    return torch.index_select(buf, 0, slots, out=out)


def _select(t: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, slots)


def _block_layer(block: KVBlock, layer: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """[(values, scales or None)] of one layer of a block, K then V."""
    k_scale = None if block.k_scale is None else block.k_scale[layer]
    v_scale = None if block.v_scale is None else block.v_scale[layer]
    return [(block.k[layer], k_scale), (block.v[layer], v_scale)]


def _stack_layers(layers: list[list[tuple[torch.Tensor, torch.Tensor | None]]]) -> KVBlock:
    """layers[i] = [(k, k_scale), (v, v_scale)] -> a KVBlock with a leading layer dimension."""

    def stack(kv: int, part: int) -> torch.Tensor | None:
        parts = [layer[kv][part] for layer in layers]
        return None if parts[0] is None else torch.stack(parts)

    return KVBlock(stack(0, 0), stack(1, 0), stack(0, 1), stack(1, 1))  # type: ignore[arg-type]
