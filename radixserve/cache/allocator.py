"""The KV slot allocator: a free list over the slots of the KV pool.

A slot holds one token's K and V for every layer. Slot 0 is reserved as the padding slot
(attention backends point padded positions at it), so usable slots are 1..size.
"""

from __future__ import annotations

import torch

PADDING_SLOT = 0


class SlotAllocator:
    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        if size < 1:
            raise ValueError(f"the KV pool needs at least 1 slot, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        """Forget every allocation: all slots are free again."""
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    @property
    def num_free(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots (int64, shape (n,)), or None when fewer than `n` are free."""
        if n > self.num_free:
            return None
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(self._free)))
