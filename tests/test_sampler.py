"""The sampler on small synthetic logits (CPU, no model).

Checks the documented contract of `radixserve.model.sampler`: penalties and bias computed by
hand, greedy = argmax, top-k / top-p / min-p never draw an excluded token, the empirical
distribution of many seeded draws tracks the (filtered, renormalised) softmax, draws are a pure
function of (seed, step, logits), logprobs come from the raw logits, and `SamplingParams`
validation. Expected values are computed independently in float64.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.core.regex_cost import unrolled_size
from radixserve.core.sampling_params import (
    MAX_STOP_LENGTH,
    MAX_STOP_REGEX_ITEMS,
    MAX_STOP_REGEX_LENGTH,
    MAX_STOP_REGEXES,
    MAX_STOPS,
    SamplingParams,
    SamplingParamsError,
)
from radixserve.model.sampler import (
    SampleOutput,
    Sampler,
    SamplingBatch,
    exponential_noise,
    filtered_probs,
    first_argmax,
    process_logits,
)

CPU = torch.device("cpu")
N_DRAWS = 2000  # rows per "never picks an excluded token" check
N_FREQ = 20000  # rows per "frequencies track the distribution" check
SIGMAS = 5.0
MARGIN = 1e-4  # test cases keep top-p / min-p boundaries at least this far from a tie


# --- helpers -------------------------------------------------------------------------------


def make_batch(
    params: Sequence[SamplingParams],
    vocab_size: int,
    seeds: Sequence[int] | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    banned: Sequence[Sequence[int]] | None = None,
) -> SamplingBatch:
    rows = len(params)
    return SamplingBatch.build(
        params,
        seeds if seeds is not None else list(range(rows)),
        prompt_ids if prompt_ids is not None else [[]] * rows,
        output_ids if output_ids is not None else [[]] * rows,
        vocab_size,
        CPU,
        banned=banned,
    )


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], **kwargs) -> SampleOutput:
    """One Sampler call on `logits` (B, V); kwargs go to `make_batch`."""
    logprob_args = {k: kwargs.pop(k) for k in ("return_logprob", "top_logprobs_num") if k in kwargs}
    return Sampler()(logits, make_batch(params, logits.shape[-1], **kwargs), **logprob_args)


def draw_many(row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n draws from one logits row (V,), one per row of a batch with seeds 0..n-1."""
    return sample(row.expand(n, -1).contiguous(), [params] * n).next_ids


def random_logits(rows: int, vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def softmax64(row: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.softmax(row.double() / temperature, dim=-1)


def top_k_set(row: torch.Tensor, k: int) -> set[int]:
    ranked = sorted(range(len(row)), key=lambda t: float(row[t]), reverse=True)
    return set(ranked[:k])


def nucleus_set(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p."""
    kept, mass = set(), 0.0
    for token in sorted(range(len(probs)), key=lambda t: float(probs[t]), reverse=True):
        if mass >= top_p:
            assert mass - top_p > MARGIN, "test case too close to the top-p boundary"
            break
        assert top_p - mass > MARGIN, "test case too close to the top-p boundary"
        kept.add(token)
        mass += float(probs[token])
    return kept


def min_p_set(probs: torch.Tensor, min_p: float) -> set[int]:
    threshold = min_p * float(probs.max())
    assert all(abs(float(p) - threshold) > MARGIN for p in probs), "too close to min-p threshold"
    return {t for t, p in enumerate(probs.tolist()) if p >= threshold}


def restricted(probs: torch.Tensor, allowed: set[int]) -> torch.Tensor:
    """probs zeroed outside `allowed` and renormalised."""
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[list(allowed)] = True
    kept = probs.where(mask, torch.zeros_like(probs))
    return kept / kept.sum()


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()


def assert_frequencies_match(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Each token's empirical frequency within SIGMAS binomial standard deviations."""
    n = len(tokens)
    observed = torch.bincount(tokens, minlength=len(expected)).double() / n
    sigma = (expected * (1 - expected) / n).sqrt()
    # Tokens with expected probability 0 must never appear (sigma = 0 there).
    excess = (observed - expected).abs() - SIGMAS * sigma
    assert (excess <= 1e-12).all(), f"observed {observed.tolist()} vs {expected.tolist()}"


# --- 1. greedy -----------------------------------------------------------------------------


def test_greedy_rows_are_argmax():
    logits = random_logits(64, 100, seed=1)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)] * 64
    assert torch.equal(sample(logits, params).next_ids, logits.argmax(dim=-1))


def test_first_argmax_breaks_ties_as_argmax_does():
    """Rows full of ties (bf16 logits widened to fp32 have many), NaN and all -inf rows:
    the same index as argmax, the first of the largest."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 4, (16, 49152), generator=gen).float()
    x[3, 100] = float("nan")
    x[5] = -math.inf
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    assert first_argmax(torch.tensor([[1.0, 7.0, 7.0, 2.0]])).item() == 1


@pytest.mark.parametrize("cols", [49152, 151936, 262144, 1000, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_first_argmax_by_blocks_finds_the_first_largest(cols, dtype):
    """The block path (vocabularies of SmolLM2, Qwen3, Gemma 3; 1000 and 64 take max whole):
    ties inside a block, across blocks (the largest value also at the start of a later
    block), a row whose largest value is its last, and a transposed (non-contiguous) batch."""
    gen = torch.Generator().manual_seed(cols)
    x = torch.randint(0, 50, (9, cols), generator=gen).to(dtype)
    top = 60.0
    x[1, [cols // 3, cols // 3 + 1]] = top  # a tie inside a block
    x[2, [cols // 2 - 1, cols // 2, cols - 1]] = top  # ends of blocks, and the last value
    x[3, -1] = top
    x[4, :] = 7.0  # all equal: index 0
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    xt = x.t().contiguous().t()  # same values, not contiguous
    assert torch.equal(first_argmax(xt), x.argmax(dim=-1))


def test_greedy_rows_stay_exact_in_a_mixed_batch():
    logits = random_logits(64, 50, seed=2, scale=0.3)  # flat: sampled rows rarely hit argmax
    greedy = SamplingParams(temperature=0.0)
    sampled = [SamplingParams(temperature=2.0), SamplingParams(top_k=10, min_p=0.05)]
    params = [greedy if row % 3 == 0 else sampled[row % 2] for row in range(64)]
    next_ids = sample(logits, params).next_ids
    is_greedy = torch.tensor([p.is_greedy for p in params])
    argmax = logits.argmax(dim=-1)
    assert torch.equal(next_ids[is_greedy], argmax[is_greedy])
    assert (next_ids[~is_greedy] != argmax[~is_greedy]).any(), "sampled rows look greedy"


def test_greedy_argmax_is_taken_after_penalties_and_bias():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    biased = SamplingParams(temperature=0.0, logit_bias={3: 10.0})
    out = sample(
        logits.repeat(3, 1),
        [penalised, biased, SamplingParams(temperature=0.0)],
        prompt_ids=[[0], [], []],
        banned=[[], [], [0]],
    )
    assert out.next_ids.tolist() == [1, 3, 1]  # 5/2 < 4; 0 + 10 wins; 0 banned


# --- 2. filtering never draws an excluded token --------------------------------------------

FILTER_LOGITS = random_logits(1, 24, seed=3, scale=1.0)[0]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=4), lambda p: top_k_set(FILTER_LOGITS, 4)),
        (SamplingParams(top_k=1, temperature=3.0), lambda p: top_k_set(FILTER_LOGITS, 1)),
        (SamplingParams(top_p=0.5), lambda p: nucleus_set(p, 0.5)),
        (SamplingParams(top_p=0.8, temperature=0.7), lambda p: nucleus_set(p, 0.8)),
        (SamplingParams(min_p=0.3), lambda p: min_p_set(p, 0.3)),
        (SamplingParams(min_p=0.1, temperature=0.5), lambda p: min_p_set(p, 0.1)),
    ],
    ids=["top_k=4", "top_k=1", "top_p=0.5", "top_p=0.8,T=0.7", "min_p=0.3", "min_p=0.1,T=0.5"],
)
def test_filters_never_draw_an_excluded_token(params, allowed):
    probs = softmax64(FILTER_LOGITS, params.temperature)
    allowed_ids = allowed(probs)
    excluded_mass = 1 - sum(float(probs[t]) for t in allowed_ids)
    assert excluded_mass > 0.1, "test case should exclude a sizeable share of the mass"
    drawn = set(draw_many(FILTER_LOGITS, params, N_DRAWS).tolist())
    assert drawn <= allowed_ids, f"drew excluded tokens {sorted(drawn - allowed_ids)}"
    if len(allowed_ids) > 1:
        assert len(drawn) > 1, "draws look greedy"


@pytest.mark.parametrize(
    "limit",
    # 1e-50 is valid (> 0) but 0 in fp32: the top token must stay all the same
    [{"top_k": 1}, {"top_p": 1e-6}, {"top_p": 1e-50}, {"min_p": 1.0}],
    ids=str,
)
def test_extreme_filters_keep_only_the_top_token(limit):
    drawn = draw_many(FILTER_LOGITS, SamplingParams(temperature=2.0, **limit), N_DRAWS)
    assert set(drawn.tolist()) == {int(FILTER_LOGITS.argmax())}


def test_filtered_probs_support_is_exactly_the_allowed_set():
    params = [SamplingParams(top_k=4), SamplingParams(top_p=0.5), SamplingParams(min_p=0.3)]
    probs = softmax64(FILTER_LOGITS)
    expected = [top_k_set(FILTER_LOGITS, 4), nucleus_set(probs, 0.5), min_p_set(probs, 0.3)]
    logits = FILTER_LOGITS.expand(3, -1)
    filtered = filtered_probs(logits, make_batch(params, logits.shape[-1]))
    for row, allowed in zip(filtered, expected, strict=True):
        assert set(row.nonzero().flatten().tolist()) == allowed


# --- 3. empirical frequencies --------------------------------------------------------------

FREQ_LOGITS = torch.tensor([1.2, 0.9, 0.4, 0.0, -0.3, -1.1])


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(), None),
        (SamplingParams(temperature=0.5), None),
        (SamplingParams(temperature=2.5), None),
        (SamplingParams(top_k=3), lambda p: top_k_set(FREQ_LOGITS, 3)),
        (SamplingParams(top_k=2, temperature=1.7), lambda p: top_k_set(FREQ_LOGITS, 2)),
        (SamplingParams(top_p=0.75), lambda p: nucleus_set(p, 0.75)),
        (SamplingParams(min_p=0.4), lambda p: min_p_set(p, 0.4)),
    ],
    ids=["T=1", "T=0.5", "T=2.5", "top_k=3", "top_k=2,T=1.7", "top_p=0.75", "min_p=0.4"],
)
def test_draw_frequencies_track_the_distribution(params, allowed):
    probs = softmax64(FREQ_LOGITS, params.temperature)
    expected = probs if allowed is None else restricted(probs, allowed(probs))
    assert_frequencies_match(draw_many(FREQ_LOGITS, params, N_FREQ), expected)


def test_frequencies_over_the_steps_of_one_seed():
    """One request drawing step after step (not many seeds) also follows the distribution."""
    n = 4000
    logits = FREQ_LOGITS.expand(n, -1).contiguous()
    steps = [range(step) for step in range(n)]  # only len(output_ids) matters here
    out = sample(logits, [SamplingParams()] * n, seeds=[1234] * n, output_ids=steps)
    assert_frequencies_match(out.next_ids, softmax64(FREQ_LOGITS))


# --- 4. penalties and bias -----------------------------------------------------------------

PENALTY_LOGITS = torch.tensor([2.0, -1.0, 3.0, -2.0, 0.5, 1.0, 4.0, -0.5])
PROMPT = [0, 1]
OUTPUT = [2, 3, 3, 5, 5, 5]


def test_penalties_by_hand():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    batch = make_batch([params], 8, prompt_ids=[PROMPT], output_ids=[OUTPUT])
    expected = [
        2.0 / 2,  # prompt only, positive: divided by r; no frequency/presence
        -1.0 * 2,  # prompt only, negative: multiplied by r
        3.0 / 2 - 0.5 * 1 - 0.25,  # in output once
        -2.0 * 2 - 0.5 * 2 - 0.25,  # in output twice, negative
        0.5,  # unseen
        1.0 / 2 - 0.5 * 3 - 0.25,  # in output three times
        4.0,
        -0.5,
    ]
    assert process_logits(PENALTY_LOGITS[None], batch)[0].tolist() == expected


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(repetition_penalty=1.25), [1.6, -1.25, 2.4, -2.5, 0.5, 0.8, 4.0, -0.5]),
        (SamplingParams(frequency_penalty=-1.0), [2.0, -1.0, 4.0, 0.0, 0.5, 4.0, 4.0, -0.5]),
        (SamplingParams(presence_penalty=1.5), [2.0, -1.0, 1.5, -3.5, 0.5, -0.5, 4.0, -0.5]),
    ],
    ids=["repetition", "frequency", "presence"],
)
def test_each_penalty_alone(params, expected):
    batch = make_batch([params], 8, prompt_ids=[PROMPT], output_ids=[OUTPUT])
    torch.testing.assert_close(
        process_logits(PENALTY_LOGITS[None], batch)[0], torch.tensor(expected)
    )


@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0])
def test_a_tiny_repetition_penalty_favours_seen_tokens_without_overflow(temperature):
    """Dividing a positive logit by 1e-40 overflows fp32: the seen tokens' logits are
    bounded instead, so they win (greedy or sampled) and nothing turns into NaN."""
    logits = torch.tensor([[3.0, 1.0, 2.0, -1.0, 0.5]])
    params = SamplingParams(temperature=temperature, repetition_penalty=1e-40)
    batch = make_batch([params], 5, prompt_ids=[[2, 3]])
    processed = process_logits(logits, batch)
    assert torch.isfinite(processed).all(), processed
    probs = filtered_probs(processed, batch)
    assert torch.isfinite(probs).all(), probs
    drawn = sample(logits.expand(200, -1).contiguous(), [params] * 200, prompt_ids=[[2, 3]] * 200)
    assert set(drawn.next_ids.tolist()) == {2}


def test_penalties_only_touch_their_own_row():
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)]
    logits = PENALTY_LOGITS.expand(2, -1)
    batch = make_batch(params, 8, prompt_ids=[PROMPT] * 2, output_ids=[OUTPUT] * 2)
    processed = process_logits(logits, batch)
    assert torch.equal(processed[0], PENALTY_LOGITS)
    assert not torch.equal(processed[1], PENALTY_LOGITS)


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], params: SamplingParams
) -> list[float]:
    """The documented rule, token by token in Python floats."""
    counts, seen = Counter(output), set(prompt) | set(output)
    result = []
    for token, x in enumerate(logits):
        if token in seen:
            r = params.repetition_penalty
            x = x / r if x > 0 else x * r
        x -= params.frequency_penalty * counts[token]
        x -= params.presence_penalty * (counts[token] > 0)
        result.append(x)
    return result


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20, width=32), min_size=6, max_size=6),
    prompt=st.lists(st.integers(0, 5), max_size=6),
    output=st.lists(st.integers(0, 5), max_size=10),
    rep=st.floats(0.05, 2.0),
    freq=st.floats(-2.0, 2.0),
    pres=st.floats(-2.0, 2.0),
)
def test_penalties_match_reference(logits, prompt, output, rep, freq, pres):
    params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    batch = make_batch([params], 6, prompt_ids=[prompt], output_ids=[output])
    actual = process_logits(torch.tensor([logits]), batch)[0]
    expected = torch.tensor(reference_penalties(logits, prompt, output, params))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_logit_bias_adds_exactly_and_banned_is_minus_inf():
    params = SamplingParams(logit_bias={6: -1.5, 4: 0.25, "1": 2})  # keys may arrive as str
    batch = make_batch([params, SamplingParams()], 8, banned=[[7, 0], []])
    processed = process_logits(PENALTY_LOGITS.expand(2, -1), batch)
    expected = [-math.inf, 1.0, 3.0, -2.0, 0.75, 1.0, 2.5, -math.inf]
    assert processed[0].tolist() == expected
    assert torch.equal(processed[1], PENALTY_LOGITS)


def test_bias_comes_after_penalties():
    params = SamplingParams(repetition_penalty=2.0, logit_bias={0: 1.0})
    batch = make_batch([params], 8, prompt_ids=[[0]])
    assert process_logits(PENALTY_LOGITS[None], batch)[0, 0].item() == 2.0 / 2 + 1.0


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=5.0), SamplingParams(top_k=2)]
)
def test_banned_token_is_never_sampled(params):
    logits = torch.tensor([10.0, 0.0, 9.0, 1.0])  # banned 0 would otherwise dominate
    n = N_DRAWS
    out = sample(logits.expand(n, -1).contiguous(), [params] * n, banned=[[0]] * n)
    drawn = set(out.next_ids.tolist())
    assert 0 not in drawn
    assert len(drawn) > 1


# --- 5. seeds and noise --------------------------------------------------------------------

SEED_LOGITS = random_logits(1, 32, seed=5, scale=0.8)[0]
FILLERS = [
    SamplingParams(temperature=0.0),
    SamplingParams(top_p=0.6, temperature=1.3),
    SamplingParams(min_p=0.2, frequency_penalty=1.0, repetition_penalty=1.5),
    SamplingParams(logit_bias={3: 5.0}, presence_penalty=-0.5),
    SamplingParams(top_k=2),
]


@pytest.mark.parametrize(
    "target", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, min_p=0.01)]
)
def test_same_seed_same_token_whatever_the_batch(target):
    """Each target row (seed s, step 3) alone, then shuffled among filler rows."""
    seeds = list(range(100, 140))
    alone = [
        sample(SEED_LOGITS[None], [target], seeds=[s], output_ids=[[9, 9, 9]]).next_ids
        for s in seeds
    ]
    filler_logits = random_logits(len(FILLERS), 32, seed=6)
    rows: list[tuple[torch.Tensor, SamplingParams, int, list[int]]] = []
    targets = []
    for i, seed in enumerate(seeds):
        for j in range(i % 4):  # 0..3 filler rows before each target
            filler = (i + j) % len(FILLERS)
            rows.append((filler_logits[filler], FILLERS[filler], seed + j + 1, [1, 2, 3, 4][:j]))
        targets.append(len(rows))
        rows.append((SEED_LOGITS, target, seed, [4, 5, 6]))  # other output ids, same step
    logits, params, row_seeds, outputs = zip(*rows, strict=True)
    mixed = sample(
        torch.stack(logits),
        list(params),
        seeds=list(row_seeds),
        prompt_ids=[[7]] * len(rows),
        output_ids=list(outputs),
    )
    assert mixed.next_ids[targets].tolist() == torch.cat(alone).tolist()
    assert len(set(mixed.next_ids[targets].tolist())) > 1


def test_different_seeds_and_steps_give_different_draws():
    n, vocab = 1000, 16
    flat = torch.zeros(n, vocab)
    by_seed = sample(flat, [SamplingParams()] * n, seeds=list(range(n))).next_ids
    counts = torch.bincount(by_seed, minlength=vocab)
    assert (counts > 0).all() and counts.max() < 0.15 * n  # expected 62.5 each
    a = sample(flat, [SamplingParams()] * n, seeds=[7] * n, output_ids=[range(i) for i in range(n)])
    b = sample(flat, [SamplingParams()] * n, seeds=[8] * n, output_ids=[range(i) for i in range(n)])
    assert (a.next_ids != b.next_ids).float().mean() > 0.8  # 15/16 expected
    assert len(set(a.next_ids.tolist())) == vocab


def test_seed_is_taken_modulo_2_pow_32():
    logits = SEED_LOGITS.expand(3, -1).contiguous()
    out = sample(logits, [SamplingParams()] * 3, seeds=[5, 5 + 2**32, -(2**32) + 5])
    assert len(set(out.next_ids.tolist())) == 1


def test_exponential_noise_is_a_pure_function():
    seeds, steps = torch.tensor([0, 1, 2**31, 2**32 - 1]), torch.tensor([0, 5, 5, 100])
    noise = exponential_noise(seeds, steps, 64)
    assert torch.equal(noise, exponential_noise(seeds, steps, 64))
    assert torch.equal(noise[2:3], exponential_noise(seeds[2:3], steps[2:3], 64))
    assert torch.equal(noise[:, :10], exponential_noise(seeds, steps, 10))  # keyed by token id
    assert len({tuple(row.tolist()) for row in noise}) == len(seeds)


def test_exponential_noise_is_exp1():
    n_seeds, vocab = 1000, 1000
    seeds = torch.arange(n_seeds)
    noise = exponential_noise(seeds, torch.zeros_like(seeds), vocab)
    n = noise.numel()
    assert noise.dtype == torch.float64 and (noise > 0).all() and noise.isfinite().all()
    assert abs(noise.mean().item() - 1.0) < SIGMAS / math.sqrt(n)  # Exp(1): mean 1, std 1
    assert abs(noise.var().item() - 1.0) < SIGMAS * math.sqrt(8 / n)  # var of s^2 is 8
    tail = (noise > 1.0).double().mean().item()
    assert abs(tail - math.exp(-1)) < SIGMAS * math.sqrt(math.exp(-1) * (1 - math.exp(-1)) / n)
    # No structure between neighbouring tokens or consecutive seeds.
    assert abs(correlation(noise[:, :-1], noise[:, 1:])) < 0.01
    assert abs(correlation(noise[:-1], noise[1:])) < 0.01


# --- 6. logprobs ---------------------------------------------------------------------------


def test_logprobs_are_those_of_the_raw_logits():
    logits = random_logits(6, 40, seed=7)
    params = [
        SamplingParams(temperature=0.0, logit_bias={0: 30.0}),  # picks a token raw-unlikely
        SamplingParams(temperature=0.3, repetition_penalty=1.8, frequency_penalty=1.0),
        SamplingParams(temperature=2.0, top_k=5, presence_penalty=2.0),
        SamplingParams(top_p=0.5, min_p=0.1),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(),
    ]
    out = sample(
        logits,
        params,
        prompt_ids=[[1, 2, 3]] * 6,
        output_ids=[[4, 4, 5]] * 6,
        banned=[[], [6], [], [], [], []],
        return_logprob=True,
        top_logprobs_num=4,
    )
    raw = torch.log_softmax(logits.double(), dim=-1).float()
    chosen = raw[torch.arange(6), out.next_ids]
    torch.testing.assert_close(out.logprobs, chosen)
    top_lp, top_ids = raw.topk(4, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top_lp)
    assert torch.equal(out.top_ids, top_ids)
    assert out.next_ids[0] == 0 and out.logprobs[0] < top_lp[0, -1]  # bias not in logprob


def test_logprobs_absent_unless_asked():
    out = sample(random_logits(2, 10, seed=8), [SamplingParams()] * 2)
    assert out.logprobs is None and out.top_logprobs is None and out.top_ids is None
    out = sample(random_logits(2, 10, seed=8), [SamplingParams()] * 2, return_logprob=True)
    assert out.logprobs is not None and out.top_ids is None


# --- 7. SamplingParams validation ----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", 1.1),
        ("min_p", -0.1),
        ("frequency_penalty", 2.1),
        ("frequency_penalty", -2.1),
        ("presence_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.1),
        ("max_new_tokens", -1),
        ("n", 0),
    ],
)
def test_out_of_range_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_min_new_tokens_above_max_new_tokens_raises():
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    SamplingParams(max_new_tokens=4, min_new_tokens=4)


@pytest.mark.parametrize(
    "values",
    [
        {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 1.0},
        {"top_k": 1, "min_p": 0.0, "top_p": 1e-6},
        {"frequency_penalty": 2.0, "presence_penalty": -2.0, "repetition_penalty": 2.0},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0, "repetition_penalty": 1e-3},
    ],
)
def test_boundary_values_are_accepted(values):
    SamplingParams(**values)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5, "top_p": 0.9})


def test_from_dict_treats_none_as_default():
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict({}) == SamplingParams()
    nulls = {"temperature": None, "top_p": None, "top_k": None, "stop": None, "logit_bias": None}
    assert SamplingParams.from_dict(nulls) == SamplingParams()
    parsed = SamplingParams.from_dict({"temperature": 0.5, "top_k": None})
    assert parsed == SamplingParams(temperature=0.5)


@pytest.mark.parametrize(
    ("pattern", "size"),
    [
        (r"END-\d\d", 6),
        (r"\d{4}-\d{2}-\d{2}", 10),
        ("a{1000}b{1000}", 2000),
        ("(?:a{1000}){1000}", 1001 * 1000),  # "?:" counts as an item: an upper bound
        ("(?:x|a{1000000})", 1000003),
        ("a{0,1000000}", 1),  # an upper bound unrolls nothing
        ("a{4294967294}", 4294967294),
        ("[{1000}]{3}", 3),  # a class is one item, whatever it holds
        (r"\{1000\}", 6),  # escaped braces are no repeat
    ],
)
def test_unrolled_size_counts_what_counted_repeats_make_compiling_copy(pattern, size):
    assert unrolled_size(pattern) == size


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        ({"stop": ["x"] * (MAX_STOPS + 1)}, "stop", f"at most {MAX_STOPS}"),
        ({"stop": "x" * (MAX_STOP_LENGTH + 1)}, "stop", f"at most {MAX_STOP_LENGTH}"),
        ({"stop_regex": ["x"] * (MAX_STOP_REGEXES + 1)}, "stop_regex", f"{MAX_STOP_REGEXES} are"),
        ({"stop_regex": ["x" * (MAX_STOP_REGEX_LENGTH + 1)]}, "stop_regex", "characters"),
        ({"stop_regex": ["a{4294967294}"]}, "stop_regex", "unroll to 4294967294 items"),
        ({"stop_regex": ["a{3000}", "b{3000}"]}, "stop_regex", "unroll to 6000 items"),
        ({"stop_regex": ["ok", ""]}, "stop_regex", "non-empty"),
        ({"regex": 0}, "regex", "Expected `str | null`, got `int`"),
        ({"json_schema": []}, "json_schema", "got `array`"),
        ({"ebnf": False}, "ebnf", "got `bool`"),
    ],
)
def test_stops_within_their_limits_and_constraints_that_are_strings(params, field, words):
    """The stop caps bound what checking a request's stops costs each step (and what its
    regexes cost to compile, refused before compiling: `a{4294967294}` would take 18 GB);
    a constraint is a string (or a JSON schema object), an empty one meaning none."""
    with pytest.raises(SamplingParamsError, match=re.escape(words)) as error:
        SamplingParams.from_dict(params)
    assert error.value.field == field


def test_stops_at_their_limits_and_empty_constraints_are_accepted():
    longest = ["y" * MAX_STOP_REGEX_LENGTH] * (MAX_STOP_REGEX_ITEMS // MAX_STOP_REGEX_LENGTH)
    most = [r"\d{64}"] * MAX_STOP_REGEXES  # 64 items apiece
    assert sum(map(unrolled_size, most)) == MAX_STOP_REGEX_ITEMS
    for patterns in (longest, most):
        stops = ["x" * MAX_STOP_LENGTH] * MAX_STOPS
        params = SamplingParams.from_dict({"stop": stops, "stop_regex": patterns, "regex": ""})
        assert params.regex is None and len(params.stop_patterns) == len(patterns)
        assert params.stop_patterns is params.stop_patterns  # compiled once
    assert SamplingParams.from_dict({"json_schema": {}}).json_schema == "{}"


def test_greedy_threshold():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


# --- regressions: bugs found while writing these tests ---------------------------------


def test_top_p_keeps_only_the_smallest_nucleus_at_an_exact_boundary():
    # Four tokens of probability exactly 0.25: two of them already reach top_p = 0.5.
    logits = torch.zeros(1, 4)
    kept = filtered_probs(logits, make_batch([SamplingParams(top_p=0.5)], 4))
    assert int((kept > 0).sum()) == 2


def test_top_p_one_row_is_unaffected_by_a_top_k_neighbour():
    # One dominant token plus 31999 tokens of ~3e-8: float32 softmax sums to slightly more
    # than 1; a top_p=1 row must still keep its whole tail when another row in the batch
    # switches the top-k/top-p path on.
    vocab = 32000
    logits = torch.zeros(1, vocab)
    logits[0, 0] = -math.log(3.1e-8)
    probs = torch.softmax(logits, dim=-1)
    if probs.sort(descending=True).values.cumsum(-1)[0, -2] <= 1.0:
        pytest.skip("this platform's float32 softmax does not overshoot 1 here")
    alone = filtered_probs(logits, make_batch([SamplingParams()], vocab))
    both = make_batch([SamplingParams(), SamplingParams(top_k=5)], vocab)
    assert torch.equal(filtered_probs(logits.expand(2, -1), both)[0], alone[0])


def test_noise_distinguishes_seed_and_step():
    # A symmetric combination would make (seed=c+a, step=b) equal (seed=c+b, step=a).
    c = 0x9E3779B9
    noise = exponential_noise(torch.tensor([c + 5, c + 7]), torch.tensor([7, 5]), 16)
    assert not torch.equal(noise[0], noise[1])
