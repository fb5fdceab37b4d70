"""`KVBlock`: the K/V of a run of tokens for every layer, in the host tier's storage format.

It is what moves between the tiers of the hierarchical cache: the host pool encodes device
KV into blocks and decodes blocks back into device slots, the disk tier stores one block per
page. `k` / `v` are (num_layers, tokens, kv_heads, head_dim) in the storage dtype; with
int8 storage, `k_scale` / `v_scale` are (num_layers, tokens, kv_heads) float32 (one scale
per token and head: value = int8 * scale), else None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HOST_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


@dataclass
class KVBlock:
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        parts = (self.k, self.v, self.k_scale, self.v_scale)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def slice(self, start: int, end: int) -> KVBlock:
        """Tokens start..end of the block (views)."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, start:end]

        return KVBlock(
            self.k[:, start:end], self.v[:, start:end], cut(self.k_scale), cut(self.v_scale)
        )

    @staticmethod
    def cat(blocks: list[KVBlock]) -> KVBlock:
        """The blocks' tokens end to end (they share one format)."""

        def join(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat(ts, dim=1)  # type: ignore[arg-type]

        return KVBlock(
            torch.cat([b.k for b in blocks], dim=1),
            torch.cat([b.v for b in blocks], dim=1),
            join([b.k_scale for b in blocks]),
            join([b.v_scale for b in blocks]),
        )
