"""Weight updates (SGLang's /update_weights_from_disk, as RL trainers drive it): a checkpoint
of the same model replaces the loaded weights between requests; outputs are then those of
the new weights (transformers' greedy on them), the prefix cache forgets the old K/V, and a
checkpoint that does not fit is refused with the old weights kept. Through the Engine, and
the route through a real server."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import requests
import torch
from safetensors.torch import save_file

from radixserve import Engine
from radixserve.model.loader import iter_safetensors
from tests.conftest import FP32, build_tiny_model
from tests.reference import greedy_of_folder, greedy_params
from tests.server_utils import ServerProcess, assert_kv_clean

PROMPT = [(5 * i) % 300 + 40 for i in range(60)]
STEPS = 12
LONG = 400  # a request long enough to be running when an update comes
TIMEOUT = 120


def engine_on(folder) -> Engine:
    return Engine(str(folder), progress=False, dtype=FP32, max_total_tokens=4096)


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dirs, tmp_path_factory) -> dict:
    """The tiny Llama, a later checkpoint of it (other weights, same shapes), and what
    transformers makes of the prompt with each."""
    first = tiny_model_dirs["llama"]
    later = build_tiny_model(tmp_path_factory.mktemp("later") / "model", "llama", seed=1)
    expected = {f: greedy_of_folder(f, [PROMPT], STEPS)[0] for f in (first, later)}
    assert expected[first] != expected[later]
    return {"first": first, "later": later, "expected": expected}


def test_the_engine_serves_the_new_weights_and_forgets_the_old_cache(checkpoints, tiny_model_dirs):
    first, later, expected = checkpoints["first"], checkpoints["later"], checkpoints["expected"]
    with engine_on(first) as engine:
        run = lambda: engine.generate(input_ids=PROMPT, sampling_params=greedy_params(STEPS))  # noqa: E731
        assert run()["output_ids"] == expected[first]
        result = engine.update_weights_from_disk(str(later))
        assert result["success"] and result["num_paused_requests"] == 0, result
        after = run()
        assert after["output_ids"] == expected[later]
        assert after["meta_info"]["cached_tokens"] == 0  # the old weights' K/V are gone
        assert run()["meta_info"]["cached_tokens"] > 0  # the new ones' are cached
        # what does not fit is refused, and the weights stay
        for path, words in [
            (tiny_model_dirs["qwen3"], "not the loaded model's shape"),
            (later.parent / "missing", "missing"),
        ]:
            result = engine.update_weights_from_disk(str(path))
            assert not result["success"] and words in result["message"], result
            assert run()["output_ids"] == expected[later]
        assert engine.update_weights_from_disk(str(first))["success"]
        assert run()["output_ids"] == expected[first]
        engine.check_kv_accounting()


def test_the_loaded_checkpoint_may_be_gone_from_disk(checkpoints, tmp_path):
    """RL trainers keep only their latest checkpoints: the folder loaded first may have
    been deleted by the time the next one comes."""
    step1 = tmp_path / "step1"
    shutil.copytree(checkpoints["first"], step1)
    with engine_on(step1) as engine:
        shutil.rmtree(step1)
        result = engine.update_weights_from_disk(str(checkpoints["later"]))
        assert result["success"], result
        out = engine.generate(input_ids=PROMPT, sampling_params=greedy_params(STEPS))
        assert out["output_ids"] == checkpoints["expected"][checkpoints["later"]]


def test_an_update_waits_for_the_running_requests_and_runs_before_later_ones(checkpoints):
    """A request running when the update comes ends on the old weights; one sent while the
    update waits for it runs after it, on the new weights."""
    first, later, expected = checkpoints["first"], checkpoints["later"], checkpoints["expected"]
    long = greedy_params(LONG)
    with engine_on(first) as engine:
        old = engine.generate(input_ids=PROMPT, sampling_params=long)["output_ids"]
        stream = engine.generate(input_ids=PROMPT, sampling_params=long, stream=True)
        next(stream)  # running
        box: dict = {}
        updater = threading.Thread(
            target=lambda: box.update(result=engine.update_weights_from_disk(str(later)))
        )
        updater.start()
        deadline = time.monotonic() + TIMEOUT
        while engine._loop._update is None and updater.is_alive():  # until it waits
            assert time.monotonic() < deadline
            time.sleep(0.001)
        after = engine.generate(input_ids=PROMPT, sampling_params=greedy_params(STEPS))
        running = list(stream)[-1]
        updater.join(TIMEOUT)
        assert running["output_ids"] == old  # all of it on the old weights
        assert after["output_ids"] == expected[later]
        assert box["result"] == {
            "success": True,
            "message": f"loaded the weights of {later}",
            "num_paused_requests": 1,  # `after`, held until the update
        }


def test_abort_all_requests_ends_the_running_ones_for_the_update(checkpoints):
    first, later = checkpoints["first"], checkpoints["later"]
    with engine_on(first) as engine:
        stream = engine.generate(input_ids=PROMPT, sampling_params=greedy_params(LONG), stream=True)
        next(stream)
        result = engine.update_weights_from_disk(str(later), abort_all_requests=True)
        assert result["success"], result
        last = list(stream)[-1]["meta_info"]
        assert last["finish_reason"] == {"type": "abort", "message": "aborted for a weight update"}
        assert last["completion_tokens"] < LONG
        engine.check_kv_accounting()


# -- from tensors (the Engine's update_weights_from_tensor) ---------------------------------
def tensors_of(folder) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in iter_safetensors(folder)}


def test_tensors_given_in_process_replace_the_weights(checkpoints, tmp_path):
    """A trainer in the same process gives tensors by their checkpoint names: all of them
    (the outputs are then the later checkpoint's), or some, which stay through a later
    update of others (two halves make the later checkpoint). The prefix cache forgets the
    old K/V (or keeps them, with flush_cache false)."""
    first, later, expected = checkpoints["first"], checkpoints["later"], checkpoints["expected"]
    new = tensors_of(later)
    names = sorted(new)
    with engine_on(first) as engine:
        run = lambda: engine.generate(input_ids=PROMPT, sampling_params=greedy_params(STEPS))  # noqa: E731
        assert run()["output_ids"] == expected[first]
        result = engine.update_weights_from_tensor(list(new.items()))
        assert result == {
            "success": True,
            "message": f"updated {len(new)} tensors of the weights",
            "num_paused_requests": 0,
        }
        after = run()
        assert after["output_ids"] == expected[later]
        assert after["meta_info"]["cached_tokens"] == 0

        assert engine.update_weights_from_disk(str(first))["success"]  # forgets the tensors
        assert run()["output_ids"] == expected[first]
        half = len(names) // 2
        assert engine.update_weights_from_tensor({n: new[n] for n in names[:half]})["success"]
        mixed = run()["output_ids"]
        assert mixed not in (expected[first], expected[later])  # some of each
        result = engine.update_weights_from_tensor(
            [(n, new[n]) for n in names[half:]], flush_cache=False
        )
        assert result["success"], result
        kept = run()  # the cache kept the K/V the mixed weights computed
        assert kept["meta_info"]["cached_tokens"] > 0
        engine.flush_cache()
        assert run()["output_ids"] == expected[later]  # both halves, the first half kept
        engine.check_kv_accounting()


def test_tensors_that_do_not_fit_are_refused_and_the_weights_stay(checkpoints):
    first, expected = checkpoints["first"], checkpoints["expected"]
    name, tensor = next(iter(tensors_of(checkpoints["later"]).items()))
    with engine_on(first) as engine:
        for named, words in [
            ([("layers.0.mlp.up_proj.weight", tensor)], "is not a tensor of the loaded"),
            ([(name, tensor[:1])], "the checkpoint's is"),
            ([(name, tensor.to(torch.int32))], "a floating-point torch.Tensor is needed"),
        ]:
            result = engine.update_weights_from_tensor(named)
            assert not result["success"] and words in result["message"], result
        with pytest.raises(TypeError, match="a \\(name, tensor\\) pair"):
            engine.update_weights_from_tensor([tensor])
        with pytest.raises(ValueError, match="load_format"):
            engine.update_weights_from_tensor([(name, tensor)], load_format="flattened_bucket")
        out = engine.generate(input_ids=PROMPT, sampling_params=greedy_params(STEPS))
        assert out["output_ids"] == expected[first]


def test_a_tied_head_is_updated_through_the_embeddings(tiny_model_dirs, tmp_path):
    """A checkpoint may store lm_head.weight beside the embeddings it is tied to (the model
    reads the embeddings): an update of it alone would change nothing, so it is refused."""
    folder = tmp_path / "tied"
    shutil.copytree(tiny_model_dirs["qwen2"], folder)
    tensors = tensors_of(folder)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    with engine_on(folder) as engine:
        result = engine.update_weights_from_tensor({"lm_head.weight": tensors["lm_head.weight"]})
        assert not result["success"] and "tied to model.embed_tokens.weight" in result["message"]


def test_a_full_set_of_tensors_needs_no_checkpoint_on_disk(checkpoints, tmp_path):
    step1 = tmp_path / "step1"
    shutil.copytree(checkpoints["first"], step1)
    new = tensors_of(checkpoints["later"])
    with engine_on(step1) as engine:
        shutil.rmtree(step1)
        name = next(iter(new))
        result = engine.update_weights_from_tensor([(name, new[name])])
        assert not result["success"] and "is gone" in result["message"], result
        assert engine.update_weights_from_tensor(new)["success"]
        out = engine.generate(input_ids=PROMPT, sampling_params=greedy_params(STEPS))
        assert out["output_ids"] == checkpoints["expected"][checkpoints["later"]]


# -- pausing generation (SGLang's pause_generation / continue_generation) --------------------
def started(engine, params) -> tuple:
    """A streamed request that has written a few tokens (it is running), and them."""
    stream = engine.generate(input_ids=PROMPT, sampling_params=params, stream=True)
    seen = [next(stream) for _ in range(3)]
    return stream, seen[-1]["output_ids"]


def test_a_retracted_request_resumes_its_greedy_output_unchanged(checkpoints):
    """Paused in retract mode, a running request goes back to the queue with its tokens;
    on continuing it is prefilled again and its output is the uninterrupted one."""
    first = checkpoints["first"]
    long = greedy_params(LONG)
    with engine_on(first) as engine:
        whole = engine.generate(input_ids=PROMPT, sampling_params=long)["output_ids"]
        engine.flush_cache()
        stream, seen = started(engine, long)
        engine.pause_generation("retract")
        state = engine.get_server_info()["internal_states"][0]
        assert state["paused"] == "retract" and state["num_running"] == 0
        assert state["num_waiting"] == 1
        engine.continue_generation()
        last = list(stream)[-1]
        assert last["output_ids"] == whole and last["output_ids"][: len(seen)] == seen
        assert engine.get_server_info()["internal_states"][0]["paused"] is None
        engine.check_kv_accounting()


def retracted_mid_prompt(engine, run) -> dict:
    """`run()`'s result where a pause (retract) lands while its prompt is prefilled in
    chunks (each step slowed by the caller, so that it does), then generation continues."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(out=run()))
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while engine.scheduler.chunked is None:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    engine.pause_generation("retract")
    state = engine.get_server_info()["internal_states"][0]
    assert state["num_running"] == 0 and state["num_waiting"] == 1
    engine.continue_generation()
    thread.join(TIMEOUT)
    return box["out"]


def test_a_prompt_retracted_mid_chunk_resumes_with_the_same_results(checkpoints, monkeypatch):
    """Retracted while its prompt is prefilled in chunks, a request prefills again: its
    output, input logprobs, and cached_tokens (its first admission's: its own chunks, which
    the tree kept, are no cache hit) are those of the uninterrupted run."""
    prompt = [(7 * i) % 400 + 30 for i in range(300)]
    params = greedy_params(6)
    with Engine(
        str(checkpoints["first"]), progress=False, dtype=FP32, max_total_tokens=4096,
        chunked_prefill_size=32,
    ) as engine:  # fmt: skip
        plain = lambda: engine.generate(input_ids=prompt, sampling_params=params)  # noqa: E731
        scored = lambda: engine.generate(  # noqa: E731
            input_ids=prompt, sampling_params=params, return_logprob=True, logprob_start_len=0
        )
        whole, whole_scored = plain(), scored()
        engine.flush_cache()
        step = engine.scheduler.step
        monkeypatch.setattr(engine.scheduler, "step", lambda: (step(), time.sleep(0.1))[0])
        again = retracted_mid_prompt(engine, plain)
        engine.flush_cache()
        again_scored = retracted_mid_prompt(engine, scored)
        engine.check_kv_accounting()
    assert again["output_ids"] == whole["output_ids"]
    assert again["meta_info"]["cached_tokens"] == whole["meta_info"]["cached_tokens"] == 0
    assert again_scored["output_ids"] == whole["output_ids"]
    ours, theirs = (o["meta_info"]["input_token_logprobs"] for o in (again_scored, whole_scored))
    assert len(ours) == len(theirs) == len(prompt)
    assert max(abs(a[0] - b[0]) for a, b in zip(ours[1:], theirs[1:], strict=True)) < 1e-5


def test_pause_update_continue_runs_the_rest_on_the_new_weights(checkpoints):
    """An RL trainer's weight sync: pause (retract), update, continue. The update goes
    ahead while the retracted request waits; the request's tokens before the pause are the
    old weights' greedy ones, and those after are the new weights' greedy continuation of
    them (transformers on the later checkpoint)."""
    first, later = checkpoints["first"], checkpoints["later"]
    long = greedy_params(LONG)
    with engine_on(first) as engine:
        old = engine.generate(input_ids=PROMPT, sampling_params=long)["output_ids"]
        stream, seen = started(engine, long)
        engine.pause_generation("retract")
        result = engine.update_weights_from_disk(str(later))
        assert result["success"] and result["num_paused_requests"] == 0, result
        engine.continue_generation()
        out = list(stream)[-1]["output_ids"]
        engine.check_kv_accounting()
    cut = next(i for i, (a, b) in enumerate(zip(out, old, strict=True)) if a != b)
    assert len(seen) <= cut < len(out)  # some on the old weights, the rest on the new
    rest = greedy_of_folder(later, [PROMPT + out[:cut]], len(out) - cut)[0]
    assert out[cut:] == rest


def test_paused_requests_wait_and_aborts_still_end_them(checkpoints):
    """Abort mode ends the running requests; a request sent while paused waits (no token)
    until generation continues, unless it is aborted, which ends it at once. Paused in
    place, a running request keeps its K/V: a weight update is refused, and the request
    ends as it would have."""
    first, expected = checkpoints["first"], checkpoints["expected"]
    long = greedy_params(LONG)
    with engine_on(first) as engine:
        whole = engine.generate(input_ids=PROMPT, sampling_params=long)["output_ids"]
        stream, _ = started(engine, long)
        engine.pause_generation("abort")
        ended = list(stream)[-1]["meta_info"]
        assert ended["finish_reason"] == {"type": "abort", "message": "aborted: generation paused"}

        box: dict = {}
        waiter = threading.Thread(
            target=lambda: box.update(
                out=engine.generate(input_ids=PROMPT, sampling_params=greedy_params(STEPS))
            )
        )
        waiter.start()
        doomed = engine.generate(input_ids=PROMPT, sampling_params=long, stream=True, rid="d")
        waiter.join(0.5)
        assert waiter.is_alive() and "out" not in box  # it waits for continue_generation
        engine.abort("d")
        assert list(doomed)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        engine.continue_generation()
        waiter.join(TIMEOUT)
        assert box["out"]["output_ids"] == expected[first]

        stream, _ = started(engine, long)
        engine.pause_generation("in_place")
        result = engine.update_weights_from_disk(str(checkpoints["later"]))
        assert not result["success"] and "paused in place" in result["message"], result
        engine.continue_generation()
        assert list(stream)[-1]["output_ids"] == whole
        with pytest.raises(ValueError, match="mode must be one of"):
            engine.pause_generation("later")
        engine.check_kv_accounting()


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("weights-server") / "server.log"
    proc = ServerProcess(
        "--model-path", str(checkpoints["first"]), "--max-total-tokens", "4000", log=log
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_the_route_answers_as_sglang_and_names_the_version(server, checkpoints):
    later, expected = checkpoints["later"], checkpoints["expected"]
    body = {"input_ids": PROMPT, "sampling_params": greedy_params(STEPS)}
    r = requests.post(
        server.url + "/update_weights_from_disk",
        json={"model_path": str(later), "weight_version": "step-7"},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    assert r.json() == {
        "success": True,
        "message": f"loaded the weights of {later}",
        "num_paused_requests": 0,
    }
    out = requests.post(server.url + "/generate", json=body, timeout=TIMEOUT).json()
    assert out["output_ids"] == expected[later]
    info = requests.get(server.url + "/get_model_info", timeout=TIMEOUT).json()
    assert info["weight_version"] == "step-7" and info["model_path"] == str(later)
    version = requests.get(server.url + "/get_weight_version", timeout=TIMEOUT).json()
    assert version == {"weight_version": "step-7"}
    # a failure: SGLang's fields and the error shape, a 400; the weights stay
    r = requests.post(
        server.url + "/update_weights_from_disk",
        json={"model_path": str(later.parent / "missing")},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert r.json()["error"]["param"] == "model_path" and "missing" in r.json()["message"]
    out = requests.post(server.url + "/generate", json=body, timeout=TIMEOUT).json()
    assert out["output_ids"] == expected[later]
    assert_kv_clean(server)


def test_the_pause_routes_answer_as_sglang(server):
    def post(path: str, body: dict | None = None) -> requests.Response:
        return requests.post(server.url + path, json=body, timeout=TIMEOUT)

    r = post("/pause_generation", {"mode": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode", r.text
    r = post("/pause_generation", {"mode": "retract"})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    info = requests.get(server.url + "/get_server_info", timeout=TIMEOUT).json()
    assert info["internal_states"][0]["paused"] == "retract"
    health = requests.get(server.url + "/health_generate", timeout=TIMEOUT)
    assert health.status_code == 503 and "paused" in health.json()["error"]["message"]
    r = post("/continue_generation")
    assert r.json() == {"message": "Generation continued successfully.", "status": "ok"}
    body = {"input_ids": PROMPT, "sampling_params": greedy_params(STEPS)}
    assert post("/generate", body).status_code == 200
    assert requests.get(server.url + "/health_generate", timeout=TIMEOUT).status_code == 200
    assert post("/pause_generation", {}).status_code == 200  # abort, SGLang's default
    assert post("/continue_generation").status_code == 200
    assert_kv_clean(server)
