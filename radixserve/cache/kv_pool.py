"""The KV pool: K and V tensors for every layer, allocated once at start-up.

Layout per layer: (num_slots + 1, num_kv_heads, head_dim); row 0 is the padding slot and is
kept zero so that a masked-out padded position can never inject NaN into attention.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.size = size
        shape = (size + 1, num_kv_heads, head_dim)
        # torch.empty: pages are only touched when slots are first written.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in (*self.k, *self.v):
            buf[0].zero_()

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of new tokens: k, v (T, kv_heads, head_dim) into `slots` (T,)."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)
