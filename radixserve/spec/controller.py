"""How many drafted tokens to verify this step: only those expected to pay for themselves.

A decode step's forward costs about `a + b * T` seconds for T tokens (on a CPU at small
batches `a`, reading the weights, dwarfs `b`; at large batches T dominates). `CostModel`
fits a and b by least squares over the recent steps' measured (T, seconds). The true cost
is not a line: a CPU's linear kernels take rows in groups (8 at a time in the AVX-512 fp32
kernel, so a step of 17 tokens costs ~1.4x one of 16 on an AMD EPYC Zen 4) and turn
compute-bound past a few rows. So `CostModel.seconds(T)` is the median of the recent steps
of exactly T tokens where there are some, the line elsewhere (a T the line under-prices is
tried once or twice, then known).

Each draft gets an estimate q of the chance that each of its tokens is accepted given the
previous one was: how drafts found the same way (own tokens or shared index, and how many
trailing tokens matched) have fared across all requests (`MatchStats`) is the prior, and
the request's own record (`Acceptance`: decayed counts) moves it. Measured on SmolLM2
(copy-heavy and free-form tasks): the first drafted token was accepted 45% of the time
after a 2-token match, 76% after 4-5, 91% after 8. Its j-th drafted token then adds q**j
expected tokens. A step with E expected tokens over T forward
tokens yields E / seconds(T) tokens per second. `plan` ranks drafted tokens from the most
to the least valuable (the values of a request's tokens fall with j, so each request keeps
a prefix of its draft) and keeps the count that makes E / seconds(T) largest; with the line
for seconds, that is adding tokens while one more worth p pays, p * (a + b T) > b * E.
Requests whose drafts keep failing fall below the bar and draft nothing.

That rule counts an accepted token as a token of progress, which holds while requests queue
behind the batch. When they do not, the step count of a batch is set by its longest request
and a token accepted for another saves only its own row (b), no more than it cost to verify.
So a step also stays where verification is almost free: it costs at most FREE_FACTOR (2)
one-token steps (on the line: T <= a / b + 2; measured costs where there are some, so a
line bent by the step shape cannot cut a batch of 1's drafts). On the 2-core AVX2 EPYC,
a ~ 45-55 ms and b ~ 3-4.5 ms for SmolLM2 in fp32: up to 12-19 tokens a step, so a batch of
1 verifies all its drafted tokens and a batch of 12-19 or more verifies none (measured: 16
concurrent requests, drafts accepted 78% of the time and still 0.92x without this cap; with
it, 1.00-1.03x). On a GPU a / b is far larger and so is the batch where speculation stops.

With several requests running and none queued, the step shape matters more: on the AMD EPYC
Zen 4 (fp32, a kernel taking rows 8 at a time) a draft at 16 running buys a third row group
(~1.4x the step) for a token that helps only if its request is the last to finish; 16
concurrent requests ran 0.93-1.03x (median of six runs ~0.95x) with 2% of request-steps
verifying a draft. So such a step takes drafts only while they keep its measured cost
within ALONE_SLACK (5%) of the step without them: the rows its kernels pay for anyway.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

PRIOR_SLOPE = 0.08  # b / (a + b) assumed until the measured steps vary enough to fit b
MIN_SLOPE = 0.01  # floor of b as a share of a one-token step: noise never makes tokens free
DECAY = 0.9  # per verified step: older acceptance counts weigh less
OUTLIER_MADS = 5.0  # a step this many median residuals off the fit is left out of it


MEASURED_KEEP = 5  # recent steps kept per token count
MEASURED_MIN = 2  # steps of a token count before their median replaces the line
# steps after which a token count not seen again is forgotten and priced by the line again:
# a count measured while something else held the cores would otherwise keep drafts out for
# as long (re-measuring costs at most MEASURED_MIN steps of that count this often)
MEASURED_STALE = 256


class CostModel:
    def __init__(self, window: int = 128) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self._by_tokens: dict[int, tuple[deque[float], int]] = {}  # T -> (seconds, last step)
        self._steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        self._samples.append((tokens, seconds))
        self._fit = None
        self._steps += 1
        recent = self._by_tokens.get(tokens)
        times = recent[0] if recent is not None else deque(maxlen=MEASURED_KEEP)
        times.append(seconds)
        self._by_tokens[tokens] = (times, self._steps)

    def seconds(self, tokens: int) -> float:
        """What a step of `tokens` tokens costs: the median of the recent such steps, else
        the fitted line."""
        recent = self._by_tokens.get(tokens)
        if recent is not None:
            times, last = recent
            if self._steps - last > MEASURED_STALE:
                del self._by_tokens[tokens]  # conditions change: measure it again
            elif len(times) >= MEASURED_MIN:
                return statistics.median(times)
        a, b = self.coefficients()
        return a + b * tokens

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
# per step, for the same statistics: a kind of draft whose record fell below the bar is not
# verified again, so only time brings it back toward the prior (half-way in ~350 steps)
IDLE_DECAY = 0.998
# plan() looks past tokens that do not pay on the line by this factor (a step-shaped cost
# can make several tokens pay where one does not), never further
MIN_GAIN = 0.25
FREE_FACTOR = 2.0  # a step with drafts costs at most this many one-token steps
ALONE_SLACK = 0.05  # nothing queued: drafts make a step of several requests this much dearer


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
        self._by_kind: dict[tuple[str, int], tuple[Acceptance, int]] = {}  # -> (record, step)
        self._step = 0

    def advance(self) -> None:
        """One decode step went by."""
        self._step += 1

    def _current(self, kind: tuple[str, int]) -> Acceptance | None:
        entry = self._by_kind.get(kind)
        if entry is None:
            return None
        record, step = entry
        if step < self._step:
            fade = IDLE_DECAY ** (self._step - step)
            record.accepted *= fade
            record.tried *= fade
            self._by_kind[kind] = (record, self._step)
        return record

    def rate(self, source: str, match_len: int) -> float:
        record = self._current((source, match_len))
        return 0.5 if record is None else record.rate()

    def record(self, source: str, match_len: int, drafted: int, accepted: int) -> None:
        kind = (source, match_len)
        record = self._current(kind)
        if record is None:
            record = Acceptance()
            self._by_kind[kind] = (record, self._step)
        record.record(drafted, accepted, GLOBAL_DECAY)


def step_ceiling(cost: Callable[[int], float], base_tokens: int, alone: bool) -> float:
    """The most a step with drafts may cost: FREE_FACTOR one-token steps (verification
    almost free), and with `alone` within ALONE_SLACK of the step without them (see the
    module docstring)."""
    ceiling = FREE_FACTOR * cost(1)
    if alone:
        ceiling = min(ceiling, (1 + ALONE_SLACK) * cost(base_tokens))
    return ceiling


def room_for_drafts(cost: Callable[[int], float], base_tokens: int, alone: bool) -> bool:
    """Whether one drafted token keeps a step of `base_tokens` under its ceiling; where it
    does not, `plan` takes none whatever the drafts, so they need not be looked up (at a
    large batch the lookups were most of the scheduler's own time: 256 running on the
    tests' tiny model, ~25 us per request and step: the Engine's 256 x 64 tokens in 2.85 s
    against 2.26 s without speculation; skipped, 2.56 s against 2.73, medians of 3, AMD
    EPYC Zen 4)."""
    return cost(base_tokens + 1) <= step_ceiling(cost, base_tokens, alone)


def plan(
    rates: list[float],
    lengths: list[int],
    base_tokens: int,
    coefficients: tuple[float, float],
    budget: int,
    seconds: Callable[[int], float] | None = None,
    alone: bool = False,
) -> list[int]:
    """Drafted tokens to verify per request: request i has `lengths[i]` drafted tokens and
    acceptance rate `rates[i]`; the step already runs `base_tokens` tokens (one per running
    request, more after a jump-forward) and may add at most `budget` (free KV slots).
    `seconds(T)`: a step's cost (default: the line of `coefficients`). `alone`: several
    requests run and none waits behind them: the step may only grow within ALONE_SLACK of
    its cost without drafts (see the module docstring)."""
    a, b = coefficients
    cost = seconds or (lambda tokens: a + b * tokens)
    ceiling = step_ceiling(cost, base_tokens, alone)
    heap = [(-q, i) for i, (q, n) in enumerate(zip(rates, lengths)) if n > 0 and q > 0]
    heapq.heapify(heap)
    picks: list[int] = []  # requests, in the order of their tokens' values
    taken = [0] * len(rates)
    expected, best_rate, best = float(base_tokens), base_tokens / cost(base_tokens), 0
    while heap and len(picks) < budget and cost(base_tokens + len(picks) + 1) <= ceiling:
        neg_value, i = heapq.heappop(heap)
        value = -neg_value
        if value * (a + b * (base_tokens + len(picks))) <= b * expected * MIN_GAIN:
            break  # under a quarter of what its row costs on the line: so is every later one
        picks.append(i)
        taken[i] += 1
        expected += value
        rate = expected / cost(base_tokens + len(picks))
        if rate > best_rate:
            best_rate, best = rate, len(picks)
        if taken[i] < lengths[i]:
            heapq.heappush(heap, (-value * rates[i], i))
    take = [0] * len(rates)
    for i in picks[:best]:
        take[i] += 1
    return take
