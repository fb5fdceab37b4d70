"""Hybrid sliding-window memory: full-attention layers keep K/V for every token, window
layers (a query at position p attends only keys at p - W < s <= p) keep it in a second,
smaller set of slots.

The main slot allocator hands out *full* slots (1..size); every full slot that holds a
token also gets a *window* slot (1..window_size) for the window layers' K/V, recorded in

    full_to_swa: (size + 1,) int64   full slot → window slot, 0 = no window K/V
                                      (row 0, the padding slot, maps to window row 0)

so the request→token table, the radix tree and every caller keep speaking full slots;
only the attention backend translates (writes go to full_to_swa[out_slots], gathers read
full_to_swa[kv_index]). `HybridSlotAllocator` is a drop-in for `SlotAllocator`:
`alloc(n)` gives n full slots each with a window slot, `free(slots)` returns both, so the
tree, retraction, rejected drafts and duplicates on insert stay consistent unchanged.

A window slot outlives its use: once a request is past position p + W, no query of it
reads p's window K/V again, but a later request that shares the prefix up to m needs
the window K/V of [m - W, m) to reuse it. So window K/V no running request needs is kept
as *reclaimable cache*, dropped only when the window pool runs short (`alloc` then asks
its `reclaimer`, which the scheduler's KV manager provides: a running request's own dead
positions first, then least recently used tree nodes). A full slot whose window K/V was
dropped keeps its full K/V; a prefix is reusable only up to the last point whose
preceding W positions still have window K/V (`usable_prefix_len`).

Accounting: free window slots + full slots mapped to one == window_size.
Nothing here imports the model, the scheduler or the server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from radixserve.cache.allocator import PADDING_SLOT, SlotAllocator

Reclaimer = Callable[[int], None]  # asked to free at least n window slots


def swa_pool_size(full_tokens: int, window: int, ratio: float) -> int:
    """Tokens of the window layers' pool: `ratio` (--swa-full-tokens-ratio) x the full pool,
    at least twice the window (so a lone request always fits with room to extend), at most
    the full pool."""
    return min(full_tokens, max(int(ratio * full_tokens), 2 * window))


class HybridSlotAllocator:
    def __init__(
        self, size: int, window_size: int, window: int, device: torch.device | str = "cpu"
    ) -> None:
        if window < 1:
            raise ValueError(f"the hybrid window pool needs a window >= 1, got {window}")
        self.full = SlotAllocator(size, device)
        self.swa = SlotAllocator(window_size, device)
        self.window = window
        self.device = self.full.device
        self.full_to_swa = torch.zeros(size + 1, dtype=torch.int64, device=self.device)
        self.reclaimer: Reclaimer | None = None

    # -- what SlotAllocator offers --------------------------------------------------------
    @property
    def size(self) -> int:
        return self.full.size

    @property
    def num_free(self) -> int:
        """Free full slots (the window pool is made room in by `alloc` itself)."""
        return self.full.num_free

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self.full_to_swa.zero_()

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` full slots (int64, (n,)), each mapped to a fresh window slot; None when either
        pool is short after reclaiming, with nothing taken."""
        slots = self.full.alloc(n)
        if slots is None:
            return None
        if not self.ensure_window(n):
            self.full.free(slots)
            return None
        window_slots = self.swa.alloc(n)
        assert window_slots is not None
        self.full_to_swa[slots] = window_slots
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Give back full slots and the window slots they hold."""
        self.free_window(slots)
        self.full.free(slots)

    # -- the window pool ------------------------------------------------------------------
    @property
    def window_size(self) -> int:
        return self.swa.size

    @property
    def window_free(self) -> int:
        return self.swa.num_free

    @property
    def window_mapped(self) -> int:
        """Full slots holding window K/V (padding row excluded)."""
        return int((self.full_to_swa[1:] != PADDING_SLOT).sum())

    def ensure_window(self, n: int) -> bool:
        """Make at least n window slots free, asking the reclaimer if needed."""
        short = n - self.swa.num_free
        if short > 0 and self.reclaimer is not None:
            self.reclaimer(short)
        return self.swa.num_free >= n

    def has_window(self, slots: torch.Tensor) -> torch.Tensor:
        """(n,) bool: which of the full `slots` still hold window K/V."""
        return self.full_to_swa[slots] != PADDING_SLOT

    def free_window(self, slots: torch.Tensor) -> int:
        """Drop the window K/V of full `slots` (their full K/V stays); returns slots freed."""
        window_slots = self.full_to_swa[slots]
        held = window_slots[window_slots != PADDING_SLOT]
        if held.numel():
            self.swa.free(held)
            self.full_to_swa[slots] = PADDING_SLOT
        return int(held.numel())

    def adopt_window(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Move window K/V from `src` to `dst` (same tokens at the same positions, e.g. a
        request's own copy of what the tree also holds) where dst has none and src has."""
        move = (self.full_to_swa[dst] == PADDING_SLOT) & (self.full_to_swa[src] != PADDING_SLOT)
        if bool(move.any()):
            to, frm = dst[move], src[move]
            self.full_to_swa[to] = self.full_to_swa[frm]
            self.full_to_swa[frm] = PADDING_SLOT

    def reclaim(
        self, need: int, protected: torch.Tensor, candidates: Iterable[torch.Tensor]
    ) -> int:
        """Drop window K/V from `candidates` (full-slot tensors, each dropped front first, in
        the order given) until `need` window slots are freed, never from a `protected` slot
        (a running request's last W positions); returns slots freed."""
        keep = torch.zeros(self.size + 1, dtype=torch.bool, device=self.device)
        keep[protected] = True
        freed = 0
        for slots in candidates:
            if freed >= need:
                break
            held = slots[~keep[slots] & self.has_window(slots)]
            freed += self.free_window(held[: need - freed])
        return freed


def usable_prefix_len(has_window: torch.Tensor, window: int, page_size: int = 1) -> int:
    """The longest page-aligned prefix length m of a cached sequence that a request can
    resume after: every position in [max(0, m - window), m) still has window K/V.
    `has_window` (L,) bool per position."""
    length = has_window.numel()
    missing = torch.zeros(length + 1, dtype=torch.int64)
    missing[1:] = (~has_window).to(torch.int64).cpu().cumsum(0)  # missing[j]: in [0, j)
    ends = torch.arange(0, length + 1, page_size)
    starts = (ends - window).clamp(min=0)
    ok = missing[ends] == missing[starts]
    return int(ends[ok].max())
