"""What an embedding request asks for: how the prompt's final hidden states are pooled into
one vector, and whether it is L2-normalized. Plain data (no torch): the edge sets it, the
scheduler pools (scheduler/embedding.py).

An embedding request is a prompt that is prefilled and never decoded: `max_new_tokens` 0,
so it ends after its prefill with finish reason `length` (length 0), like a prefill-only
generation, and its prompt's KV goes into the radix tree like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Pooling = Literal["last", "mean"]
POOLINGS: tuple[Pooling, ...] = ("last", "mean")


@dataclass(frozen=True)
class EmbedParams:
    # last: the hidden state of the prompt's last token (a cached prefix is reused);
    # mean: the mean over every prompt token (all recomputed: the cache holds no hidden states)
    pooling: Pooling = "last"
    normalize: bool = True  # divide by the L2 norm

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")

    @property
    def needs_every_position(self) -> bool:
        """Mean pooling needs the hidden state of every prompt token, so no cached prefix."""
        return self.pooling == "mean"
