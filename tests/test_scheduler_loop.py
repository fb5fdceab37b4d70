"""The scheduler loop's rules and its fault barrier, through the in-process Engine (the same
loop the server's scheduler process runs over ZMQ)."""

from __future__ import annotations

import threading

import pytest
import torch

from radixserve.cache import kv_pool
from radixserve.config import Config
from radixserve.core.errors import DuplicateRid, QueueFull, rejection
from radixserve.core.messages import GenerateReq, Rejected
from radixserve.core.sampling_params import SamplingParams
from radixserve.model.runner import ModelRunner
from radixserve.model.sampler import Sampler
from radixserve.scheduler.loop import SchedulerLoop
from radixserve.scheduler.scheduler import Scheduler
from tests.conftest import FP32
from tests.test_engine import PROMPTS, finish, greedy, make_engine

POISON_TEMPERATURE = 0.625  # the faulty sampler fails every batch holding this temperature


class FaultySampler(Sampler):
    """A sampler with a bug that only one request's parameters trigger."""

    def __call__(self, logits, batch, *args, **kwargs):
        if bool((batch.temperatures == POISON_TEMPERATURE).any()):
            raise RuntimeError("injected sampling fault")
        return super().__call__(logits, batch, *args, **kwargs)


def test_a_sampling_fault_fails_that_request_only(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096)
    clean = engine.generate(input_ids=PROMPTS[:2], sampling_params=greedy(12))
    engine.scheduler.post.sampler = FaultySampler()
    poisoned = {"temperature": POISON_TEMPERATURE, "max_new_tokens": 12}
    results = engine.generate(input_ids=PROMPTS[:3], sampling_params=[greedy(12)] * 2 + [poisoned])
    assert [r["output_ids"] for r in results[:2]] == [r["output_ids"] for r in clean]
    reason = results[2]["meta_info"]["finish_reason"]
    assert reason["type"] == "error" and "injected sampling fault" in reason["message"]
    assert engine.get_server_info()["internal_states"][0]["request_errors"] == 1
    # the engine goes on serving, and nothing leaked
    again = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(12))
    assert again["output_ids"] == clean[0]["output_ids"]
    finish(engine)


def test_a_stop_check_fault_fails_that_request_only(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs, max_total_tokens=4096)
    stops = engine.scheduler.post.stops
    real_check = stops.check

    def check(req):
        if req.rid == "victim":
            raise KeyError("injected stop-check fault")
        return real_check(req)

    stops.check = check
    victim = threading.Thread(
        target=lambda: out.append(
            engine.generate(input_ids=PROMPTS[1], sampling_params=greedy(8), rid="victim")
        )
    )
    out: list[dict] = []
    victim.start()
    other = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(8))
    victim.join(30)
    assert len(other["output_ids"]) == 8
    assert out[0]["meta_info"]["finish_reason"]["type"] == "error"
    assert len(out[0]["output_ids"]) == 1  # the token sampled before the faulty check
    finish(engine)


class RecordingTransport:
    """A transport that keeps what the loop sends."""

    def __init__(self) -> None:
        self.accepted_rids: list[str] = []
        self.replies: list[object] = []
        self.outputs: list[object] = []

    def receive(self, timeout_s: float) -> list:
        return []

    def send_outputs(self, outputs) -> None:
        assert {o.rid for o in outputs} <= set(self.accepted_rids), "an output before accepted"
        self.outputs += outputs

    def accepted(self, msg) -> None:
        self.accepted_rids.append(msg.rid)

    def reply(self, msg) -> None:
        self.replies.append(msg)

    def alive(self) -> bool:
        return True


def test_queue_bound_and_duplicate_rids_are_typed_refusals(tiny_model_dirs):
    cfg = Config.from_flat(
        model_path=str(tiny_model_dirs["llama"]), max_total_tokens=4096, dtype=FP32
    )
    scheduler = Scheduler(ModelRunner(cfg, progress=False), cfg.scheduler)
    transport = RecordingTransport()
    loop = SchedulerLoop(scheduler, transport, max_queued=2)
    params = SamplingParams.from_dict(greedy(4))
    for rid in ("a", "a", "b", "c"):
        loop.handle(GenerateReq(rid, PROMPTS[2], params, seed=0))
    loop.handle(GenerateReq("d", [10**9], params, seed=0))
    assert transport.accepted_rids == ["a", "b"]
    kinds = [(r.rid, r.kind) for r in transport.replies if isinstance(r, Rejected)]
    assert kinds == [("a", "duplicate_rid"), ("c", "queue_full"), ("d", "queue_full")]
    assert isinstance(rejection("queue_full", "x"), QueueFull)
    assert isinstance(rejection("duplicate_rid", "x"), DuplicateRid)
    while scheduler.has_work:
        loop.run_once()
    loop.handle(GenerateReq("d", [10**9], params, seed=0))  # room now: refused as invalid
    assert transport.replies[-1].kind == "invalid" and "token ids" in transport.replies[-1].message
    assert {o.rid for o in transport.outputs if o.finished} == {"a", "b"}
    scheduler.check_kv_accounting()


def test_requests_waiting_for_their_grammar_are_held_then_settled(tiny_model_dirs, monkeypatch):
    """While its grammar compiles (held at a gate here), a request is live (its rid taken),
    counts against the queue bound, and is neither accepted nor refused; once compiled it is
    accepted before any of its outputs, or refused as invalid, as on arrival."""
    cfg = Config.from_flat(
        model_path=str(tiny_model_dirs["llama"]), max_total_tokens=4096, dtype=FP32
    )
    scheduler = Scheduler(ModelRunner(cfg, progress=False), cfg.scheduler)
    transport = RecordingTransport()
    loop = SchedulerLoop(scheduler, transport, max_queued=2)
    backend = scheduler.grammars.backend
    gate, compile_ = threading.Event(), backend._compile
    monkeypatch.setattr(backend, "_compile", lambda c: gate.wait(60) and compile_(c))
    for rid, extra in [("r", {"regex": "[ab]{3}"}), ("r", {}), ("bad", {"regex": "(("}), ("f", {})]:
        params = SamplingParams.from_dict(greedy(4, **extra))
        loop.handle(GenerateReq(rid, PROMPTS[0], params, seed=0))
    for _ in range(3):
        loop.run_once()
    assert transport.accepted_rids == [] and scheduler.has_work and not scheduler.can_step
    assert scheduler.state().num_grammar_queue == 2
    gate.set()
    while scheduler.has_work:
        loop.run_once()
    assert transport.accepted_rids == ["r"]
    refused = [(r.rid, r.kind) for r in transport.replies if isinstance(r, Rejected)]
    assert refused == [("r", "duplicate_rid"), ("f", "queue_full"), ("bad", "invalid")]
    bad = [r for r in transport.replies if isinstance(r, Rejected) and r.rid == "bad"][0]
    assert "unclosed group" in bad.message and bad.param == "regex"
    finished = [o for o in transport.outputs if o.finished]
    assert [o.rid for o in finished] == ["r"] and finished[0].finish_reason.type == "stop"
    scheduler.check_kv_accounting()
    scheduler.close()


def test_a_failed_accounting_check_is_an_error_not_a_hang(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs, max_total_tokens=512)
    engine.generate(input_ids=PROMPTS[2], sampling_params=greedy(4))
    leaked = engine.scheduler.kv.allocator.alloc(3)  # slots nobody accounts for
    with pytest.raises(AssertionError, match="KV accounting broken"):
        engine.check_kv_accounting()
    engine.scheduler.kv.allocator.free(leaked)
    assert torch.is_tensor(leaked)
    finish(engine)


def test_an_idle_loop_maps_the_kv_pool_and_a_busy_one_runs_first(tiny_model_dirs):
    """The KV pool's pages are mapped MAPPING_THREADS chunks per idle loop iteration
    (cache/kv_pool.py, IDLE_MAPPING), never while a request waits or runs, but for the pages
    its steps write K/V to: a request finishes as it would without it, and then the idle
    iterations map the rest."""
    cfg = Config.from_flat(
        model_path=str(tiny_model_dirs["llama"]), max_total_tokens=65536, dtype=FP32
    )
    scheduler = Scheduler(ModelRunner(cfg, progress=False), cfg.scheduler)
    pool = scheduler.runner.kv_pool
    if not pool.mapping:
        pytest.skip("this kernel cannot map pages without writing them (Linux 5.14+)")
    transport = RecordingTransport()
    loop = SchedulerLoop(scheduler, transport, max_queued=2)
    loop.handle(GenerateReq("a", PROMPTS[2], SamplingParams.from_dict(greedy(4)), seed=0))
    first_chunks = 2 * len(pool.k) - 1  # every buffer's but the first's, mapped at once
    before = len(pool._unmapped)
    assert before > first_chunks  # the buffers are longer than one chunk
    assert scheduler.state().kv_unmapped_bytes == pool.unmapped_bytes > 0
    while scheduler.has_work:
        loop.run_once()
    # the request's steps mapped only the pages of its slots (each buffer's first chunk,
    # `map_for_slots`), no idle mapping between them
    left = len(pool._unmapped)
    assert left == before - first_chunks
    assert all(offset > 0 for offset, _, _ in pool._unmapped)
    assert [o.rid for o in transport.outputs if o.finished] == ["a"]
    iterations = 0
    while pool.mapping:
        loop.run_once()
        iterations += 1
    assert iterations == -(-left // kv_pool.MAPPING_THREADS)  # that many chunks an iteration
    assert scheduler.state().kv_unmapped_bytes == 0  # what the vs-vllm run waits for
