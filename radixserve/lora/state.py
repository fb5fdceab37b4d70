"""The adapters a model runner holds, and which rows of the step in flight use which.

The runner sets `LoraState.groups` for a step whose requests name adapters (`begin`) and
clears them after (`end`); each attention and MLP module holds a `LoraSite` that adds its
adapters' products to the base layer's, row group by row group. A step with no adapter
rows runs exactly as without LoRA (the fused decode layers included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixserve.lora.adapter import LoraAdapter


@dataclass
class LoraState:
    adapters: dict[int, LoraAdapter] = field(default_factory=dict)  # uid → adapter
    # the step in flight: (adapter, its rows; None where it has every row)
    groups: list[tuple[LoraAdapter, torch.Tensor | None]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def begin(self, uids: Sequence[int], extend_lens: Sequence[int], device) -> None:
        """Group the step's rows by adapter: entry i of the batch (extend_lens[i] rows)
        uses adapter uids[i], 0 for the base model."""
        self.groups = []
        if not any(uids):
            return
        per_row = torch.repeat_interleave(torch.tensor(uids), torch.tensor(extend_lens)).to(device)
        for uid in sorted(set(uids) - {0}):
            adapter = self.adapters.get(uid)
            if adapter is None:
                raise KeyError(f"a step names LoRA adapter {uid}, which is not loaded")
            rows = None if all(u == uid for u in uids) else (per_row == uid).nonzero().view(-1)
            self.groups.append((adapter, rows))

    def end(self) -> None:
        self.groups = []


@dataclass(frozen=True)
class LoraSite:
    """One decoder layer's hook into the step's adapters."""

    state: LoraState
    layer: int

    @property
    def active(self) -> bool:
        return self.state.active

    def add(self, site: str, x: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """outs (the site's base products of x, (T, out_i) each) plus each adapter's
        product on its rows, as new tensors."""
        for adapter, rows in self.state.groups:
            weights = adapter.sites.get((self.layer, site))
            if weights is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            delta = (xs @ weights.a) @ weights.b  # (n, sum of the outs' widths)
            start = 0
            for i, out in enumerate(outs):
                part = delta[:, start : start + out.shape[-1]]
                start += out.shape[-1]
                outs[i] = out + part if rows is None else out.index_add(0, rows, part)
        return outs
