"""Turning requests into `ForwardBatch`es: KV slots are allocated and recorded in the
request→token table here, and given back by `release`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.cache import ReqToTokenPool, SlotAllocator
from radixserve.core.batch import ForwardBatch, ForwardMode
from radixserve.core.req import Req


class OutOfKVSlots(RuntimeError):
    """The KV pool has fewer free slots than a batch needs."""


class BatchBuilder:
    def __init__(
        self, allocator: SlotAllocator, req_to_token: ReqToTokenPool, device: torch.device
    ) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.device = device

    def extend(
        self,
        reqs: Sequence[Req],
        new_tokens: Sequence[Sequence[int]],
        all_logits: Sequence[bool] | None = None,
    ) -> ForwardBatch:
        """Append `new_tokens[i]` after the `kv_len` cached tokens of `reqs[i]`.

        Logits are returned for the last new token of each request, or for every new token
        of the requests flagged in `all_logits`.
        """
        lens = [len(t) for t in new_tokens]
        slots = self._alloc(sum(lens))
        logits_at: list[int] = []
        offset = 0
        for i, (req, n) in enumerate(zip(reqs, lens, strict=True)):
            self._ensure_row(req)
            self.req_to_token.write(req.row, req.kv_len, slots[offset : offset + n])
            want_all = all_logits is not None and all_logits[i]
            logits_at.extend(range(offset, offset + n) if want_all else [offset + n - 1])
            offset += n
        prefix_lens = [r.kv_len for r in reqs]
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=self._tensor([t for toks in new_tokens for t in toks]),
            positions=self._tensor([p + j for p, n in zip(prefix_lens, lens) for j in range(n)]),
            out_slots=slots,
            req_rows=self._tensor([r.row for r in reqs]),
            prefix_lens=prefix_lens,
            extend_lens=lens,
            logits_indices=self._tensor(logits_at),
        )
        for req, n in zip(reqs, lens, strict=True):
            req.kv_len += n
        return batch

    def decode(self, reqs: Sequence[Req]) -> ForwardBatch:
        """One step: each request's last token (not yet in the KV pool) is run."""
        assert all(r.kv_len == len(r.input_ids) + len(r.output_ids) - 1 for r in reqs)
        slots = self._alloc(len(reqs))
        rows = self._tensor([r.row for r in reqs])
        prefix_lens = [r.kv_len for r in reqs]
        positions = self._tensor(prefix_lens)
        self.req_to_token.table[rows, positions] = slots
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self._tensor([r.output_ids[-1] for r in reqs]),
            positions=positions,
            out_slots=slots,
            req_rows=rows,
            prefix_lens=prefix_lens,
            extend_lens=[1] * len(reqs),
            logits_indices=torch.arange(len(reqs), device=self.device),
        )
        for req in reqs:
            req.kv_len += 1
        return batch

    def attach_prefix(self, req: Req, slots: torch.Tensor) -> None:
        """Give a request with no KV yet the cached slots of its first len(slots) tokens."""
        assert req.kv_len == 0
        self._ensure_row(req)
        self.req_to_token.write(req.row, 0, slots)
        req.kv_len = req.tree_len = int(slots.numel())

    def release(self, req: Req) -> None:
        """Give back the request's own KV slots (those past `tree_len`; the prefix cache
        owns the rest) and its table row."""
        if req.row is None:
            return
        self.allocator.free(self.req_to_token.slots(req.row, req.tree_len, req.kv_len).clone())
        self.req_to_token.free(req.row)
        req.row, req.kv_len, req.tree_len = None, 0, 0

    def _ensure_row(self, req: Req) -> None:
        if req.row is None:
            row = self.req_to_token.alloc()
            if row is None:
                raise OutOfKVSlots("no free request row: too many running requests")
            req.row = row

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.allocator.alloc(n)
        if slots is None:
            raise OutOfKVSlots(f"need {n} KV slots, {self.allocator.num_free} free")
        return slots

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
