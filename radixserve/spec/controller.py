"""How many drafted tokens to verify this step: only those expected to pay for themselves.

A decode step's forward costs about `a + b * T` seconds for T tokens (on a CPU at small
batches `a`, reading the weights, dwarfs `b`; at large batches T dominates). `CostModel`
fits a and b by least squares over the recent steps' measured (T, seconds).

Each draft gets an estimate q of the chance that each of its tokens is accepted given the
previous one was: how drafts found the same way (own tokens or shared index, and how many
trailing tokens matched) have fared across all requests (`MatchStats`) is the prior, and
the request's own record (`Acceptance`: decayed counts) moves it. Measured on SmolLM2
(copy-heavy and free-form tasks): the first drafted token was accepted 45% of the time
after a 2-token match, 76% after 4-5, 91% after 8. Its j-th drafted token then adds q**j
expected tokens. A step with E expected tokens over T forward
tokens yields E / (a + b T) tokens per second; one more drafted token worth p raises that
exactly when

    p * (a + b T) > b * E.

`plan` adds drafted tokens from the most to the least valuable while that holds (the values
of a request's tokens fall with j, so each request keeps a prefix of its draft). Requests
whose drafts keep failing fall below the bar and draft nothing.

That rule counts an accepted token as a token of progress, which holds while requests queue
behind the batch. When they do not, the step count of a batch is set by its longest request
and a token accepted for another saves only its own row (b), no more than it cost to verify.
So a step also stays where verification is almost free: its tokens cost at most its fixed
part (T <= a / b). On the 2-core AVX2 EPYC, a ~ 45-55 ms and b ~ 3-4.5 ms for SmolLM2 in
fp32: up to 12-19 tokens a step, so a batch of 1 verifies all its drafted tokens and a batch
of 12-19 or more verifies none (measured: 16 concurrent requests, drafts accepted 78% of the
time and still 0.92x without this cap; with it, 1.00-1.03x). On a GPU a / b is far larger
and so is the batch where speculation stops.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from dataclasses import dataclass

PRIOR_SLOPE = 0.08  # b / (a + b) assumed until the measured steps vary enough to fit b
MIN_SLOPE = 0.01  # floor of b as a share of a one-token step: noise never makes tokens free
DECAY = 0.9  # per verified step: older acceptance counts weigh less
OUTLIER_MADS = 5.0  # a step this many median residuals off the fit is left out of it


class CostModel:
    def __init__(self, window: int = 128) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        self._samples.append((tokens, seconds))
        self._fit = None

    def coefficients(self) -> tuple[float, float]:
        """(a, b): fixed seconds per step and seconds per token (refitted after each new
        observation only)."""
        if self._fit is None:
            self._fit = self._least_squares()
        return self._fit

    def _least_squares(self) -> tuple[float, float]:
        """The fit, refitted without the steps it explains worst: a step slowed by
        something else (another process on the cores, a page fault storm) would otherwise
        inflate a or b and stop drafting for a whole window."""
        samples = list(self._samples)
        if not samples:
            return 1.0, PRIOR_SLOPE
        a, b = _fit(samples)
        residuals = [abs(s - a - b * t) for t, s in samples]
        spread = OUTLIER_MADS * statistics.median(residuals)
        kept = [x for x, r in zip(samples, residuals) if r <= spread]
        if spread > 0 and len(samples) >= 8 and len(kept) < len(samples):
            a, b = _fit(kept)
        return a, b


def _fit(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares a + b * T over (T, seconds), held to what the data can support."""
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_s = sum(s for _, s in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if n >= 8 and var > 0:
        b = sum((t - mean_t) * (s - mean_s) for t, s in samples) / var
    else:
        b = PRIOR_SLOPE * mean_s / max(mean_t, 1.0)
    a = mean_s - b * mean_t
    floor = MIN_SLOPE * max(mean_s / max(mean_t, 1.0), 1e-9)
    if b < floor or a <= 0:  # noise, or a fit the data cannot support
        b = max(b, floor)
        a = max(mean_s - b * mean_t, b)
    return a, b


PRIOR_WEIGHT = 2.0  # pseudo-observations the prior counts for against a request's own record
GLOBAL_DECAY = 0.995  # per verified draft, for the statistics shared by all requests


@dataclass
class Acceptance:
    """Decayed counts of drafted tokens tried and accepted (a token counts as tried when
    every token before it in its draft was accepted)."""

    accepted: float = 0.0
    tried: float = 0.0

    def rate(self, prior: float = 0.5, weight: float = PRIOR_WEIGHT) -> float:
        """The acceptance rate, `prior` counting for `weight` observations."""
        return (self.accepted + weight * prior) / (self.tried + weight)

    def record(self, drafted: int, accepted: int, decay: float = DECAY) -> None:
        """`accepted` of `drafted` tokens kept (a run of acceptances, then one rejection
        unless all were kept)."""
        self.accepted = self.accepted * decay + accepted
        self.tried = self.tried * decay + min(accepted + 1, drafted)


class MatchStats:
    """Acceptance of drafts by how they were found (source, trailing tokens matched),
    over all requests: the prior of each request's estimate."""

    def __init__(self) -> None:
        self._by_kind: dict[tuple[str, int], Acceptance] = {}

    def rate(self, source: str, match_len: int) -> float:
        record = self._by_kind.get((source, match_len))
        return 0.5 if record is None else record.rate()

    def record(self, source: str, match_len: int, drafted: int, accepted: int) -> None:
        record = self._by_kind.setdefault((source, match_len), Acceptance())
        record.record(drafted, accepted, GLOBAL_DECAY)


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
    budget = min(budget, int(a / b) - base_tokens)  # keep verification almost free
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
