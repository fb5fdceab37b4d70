"""Attention backends: they write the new tokens' K/V into the pool and attend over the pool.

The interface is two calls: `prepare(batch)` once per forward pass (index and mask building
shared by all layers), then `forward(layer, q, k, v, meta)` in every layer. Faster backends
(Triton kernels, CUDA graphs) implement the same two calls.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from radixserve.cache import KVPool, ReqToTokenPool
from radixserve.cache.allocator import PADDING_SLOT
from radixserve.core.batch import ForwardBatch, ForwardMode
from radixserve.model.cpu_kernels import function_address, load_kernel, profiled

logger = logging.getLogger(__name__)


@dataclass
class AttentionGroup:
    """Requests attended together in one SDPA (or decode kernel) call."""

    # their flat token positions: (T_g,) indices, or a slice where they are one stretch (a
    # mixed step's prefill rows, then its decode rows); None: every token
    tokens: torch.Tensor | slice | None
    kv_index: torch.Tensor | None  # (B, S) slot of each key position, padding → PADDING_SLOT;
    # None: the decode kernel reads the slots from the request→token table itself
    mask: torch.Tensor | None  # (B, 1, Q, S) bool, True where a query may attend a key
    is_causal: bool  # no mask needed: one request, no cached prefix, plain causal
    q_index: torch.Tensor | None  # (T_g,) token → row of the padded (B*Q) layout; None: identity
    max_q: int
    req_rows: torch.Tensor | None = None  # (B,) for the decode kernel
    seq_lens: torch.Tensor | None = None  # (B,) for the decode kernel
    # Prompts with no cached prefix: each attends causally over its own new K/V, one SDPA
    # call per request (no gather, no padding, no mask; SDPA's causal path skips the
    # blocks above the diagonal, which an explicit mask cannot). Their lengths, in order.
    causal_lens: list[int] | None = None
    # Sliding-window layers' variant of the group: keys of a query at position p are those
    # at p - window < s <= p (0: every key). The decode kernel skips the earlier keys; the
    # masks say it for SDPA.
    window: int = 0
    causal_masks: list[torch.Tensor | None] | None = None  # (n, n) band per causal_lens entry
    # Hybrid window memory: the decode kernel's table, (B, min(seq, W)) window slots of each
    # request's last positions (rows are then 0..B-1); None: the request→token table
    decode_table: torch.Tensor | None = None
    # The extend kernel's group (with req_rows): each request's cached prefix and new tokens
    prefix_lens: torch.Tensor | None = None  # (B,)
    extend_lens: torch.Tensor | None = None  # (B,)


@dataclass
class TorchNativeMetadata:
    out_slots: torch.Tensor  # (T,) where the new tokens' K/V go
    groups: list[AttentionGroup]  # one, or the decode rows and extend rows of a mixed batch
    kv_loads: list = field(default_factory=list)  # ForwardBatch.kv_loads
    # window → the groups of the layers with that sliding window, where some request is
    # longer than it (else those layers use `groups`: the window holds every key)
    window_groups: dict[int, list[AttentionGroup]] = field(default_factory=dict)
    window_out_slots: torch.Tensor | None = None  # (T,) hybrid window memory: window slots


SEGMENT_DECODE, SEGMENT_EXTEND = 0, 1  # decode_layers.cpp's Segment kinds


class AttentionSegment(NamedTuple):
    """A stretch of a step's rows attended by one kernel call, as `forward` calls it."""

    kind: int  # SEGMENT_DECODE: one-token rows; SEGMENT_EXTEND: new tokens after a prefix
    kernel: int  # the kernel's address
    start: int  # its first row in the step
    req_rows: torch.Tensor  # (B,) each request's row in the request→token table
    lens: torch.Tensor  # (B,) sequence lengths (decode) or cached prefixes' lengths (extend)
    extend_lens: torch.Tensor | None  # (B,) new tokens (extend)
    code: int  # the kernel's dtype code for queries, pool and output of the step's dtype


class DriverView(NamedTuple):
    """A step as `decode_layers.cpp` runs its attention (`driver_view`)."""

    pool_k: list[torch.Tensor]  # per layer (N, KH, D)
    pool_v: list[torch.Tensor]
    slots: torch.Tensor  # (T,) where each row's K/V go
    table: torch.Tensor  # the request→token table (R, C)
    segments: tuple[AttentionSegment, ...]  # in the rows' order, covering every row


KERNEL_ISAS = ("amx", "avx512", "avx2")  # the decode kernel's builds, best first


class DeviceDecodeKernel(Protocol):
    """A decode kernel for a device the C++ ones do not run on (triton_attention.py on
    CUDA), called as they are: one-token rows attend `table[req_rows[b], :seq_lens[b]]`."""

    def supports(self, heads: int, kv_heads: int, head_dim: int) -> bool: ...

    def __call__(
        self,
        q: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        table: torch.Tensor,
        req_rows: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor: ...


class AttentionBackend(Protocol):
    def prepare(self, batch: ForwardBatch) -> object: ...

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object
    ) -> torch.Tensor: ...

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: object) -> None: ...


class TorchNativeAttention:
    """Gather K/V by slot index into a padded (B, heads, S, D) batch, then one SDPA call.

    Works on CPU and CUDA. Queries are padded to the longest extend length of the batch
    (1 in decode mode); the mask encodes causality after each request's cached prefix and
    the padding of keys and queries.

    A pool in another dtype than the queries (e.g. `--kv-cache-dtype bfloat16` under an
    fp32 model) is read in its own dtype and the gathered K/V widened to the queries'.

    With `use_kernel` (on x86 CPUs, the kernel plan's choice), one-token rows (decode
    steps) go to the C++ decode kernel instead (`decode_attention.cpp`, or with `kernel_isa`
    "avx512" its AVX-512 variant, "amx" that one built with AMX), which reads K/V where they
    lie in the pool, in fp32, bf16 or fp16: no gathered copy, no padding, no mask. A
    `device_kernel` (the Triton one on CUDA) takes those rows ahead of them. With
    `use_extend_kernel` (a model over a pool of its own dtype: fp32 on AVX2,
    `extend_attention.cpp`; fp32 or bf16 on AVX-512 + AVX512-BF16,
    `extend_attention_avx512.cpp`) the other rows (prompts, with or without a cached
    prefix) go to the extend kernel, which reads the pool in place too; not with hybrid
    window memory, nor in a sliding-window layer whose window is shorter than some request
    (those keep SDPA and its masks).

    `windows` gives each layer's sliding window (Gemma 3's local layers: a query at
    position p attends the keys at p - W < s <= p), 0 for layers that attend every key;
    `prepare` builds one more set of groups per window that matters for the batch.

    With hybrid window memory (`window_map`, the allocator's full_to_swa, cache/swa_pool.py)
    the window layers' pool rows are window slots: their writes and gathers go through the
    map (keys outside the window may map to the zero padding row: they are masked), and
    the decode kernel reads a compact table of each request's last W window slots, so it
    never touches a position outside the window. Full layers are unchanged.
    """

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        scale: float,
        num_heads: int,
        use_kernel: bool = True,
        kernel_dir: Path | None = None,
        windows: Sequence[int] = (),
        window_map: torch.Tensor | None = None,
        kernel_isa: str = "avx2",
        use_extend_kernel: bool = False,
        device_kernel: DeviceDecodeKernel | None = None,
    ) -> None:
        self.kv_pool = kv_pool
        self.window_map = window_map  # (pool size + 1,) full slot → window slot, or None
        self.req_to_token = req_to_token
        self.scale = scale
        self.windows = [int(w) for w in windows]  # per layer; missing or 0: no window
        if any(w < 0 for w in self.windows):
            raise ValueError(f"sliding windows must be >= 0, got {sorted(set(self.windows))}")
        _, kv_heads, head_dim = kv_pool.k[0].shape
        self.decode_kernel = None
        if device_kernel is not None and device_kernel.supports(num_heads, kv_heads, head_dim):
            self.decode_kernel = device_kernel
        # the plan's build, else the next one down, that loads and takes these heads (head
        # size a multiple of 32, at most 8 query heads per KV head; AMX: head size <= 256)
        builds = KERNEL_ISAS[KERNEL_ISAS.index(kernel_isa) :] if use_kernel else ()
        for isa in builds if self.decode_kernel is None else ():
            kernel = decode_attention_kernel(kernel_dir, isa)
            if kernel is not None and kernel.supports(num_heads, kv_heads, head_dim):
                self.decode_kernel = kernel
                break
        self.extend_kernel = None
        if use_extend_kernel and window_map is None:
            kernel = extend_attention_kernel(kernel_dir, kernel_isa)
            if (
                kernel is not None
                and kv_pool.k[0].dtype in kernel.dtypes
                and kernel.supports(num_heads, kv_heads, head_dim)
            ):
                self.extend_kernel = kernel

    def prepare(self, batch: ForwardBatch) -> TorchNativeMetadata:
        """The groups every full-attention layer uses, and those of each sliding window
        shorter than some request of the batch."""
        meta = TorchNativeMetadata(batch.out_slots, self._groups(batch, 0), batch.kv_loads)
        longest = max(batch.seq_lens)
        for window in sorted(set(self.windows) - {0}):
            if longest > window:
                meta.window_groups[window] = self._groups(batch, window)
        if self.window_map is not None:
            self._to_window_memory(meta)
        return meta

    def _to_window_memory(self, meta: TorchNativeMetadata) -> None:
        """Every window's groups (its own, or the full ones where the window holds every
        key) re-expressed in window slots."""
        wmap = self.window_map
        assert wmap is not None
        meta.window_out_slots = wmap[meta.out_slots]
        for window in sorted(set(self.windows) - {0}):
            base = meta.window_groups.get(window, meta.groups)
            meta.window_groups[window] = [self._window_group(g, window) for g in base]

    def _window_group(self, group: AttentionGroup, window: int) -> AttentionGroup:
        assert self.window_map is not None
        if group.causal_lens is not None:  # attends the batch's own K/V: no pool read
            return group
        if group.kv_index is not None:
            return dataclasses.replace(group, kv_index=self.window_map[group.kv_index])
        assert group.req_rows is not None and group.seq_lens is not None
        seq_lens = group.seq_lens  # (B,)
        kept = seq_lens.clamp(max=window)  # (B,) the positions a query can see
        span = torch.arange(int(kept.max()), device=seq_lens.device)  # (K,)
        valid = span[None, :] < kept[:, None]  # (B, K)
        pos = torch.where(valid, (seq_lens - kept)[:, None] + span[None, :], 0)  # (B, K)
        full = self.req_to_token.table[group.req_rows[:, None], pos]  # (B, K) full slots
        table = torch.where(valid, self.window_map[full], PADDING_SLOT).contiguous()
        rows = torch.arange(len(seq_lens), device=seq_lens.device)
        return dataclasses.replace(
            group, req_rows=rows, seq_lens=kept, window=0, decode_table=table
        )

    def _groups(self, batch: ForwardBatch, window: int) -> list[AttentionGroup]:
        """One group, except for an extend batch mixing one-token rows (decode steps) with
        longer ones (e.g. jump-forward): padding every row's queries to the longest would
        multiply the decode rows' attention work, so the two kinds are attended apart."""
        lens = batch.extend_lens
        single = [i for i, n in enumerate(lens) if n == 1]
        if batch.mode is ForwardMode.DECODE or not single or len(single) == len(lens):
            return [self._group(batch, list(range(batch.batch_size)), None, window)]
        device = batch.input_ids.device
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        kinds = (single, [i for i, n in enumerate(lens) if n > 1])
        tokens = [[starts[i] + j for i in rows for j in range(lens[i])] for rows in kinds]
        if all(t == list(range(t[0], t[0] + len(t))) for t in tokens):  # one stretch each
            kinds, tokens = zip(*sorted(zip(kinds, tokens, strict=True), key=lambda kt: kt[1][0]))
            index = [slice(t[0], t[0] + len(t)) for t in tokens]  # in the batch's order
        else:
            index = [torch.tensor(t, device=device) for t in tokens]
        return [self._group(batch, rows, i, window) for rows, i in zip(kinds, index, strict=True)]

    def _group(
        self, batch: ForwardBatch, rows: list[int], tokens: torch.Tensor | None, window: int
    ) -> AttentionGroup:
        """Indices and mask for the batch's requests `rows` (all of them when tokens is
        None), with keys limited to the sliding `window` when it is not 0."""
        device = batch.input_ids.device
        all_seq_lens = batch.seq_lens  # a property: built once here, not once per row
        seq_list = [all_seq_lens[i] for i in rows]
        prefix_list = [batch.prefix_lens[i] for i in rows]
        extend_list = [batch.extend_lens[i] for i in rows]
        seq_lens = torch.tensor(seq_list, device=device)
        req_rows = batch.req_rows if tokens is None else batch.req_rows[rows]
        if window and max(seq_list) <= window:
            window = 0  # every key of these requests is inside the window
        if self.decode_kernel is not None and all(n == 1 for n in extend_list):
            return AttentionGroup(
                tokens, None, None, False, None, 1, req_rows, seq_lens, window=window
            )
        if self.extend_kernel is not None and not window:
            return AttentionGroup(
                tokens,
                None,
                None,
                False,
                None,
                max(extend_list),
                req_rows,
                prefix_lens=torch.tensor(prefix_list, device=device),
                extend_lens=torch.tensor(extend_list, device=device),
            )
        if max(extend_list) > 1 and not any(prefix_list):
            masks = None
            if window:
                masks = [_band_mask(n, window, device) if n > window else None for n in extend_list]
            return AttentionGroup(
                tokens,
                None,
                None,
                True,
                None,
                max(extend_list),
                None,
                None,
                extend_list,
                window=window,
                causal_masks=masks,
            )
        prefix_lens = torch.tensor(prefix_list, device=device)
        extend_lens = torch.tensor(extend_list, device=device)
        max_s = max(seq_list)
        max_q = max(extend_list)

        key_pos = torch.arange(max_s, device=device)  # (S,)
        key_valid = key_pos[None, :] < seq_lens[:, None]  # (B, S)
        kv_index = self.req_to_token.table[req_rows, :max_s]
        kv_index = torch.where(key_valid, kv_index, PADDING_SLOT)

        q_off = torch.arange(max_q, device=device)  # (Q,)
        q_pos = prefix_lens[:, None] + q_off[None, :]  # (B, Q) absolute position of each query
        mask = key_valid[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # (B,Q,S)
        if window:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
        # Padded query rows attend to key 0 only, so their softmax stays finite; discarded.
        q_pad = q_off[None, :] >= extend_lens[:, None]  # (B, Q)
        mask = torch.where(q_pad[:, :, None], key_pos[None, None, :] == 0, mask)

        q_index = None
        if max_q > 1 and not all(n == max_q for n in extend_list):
            starts = torch.arange(len(rows), device=device) * max_q
            q_index = torch.repeat_interleave(starts, extend_lens) + _ragged_arange(extend_lens)
        # Cheaper special cases (same result): SDPA's own causal path, or no mask at all.
        is_causal = len(rows) == 1 and prefix_list[0] == 0 and max_q > 1 and not window
        unmasked = max_q == 1 and len(set(seq_list)) == 1 and not window
        attn_mask = None if is_causal or unmasked else mask[:, None]
        return AttentionGroup(tokens, kv_index, attn_mask, is_causal, q_index, max_q, window=window)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # (T, H, D)
        k: torch.Tensor,  # (T, KH, D)
        v: torch.Tensor,  # (T, KH, D)
        meta: TorchNativeMetadata,
    ) -> torch.Tensor:  # (T, H * D)
        self.write(layer, k, v, meta)
        window = self.windows[layer] if layer < len(self.windows) else 0
        groups = meta.groups
        if window and meta.window_groups:
            groups = meta.window_groups.get(window, groups)
        if len(groups) == 1:
            return self._attend(layer, q, k, v, groups[0])
        if isinstance(groups[0].tokens, slice):
            # each kind's rows one stretch, the groups in the batch's order: views in, one
            # concatenation out (the gathers and scatters were ~5% of a mixed step of 45 rows)
            return torch.cat(
                [self._attend(layer, q[g.tokens], k[g.tokens], v[g.tokens], g) for g in groups]
            )
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for group in groups:
            t = group.tokens
            out.index_copy_(0, t, self._attend(layer, q[t], k[t], v[t], group))
        return out

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: TorchNativeMetadata
    ) -> None:
        """The step's K/V (T, KH, D) into the layer's pool, as `forward` writes them first
        (a last layer that attends only the logits rows writes every row's this way)."""
        for load in meta.kv_loads:  # this layer's rows loaded back (overlapping the forward)
            load.wait_layer(layer)
        window = self.windows[layer] if layer < len(self.windows) else 0
        slots = meta.out_slots
        if window and meta.window_out_slots is not None:
            slots = meta.window_out_slots
        self.kv_pool.write(layer, slots, k, v)

    def driver_view(self, meta: TorchNativeMetadata, dtype: torch.dtype) -> DriverView | None:
        """What `decode_layers.cpp` needs to write a step's K/V (of `dtype`, the queries'
        too) and attend them in every layer as `forward` does, or None where `forward`
        would do something else for this step: a group neither the decode kernel's nor the
        extend kernel's (SDPA, causal prompts without the extend kernel), rows gathered by
        index, sliding windows, hybrid window memory, K/V being loaded back, a pool of
        another dtype, queries a kernel converts."""
        if meta.kv_loads or meta.window_groups or self.window_map is not None:
            return None
        pool_k, pool_v = self.kv_pool.k, self.kv_pool.v
        if any(self.windows) or pool_k[0].dtype != dtype:
            return None
        if not all(t.is_contiguous() for t in (*pool_k, *pool_v)):
            return None
        segments = []
        for group in meta.groups:
            tokens = group.tokens
            if isinstance(tokens, torch.Tensor) or group.window or group.kv_index is not None:
                return None
            if group.req_rows is None or group.decode_table is not None:
                return None
            start = 0 if tokens is None else tokens.start
            segment = self._segment(group, start, dtype)
            if segment is None:
                return None
            segments.append(segment)
        table = self.req_to_token.table
        return DriverView(pool_k, pool_v, meta.out_slots.contiguous(), table, tuple(segments))

    def _segment(
        self, group: AttentionGroup, start: int, dtype: torch.dtype
    ) -> AttentionSegment | None:
        if group.causal_lens is not None:
            return None
        req_rows = group.req_rows.contiguous()
        if group.extend_lens is not None:
            kernel = self.extend_kernel
            if kernel is None or group.prefix_lens is None or dtype not in kernel.dtypes:
                return None
            return AttentionSegment(
                SEGMENT_EXTEND, kernel.address, start, req_rows,
                group.prefix_lens.contiguous(), group.extend_lens.contiguous(),
                EXTEND_DTYPE_CODES[dtype],
            )  # fmt: skip
        kernel, code = self.decode_kernel, None
        if kernel is not None and group.seq_lens is not None:
            code = kernel.io_code(dtype)
        if code is None:
            return None
        return AttentionSegment(
            SEGMENT_DECODE, kernel.address, start, req_rows, group.seq_lens.contiguous(), None, code
        )

    def _attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionGroup
    ) -> torch.Tensor:
        """Attention of one group's queries q (T_g, H, D) → (T_g, H * D); k, v (T_g, KH, D)
        are the group's new keys and values (already in the pool)."""
        _, num_heads, head_dim = q.shape
        if meta.causal_lens is not None:
            return self._attend_causal(q, k, v, meta.causal_lens, meta.causal_masks)
        if meta.extend_lens is not None:
            assert self.extend_kernel is not None and meta.prefix_lens is not None
            return self.extend_kernel(
                q,
                self.kv_pool.k[layer],
                self.kv_pool.v[layer],
                self.req_to_token.table,
                meta.req_rows,
                meta.prefix_lens,
                meta.extend_lens,
                self.scale,
            )
        if meta.kv_index is None:
            pool_k, pool_v = self.kv_pool.k[layer], self.kv_pool.v[layer]
            table = meta.decode_table
            if table is None:
                table = self.req_to_token.table
            return self.decode_kernel(
                q, pool_k, pool_v, table, meta.req_rows, meta.seq_lens, self.scale, meta.window
            )
        batch_size, max_s = meta.kv_index.shape
        keys = self._gather(self.kv_pool.k[layer], meta.kv_index).to(q.dtype)  # (B, KH, S, D)
        values = self._gather(self.kv_pool.v[layer], meta.kv_index).to(q.dtype)
        if meta.max_q == 1:
            # Decode: fold each KV head's query group into the query axis, (B, KH, G, D),
            # so one SDPA call serves GQA without repeating K/V.
            q = q.view(batch_size, keys.shape[1], -1, head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, meta.mask, scale=self.scale)
            return out.reshape(batch_size, num_heads * head_dim)
        if meta.q_index is not None:
            padded = q.new_zeros(batch_size * meta.max_q, num_heads, head_dim)
            q = padded.index_copy_(0, meta.q_index, q)
        q = q.view(batch_size, meta.max_q, num_heads, head_dim).transpose(1, 2)  # (B, H, Q, D)
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=meta.mask,
            is_causal=meta.is_causal,
            scale=self.scale,
            enable_gqa=True,
        )  # (B, H, Q, D)
        out = out.transpose(1, 2).reshape(batch_size * meta.max_q, num_heads * head_dim)
        return out if meta.q_index is None else out[meta.q_index]

    def _attend_causal(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lens: list[int],
        masks: list[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Each request's new tokens attending causally to themselves (no cached prefix);
        a request with a band mask (sliding window) attends through it instead."""
        outs = []
        start = 0
        for i, n in enumerate(lens):
            qi, ki, vi = (x[start : start + n].transpose(0, 1) for x in (q, k, v))  # (H, n, D)
            mask = masks[i] if masks is not None else None
            out = F.scaled_dot_product_attention(
                qi[None],
                ki[None],
                vi[None],
                attn_mask=mask,
                is_causal=n > 1 and mask is None,
                scale=self.scale,
                enable_gqa=True,
            )  # (1, H, n, D)
            outs.append(out[0].transpose(0, 1).reshape(n, -1))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _gather(pool: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
        """(N, KH, D) pool rows at kv_index (B, S) → (B, KH, S, D).

        index_select over flat rows is several times faster than advanced indexing on CPU.
        """
        batch_size, max_s = kv_index.shape
        rows = pool.view(pool.shape[0], -1).index_select(0, kv_index.view(-1))
        return rows.view(batch_size, max_s, *pool.shape[1:]).transpose(1, 2)


KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
EXTEND_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # q, pool and output alike
BF16_QUERY_CODE = 3  # a bf16 pool read by a bf16 query (the AVX-512 kernel's vdpbf16ps path)
BF16_IO_CODE = 4  # the same, the query and output passed as bf16 (builds that take it)


class _AttentionLibrary:
    """An attention kernel's library: its `<name>_supports(heads, kv_heads, head_dim)`."""

    def __init__(self, library: ctypes.CDLL, name: str) -> None:
        self._supports = getattr(library, f"{name}_supports")
        self._supports.argtypes = [ctypes.c_int64] * 3
        self._supports.restype = ctypes.c_int

    def supports(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        return bool(self._supports(heads, kv_heads, head_dim))

    @property
    def address(self) -> int:
        """The kernel's entry point (for decode_layers.cpp)."""
        return function_address(self._run)


class DecodeKernel(_AttentionLibrary):
    """The C++ decode attention: `kernel(q (B, H, D), k_pool, v_pool (N, KH, D),
    table (R, C), rows (B,), seq_lens (B,), scale, window)` → (B, H * D) in q's dtype. The
    pool may be fp32, bf16 or fp16; the arithmetic is fp32. With `window` W > 0 a request
    attends only its last W positions."""

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library, "decode_attention")
        self._run = library.decode_attention
        pointers, sizes = [ctypes.c_void_p] * 7, [ctypes.c_int64] * 5
        self._run.argtypes = [
            *pointers,
            *sizes,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        self._run.restype = None
        # the AVX-512 build reads a bf16 query and writes a bf16 output itself: two
        # conversions fewer per layer (torch ops of ~20 us each at 16 running)
        self.bf16_io = hasattr(library, "decode_attention_bf16_io")

    def io_code(self, dtype: torch.dtype) -> int | None:
        """The kernel's dtype code for queries, pool and output all of `dtype`, taken and
        written as they are; None where `__call__` would convert them."""
        if dtype == torch.float32:
            return KV_DTYPE_CODES[dtype]
        return BF16_IO_CODE if dtype == torch.bfloat16 and self.bf16_io else None

    def __call__(
        self, q, k_pool, v_pool, table, rows, seq_lens, scale: float, window: int = 0
    ) -> torch.Tensor:
        batch, heads, dim = q.shape
        code = KV_DTYPE_CODES[k_pool.dtype]
        if q.dtype == torch.bfloat16 and k_pool.dtype == torch.bfloat16:
            code = BF16_IO_CODE if self.bf16_io else BF16_QUERY_CODE
        q_in = q.contiguous() if code == BF16_IO_CODE else q.contiguous().float()
        out = torch.empty(batch, heads * dim, dtype=q_in.dtype)
        rows, seq_lens = rows.contiguous(), seq_lens.contiguous()
        with profiled("kernel:attention"):
            self._run(
                q_in.data_ptr(),
                k_pool.data_ptr(),
                v_pool.data_ptr(),
                table.data_ptr(),
                rows.data_ptr(),
                seq_lens.data_ptr(),
                out.data_ptr(),
                batch,
                heads,
                k_pool.shape[1],
                dim,
                table.stride(0),
                scale,
                torch.get_num_threads(),
                code,
                window,
            )
        return out.to(q.dtype)  # a no-op for bf16 io


class ExtendKernel(_AttentionLibrary):
    """The C++ prefill / extend attention (`extend_attention.cpp`, AVX2, fp32;
    `extend_attention_avx512.cpp`, fp32 or bf16): `kernel(q (T, H, D), k_pool, v_pool
    (N, KH, D), table (R, C), rows (B,), prefix_lens (B,), extend_lens (B,), scale)` →
    (T, H * D), all in one of `dtypes`; q holds each request's new tokens in turn, whose
    K/V are in the pool already."""

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library, "extend_attention")
        takes_bf16 = library.extend_attention_takes_bf16
        takes_bf16.restype = ctypes.c_int
        self.dtypes = {torch.float32} | ({torch.bfloat16} if takes_bf16() else set())
        self._run = library.extend_attention
        self._run.argtypes = [
            *[ctypes.c_void_p] * 8,
            *[ctypes.c_int64] * 5,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_int,
        ]
        self._run.restype = None

    def __call__(
        self, q, k_pool, v_pool, table, rows, prefix_lens, extend_lens, scale: float
    ) -> torch.Tensor:
        tokens, heads, dim = q.shape
        if not (q.dtype == k_pool.dtype == v_pool.dtype and q.dtype in self.dtypes):
            raise TypeError(f"the extend kernel takes q {q.dtype} over a pool of {k_pool.dtype}")
        q = q.contiguous()
        out = torch.empty(tokens, heads * dim, dtype=q.dtype)
        rows, prefix_lens, extend_lens = (t.contiguous() for t in (rows, prefix_lens, extend_lens))
        with profiled("kernel:attention"):
            self._run(
                q.data_ptr(),
                k_pool.data_ptr(),
                v_pool.data_ptr(),
                table.data_ptr(),
                rows.data_ptr(),
                prefix_lens.data_ptr(),
                extend_lens.data_ptr(),
                out.data_ptr(),
                len(extend_lens),
                heads,
                k_pool.shape[1],
                dim,
                table.stride(0),
                scale,
                torch.get_num_threads(),
                EXTEND_DTYPE_CODES[q.dtype],
            )
        return out


@functools.cache
def extend_attention_kernel(
    kernel_dir: Path | None = None, isa: str = "avx512"
) -> ExtendKernel | None:
    """The C++ prefill / extend attention built into `kernel_dir` for the decode kernel's
    `isa`: "avx2" `extend_attention.cpp` (fp32); "avx512" `extend_attention_avx512.cpp`
    (AVX-512 + AVX512-BF16; fp32 and bf16); "amx" that source built with AMX (a bf16
    model's products on the tile unit); None where it cannot be built or run."""
    if isa == "avx2":
        library = load_kernel("extend_attention", kernel_dir, "avx2")
    else:
        library = load_kernel("extend_attention_avx512", kernel_dir, isa)
    if library is None:
        return None
    if isa == "amx" and not library.extend_attention_amx_enable():
        logger.warning("Linux refused this process AMX's tile state: no extend-attention kernel")
        return None
    return ExtendKernel(library)


@functools.cache
def decode_attention_kernel(
    kernel_dir: Path | None = None, isa: str = "avx2"
) -> DecodeKernel | None:
    """The C++ decode attention built into `kernel_dir` (`decode_attention.cpp`; for isa
    "avx512" `decode_attention_avx512.cpp`; for "amx" the same source built with AMX, which
    takes a bf16 model's q . k on the tile unit), or None where it cannot be built or run."""
    name = "decode_attention" if isa == "avx2" else "decode_attention_avx512"
    library = load_kernel(name, kernel_dir, isa)
    if library is None:
        return None
    if isa == "amx" and not library.decode_attention_amx_enable():
        logger.warning("Linux refused this process AMX's tile state: decode attention without it")
        return None
    return DecodeKernel(library)


def _band_mask(n: int, window: int, device: torch.device) -> torch.Tensor:
    """(n, n) bool: query i attends key j where i - window < j <= i."""
    pos = torch.arange(n, device=device)
    diff = pos[:, None] - pos[None, :]  # query minus key position
    return (diff >= 0) & (diff < window)


def _ragged_arange(lengths: torch.Tensor) -> torch.Tensor:
    """[0..l0-1, 0..l1-1, ...] for lengths (B,)."""
    total = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total, device=lengths.device) - torch.repeat_interleave(starts, lengths)
