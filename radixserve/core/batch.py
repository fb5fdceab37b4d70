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

# Which of a request's new tokens give their final-norm hidden state (an embedding request's
# instead of logits): none (a chunk of a last-pooled prompt that is not its last), its last
# token, or all of them (mean pooling; a request with return_hidden_states).
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
    # (E,) int64, flat positions whose final-norm hidden states are returned (embeddings,
    # return_hidden_states)
    hidden_indices: torch.Tensor | None = None
    # copies into the KV pool still in flight (the hierarchical cache's load back, on
    # CUDA): objects with `wait_layer(layer)`, waited on before each layer reads the pool
    kv_loads: list[Any] = field(default_factory=list)
    # (B,) per entry, the uid of the LoRA adapter its rows run with (0: the base model);
    # None where no entry uses one
    lora_ids: list[int] | None = None

    def __post_init__(self) -> None:
        num_tokens = self.input_ids.numel()
        assert len(self.prefix_lens) == len(self.extend_lens) == self.req_rows.numel()
        assert sum(self.extend_lens) == num_tokens == self.positions.numel()
        assert self.out_slots.numel() == num_tokens
        assert all(n >= 1 for n in self.extend_lens), "every request needs a new token"
        assert self.lora_ids is None or len(self.lora_ids) == len(self.extend_lens)
        if self.mode is ForwardMode.DECODE:
            assert all(n == 1 for n in self.extend_lens), "decode takes one token per request"

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]

    @property
    def uses_lora(self) -> bool:
        return self.lora_ids is not None and any(self.lora_ids)

    def logits_rows(self) -> ForwardBatch | None:
        """The step narrowed to its logits rows, as the last decoder layer sees them: past
        its K/V (written for every row), that layer's other rows feed nothing, so it runs
        only these rows' queries, attention and MLP, each request's other new tokens taken
        as cached (a longer prefix). A prefill chunk then runs one row of its last layer,
        not the chunk's every row (~3% of a prefill's products for a 30-layer model). None
        where that narrows nothing (decode steps), where some request's logits rows are not
        the last of its new tokens, or where hidden states are returned (embeddings)."""
        wanted = self.logits_indices
        if self.hidden_indices is not None or not 0 < wanted.numel() < self.input_ids.numel():
            return None
        rows = wanted.tolist()
        kept_reqs: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        j = end = 0
        for i, (prefix, n) in enumerate(zip(self.prefix_lens, self.extend_lens, strict=True)):
            end += n
            first = j
            while j < len(rows) and rows[j] < end:
                j += 1
            kept = j - first
            if kept == 0:
                continue
            if rows[first:j] != list(range(end - kept, end)):  # not a suffix, or out of order
                return None
            kept_reqs.append(i)
            prefix_lens.append(prefix + n - kept)
            extend_lens.append(kept)
        if j != len(rows):  # rows past the step's, or out of order
            return None
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=self.input_ids[wanted],
            positions=self.positions[wanted],
            out_slots=self.out_slots[wanted],
            req_rows=self.req_rows[kept_reqs],
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            logits_indices=torch.arange(len(rows), device=wanted.device),
            kv_loads=self.kv_loads,
        )
