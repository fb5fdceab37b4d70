"""Embeddings through the offline Engine and the scheduler: the final-norm hidden state,
pooled last or mean, equals transformers' (`output_hidden_states`, last layer) alone,
batched, chunked, beside running generations and over a cached prefix; embedding rows never
run the LM head; KV accounting exact after every scenario."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve import Engine
from radixserve.core.embedding import EmbedParams
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from tests.conftest import FP32
from tests.reference import reference_greedy
from tests.test_scheduler import make_scheduler, run_to_end

TOL = 1e-4
SHARED = [(7 * i) % 400 + 50 for i in range(60)]  # a shared prefix
PROMPTS = [SHARED + [11, 12, 13], SHARED + [21, 22], [5, 6, 7, 8, 9], [42]]
POOLINGS = ("last", "mean")


@torch.no_grad()
def reference_embedding(model, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' last hidden state (after the final norm), pooled and normalized."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].float()  # (T, hidden)
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def max_diff(got: list[float], want: torch.Tensor) -> float:
    assert len(got) == want.numel()
    return float((torch.tensor(got) - want).abs().max())


def make_engine(tiny_model_dirs, **config) -> Engine:
    config.setdefault("max_total_tokens", 4096)
    return Engine(str(tiny_model_dirs["llama"]), progress=False, dtype=FP32, **config)


def finish(engine: Engine) -> None:
    engine.check_kv_accounting()
    assert engine.flush_cache()
    assert engine.runner.allocator.num_free == engine.runner.max_total_tokens
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(reference) -> dict[tuple[int, str, bool], torch.Tensor]:
    return {
        (i, pooling, normalize): reference_embedding(reference, p, pooling, normalize)
        for i, p in enumerate(PROMPTS)
        for pooling in POOLINGS
        for normalize in (False, True)
    }


def test_transformers_last_hidden_state_is_after_the_final_norm(reference):
    """What the fidelity tests compare with: hidden_states[-1] is the normed output."""
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        out = reference(ids, output_hidden_states=True)
        normed = reference.model(ids).last_hidden_state
    assert torch.equal(out.hidden_states[-1], normed)
    assert not torch.allclose(out.hidden_states[-2], normed, atol=1e-2)


@pytest.mark.parametrize(
    "config",
    [{}, {"chunked_prefill_size": 7}, {"chunked_prefill_size": 1}, {"page_size": 4}],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default",
)
@pytest.mark.parametrize("pooling", POOLINGS)
def test_embedding_equals_transformers_alone_and_batched(
    tiny_model_dirs, expected, pooling, config
):
    engine = make_engine(tiny_model_dirs, embedding_pooling=pooling, **config)
    for normalize in (False, True):
        alone = [engine.encode(input_ids=p, normalize=normalize) for p in PROMPTS]
        batched = engine.encode(input_ids=PROMPTS, normalize=normalize)
        for i, (one, many) in enumerate(zip(alone, batched)):
            want = expected[i, pooling, normalize]
            assert max_diff(one["embedding"], want) < TOL, f"prompt {i} alone"
            assert max_diff(many["embedding"], want) < TOL, f"prompt {i} batched"
            assert max_diff(many["embedding"], torch.tensor(one["embedding"])) < 1e-5
            if normalize:
                assert math.isclose(torch.tensor(one["embedding"]).norm().item(), 1, rel_tol=1e-5)
            meta = one["meta_info"]
            assert meta["prompt_tokens"] == len(PROMPTS[i])
            assert meta["completion_tokens"] == 0
            assert meta["finish_reason"] == {"type": "length", "length": 0}
    finish(engine)


def test_last_pooling_reuses_a_cached_prefix(tiny_model_dirs, expected, reference):
    engine = make_engine(tiny_model_dirs)
    cold = engine.encode(input_ids=PROMPTS[0])  # nothing cached yet
    assert cold["meta_info"]["cached_tokens"] == 0
    warm = engine.encode(input_ids=PROMPTS[0])  # the whole prompt but its last token cached
    assert warm["meta_info"]["cached_tokens"] == len(PROMPTS[0]) - 1
    # the shared prefix was inserted by the embeddings: a generation on it hits the cache
    gen = engine.generate(
        input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 4, "temperature": 0}
    )
    assert gen["meta_info"]["cached_tokens"] >= len(SHARED)
    assert gen["output_ids"] == reference_greedy(reference, PROMPTS[1], 4)
    # and a generation's prompt serves a later embedding on the same prefix
    after_gen = engine.encode(input_ids=PROMPTS[1])
    assert after_gen["meta_info"]["cached_tokens"] == len(PROMPTS[1]) - 1
    for result, i in ((cold, 0), (warm, 0), (after_gen, 1)):
        assert max_diff(result["embedding"], expected[i, "last", True]) < TOL
    finish(engine)


def test_mean_pooling_recomputes_the_whole_prompt_but_caches_its_kv(tiny_model_dirs, expected):
    engine = make_engine(tiny_model_dirs, embedding_pooling="mean")
    first = engine.encode(input_ids=PROMPTS[0])
    second = engine.encode(input_ids=PROMPTS[0])
    assert first["meta_info"]["cached_tokens"] == second["meta_info"]["cached_tokens"] == 0
    for result in (first, second):
        assert max_diff(result["embedding"], expected[0, "mean", True]) < TOL
    last = engine.encode(input_ids=PROMPTS[1], pooling="last")  # its KV went to the tree
    assert last["meta_info"]["cached_tokens"] >= len(SHARED)
    assert max_diff(last["embedding"], expected[1, "last", True]) < TOL
    finish(engine)


def test_text_prompts_are_tokenized_like_generation(tiny_model_dirs, reference):
    engine = make_engine(tiny_model_dirs)
    texts = ["hello world", "a longer sentence about the sea"]
    results = engine.encode(texts)
    for text, result in zip(texts, results):
        ids = engine.tokenizer.encode(text)
        want = reference_embedding(reference, ids, "last", True)
        assert result["meta_info"]["prompt_tokens"] == len(ids)
        assert max_diff(result["embedding"], want) < TOL
    finish(engine)


def test_embedding_rows_never_run_the_lm_head(tiny_model_dirs, monkeypatch):
    engine = make_engine(tiny_model_dirs)
    model = engine.runner.model
    rows: list[int] = []
    original = model.compute_logits

    def counting(x: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return original(x)

    monkeypatch.setattr(model, "compute_logits", counting)
    engine.encode(input_ids=PROMPTS)
    assert rows == [], "an embedding batch ran the LM head"
    engine.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": 1})
    assert rows, "the counter should see a generation's logits"
    finish(engine)


def embed_req(rid: str, ids: list[int], pooling: str) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=0), embed=EmbedParams(pooling))


@pytest.mark.parametrize("pooling", POOLINGS)
def test_chunked_embedding_beside_running_generations(
    tiny_model_dirs, reference, expected, pooling
):
    """A prompt chunked across mixed steps while others decode: the decode rows and the
    embedding rows of one forward land where they belong."""
    sched = make_scheduler(tiny_model_dirs, max_total_tokens=2048, chunked_prefill_size=8)
    gen_ids = [3, 4, 5]
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    sched.add_request(Req("gen", gen_ids, params))
    sched.step()  # the generation runs
    sched.add_request(embed_req("emb", PROMPTS[0], pooling))
    trace = run_to_end(sched)
    outputs = {o.rid: o for step in trace for o in step if o.finished}
    assert sched.stats.mixed_steps > 1, "the embedding's chunks should ride with decode"
    assert max_diff(outputs["emb"].embedding, expected[0, pooling, True]) < TOL
    gen_tokens = [t for step in trace for o in step if o.rid == "gen" for t in o.new_ids]
    assert len(gen_tokens) == 19  # the first came with the first step
    want = reference_greedy(reference, gen_ids, 20)
    assert gen_tokens == want[1:]
    sched.check_kv_accounting()


def test_embedding_request_must_not_generate():
    with pytest.raises(ValueError, match="max_new_tokens must be 0"):
        Req("r", [1, 2], SamplingParams(max_new_tokens=1), embed=EmbedParams())
    with pytest.raises(ValueError, match="pooling"):
        EmbedParams("max")  # type: ignore[arg-type]


def test_invalid_calls_raise_naming_the_field(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs)
    with pytest.raises(ValueError, match="empty"):
        engine.encode("")
    with pytest.raises(ValueError, match="empty"):
        engine.encode(input_ids=[[1, 2], []])
    with pytest.raises(ValueError, match="context length"):
        engine.encode(input_ids=[1] * 2049)
    with pytest.raises(ValueError, match=r"token ids in \[0, 512\)"):
        engine.encode(input_ids=[1, 100000])
    finish(engine)


@pytest.mark.smollm2
@pytest.mark.parametrize("pooling", POOLINGS)
def test_smollm2_embedding_equals_transformers(pooling):
    from transformers import AutoModelForCausalLM

    engine = Engine(None, progress=False, dtype=FP32, max_total_tokens=4096)
    texts = [
        "The capital of France is Paris, and the capital of Germany is Berlin.",
        "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    ]
    folder = engine.runner.model_folder
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = engine.encode(texts, pooling=pooling)
    raw = engine.encode(texts, pooling=pooling, normalize=False)
    diffs = []
    for text, unit, plain in zip(texts, results, raw):
        ids = engine.tokenizer.encode(text)
        assert unit["meta_info"]["prompt_tokens"] == len(ids)
        for normalize, got in ((True, unit), (False, plain)):
            want = reference_embedding(reference, ids, pooling, normalize)
            diffs.append(max_diff(got["embedding"], want))
    print(f"SmolLM2 {pooling}: max abs diff vs transformers {max(diffs):.2e}")
    assert max(diffs) < TOL
    finish(engine)
