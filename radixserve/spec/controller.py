"""How many drafted tokens to verify this step: only those expected to pay for themselves.

A decode step's forward costs about `a + b * T` seconds for T tokens (on a CPU at small
batches `a`, reading the weights, dwarfs `b`; at large batches T dominates). `CostModel`
fits a and b by least squares over the recent steps' measured (T, seconds).

Each request carries an estimate q of the chance that its next drafted token is accepted
given the previous one was (`Acceptance`: decayed counts with a Beta(1, 1) prior). Its j-th
drafted token then adds q**j expected tokens. A step with E expected tokens over T forward
tokens yields E / (a + b T) tokens per second; one more drafted token worth p raises that
exactly when

    p * (a + b T) > b * E.

`plan` adds drafted tokens from the most to the least valuable while that holds (the values
of a request's tokens fall with j, so each request keeps a prefix of its draft). Requests
whose drafts keep failing fall below the bar and draft nothing; a batch large enough that
verification is no longer almost free (b T comparable to a) raises the bar for all.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

PRIOR_SLOPE = 0.08  # b / (a + b) assumed until the measured steps vary enough to fit b
MIN_SLOPE = 0.01  # floor of b as a share of a one-token step: noise never makes tokens free
DECAY = 0.9  # per verified step: older acceptance counts weigh less


class CostModel:
    def __init__(self, window: int = 128) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, tokens: int, seconds: float) -> None:
        self._samples.append((tokens, seconds))

    def coefficients(self) -> tuple[float, float]:
        """(a, b): fixed seconds per step and seconds per token."""
        if not self._samples:
            return 1.0, PRIOR_SLOPE
        n = len(self._samples)
        mean_t = sum(t for t, _ in self._samples) / n
        mean_s = sum(s for _, s in self._samples) / n
        var = sum((t - mean_t) ** 2 for t, _ in self._samples)
        if n >= 8 and var > 0:
            b = sum((t - mean_t) * (s - mean_s) for t, s in self._samples) / var
        else:
            b = PRIOR_SLOPE * mean_s / max(mean_t, 1.0)
        a = mean_s - b * mean_t
        floor = MIN_SLOPE * max(mean_s / max(mean_t, 1.0), 1e-9)
        if b < floor or a <= 0:  # noise, or a fit the data cannot support
            b = max(b, floor)
            a = max(mean_s - b * mean_t, b)
        return a, b


@dataclass
class Acceptance:
    """A request's chance that a drafted token is accepted after the previous one was."""

    accepted: float = 0.0
    tried: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + 1.0) / (self.tried + 2.0)

    def record(self, drafted: int, accepted: int) -> None:
        """`accepted` of `drafted` tokens kept (a run of acceptances, then one rejection
        unless all were kept)."""
        self.accepted = self.accepted * DECAY + accepted
        self.tried = self.tried * DECAY + min(accepted + 1, drafted)


def plan(
    rates: list[float],
    lengths: list[int],
    base_tokens: int,
    coefficients: tuple[float, float],
    budget: int,
) -> list[int]:
    """Drafted tokens to verify per request: request i has `lengths[i]` drafted tokens and
    acceptance rate `rates[i]`; the step already runs `base_tokens` tokens (one per running
    request, more after a jump-forward) and may add at most `budget` (free KV slots)."""
    a, b = coefficients
    take = [0] * len(rates)
    expected = float(base_tokens)
    tokens = base_tokens
    heap = [(-q, i) for i, (q, n) in enumerate(zip(rates, lengths)) if n > 0 and q > 0]
    heapq.heapify(heap)
    while heap and budget > 0:
        neg_value, i = heapq.heappop(heap)
        value = -neg_value
        if value * (a + b * tokens) <= b * expected:
            break  # every remaining token is worth less than this one
        take[i] += 1
        expected += value
        tokens += 1
        budget -= 1
        if take[i] < lengths[i]:
            heapq.heappush(heap, (-value * rates[i], i))
    return take
