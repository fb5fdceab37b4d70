"""The flat batch one forward pass runs on.

Tokens of every request are concatenated ("flat"); per-request tensors say where each
request's tokens start and how long its sequence is. The KV slots of all tokens before this
step are found through the request→token table row of each request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

# Which of a request's new tokens give their final-norm hidden state instead of logits (an
# embedding request: no logits at all): none (a chunk of a last-pooled prompt that is not its
# last), its last token, or all of them (mean pooling).
HiddenRows = Literal["none", "last", "all"]


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # new tokens appended after a cached prefix of any length (incl. 0)
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # (T,) int64, the new tokens of all requests, concatenated
    positions: torch.Tensor  # (T,) int64, absolute position of each new token
    out_slots: torch.Tensor  # (T,) int64, KV slot each new token's K/V is written to
    req_rows: torch.Tensor  # (B,) int64, request→token table row of each request
    prefix_lens: list[int]  # (B,) tokens already in the KV pool before this step
    extend_lens: list[int]  # (B,) new tokens of each request in this step
    logits_indices: torch.Tensor  # (L,) int64, flat positions whose logits are returned
    # (E,) int64, flat positions whose final-norm hidden states are returned (embeddings)
    hidden_indices: torch.Tensor | None = None
    # copies into the KV pool still in flight (the hierarchical cache's load back, on
    # CUDA): objects with `wait_layer(layer)`, waited on before each layer reads the pool
    kv_loads: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        num_tokens = self.input_ids.numel()
        assert len(self.prefix_lens) == len(self.extend_lens) == self.req_rows.numel()
        assert sum(self.extend_lens) == num_tokens == self.positions.numel()
        assert self.out_slots.numel() == num_tokens
        assert all(n >= 1 for n in self.extend_lens), "every request needs a new token"
        if self.mode is ForwardMode.DECODE:
            assert all(n == 1 for n in self.extend_lens), "decode takes one token per request"

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]
