"""Speculative decoding (n-gram drafts verified in the decode step): outputs identical to
decoding without it — greedy and seeded sampling, alone and batched, with the radix cache,
chunked prefill, constrained decoding, retraction, stop rules and logprobs — KV accounting
exact after every scenario (aborts in the middle of verified steps included), sampling
drawing from the model's distribution, and the drafter and controller on their own."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import jsonschema
import pytest
import torch

from radixserve.config import SpeculativeConfig
from radixserve.core.output import SchedulerStats
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.scheduler.speculative import Speculator
from radixserve.spec.controller import (
    MEASURED_MIN,
    MEASURED_STALE,
    Acceptance,
    CostModel,
    MatchStats,
    plan,
    room_for_drafts,
)
from radixserve.spec.ngram import NgramDrafter, NgramIndex, SharedIndex
from tests.conftest import FP32
from tests.reference import reference_greedy, verification_free
from tests.test_constrained import DATE, NESTED, PERSON
from tests.test_engine import PROMPTS, finish, greedy
from tests.test_engine import make_engine as make_plain_engine

STEPS = 40
NGRAM = {"speculative_algorithm": "ngram"}  # the default, named where it matters
OFF = {"speculative_algorithm": "none"}
# prompts whose greedy continuations repeat themselves now and then (the tiny random model
# loops on them), and two that do not
LOOPY = [[3] * 20, [7, 8] * 10, PROMPTS[2], PROMPTS[0]]


@pytest.fixture(scope="module")
def expected(reference) -> list[list[int]]:
    return [reference_greedy(reference, p, STEPS) for p in LOOPY]


def make_engine(tiny_model_dirs, **flags):
    """test_engine's engine, its speculation controller counting verification as free
    (`verification_free`): these tests pin what drafts do to the outputs. The controller's
    own rules are tested below, and with SmolLM2 at the end of this module."""
    return verification_free(make_plain_engine(tiny_model_dirs, **flags))


def accepted(engine) -> int:
    return engine.get_server_info()["internal_states"][0]["spec_accepted_tokens"]


# -- the drafter and the controller ------------------------------------------------------
def test_index_continues_the_longest_earlier_match():
    seq = [1, 2, 3, 4, 9, 9, 2, 3, 4, 5, 6, 7, 0, 3, 4]
    index = NgramIndex(key_len=2, max_match=4)
    index.add(seq, 0, len(seq))
    # the suffix (3, 4) occurred twice; after (2, 3, 4) both times, after (9, 2, 3, 4) once
    draft = index.lookup([8, 9, 2, 3, 4], 3, "self")
    assert draft is not None and draft.tokens == [5, 6, 7] and draft.match_len == 4
    recent = index.lookup([2, 3, 4], 2, "self")  # a tie in length: the most recent wins
    assert recent is not None and recent.tokens == [5, 6]
    assert index.lookup([7, 8], 3, "self") is None


def test_own_tokens_grow_and_never_match_their_own_suffix():
    drafter = NgramDrafter(min_match=2, max_match=4, capacity=100)
    own = drafter.own_tokens()
    prompt = [1, 2, 3, 1, 2]
    draft = drafter.propose(own, prompt, [], 4)
    assert draft is not None and draft.tokens == [3, 1, 2] and draft.source == "self"
    draft = drafter.propose(own, prompt, [3, 7], 4)  # ... 3 7: nothing followed (3, 7)
    assert draft is None and own.tokens == [1, 2, 3, 1, 2, 3, 7]


def test_shared_index_serves_other_requests_and_forgets_the_oldest():
    shared = SharedIndex(key_len=2, max_match=4, capacity=12)
    shared.add([1, 2, 3, 4, 5, 6])
    draft = shared.lookup([0, 2, 3], 3)
    assert draft is not None and draft.tokens == [4, 5, 6] and draft.source == "shared"
    shared.add([7, 8, 9, 10, 11, 12, 13])  # over capacity: the first sequence goes
    assert shared.num_tokens == 7 and shared.lookup([2, 3], 3) is None
    assert shared.lookup([8, 9], 2).tokens == [10, 11]


def test_controller_drafts_only_what_pays():
    a, b = 0.040, 0.003  # batch-1 decode on a CPU: verifying is nearly free
    assert plan([0.9], [8], 1, (a, b), 100) == [8]
    assert plan([0.05], [8], 1, (a, b), 100) == [0]  # a request whose drafts keep failing
    assert plan([0.9], [8], 1, (a, b), 3) == [3]  # no more than the free KV slots
    # 64 running: the fixed cost no longer dwarfs the per-token one, only sure drafts pay
    few = plan([0.6] * 64, [8] * 64, 64, (a, b), 10_000)
    assert sum(few) < sum(plan([0.6], [8], 1, (a, b), 100)) * 64 / 4
    # past T = a / b tokens a step is no longer almost free: a batch of 16 verifies nothing
    assert plan([0.99] * 16, [8] * 16, 16, (0.045, 0.0045), 10_000) == [0] * 16
    mixed = plan([0.95, 0.3], [4, 4], 2, (a, b), 100)
    assert mixed[0] == 4 and mixed[1] < 4  # the better request gets more


def test_controller_follows_a_step_shaped_cost():
    """Rows in groups of 8: a step of 16 + 1 tokens costs as one of 24. One sure token past
    16 does not pay, eight do; measured costs override the line where there are some."""
    line = (0.030, 0.0010)

    def steps(tokens: int) -> float:
        return 0.030 + 0.010 * ((tokens + 7) // 8)

    one = plan([0.9, 0.0], [1, 0], 16, line, 100, steps)
    assert one == [0, 0]  # 17 tokens cost a third row group for 0.9 of a token
    many = plan([0.99] * 8, [1] * 8, 16, line, 100, steps)
    assert many == [1] * 8  # 24 tokens: the same group, ~8 more tokens
    on_the_line = plan([0.9, 0.0], [1, 0], 16, line, 100)
    assert on_the_line == [1, 0]  # what the line alone would have done
    # a line bent by such steps (a / b ~ 6) does not cut a batch of 1's draft where the
    # measured steps say 9 tokens cost ~1.1 one-token steps
    bent = (0.018, 0.00285)
    assert plan([0.9], [8], 1, bent, 100) == [7]
    assert plan([0.9], [8], 1, bent, 100, lambda t: 0.030 + 0.0004 * t) == [8]
    # nothing queued behind 12 running: drafts only within the row group they pay for
    alone = plan([0.99] * 12, [8] * 12, 12, line, 100, steps, alone=True)
    assert sum(alone) == 4
    assert sum(plan([0.99] * 12, [8] * 12, 12, line, 100, steps)) > 4  # a queue: throughput
    assert plan([0.9], [8], 1, line, 100, steps, alone=True) == [7]  # cost(1..8) alike
    cost = CostModel()
    for _ in range(20):
        cost.observe(16, steps(16))
        cost.observe(8, steps(8))
    assert cost.seconds(16) == pytest.approx(steps(16)) and cost.seconds(17) > steps(16)
    cost.observe(17, steps(17))
    assert cost.seconds(17) < steps(17)  # one step of a count is not enough to trust
    cost.observe(17, steps(17))
    assert cost.seconds(17) == pytest.approx(steps(17))


def test_no_draft_is_looked_up_where_none_could_be_verified():
    """At a large batch a step's cost grows with every token (here 0.1 ms a token over a
    1 ms base): one drafted token would cost more than two one-token steps, so `plan` takes
    none, and the speculator looks none up (its requests' own tokens stay unindexed until
    a step has room)."""
    steep = CostModel()
    for tokens in (200, 256, 240, 256, 230, 250, 256, 220):
        steep.observe(tokens, 0.001 + 0.0001 * tokens)
    assert not room_for_drafts(steep.seconds, 256, alone=False)
    assert (
        plan([0.99] * 256, [8] * 256, 256, steep.coefficients(), 10_000, steep.seconds) == [0] * 256
    )
    assert room_for_drafts(steep.seconds, 4, alone=False)

    speculator = Speculator(SpeculativeConfig(), SchedulerStats(), context_len=2048)
    reqs = [Req(f"r{i}", [5, 6, 7, 8] * 8, SamplingParams(max_new_tokens=16)) for i in range(256)]
    speculator.cost = steep
    assert speculator.propose(reqs, [1] * 256, free_slots=10_000) == [[]] * 256
    assert all(r.spec.own.tokens == [] and r.spec.draft is None for r in reqs)
    few = reqs[:2]
    drafts = speculator.propose(few, [1, 1], free_slots=10_000)
    assert all(r.spec.own.tokens == r.input_ids for r in few)  # caught up when looked up
    assert all(d and d == [5, 6, 7, 8, 5, 6, 7, 8][: len(d)] for d in drafts), drafts


def test_cost_model_fits_the_measured_steps():
    cost = CostModel()
    for tokens in (1, 2, 4, 8, 1, 9, 3, 5, 1, 16):
        cost.observe(tokens, 0.040 + 0.003 * tokens)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.040, rel=1e-6) and b == pytest.approx(0.003, rel=1e-6)
    noisy = CostModel()  # a few steps slowed by something else do not move the fit
    for i in range(60):
        tokens = 1 + i % 12
        slow = 0.5 if i in (11, 23, 47) else 0.0  # at 12 tokens: would inflate b
        noisy.observe(tokens, 0.050 + 0.004 * tokens + 0.0005 * (i % 3) + slow)
    a, b = noisy.coefficients()
    assert a == pytest.approx(0.0505, rel=0.05) and b == pytest.approx(0.004, rel=0.1)
    rate = Acceptance()
    assert rate.rate() == 0.5
    for _ in range(10):
        rate.record(drafted=4, accepted=0)
    assert rate.rate() < 0.15 and rate.rate(prior=0.9) > rate.rate()


def test_controller_recovers_from_a_bad_start():
    """Neither a draft's step measured while something else held the cores nor a kind of
    draft that failed at first keeps drafting off for good: drafts are not verified while
    the controller believes them not to pay, so nothing else would correct it."""
    cost = CostModel()
    for _ in range(20):
        cost.observe(1, 0.010)
    for _ in range(MEASURED_MIN):
        cost.observe(4, 0.050)  # a verify step of 3 drafts, slowed by another process
    assert cost.seconds(4) == 0.050 and not room_for_drafts(cost.seconds, 1, alone=False)
    steps = 0
    while cost.seconds(4) > 0.020:
        cost.observe(1, 0.010)
        steps += 1
    assert steps <= MEASURED_STALE + 1  # priced by the line again, until measured again
    assert room_for_drafts(cost.seconds, 1, alone=False)

    matches = MatchStats()
    for _ in range(10):
        matches.record("own", 2, drafted=4, accepted=0)
    assert matches.rate("own", 2) < 0.15
    for _ in range(2000):
        matches.advance()
    assert matches.rate("own", 2) > 0.4  # back near the prior: tried again
    assert matches.rate("shared", 8) == 0.5


def test_flags_are_checked():
    assert SpeculativeConfig(speculative_algorithm="NGRAM").enabled
    with pytest.raises(ValueError, match="speculative_algorithm"):
        SpeculativeConfig(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="min_match_window"):
        SpeculativeConfig(
            speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=2
        )


# -- outputs unchanged -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"chunked_prefill_size": 7},
        {"disable_radix_cache": True},
        {"page_size": 4},
        {"enable_mixed_chunk": False},
        {"speculative_num_draft_tokens": 1},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default",
)
def test_greedy_identical_with_speculation(tiny_model_dirs, expected, config):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096, **NGRAM, **config)
    alone = [engine.generate(input_ids=p, sampling_params=greedy(STEPS)) for p in LOOPY]
    batched = engine.generate(input_ids=LOOPY, sampling_params=greedy(STEPS))
    for i, want in enumerate(expected):
        assert alone[i]["output_ids"] == want, f"prompt {i} alone"
        assert batched[i]["output_ids"] == want, f"prompt {i} batched"
    assert accepted(engine) > 0, "the scenario should verify drafts"
    # the second time, each prompt's first output is in the shared index: long drafts
    metas = [r["meta_info"] for r in batched]
    assert all(m["spec_verify_ct"] > 0 for m in metas)
    if config.get("speculative_num_draft_tokens") != 1:
        assert min(m["spec_accept_length"] for m in metas) > 2, metas
    finish(engine)


def test_forced_retraction_with_speculation(tiny_model_dirs, reference):
    engine = make_engine(
        tiny_model_dirs,
        max_total_tokens=200,
        init_new_token_ratio=0.1,
        min_new_token_ratio=0.01,
        chunked_prefill_size=16,
        **NGRAM,
    )
    prompts = [LOOPY[i % 2][: 20 + i] for i in range(6)]
    results = engine.generate(input_ids=prompts, sampling_params=greedy(STEPS))
    assert engine.scheduler.stats.retractions > 0, "the scenario should force a retraction"
    assert accepted(engine) > 0
    for prompt, result in zip(prompts, results):
        assert result["output_ids"] == reference_greedy(reference, prompt, STEPS)
    finish(engine)


def run_both(tiny_model_dirs, prompts, params, **config) -> tuple[list[dict], list[dict]]:
    """The same requests with speculation off, then on (outputs, in order)."""
    results = []
    for spec in (OFF, NGRAM):
        engine = make_engine(tiny_model_dirs, max_total_tokens=4096, **spec, **config)
        results.append(engine.generate(input_ids=prompts, sampling_params=params))
        if spec is NGRAM:
            assert accepted(engine) > 0, "the scenario should verify drafts"
        finish(engine)
    return results[0], results[1]


def test_seeded_sampling_and_logprobs_identical(tiny_model_dirs):
    params = [
        {"temperature": 0.7, "sampling_seed": i, "max_new_tokens": STEPS, "ignore_eos": True}
        for i in range(4)
    ] + [greedy(STEPS, frequency_penalty=0.3), greedy(STEPS, min_new_tokens=30)]
    prompts = (LOOPY * 2)[: len(params)]
    off, on = run_both(tiny_model_dirs, prompts, params)
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    lp = {"return_logprob": True, "top_logprobs_num": 3}
    off_lp = [make_lp(tiny_model_dirs, p, lp, OFF) for p in LOOPY[:2]]
    on_lp = [make_lp(tiny_model_dirs, p, lp, NGRAM) for p in LOOPY[:2]]
    for a, b in zip(off_lp, on_lp):
        assert [t for _, t, _ in a] == [t for _, t, _ in b]
        assert [x for x, _, _ in a] == pytest.approx([x for x, _, _ in b], abs=1e-4)


def make_lp(tiny_model_dirs, prompt, lp, spec) -> list:
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096, **spec)
    out = engine.generate(input_ids=prompt, sampling_params=greedy(STEPS), **lp)
    finish(engine)
    return out["meta_info"]["output_token_logprobs"]


def test_constrained_decoding_and_jump_forward_compose(tiny_model_dirs):
    """Grammar masks follow the accepted tokens position by position; a drafted token the
    grammar refuses ends the run; forced text still jumps forward. Each batch runs twice so
    that the second pass drafts from the first one's outputs."""
    params = [
        greedy(96, json_schema=json.dumps(PERSON)),
        greedy(96, json_schema=json.dumps(NESTED)),
        {"temperature": 1.0, "sampling_seed": 3, "max_new_tokens": 64, "regex": DATE},
        {"temperature": 0.8, "sampling_seed": 5, "max_new_tokens": 96, "json_schema": PERSON},
    ]
    prompts = LOOPY * 2
    off, on = run_both(tiny_model_dirs, prompts, params * 2)
    assert [o["text"] for o in on] == [o["text"] for o in off]
    for out, p in zip(on, params * 2):
        if "regex" in p:
            assert re.fullmatch(DATE, out["text"])
        else:
            schema = p["json_schema"]
            jsonschema.validate(
                json.loads(out["text"]), json.loads(schema) if isinstance(schema, str) else schema
            )


def test_stop_rules_identical(tiny_model_dirs, expected):
    want = expected[0]
    params = [
        greedy(STEPS, stop_token_ids=[want[7]]),
        greedy(STEPS, min_new_tokens=30, stop_token_ids=[want[2]]),
        greedy(13),
        {"temperature": 0, "max_new_tokens": STEPS},  # eos ends it
    ]
    off, on = run_both(tiny_model_dirs, [LOOPY[0]] * len(params) * 2, params * 2)
    assert [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in on] == [
        (o["output_ids"], o["meta_info"]["finish_reason"]) for o in off
    ]
    assert on[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": want[7]}
    assert on[2]["meta_info"]["finish_reason"] == {"type": "length", "length": 13}


def test_stop_strings_identical(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096, **OFF)
    text = engine.generate(input_ids=LOOPY[0], sampling_params=greedy(STEPS))["text"]
    finish(engine)
    stop = text[len(text) // 2 :][:3]
    params = [greedy(STEPS, stop=[stop]), greedy(STEPS, stop_regex=re.escape(stop))]
    off, on = run_both(tiny_model_dirs, [LOOPY[0]] * 4, params * 2)
    assert [o["text"] for o in on] == [o["text"] for o in off]
    assert on[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_abort_during_speculation_leaks_nothing(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096, **NGRAM)
    engine.generate(input_ids=LOOPY[1], sampling_params=greedy(200))  # feeds the shared index
    stream = engine.generate(
        input_ids=LOOPY[1], sampling_params=greedy(200), stream=True, rid="victim"
    )
    for _, out in zip(range(3), stream):
        assert out["meta_info"]["finish_reason"] is None
    engine.abort("victim")
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert accepted(engine) > 0
    finish(engine)


def test_sampling_with_speculation_draws_from_the_model(tiny_model_dirs, reference):
    """Tokens reached through accepted drafts follow the model's conditional distribution:
    at output position 3, each token's count over many seeds is within 4 sigma of the sum
    of its probabilities given each sample's own first three tokens (transformers)."""
    prompt, n, temperature = LOOPY[1], 300, 0.3
    engine = make_engine(tiny_model_dirs, max_total_tokens=8192, **NGRAM)
    params = {"temperature": temperature, "max_new_tokens": 6, "ignore_eos": True}
    samples = [  # one at a time
        engine.generate(input_ids=prompt, sampling_params={**params, "sampling_seed": s})[
            "output_ids"
        ]
        for s in range(n)
    ]
    assert accepted(engine) > 50
    finish(engine)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + s[:3] for s in samples])).logits[:, -1]
    probs = torch.softmax(logits.double() / temperature, dim=-1)  # (n, V)
    counts = Counter(s[3] for s in samples)
    for token, _ in counts.most_common(5):
        p = probs[:, token]
        mean, sigma = float(p.sum()), math.sqrt(float((p * (1 - p)).sum()))
        assert abs(counts[token] - mean) <= 4 * sigma + 1, (token, counts[token], mean, sigma)


def test_copying_with_the_default_model_is_identical_and_accepts_drafts():
    from radixserve import Engine

    text = (
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. "
        "It is named after the engineer Gustave Eiffel, whose company designed and built it."
    )
    outs = {}
    for spec in ("none", "ngram"):
        with Engine(
            None, progress=False, dtype=FP32, max_total_tokens=4096, speculative_algorithm=spec
        ) as engine:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
                tokenize=False,
                add_generation_prompt=True,
            )
            outs[spec] = engine.generate(prompt, greedy(48))
    assert outs["ngram"]["output_ids"] == outs["none"]["output_ids"]
    assert outs["ngram"]["meta_info"]["spec_accept_length"] > 1.5
