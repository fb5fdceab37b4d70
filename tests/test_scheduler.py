"""Scheduler behaviour step by step: admission order, in-batch prefix sharing, chunked
prefill interleaved with decode, abort of a chunked request, accounting."""

from __future__ import annotations

import random

import pytest

from radixserve.cache import SlotAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import Config
from radixserve.core.output import FinishReason
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.hardware import CHUNKED_PREFILL
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.policy import order_waiting
from radixserve.scheduler.scheduler import Scheduler
from tests.conftest import FP32

SHARED = [(11 * i) % 300 + 40 for i in range(120)]


def make_scheduler(tiny_model_dirs, **config) -> Scheduler:
    config.setdefault("max_total_tokens", 16384)  # not the pre-faulted quarter of RAM
    cfg = Config.from_flat(model_path=str(tiny_model_dirs["llama"]), dtype=FP32, **config)
    return Scheduler(ModelRunner(cfg, progress=False), cfg.scheduler, cfg.cache.page_size)


def req(rid: str, ids: list[int], max_new_tokens: int = 4, **kw) -> Req:
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return Req(rid, ids, params, **kw)


def run_to_end(sched: Scheduler, max_steps: int = 500) -> list:
    trace = []
    for _ in range(max_steps):
        if not sched.has_work:
            return trace
        trace.append(sched.step())
        sched.check_kv_accounting()
    raise AssertionError("the scheduler did not finish")


def test_in_batch_prefix_sharing_computes_a_shared_prefix_once(tiny_model_dirs):
    sched = make_scheduler(tiny_model_dirs, max_total_tokens=2048)
    for i in range(4):
        sched.add_request(req(f"r{i}", SHARED + [i + 1, i + 2]))
    first = sched.step()  # only one of the four is admitted: the others wait for its prefix
    assert len(first) == 1
    run_to_end(sched)
    assert sched.stats.cached_tokens >= 3 * len(SHARED)


def test_in_batch_prefix_caching_can_be_disabled(tiny_model_dirs):
    """--disable-in-batch-prefix-caching: the four start together, each computing the shared
    prefix (nothing cached), and their greedy outputs are the same as with sharing."""
    outputs = {}
    for disabled in (False, True):
        sched = make_scheduler(
            tiny_model_dirs, max_total_tokens=2048, disable_in_batch_prefix_caching=disabled
        )
        for i in range(4):
            sched.add_request(req(f"r{i}", SHARED + [i + 1, i + 2]))
        first = sched.step()
        assert len(first) == (4 if disabled else 1)
        trace = [first, *run_to_end(sched)]
        assert (sched.stats.cached_tokens == 0) == disabled
        tokens: dict[str, list[int]] = {}
        for step in trace:
            for o in step:
                tokens.setdefault(o.rid, []).extend(o.new_ids)
        outputs[disabled] = tokens
    assert outputs[True] == outputs[False] and len(outputs[True]) == 4


@pytest.mark.parametrize(
    "shared, own, waits",
    [
        (12, 10, True),  # a short shared context that is most of each request: computed once
        (12, 20, False),  # under half of what each computes: all run at once
        (6, 2, False),  # fewer than IN_BATCH_SHARE_MIN shared tokens
    ],
)
def test_a_short_shared_prefix_waits_when_it_is_most_of_the_request(
    tiny_model_dirs, shared, own, waits
):
    sched = make_scheduler(tiny_model_dirs, max_total_tokens=2048)
    for i in range(4):
        tail = [(7 * i + j) % 200 + 300 for j in range(own)]
        sched.add_request(req(f"r{i}", SHARED[:shared] + tail, max_new_tokens=1))
    first = sched.step()
    assert len(first) == (1 if waits else 4)
    run_to_end(sched)
    assert sched.stats.cached_tokens == (3 * shared if waits else 0)


def test_chunked_prefill_interleaves_with_decode(tiny_model_dirs):
    sched = make_scheduler(
        tiny_model_dirs, max_total_tokens=2048, chunked_prefill_size=16, enable_mixed_chunk=False
    )
    sched.add_request(req("short", [5, 6, 7], max_new_tokens=40))
    sched.step()
    assert [r.rid for r in sched.running] == ["short"]
    sched.add_request(req("long", SHARED, max_new_tokens=2))
    kinds = []
    for _ in range(12):
        outs = sched.step()
        kinds.append("decode" if any(o.rid == "short" for o in outs) else "prefill")
        sched.check_kv_accounting()
    # 120 prompt tokens in chunks of 16 (8 chunks): chunks alternate with decode steps
    assert kinds == ["decode", "prefill"] * 6
    assert sched.chunked is not None and sched.chunked.rid == "long"
    run_to_end(sched)


def test_mixed_chunks_carry_the_decode_step(tiny_model_dirs):
    """--enable-mixed-chunk: each prefill chunk carries the running request's decode step,
    so it streams a token every step; its token counts against the chunk budget."""
    sched = make_scheduler(
        tiny_model_dirs, max_total_tokens=2048, chunked_prefill_size=16, enable_mixed_chunk=True
    )
    sched.add_request(req("short", [5, 6, 7], max_new_tokens=40))
    sched.step()
    sched.add_request(req("long", SHARED, max_new_tokens=2))
    chunks = []
    for _ in range(8):
        outs = sched.step()
        assert sched.last_step == "mixed"
        assert [o.rid for o in outs if o.rid == "short"] == ["short"]  # a token every step
        chunks.append(sched.chunked.kv_len if sched.chunked is not None else None)
        sched.check_kv_accounting()
    # 15 prompt tokens per chunk beside the one decode token: 120 tokens in 8 chunks
    assert chunks == [15, 30, 45, 60, 75, 90, 105, None]
    assert [r.rid for r in sched.running] == ["short", "long"]
    assert sched.stats.mixed_steps == 8
    run_to_end(sched)
    assert sched.flush_cache()


@pytest.mark.parametrize(
    "flag, chunk", [(None, CHUNKED_PREFILL["cpu"]), (0, 0), (-1, 0), (300, 300)]
)
def test_the_chunk_length_defaults_to_the_devices(tiny_model_dirs, flag, chunk):
    """Without --chunked-prefill-size a CPU step takes at most CHUNKED_PREFILL["cpu"] new
    tokens (the resolved length is what ModelInfo, hence /get_server_info, reports); 0 or
    -1 turns chunking off."""
    sched = make_scheduler(tiny_model_dirs, chunked_prefill_size=flag)
    assert sched.info.chunked_prefill_size == chunk
    prompt = [(7 * i) % 300 + 40 for i in range(1500)]
    sched.add_request(req("long", prompt, max_new_tokens=2))
    sched.step()
    if chunk:
        assert sched.chunked is not None and sched.chunked.kv_len == chunk
    else:
        assert sched.chunked is None and [r.kv_len for r in sched.running] == [1500]
    run_to_end(sched)
    sched.check_kv_accounting()


def test_abort_of_a_chunked_request_leaks_nothing(tiny_model_dirs):
    sched = make_scheduler(tiny_model_dirs, max_total_tokens=2048, chunked_prefill_size=16)
    sched.add_request(req("long", SHARED))
    sched.step()
    assert sched.chunked is not None
    sched.abort("long")
    [out] = sched.step()
    assert out.finish_reason == FinishReason.abort("aborted")
    assert not sched.has_work
    sched.check_kv_accounting()
    assert sched.flush_cache()
    assert sched.runner.allocator.num_free == sched.runner.max_total_tokens


def test_flush_is_refused_while_requests_run(tiny_model_dirs):
    sched = make_scheduler(tiny_model_dirs, max_total_tokens=512)
    sched.add_request(req("a", [5, 6, 7]))
    assert not sched.flush_cache()
    run_to_end(sched)
    assert sched.flush_cache()


def _tree_with(prefixes: list[list[int]]) -> RadixCache:
    alloc = SlotAllocator(1000)
    tree = RadixCache(alloc)
    for p in prefixes:
        tree.insert(p, alloc.alloc(len(p)))
    return tree


def test_policies_order_the_waiting_queue():
    tree = _tree_with([[1, 2, 3, 4, 5, 6]])
    a = req("a", [9, 9, 9], max_new_tokens=2, priority=1)
    b = req("b", [1, 2, 3, 4, 8], max_new_tokens=9, priority=5)
    c = req("c", [1, 2, 9], max_new_tokens=5, priority=3)
    waiting = [a, b, c]
    rng = random.Random(0)
    assert order_waiting("fcfs", waiting, tree, rng) == [a, b, c]
    assert order_waiting("lof", waiting, tree, rng) == [b, c, a]
    assert order_waiting("priority", waiting, tree, rng) == [b, c, a]
    assert order_waiting("lpm", waiting, tree, rng) == [b, c, a]
    assert sorted(order_waiting("random", waiting, tree, rng), key=lambda r: r.rid) == waiting


def test_dfs_weight_runs_the_heavier_subtree_first():
    tree = _tree_with([[1, 1, 1, 1], [2, 2, 2, 2]])
    light = req("light", [1, 1, 1, 1, 5])
    heavy = [req(f"h{i}", [2, 2, 2, 2, 6 + i]) for i in range(3)]
    cold = req("cold", [7, 7])
    order = order_waiting("dfs-weight", [light, cold, *heavy], tree, random.Random(0))
    names = [r.rid for r in order]
    assert names.index("light") > max(names.index(h.rid) for h in heavy)
    # requests sharing a subtree are contiguous
    positions = sorted(names.index(h.rid) for h in heavy)
    assert positions == list(range(positions[0], positions[0] + 3))


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_accounting_under_pressure(tiny_model_dirs, page_size):
    sched = make_scheduler(
        tiny_model_dirs,
        max_total_tokens=120,
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.01,
        page_size=page_size,
    )
    for i in range(5):
        sched.add_request(req(f"r{i}", [(i * 7 + j) % 400 + 3 for j in range(15)], 20))
    trace = run_to_end(sched)
    finished = {o.rid for outs in trace for o in outs if o.finish_reason}
    assert finished == {f"r{i}" for i in range(5)}
    assert sched.stats.retractions > 0
    assert sched.flush_cache() and sched.runner.allocator.num_free == 120


@pytest.mark.parametrize("start", [0, 5, 30, 33, 47, 60])
def test_prompt_logprobs_survive_chunking(tiny_model_dirs, start):
    """Input logprobs from `start` on are the same whether the prompt runs in one piece or
    in chunks of 16 (chunk boundaries before, inside and at the end of the span)."""
    ids = SHARED[:61]
    results = {}
    for chunk in (None, 16):
        chunking = {"chunked_prefill_size": chunk} if chunk else {}
        sched = make_scheduler(tiny_model_dirs, max_total_tokens=2048, **chunking)
        r = req("r", ids, max_new_tokens=1, return_logprob=True, logprob_start_len=start)
        sched.add_request(r)
        run_to_end(sched)
        assert [t for _, t in r.input_logprobs] == ids[start:], (chunk, r.input_logprobs)
        results[chunk] = [lp for lp, _ in r.input_logprobs]
    one, chunked = results[None], results[16]
    assert (one[0] is None) == (chunked[0] is None) == (start == 0)
    assert chunked[1:] == pytest.approx(one[1:], abs=1e-4)


def test_recent_rate_follows_the_last_seconds():
    from radixserve.scheduler.scheduler import RATE_WINDOW_S, RecentRate

    rate = RecentRate()
    assert rate.update(0, now=0.0) == 0.0
    assert rate.update(100, now=1.0) == pytest.approx(100.0)
    for t in range(2, 30):
        value = rate.update(100 + 50 * (t - 1), now=float(t))  # 50 a second from t = 1
    assert value == pytest.approx(50.0, rel=0.02)
    idle = [rate.update(100 + 50 * 28, now=29.0 + t) for t in range(1, int(RATE_WINDOW_S) + 3)]
    assert idle[0] > 0 and idle[-1] == 0.0  # nothing new: it falls to 0 within the window


def _tokens(trace: list) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for step in trace:
        for o in step:
            tokens.setdefault(o.rid, []).extend(o.new_ids)
    return tokens


def _alone(tiny_model_dirs, prompts: dict, max_new, **config) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, all run on a scheduler of their own with `config` (no
    tier, no priority): what any other schedule of them must give. `max_new`: a count, or
    one per rid."""
    sched = make_scheduler(tiny_model_dirs, **config)
    for rid, ids in prompts.items():
        sched.add_request(req(rid, ids, max_new(rid) if callable(max_new) else max_new))
    return _tokens(run_to_end(sched))


def test_flex_requests_go_after_the_others_and_give_up_their_rows(tiny_model_dirs):
    """Deferred (OpenAI's flex tier, a batch's lines): a waiting request that is not deferred
    is admitted first, under lpm too where the deferred one matches a longer cached prefix,
    and with every running row taken a deferred request goes back to the queue for it. No
    greedy output changes, and no KV slot is lost."""
    prompts = {f"d{i}": SHARED[:40] + [i + 5, i + 9, i + 13] for i in range(3)}
    prompts["n0"] = [(13 * j) % 300 + 20 for j in range(20)]
    expected = _alone(tiny_model_dirs, prompts, 12, max_total_tokens=2048)

    sched = make_scheduler(tiny_model_dirs, max_total_tokens=2048, max_running_requests=2)
    for rid in ("d0", "d1"):
        sched.add_request(req(rid, prompts[rid], 12, deferred=True))
    trace = [sched.step()]  # (one of the two: the other waits for the shared prefix)
    while len(sched.running) < 2:
        trace.append(sched.step())
    trace += [sched.step() for _ in range(3)]
    sched.add_request(req("d2", prompts["d2"], 12, deferred=True))  # cached prefix: lpm's pick
    sched.add_request(req("n0", prompts["n0"], 12))
    trace.append(sched.step())
    assert sched.stats.preemptions == 1
    assert "n0" in {r.rid for r in sched.running}
    assert {r.rid for r in sched.waiting} == {"d2", "d1"}  # d1: fewer outputs than d0
    sched.check_kv_accounting()
    trace += run_to_end(sched)
    assert _tokens(trace) == expected
    assert sched.stats.retractions == 0  # (a preemption is not a retraction for memory)


def test_under_memory_pressure_the_flex_requests_are_retracted_first(tiny_model_dirs):
    sched = make_scheduler(
        tiny_model_dirs, max_total_tokens=120, init_new_token_ratio=0.05, min_new_token_ratio=0.01
    )
    for i in range(5):
        ids = [(i * 7 + j) % 400 + 3 for j in range(15)]
        sched.add_request(req(f"r{i}", ids, 20, deferred=i in (3, 4)))
    retracted: list[str] = []
    for _ in range(500):
        if not sched.has_work:
            break
        before = {r.rid for r in sched.running}
        sched.step()
        back = {r.rid for r in sched.waiting if r.output_ids} & before
        retracted += sorted(back)
    assert sched.stats.retractions > 0 and retracted
    assert retracted[0] in ("r3", "r4")


@pytest.mark.parametrize(
    "flags, capped",
    [({}, True), ({"flex_max_running_requests": -1}, False)],
)
def test_beside_an_interactive_request_at_most_the_flex_cap_keeps_running(
    tiny_model_dirs, flags, capped
):
    """--flex-max-running-requests: while a request outside the flex tier runs, the flex
    requests past the cap go back to the queue (their KV to the tree) and none is admitted
    past it; once it has ended they all run again. No greedy output changes, no KV slot is
    lost. -1: no cap."""
    prompts = {f"f{i}": [(5 * i + 3 * j) % 300 + 20 for j in range(16)] for i in range(5)}
    prompts["n0"] = [(13 * j) % 300 + 7 for j in range(12)]
    expected = _alone(
        tiny_model_dirs, prompts, lambda rid: 24 if rid == "n0" else 40, max_total_tokens=4096
    )

    flags = {"flex_max_running_requests": 2} | flags
    sched = make_scheduler(tiny_model_dirs, max_total_tokens=4096, **flags)
    sched.flex_cap_grace_s = 60.0  # (longer than any step, however loaded the machine)
    for rid in ("f0", "f1", "f2"):
        sched.add_request(req(rid, prompts[rid], 40, deferred=True))
    trace = [sched.step() for _ in range(3)]
    assert len(sched.running) == 3  # (only flex requests: no cap)
    sched.add_request(req("n0", prompts["n0"], 24))
    sched.add_request(req("f3", prompts["f3"], 40, deferred=True))
    sched.add_request(req("f4", prompts["f4"], 40, deferred=True))
    flex_rows = []
    while any(r.rid == "n0" for r in sched.live()):
        trace.append(sched.step())
        sched.check_kv_accounting()
        flex_rows.append(sum(r.deferred for r in sched.running))
    assert max(flex_rows) == (2 if capped else 5)
    assert sched.stats.preemptions == (1 if capped else 0)
    trace.append(sched.step())  # n0 has just ended: the cap holds a while yet (FLEX_CAP_GRACE_S)
    assert sum(r.deferred for r in sched.running) == (2 if capped else 5)
    sched.others_seen_at -= 2 * sched.flex_cap_grace_s  # (as if that while had gone by)
    trace.append(sched.step())
    assert sum(r.deferred for r in sched.running) == 5  # all again
    trace += run_to_end(sched)
    assert _tokens(trace) == expected


def test_under_the_priority_policy_the_flex_cap_keeps_the_most_urgent_flex_requests(
    tiny_model_dirs,
):
    """Cap 1: beside an interactive request the lower-priority flex request goes back, and
    a more urgent flex request (by more than the threshold) takes the flex row of a running
    one; outputs as alone."""
    prompts = {rid: [(7 * i + 3 * j) % 300 + 20 for j in range(14)] for i, rid in
               enumerate(("lo", "hi", "top", "n0"))}  # fmt: skip
    expected = _alone(tiny_model_dirs, prompts, 30, max_total_tokens=4096)

    sched = make_scheduler(
        tiny_model_dirs, max_total_tokens=4096, flex_max_running_requests=1,
        schedule_policy="priority",
    )  # fmt: skip
    sched.add_request(req("lo", prompts["lo"], 30, deferred=True, priority=0))
    trace = [sched.step()]
    sched.add_request(req("hi", prompts["hi"], 30, deferred=True, priority=5))
    trace += [sched.step(), sched.step()]
    assert {r.rid for r in sched.running} == {"lo", "hi"}  # (no other tier: no cap)
    sched.add_request(req("n0", prompts["n0"], 30))
    trace.append(sched.step())
    assert {r.rid for r in sched.running} == {"hi", "n0"}  # lo (priority 0) went back
    sched.add_request(req("top", prompts["top"], 30, deferred=True, priority=20))
    trace.append(sched.step())
    assert {r.rid for r in sched.running} == {"top", "n0"}  # 20 - 5 > 10: hi went back
    assert sched.stats.preemptions == 2
    sched.check_kv_accounting()
    trace += run_to_end(sched)
    assert _tokens(trace) == expected


def test_with_preemption_disabled_the_flex_cap_only_holds_back_admissions(tiny_model_dirs):
    sched = make_scheduler(
        tiny_model_dirs, max_total_tokens=4096, flex_max_running_requests=1,
        disable_priority_preemption=True,
    )  # fmt: skip
    for i in range(3):
        sched.add_request(req(f"f{i}", [(5 * i + 3 * j) % 300 + 20 for j in range(16)], 30,
                              deferred=True))  # fmt: skip
    while len(sched.running) < 3:
        sched.step()
    sched.add_request(req("n0", [7 + j for j in range(12)], 20))
    sched.add_request(req("f3", [9 + j for j in range(12)], 30, deferred=True))
    while any(r.rid == "n0" for r in sched.live()):
        sched.step()
        sched.check_kv_accounting()
        assert "f3" in {r.rid for r in sched.waiting}  # (three flex rows: more than one)
        assert sum(r.deferred for r in sched.running) == 3
    assert sched.stats.preemptions == 0
    run_to_end(sched)


@pytest.mark.parametrize(
    "urgency, preempts, flags",
    [
        (20, True, {}),  # more urgent by more than the threshold (10)
        (10, False, {}),  # by no more than it
        (20, False, {"disable_priority_preemption": True}),
        (3, True, {"priority_scheduling_preemption_threshold": 2}),
    ],
)
def test_under_the_priority_policy_an_urgent_request_takes_a_running_row(
    tiny_model_dirs, urgency, preempts, flags
):
    prompts = {f"r{i}": [(7 * i + 3 * j) % 300 + 20 for j in range(24)] for i in range(3)}
    expected = _alone(tiny_model_dirs, prompts, 10, max_total_tokens=2048)

    sched = make_scheduler(
        tiny_model_dirs, max_total_tokens=2048, max_running_requests=2,
        schedule_policy="priority", **flags,
    )  # fmt: skip
    sched.add_request(req("r0", prompts["r0"], 10, priority=0))
    sched.add_request(req("r1", prompts["r1"], 10, priority=1))
    trace = [sched.step(), sched.step(), sched.step()]
    assert len(sched.running) == 2
    sched.add_request(req("r2", prompts["r2"], 10, priority=urgency))
    trace.append(sched.step())
    running = {r.rid for r in sched.running}
    assert sched.stats.preemptions == int(preempts)
    assert running == ({"r1", "r2"} if preempts else {"r0", "r1"})  # r0: the lowest
    trace += run_to_end(sched)
    assert _tokens(trace) == expected


def test_a_flex_prompt_being_chunked_gives_its_row_to_a_request_that_is_not(tiny_model_dirs):
    prompts = {
        "f0": [20 + i % 200 for i in range(8)],
        "long": [30 + i % 250 for i in range(320)],
        "n0": [7 + i for i in range(8)],
    }
    expected = _alone(tiny_model_dirs, prompts, 8, max_total_tokens=4096, chunked_prefill_size=16)

    sched = make_scheduler(
        tiny_model_dirs, max_total_tokens=4096, chunked_prefill_size=16, max_running_requests=2
    )
    sched.add_request(req("f0", prompts["f0"], 8, deferred=True))
    trace = [sched.step()]
    sched.add_request(req("long", prompts["long"], 8, deferred=True))
    trace.append(sched.step())
    assert sched.chunked is not None and sched.chunked.rid == "long"
    sched.add_request(req("n0", prompts["n0"], 8))
    trace.append(sched.step())
    assert "n0" in {r.rid for r in sched.running} and sched.stats.preemptions == 1
    trace += run_to_end(sched)  # the long prompt goes on from the chunks it computed
    assert _tokens(trace) == expected


@pytest.mark.parametrize("hidden", [False, True])
def test_a_flex_prompt_whose_work_cannot_be_reused_is_not_preempted(tiny_model_dirs, hidden):
    """A chunked flex prompt with return_hidden_states would compute its whole prompt again
    after each preemption (the cache keeps no hidden states): it keeps its row, and ends
    while interactive requests keep coming; another gives its row and ends too."""
    sched = make_scheduler(
        tiny_model_dirs, max_total_tokens=4096, chunked_prefill_size=16, max_running_requests=2
    )
    sched.add_request(req("f0", [20 + i for i in range(8)], 400, deferred=True))
    sched.step()
    long = [30 + i % 250 for i in range(320)]
    sched.add_request(req("long", long, 4, deferred=True, return_hidden_states=hidden))
    for step in range(300):
        if step % 12 == 5:
            sched.add_request(req(f"i{step}", [7 + step % 50 + i for i in range(8)], 2))
        sched.step()
        sched.check_kv_accounting()
        if not any(r.rid == "long" for r in sched.live()):
            break
    else:
        raise AssertionError("the long flex prompt never ended")
    assert sched.stats.preemptions >= 1  # (f0, or the long prompt when it can resume)
