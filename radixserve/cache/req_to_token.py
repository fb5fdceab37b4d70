"""The request→token table: row r, position p → the KV slot holding that token.

Each running request owns one row for its lifetime; its row lists the slots of its tokens
in order, so the attention backend can gather a request's K/V with one index.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, num_rows: int, max_context_len: int, device: torch.device | str) -> None:
        self.num_rows = num_rows
        self.max_context_len = max_context_len
        self.table = torch.zeros((num_rows, max_context_len), dtype=torch.int64, device=device)
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or None when every row is taken."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if not 0 <= row < self.num_rows or row in self._free_rows:
            raise ValueError(f"row {row} is not allocated")
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record that positions start..start+len(slots) of `row` live in `slots`."""
        end = start + slots.numel()
        if end > self.max_context_len:
            raise ValueError(f"position {end} exceeds the context length {self.max_context_len}")
        self.table[row, start:end] = slots

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.table[row, start:end]
