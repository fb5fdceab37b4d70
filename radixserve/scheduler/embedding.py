"""Pooling an embedding request's final hidden states into its vector, across the prefill
chunks of its prompt.

    last pooling: only the chunk that ends the prompt asks for a row, its last token's; a
                  cached prefix is not recomputed (the last token always is, as for any
                  prefill-only request: `Req.max_cacheable_prefix`)
    mean pooling: every chunk asks for all its rows, summed into the request's running total;
                  the request matches no cached prefix (the tree keeps KV, not hidden
                  states), so its chunks cover every prompt position exactly once

The prompt's KV still goes into the radix tree, so a later request on the same prefix hits
the cache whatever the pooling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.core.batch import HiddenRows
from radixserve.core.req import Req


@dataclass
class Pooled:
    """One request's pooling so far (`Req.pooled`)."""

    total: torch.Tensor  # (hidden,) fp32: the sum of rows (mean) or the last row (last)
    positions: int  # prompt positions it covers


def hidden_rows(req: Req, ends_prompt: bool) -> HiddenRows | None:
    """The rows of this step's tokens `req` wants (None: not an embedding request)."""
    if req.embed is None:
        return None
    if req.embed.pooling == "mean":
        return "all"
    return "last" if ends_prompt else "none"


def accumulate(req: Req, rows: torch.Tensor, start: int, end: int) -> None:
    """Fold this step's rows (positions start..end of the prompt) into `req.pooled`."""
    assert req.embed is not None
    if req.embed.pooling == "last":
        if len(rows):
            req.pooled = Pooled(rows[-1].clone(), end)
        return
    if start == 0:  # a fresh admission (mean pooling never starts from a cached prefix)
        req.pooled = None
    assert len(rows) == end - start, "mean pooling needs a row per prompt position"
    total = rows.sum(dim=0)
    if req.pooled is None:
        req.pooled = Pooled(total, end)
        return
    assert req.pooled.positions == start, "mean pooling lost a chunk"
    req.pooled = Pooled(req.pooled.total + total, end)


def finish(req: Req) -> list[float]:
    """The request's embedding once its whole prompt is prefilled."""
    assert req.embed is not None and req.pooled is not None
    pooled = req.pooled
    assert pooled.positions == len(req.input_ids), "the prompt was not fully pooled"
    vector = pooled.total / len(req.input_ids) if req.embed.pooling == "mean" else pooled.total
    if req.embed.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    req.pooled = None
    return vector.tolist()
