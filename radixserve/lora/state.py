"""The adapters a model runner holds, and which rows of the step in flight use which.

The runner sets the step's rows (`begin`) for a step whose requests name adapters and
clears them after (`end`); each attention and MLP module holds a `LoraSite` that adds the
adapters' products to the base layer's. A step with no adapter rows runs exactly as
without LoRA (the fused decode layers included).

Where every row uses one adapter, a site computes x @ A and adds each module's span of it
times the module's B (adapter.py). Where rows use several (or some use the base model),
the site's matrices of the step's adapters are stacked: A side by side (in, sum of
ranks), each module's B on top of each other (sum of ranks, out), so that one product
x @ A covers every adapter, a mask keeps each row's own adapter's columns (the base
model's rows keep none), and one product per module adds them: the same few ops per site
whatever the number of adapters, not a gather, products and a scatter per adapter
(measured: `benchmarks/lora_overhead.py`). The stacks of recent sets of adapters are kept
(`STACKS_KEPT`, within as many bytes as the loaded adapters take), since a set lasts from
step to step while its requests decode.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixserve.lora.adapter import SITES, LoraAdapter, SiteWeights

STACKS_KEPT = 8  # sets of adapters whose stacked matrices are kept (least recent dropped)


@dataclass
class Stack:
    """A set of adapters' matrices, stacked per site (see the module's doc): A's columns
    module by module, each module's adapters in the set's order, so that each module's
    stacked B takes one span of them; `owners` says whose each column is."""

    uids: tuple[int, ...]
    sites: dict[tuple[int, str], SiteWeights]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.sites.values())

    @classmethod
    def of(cls, adapters: Sequence[tuple[int, LoraAdapter]]) -> Stack:
        keys = sorted({key for _, adapter in adapters for key in adapter.sites})
        shared: dict[tuple, torch.Tensor] = {}  # one owners tensor per layout: one mask
        return cls(
            tuple(uid for uid, _ in adapters), {k: _stacked(adapters, k, shared) for k in keys}
        )


def _stacked(adapters, key: tuple[int, str], shared: dict) -> SiteWeights:
    a_parts, owners, spans, bs = [], [], [], []
    start = 0
    for m in range(len(SITES[key[1]])):
        b_parts = []
        for j, (_, adapter) in enumerate(adapters):
            weights = adapter.sites.get(key)
            if weights is None or weights.bs[m] is None:
                continue
            lo, hi = weights.spans[m]
            a_parts.append(weights.a[:, lo:hi])
            b_parts.append(weights.bs[m])
            owners += [j] * (hi - lo)
        end = start + sum(b.shape[0] for b in b_parts)
        spans.append((start, end))
        bs.append(torch.cat(b_parts, dim=0) if b_parts else None)
        start = end
    a = torch.cat(a_parts, dim=1).contiguous()
    layout = (tuple(owners), str(a.device))
    if layout not in shared:
        shared[layout] = torch.tensor(owners, device=a.device)
    return SiteWeights(a, tuple(spans), tuple(bs), shared[layout])


@dataclass
class LoraState:
    adapters: dict[int, LoraAdapter] = field(default_factory=dict)  # uid → adapter
    stacks: OrderedDict[tuple[int, ...], Stack] = field(default_factory=OrderedDict)
    # the step in flight: its one adapter (every row uses it), or the stack of its
    # adapters with each row's index in it (-1: the base model), and the masks made so far
    single: LoraAdapter | None = None
    stack: Stack | None = None
    row_owner: torch.Tensor | None = None  # (T,)
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # id(owners) → (T, R)
    dtype: torch.dtype = torch.float32

    @property
    def active(self) -> bool:
        return self.single is not None or self.stack is not None

    def begin(self, uids: Sequence[int], extend_lens: Sequence[int], dtype: torch.dtype) -> None:
        """Set the step's rows: entry i of the batch (extend_lens[i] rows) uses adapter
        uids[i], 0 for the base model."""
        self.end()
        used = sorted(set(uids) - {0})
        missing = [uid for uid in used if uid not in self.adapters]
        if missing:
            raise KeyError(f"a step names LoRA adapter {missing[0]}, which is not loaded")
        if not used:
            return
        if len(used) == 1 and all(uids):
            self.single = self.adapters[used[0]]
            return
        self.stack = self._stack(tuple(used))
        index = {uid: i for i, uid in enumerate(used)}
        owner = torch.tensor([index.get(uid, -1) for uid in uids])
        device = next(iter(self.stack.sites.values())).a.device
        self.row_owner = torch.repeat_interleave(owner, torch.tensor(extend_lens)).to(device)
        self.dtype = dtype

    def end(self) -> None:
        self.single = self.stack = self.row_owner = None
        self.masks = {}

    def drop(self, uid: int) -> None:
        """Forget an unloaded adapter, and the stacks it is in."""
        self.adapters.pop(uid, None)
        for uids in [u for u in self.stacks if uid in u]:
            del self.stacks[uids]

    def _stack(self, uids: tuple[int, ...]) -> Stack:
        """The set's stack, made or kept; the least recent others dropped past STACKS_KEPT
        or past the loaded adapters' bytes (a copy of each set's matrices is kept)."""
        stack = self.stacks.get(uids)
        if stack is not None:
            self.stacks.move_to_end(uids)
            return stack
        stack = self.stacks[uids] = Stack.of([(uid, self.adapters[uid]) for uid in uids])
        budget = sum(adapter.nbytes for adapter in self.adapters.values())
        while len(self.stacks) > 1 and (
            len(self.stacks) > STACKS_KEPT or sum(s.nbytes for s in self.stacks.values()) > budget
        ):
            self.stacks.popitem(last=False)
        return stack

    def mask(self, owners: torch.Tensor) -> torch.Tensor:
        """(T, R): 1 where a row's adapter owns the column (made once per step and layout)."""
        mask = self.masks.get(id(owners))
        if mask is None:
            mask = (self.row_owner[:, None] == owners[None, :]).to(self.dtype)
            self.masks[id(owners)] = mask
        return mask


@dataclass(frozen=True)
class LoraSite:
    """One decoder layer's hook into the step's adapters."""

    state: LoraState
    layer: int

    @property
    def active(self) -> bool:
        return self.state.active

    def add(self, site: str, x: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """Add to outs (the site's base products of x, (T, out_i) each, one per module:
        tensors or views the caller owns) the adapters' products of their rows, in place."""
        state, key = self.state, (self.layer, site)
        if state.single is not None:
            weights = state.single.sites.get(key)
            if weights is None:
                return
            xa = x @ weights.a  # (T, R)
        else:
            assert state.stack is not None
            weights = state.stack.sites.get(key)
            if weights is None:
                return
            xa = (x @ weights.a) * state.mask(weights.owners)  # each row its adapter's
        for out, (lo, hi), b in zip(outs, weights.spans, weights.bs, strict=True):
            if b is not None:
                out.addmm_(xa[:, lo:hi], b)
