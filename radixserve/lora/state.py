"""The adapters a model runner holds, and which rows of the step in flight use which.

The runner sets the step's rows (`begin`) for a step whose requests name adapters and
clears them after (`end`); each attention and MLP module holds a `LoraSite` that adds the
adapters' products to the base layer's. A step with no adapter rows runs exactly as
without LoRA (the fused decode layers included).

Where every row uses one adapter, a site computes x @ A.T and adds each module's span of it
times the module's B (adapter.py). Where rows use several (or some use the base model),
the site's matrices of the step's adapters are stacked: A (sum of ranks, in) and each
module's B (sum of ranks, out) on top of each other, so that one product x @ A.T covers
every adapter, a mask keeps each row's own adapter's columns (the base model's rows keep
none), and one product per module adds them: the same few ops per site whatever the
number of adapters, not a gather, products and a scatter per adapter (measured:
`benchmarks/lora_overhead.py`). The stacks of recent sets of adapters are kept
(`STACKS_KEPT`, within as many bytes as the loaded adapters take), since a set lasts from
step to step while its requests decode.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from radixserve.lora.adapter import SITES, LoraAdapter, SiteWeights

STACKS_KEPT = 8  # sets of adapters whose stacked matrices are kept (least recent dropped)
LORA_SITE_FIELDS = 16  # fused_ops.cpp's LoraSite


@dataclass(frozen=True)
class DriverLora:
    """The step's adapters as the fused decode layers take them (decode_layers.cpp): per
    layer and site (SITES order) a LoraSite's fields, and each row's adapter in the stack
    (None: every row uses the one adapter)."""

    fields: torch.Tensor  # (layers, len(SITES), LORA_SITE_FIELDS) int64
    row_owner: torch.Tensor | None


def site_fields(weights: SiteWeights | None) -> list[int]:
    """fused_ops.cpp's LoraSite of a site's weights (all 0 where there are none): pointers
    into them, which stay valid while they are held."""
    if weights is None:
        return [0] * LORA_SITE_FIELDS
    owners = 0 if weights.owners is None else weights.owners.data_ptr()
    row = [weights.a.data_ptr(), weights.a.shape[0], owners, len(weights.spans)]
    for (lo, hi), b in zip(weights.spans, weights.bs, strict=True):
        row += [lo, hi, 0, 0] if b is None else [lo, hi, b.data_ptr(), b.shape[1]]
    return row + [0] * (LORA_SITE_FIELDS - len(row))


@dataclass
class Stack:
    """A set of adapters' matrices, stacked per site (see the module's doc): A's rows
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
            a_parts.append(weights.a[lo:hi])
            b_parts.append(weights.bs[m])
            owners += [j] * (hi - lo)
        end = start + sum(b.shape[0] for b in b_parts)
        spans.append((start, end))
        bs.append(torch.cat(b_parts, dim=0) if b_parts else None)
        start = end
    a = torch.cat(a_parts).contiguous()
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
    uids: tuple[int, ...] = ()  # the step's adapters
    # DriverLora fields of the adapters used lately: (stacked, uids) → fields (pointers into
    # the adapter's or the stack's tensors: dropped with them)
    driver_fields: dict[tuple[bool, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)

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
        self.uids = tuple(used)
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
        self.uids = ()

    def drop(self, uid: int) -> None:
        """Forget an unloaded adapter, and the stacks it is in."""
        self.adapters.pop(uid, None)
        for uids in [u for u in self.stacks if uid in u]:
            del self.stacks[uids]
        for key in [k for k in self.driver_fields if uid in k[1]]:
            del self.driver_fields[key]

    def driver_lora(self, layers: int) -> DriverLora:
        """The step's adapters for the fused decode layers of a model of `layers` layers."""
        key = (self.stack is not None, self.uids)
        fields = self.driver_fields.get(key)
        if fields is None:
            sites = self.stack.sites if self.stack is not None else self.single.sites
            fields = torch.tensor(
                [[site_fields(sites.get((i, s))) for s in SITES] for i in range(layers)],
                dtype=torch.int64,
            )
            self.driver_fields[key] = fields
        return DriverLora(fields, self.row_owner)

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
            dropped, _ = self.stacks.popitem(last=False)
            self.driver_fields.pop((True, dropped), None)
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
            xa = F.linear(x, weights.a)  # (T, R)
        else:
            assert state.stack is not None
            weights = state.stack.sites.get(key)
            if weights is None:
                return
            xa = F.linear(x, weights.a) * state.mask(weights.owners)  # each row its adapter's
        for out, (lo, hi), b in zip(outs, weights.spans, weights.bs, strict=True):
            if b is not None:
                out.addmm_(xa[:, lo:hi], b)
