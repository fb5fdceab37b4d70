"""A request as the scheduler sees it: its tokens, its sampling parameters, its KV state."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from radixserve.core.sampling_params import SamplingParams


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int = -1  # the draw seed: params.sampling_seed, else a random one
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None  # request→token table row while it holds KV
    kv_len: int = 0  # tokens (from the start of input+output) whose K/V are in the pool
    finish_reason: dict[str, Any] | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("the prompt is empty: a request needs at least one input token")
        if self.seed < 0:
            seed = self.params.sampling_seed
            self.seed = random.getrandbits(32) if seed is None else seed
        assert 0 <= self.kv_len <= len(self.input_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
