"""Runner-level accounting and batching behaviour on the tiny model."""

from __future__ import annotations

import pytest

from radixserve.config import Config
from radixserve.core.sampling_params import SamplingParams
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.batch_builder import OutOfKVSlots
from tests.conftest import FP32
from tests.static_generator import StaticGenerator


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dirs):
    return ModelRunner(
        Config.from_flat(model_path=str(tiny_model_dirs["llama"]), max_total_tokens=96, dtype=FP32),
        progress=False,
    )


def test_every_slot_comes_back_after_generation(tiny_runner):
    gen = StaticGenerator(tiny_runner)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.7) for n in (0, 1, 9)]
    results = gen.generate([[5, 6, 7], [8, 9], [10] * 20], params)
    assert [len(r.output_ids) for r in results] == [0, 1, 9]
    assert [r.finish_reason for r in results] == ["length"] * 3
    assert tiny_runner.allocator.num_free == tiny_runner.allocator.size
    assert tiny_runner.req_to_token.num_free == tiny_runner.req_to_token.num_rows


def test_out_of_kv_frees_what_was_taken(tiny_runner):
    """A batch larger than the pool fails clearly and leaks nothing."""
    gen = StaticGenerator(tiny_runner)
    with pytest.raises(OutOfKVSlots, match="KV slots"):
        gen.generate([[5] * 60, [6] * 60], [SamplingParams(max_new_tokens=4)] * 2)
    assert tiny_runner.allocator.num_free == tiny_runner.allocator.size
    assert tiny_runner.req_to_token.num_free == tiny_runner.req_to_token.num_rows


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_runner):
    gen = StaticGenerator(tiny_runner)
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=7, ignore_eos=True)
    other = SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=8, ignore_eos=True)
    alone = gen.generate([[5, 6, 7]], [seeded])[0].output_ids
    batched = gen.generate([[9, 9], [5, 6, 7]], [other, seeded])[1].output_ids
    assert alone == batched
    assert gen.generate([[5, 6, 7]], [other])[0].output_ids != alone


def test_min_new_tokens_holds_back_eos_and_stop_ids(tiny_runner):
    gen = StaticGenerator(tiny_runner)
    first = gen.generate([[5, 6, 7]], [SamplingParams(temperature=0, max_new_tokens=1)])[0]
    stop_on_first = SamplingParams(
        temperature=0, max_new_tokens=6, min_new_tokens=4, stop_token_ids=[first.output_ids[0]]
    )
    result = gen.generate([[5, 6, 7]], [stop_on_first])[0]
    assert first.output_ids[0] not in result.output_ids[:4]
    assert len(result.output_ids) >= 4


def test_context_length_is_checked(tiny_runner):
    with pytest.raises(ValueError, match="context length"):
        StaticGenerator(tiny_runner).generate([[5] * 10], [SamplingParams(max_new_tokens=5000)])
