"""Decode attention on CUDA as a Triton kernel that reads K/V where they lie in the pool.

The C++ decode kernels' contract on a GPU: each one-token row b attends the keys at
positions 0..seq_lens[b]-1 of its request, whose slots are `table[req_rows[b], :seq_len]`
(with a sliding `window`, only the last `window` of them). No gathered copy, no padding to
the longest request, no mask, and nothing of the batch's shape but its row count reaches
the host: the lengths are read on the device, so a step can be captured in a CUDA graph
once and replayed for any lengths (model/cuda_graph.py).

One program per (row, query head): it streams the row's keys in blocks of BLOCK_N with an
online softmax in fp32 (the pool in fp32, bf16 or fp16; the output in the queries' dtype).
The dot products are sums of fp32 products, not tensor-core dots (tf32 would cost fp32
models their fidelity bar). Decode attention of a small model is a fraction of a step; a
split over the keys for long contexts at small batch is not done.

This module imports Triton: import it only where CUDA and Triton are there
(runner.py's `device_decode_kernel` says None elsewhere).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per iteration


@triton.jit
def _decode_attention(
    q_ptr,  # (B, H, D)
    k_ptr,  # (N, KH, D) one layer's pool
    v_ptr,
    out_ptr,  # (B, H, D)
    table_ptr,  # (R, C) slot of each request's positions
    rows_ptr,  # (B,)
    lens_ptr,  # (B,)
    scale,
    window,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_t,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // GROUP
    row = tl.load(rows_ptr + b).to(tl.int64)
    n = tl.load(lens_ptr + b).to(tl.int32)
    lo = n * 0  # the first key position: 0, or the window's first
    if window > 0:
        lo = tl.maximum(n - window, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    q = q * scale
    m = tl.full([], float("-inf"), tl.float32)  # running max of the scores
    total = tl.full([], 0.0, tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_D], tl.float32)  # running sum of exp(score - m) * v
    for start in range(lo, n, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < n
        slots = tl.load(table_ptr + row * stride_t + pos, mask=ok, other=0).to(tl.int64)
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + slots[:, None] * stride_kn + kh * stride_kh + d[None, :], mask=kv_ok, other=0.0
        ).to(tl.float32)  # (BLOCK_N, BLOCK_D)
        scores = tl.sum(k * q[None, :], axis=1)
        scores = tl.where(ok, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(
            v_ptr + slots[:, None] * stride_vn + kh * stride_vh + d[None, :], mask=kv_ok, other=0.0
        ).to(tl.float32)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    out = acc / total
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


class TritonDecodeKernel:
    """Called as the C++ decode kernels are (`TorchNativeAttention._attend`)."""

    def supports(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        return heads % kv_heads == 0 and head_dim <= 256

    def __call__(
        self,
        q: torch.Tensor,  # (B, H, D)
        pool_k: torch.Tensor,  # (N, KH, D)
        pool_v: torch.Tensor,
        table: torch.Tensor,  # (R, C)
        req_rows: torch.Tensor,  # (B,)
        seq_lens: torch.Tensor,  # (B,)
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:  # (B, H * D)
        batch, heads, head_dim = q.shape
        kv_heads = pool_k.shape[1]
        out = q.new_empty(batch, heads, head_dim)
        if batch == 0:
            return out.view(0, heads * head_dim)
        q = q if q.stride(-1) == 1 else q.contiguous()
        assert pool_k.stride(-1) == pool_v.stride(-1) == table.stride(-1) == 1
        _decode_attention[(batch, heads)](
            q, pool_k, pool_v, out, table, req_rows, seq_lens, scale, window,
            q.stride(0), q.stride(1), pool_k.stride(0), pool_k.stride(1),
            pool_v.stride(0), pool_v.stride(1), out.stride(0), out.stride(1), table.stride(0),
            GROUP=heads // kv_heads, HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=BLOCK_N,
        )  # fmt: skip
        return out.view(batch, heads * head_dim)
