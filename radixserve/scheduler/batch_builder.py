"""Turning requests into `ForwardBatch`es: KV slots are allocated and recorded in the
request→token table here, and given back by `release`. The builder knows which request
holds each table row (`holders`), so the KV manager can tell which window K/V a running
request still needs (hybrid sliding-window memory)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.cache import ReqToTokenPool, SlotAllocator
from radixserve.cache.swa_pool import HybridSlotAllocator
from radixserve.core.batch import ForwardBatch, ForwardMode, HiddenRows
from radixserve.core.req import Req


class OutOfKVSlots(RuntimeError):
    """The KV pool has fewer free slots than a batch needs."""


class BatchBuilder:
    def __init__(
        self,
        allocator: SlotAllocator | HybridSlotAllocator,
        req_to_token: ReqToTokenPool,
        device: torch.device,
    ) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.device = device
        self.holders: dict[int, Req] = {}  # table row → the request holding it

    def extend(
        self,
        reqs: Sequence[Req],
        new_tokens: Sequence[Sequence[int]],
        all_logits: Sequence[bool] | None = None,
        hidden_rows: Sequence[HiddenRows | None] | None = None,
    ) -> ForwardBatch:
        """Append `new_tokens[i]` after the `kv_len` cached tokens of `reqs[i]`.

        Logits are returned for the last new token of each request, or for every new token
        of the requests flagged in `all_logits`; the hidden states of the rows `hidden_rows[i]`
        says (see HiddenRows) besides; an embedding request gets no logits.
        """
        lens = [len(t) for t in new_tokens]
        slots = self._alloc(sum(lens))
        logits_at: list[int] = []
        hidden_at: list[int] = []
        offset = 0
        for i, (req, n) in enumerate(zip(reqs, lens, strict=True)):
            self._ensure_row(req)
            self.req_to_token.write(req.row, req.kv_len, slots[offset : offset + n])
            rows = range(offset, offset + n)
            hidden = hidden_rows[i] if hidden_rows is not None else None
            if hidden is not None:
                hidden_at.extend({"none": [], "last": rows[-1:], "all": rows}[hidden])
            if req.embed is not None:
                pass  # an embedding request's rows give hidden states alone
            elif all_logits is not None and all_logits[i]:
                logits_at.extend(rows)
            else:
                logits_at.append(offset + n - 1)
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
            hidden_indices=self._tensor(hidden_at) if hidden_rows is not None else None,
            lora_ids=_lora_ids(reqs),
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
            lora_ids=_lora_ids(reqs),
        )
        for req in reqs:
            req.kv_len += 1
        return batch

    def verify(
        self, reqs: Sequence[Req], drafts: Sequence[Sequence[int]]
    ) -> tuple[ForwardBatch, list[int]]:
        """A decode step in which requests may carry drafted tokens after their pending one.

        A request with a draft runs each of its tokens as a one-token row on its own table
        row: row j attends to the first kv_len + j + 1 positions, which is causal attention
        over the pool, so the decode kernel verifies drafts; its logits are returned for
        every row. A request with several pending tokens (after a jump-forward) runs them as
        one extend row. Returns the batch and each request's first logits row.
        """
        news = [r.all_ids[r.kv_len :] + list(d) for r, d in zip(reqs, drafts, strict=True)]
        positions = [r.kv_len + j for r, new in zip(reqs, news) for j in range(len(new))]
        slots = self._alloc(sum(map(len, news)))
        rows: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        logits_at: list[int] = []
        first_rows: list[int] = []
        entries: list[Req] = []  # the request of each entry (a draft's rows are one each)
        offset = 0
        for req, new, draft in zip(reqs, news, drafts):
            n = len(new)
            self.req_to_token.write(req.row, req.kv_len, slots[offset : offset + n])
            first_rows.append(len(logits_at))
            if draft or n == 1:
                rows += [req.row] * n
                prefix_lens += range(req.kv_len, req.kv_len + n)
                extend_lens += [1] * n
                entries += [req] * n
                logits_at += range(offset, offset + n)
            else:
                rows.append(req.row)
                prefix_lens.append(req.kv_len)
                extend_lens.append(n)
                entries.append(req)
                logits_at.append(offset + n - 1)
            offset += n
        single = all(n == 1 for n in extend_lens)
        batch = ForwardBatch(
            mode=ForwardMode.DECODE if single else ForwardMode.EXTEND,
            input_ids=self._tensor([t for new in news for t in new]),
            positions=self._tensor(positions),
            out_slots=slots,
            req_rows=self._tensor(rows),
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            logits_indices=self._tensor(logits_at),
            lora_ids=_lora_ids(entries),
        )
        for req, new in zip(reqs, news):
            req.kv_len += len(new)
        return batch, first_rows

    def truncate(self, req: Req, kv_len: int) -> None:
        """Drop the request's KV from position `kv_len` on (rejected drafted tokens)."""
        assert req.row is not None and req.tree_len <= kv_len <= req.kv_len
        if kv_len < req.kv_len:
            self.allocator.free(self.req_to_token.slots(req.row, kv_len, req.kv_len).clone())
            req.kv_len = kv_len

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
        del self.holders[req.row]
        req.row, req.kv_len, req.tree_len = None, 0, 0

    def _ensure_row(self, req: Req) -> None:
        if req.row is None:
            row = self.req_to_token.alloc()
            if row is None:
                raise OutOfKVSlots("no free request row: too many running requests")
            req.row = row
            self.holders[row] = req

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.allocator.alloc(n)
        if slots is None:
            raise OutOfKVSlots(f"need {n} KV slots, {self.allocator.num_free} free")
        return slots

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def _lora_ids(reqs: Sequence[Req]) -> list[int] | None:
    """Each entry's LoRA adapter uid (0: the base model), or None where none uses one."""
    ids = [req.lora_id for req in reqs]
    return ids if any(ids) else None
