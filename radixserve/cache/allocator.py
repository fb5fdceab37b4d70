"""The KV slot allocator: a stack of the free slots of the KV pool.

A slot holds one token's K and V for every layer. Slot 0 is reserved as the padding slot
(attention backends point padded positions at it), so usable slots are 1..size.

The most recently freed slots are handed out first (LIFO): their pages are already
resident and in the TLB, and the pool's working set stays as small as the load needs
instead of walking through slots never touched before. The stack is one preallocated
tensor, so `alloc` and `free` each copy only the slots they move:

    _stack: [ allocated (head) | free slots, the next to hand out first ]
             0                 ^_head                                   size
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
        self._stack = torch.empty(size, dtype=torch.int64, device=self.device)
        self._head = 0  # _stack[_head:] are the free slots
        self.clear()

    def clear(self) -> None:
        """Forget every allocation: all slots are free again, handed out from slot 1 up."""
        torch.arange(1, self.size + 1, out=self._stack)
        self._head = 0

    @property
    def num_free(self) -> int:
        return self.size - self._head

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots (int64, shape (n,)), the most recently freed first, or None when
        fewer than `n` are free."""
        if n > self.num_free:
            return None
        start = self._head
        self._head += n
        return self._stack[start : self._head].clone()  # the stack's cells are reused

    def free(self, slots: torch.Tensor) -> None:
        """Give back slots from `alloc`; the next `alloc` of as many returns them in order."""
        n = slots.numel()
        if n > self._head:
            raise ValueError(f"freeing {n} slots but only {self._head} are allocated")
        self._head -= n
        self._stack[self._head : self._head + n] = slots
