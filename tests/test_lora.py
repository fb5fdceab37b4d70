"""LoRA serving through the in-process Engine, against PEFT (the reference implementation of
LoRA) on the same base weights: adapters made and saved by PEFT itself, in its folder
format, and PEFT's forward pass as the expected output.

One batch mixes two adapters of different shapes and the base model; greedy tokens must be
PEFT's, token for token, and the prompt's logprobs close to its log-softmax (fp32).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixserve.config import Config
from radixserve.engine import Engine
from radixserve.lora import registry as lora_registry
from radixserve.lora.adapter import LoraAdapter, LoraError, ModelShape
from radixserve.model.loader import resolve_model_folder
from tests.conftest import FP32, build_tiny_model

STEPS = 12
GREEDY = {"temperature": 0, "max_new_tokens": STEPS}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "def add(a, b):\n    return",
    "Once upon a time, in a land far away, there lived a",
]
EVERY_MODULE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# adapter "a": every module, rank 8; "b": a few modules, rank 4, rsLoRA's scaling
ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=EVERY_MODULE),
    "b": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
}


def make_adapter(base: torch.nn.Module, folder: Path, seed: int, **config) -> Path:
    """A PEFT LoRA adapter of random A and B (PEFT's own init leaves B zero, a no-op),
    saved by PEFT; the base model is left as it was."""
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():  # large enough to move greedy choices, not to drown the base
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    model.save_pretrained(folder)
    model.unload()  # the base's modules back as they were
    return folder


class Case:
    """A base model folder, its adapters, and PEFT's answers on them."""

    def __init__(self, folder: Path, adapters: dict[str, Path]) -> None:
        from peft import PeftModel

        self.folder, self.adapters = folder, adapters
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        names = list(adapters)
        self.peft = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            self.peft.load_adapter(adapters[name], adapter_name=name)
        self.peft.eval()

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    @torch.no_grad()
    def greedy(self, prompt: str, adapter: str | None) -> list[int]:
        ids = torch.tensor([self.ids(prompt)])
        if adapter is None:
            with self.peft.disable_adapter():
                out = self.peft.generate(ids, max_new_tokens=STEPS, do_sample=False)
        else:
            self.peft.set_adapter(adapter)
            out = self.peft.generate(ids, max_new_tokens=STEPS, do_sample=False)
        return out[0, ids.shape[1] :].tolist()

    @torch.no_grad()
    def prompt_logprobs(self, prompt: str, adapter: str) -> torch.Tensor:
        """log-softmax of each prompt token after the ones before it (the first has none)."""
        ids = torch.tensor([self.ids(prompt)])
        self.peft.set_adapter(adapter)
        logits = self.peft(ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


def build_case(root: Path, arch: str) -> Case:
    if arch == "smollm2":
        folder = resolve_model_folder(None, Config.from_flat().model.cache_dir, progress=False)
    else:
        folder = build_tiny_model(root / arch, arch)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapters = {
        name: make_adapter(base, root / f"{arch}-{name}", seed, **config)
        for seed, (name, config) in enumerate(ADAPTERS.items(), start=1)
    }
    return Case(folder, adapters)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3", "smollm2"])
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    case = build_case(root, request.param)
    paths = [f"{name}={path}" for name, path in case.adapters.items()]
    # chunks of 16 tokens: the prompts' prefills run in pieces too
    engine = Engine(
        str(case.folder),
        progress=False,
        dtype=FP32,
        max_total_tokens=4096,
        chunked_prefill_size=16,
        lora_paths=paths,
    )
    yield case, engine
    engine.shutdown()


def test_mixed_batch_matches_peft(case):
    """Every prompt under adapter a, adapter b and the base model, all in one call (one
    batch): each output is PEFT's greedy output for that adapter."""
    case, engine = case
    names = ["a", "b", None]
    prompts = [p for p in PROMPTS for _ in names]
    adapters = names * len(PROMPTS)
    outs = engine.generate(prompts, GREEDY, lora_path=adapters)
    expected = [case.greedy(p, a) for p, a in zip(prompts, adapters, strict=True)]
    got = [o["output_ids"] for o in outs]
    assert got == expected
    for prompt in PROMPTS:  # the adapters do change the output (so the test could fail)
        assert len({tuple(case.greedy(prompt, a)) for a in names}) > 1, prompt
    engine.check_kv_accounting()


def test_prompt_logprobs_close_to_peft(case):
    case, engine = case
    for adapter in ("a", "b"):
        prompt = PROMPTS[0]
        out = engine.generate(
            prompt,
            {"temperature": 0, "max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=0,
            lora_path=adapter,
        )
        ours = torch.tensor([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])
        ref = case.prompt_logprobs(prompt, adapter)
        assert torch.allclose(ours, ref, atol=2e-4), (adapter, (ours - ref).abs().max())
        # the frontend's select scores under the adapter too
        scored = engine.score_continuations(prompt[:-8], [prompt[-8:]], lora_path=adapter)
        span = scored["continuations"][0]["logprobs"]
        assert torch.allclose(torch.tensor(span), ref[-len(span) :], atol=2e-4), adapter


def test_prefix_cache_is_per_adapter(case):
    """A prefix cached under one adapter is never served to another, nor to the base
    model; a request under the same adapter finds it."""
    case, engine = case
    engine.flush_cache()
    prompt = PROMPTS[2] * 3
    first = engine.generate(prompt, GREEDY, lora_path="a")
    again = engine.generate(prompt, GREEDY, lora_path="a")
    other = engine.generate(prompt, GREEDY, lora_path="b")
    base = engine.generate(prompt, GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] > 0
    assert other["meta_info"]["cached_tokens"] == 0
    assert base["meta_info"]["cached_tokens"] == 0
    assert again["output_ids"] == first["output_ids"] == case.greedy(prompt, "a")
    assert base["output_ids"] == case.greedy(prompt, None)
    engine.check_kv_accounting()


def test_unknown_adapter_is_refused(case):
    _, engine = case
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        engine.generate(PROMPTS[0], GREEDY, lora_path="nope")
    with pytest.raises(ValueError, match="one entry per prompt"):
        engine.generate(PROMPTS[:2], GREEDY, lora_path=["a"])


# -- loading and unloading while serving ----------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-dynamic")
    case = build_case(root, "llama")
    engine = Engine(str(case.folder), progress=False, dtype=FP32, enable_lora=True)
    yield case, engine, root
    engine.shutdown()


def test_load_serve_unload(llama):
    case, engine, _ = llama
    prompt = PROMPTS[1]
    answer = engine.load_lora_adapter("x", str(case.adapters["a"]))
    assert answer == {
        "success": True,
        "error_message": None,
        "loaded_adapters": {"x": str(case.adapters["a"])},
    }
    assert engine.generate(prompt, GREEDY, lora_path="x")["output_ids"] == case.greedy(prompt, "a")
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora_adapter("x", str(case.adapters["b"]))
    # the same weights under a second name: the same prefix-cache namespace
    engine.load_lora_adapter("y", str(case.adapters["a"]))
    assert engine.generate(prompt, GREEDY, lora_path="y")["meta_info"]["cached_tokens"] > 0
    assert engine.unload_lora_adapter("x")["loaded_adapters"] == {"y": str(case.adapters["a"])}
    with pytest.raises(ValueError, match="'x' is not loaded"):
        engine.generate(prompt, GREEDY, lora_path="x")
    engine.unload_lora_adapter("y")
    # a name may be loaded again, with other weights
    engine.load_lora_adapter("x", str(case.adapters["b"]))
    assert engine.generate(prompt, GREEDY, lora_path="x")["output_ids"] == case.greedy(prompt, "b")
    engine.unload_lora_adapter("x")
    assert engine.scheduler.runner.lora.adapters == {}
    engine.check_kv_accounting()


def test_unload_waits_for_running_requests(llama):
    case, engine, _ = llama
    engine.load_lora_adapter("z", str(case.adapters["a"]))
    prompt = PROMPTS[0]
    stream = engine.generate(prompt, GREEDY, lora_path="z", stream=True)
    first = next(stream)
    assert not first["meta_info"]["finish_reason"]
    unloaded: list[dict] = []
    unloading = threading.Thread(target=lambda: unloaded.append(engine.unload_lora_adapter("z")))
    unloading.start()
    *_, last = stream  # the request runs to its end under the adapter
    unloading.join(timeout=60)
    assert unloaded and unloaded[0]["success"]
    assert last["output_ids"] == case.greedy(prompt, "a")
    assert engine.scheduler.runner.lora.adapters == {}


def test_adapters_that_cannot_be_served(llama, tmp_path):
    case, engine, root = llama
    missing = engine.load_lora_adapter("m", str(tmp_path / "nowhere"))
    assert missing["success"] is False and "does not exist" in missing["error_message"]
    qwen3 = build_case(root / "other", "qwen3")  # q is 384 wide there, 256 in the llama
    wrong = engine.load_lora_adapter("w", str(qwen3.adapters["a"]))
    assert wrong["success"] is False and "trained for another model" in wrong["error_message"]
    assert wrong["loaded_adapters"] == {}
    with pytest.raises(ValueError, match="not loaded"):
        engine.generate(PROMPTS[0], GREEDY, lora_path="w")


def test_engine_without_lora_refuses_loads(tiny_model_dirs):
    with Engine(str(tiny_model_dirs["llama"]), progress=False, dtype=FP32) as engine:
        with pytest.raises(ValueError, match="--enable-lora"):
            engine.load_lora_adapter("a", "/nowhere")
        with pytest.raises(ValueError, match="not loaded"):
            engine.generate(PROMPTS[0], GREEDY, lora_path="a")


# -- reading PEFT folders -------------------------------------------------------------------
SHAPE = ModelShape.of(hidden=256, q_size=256, kv_size=128, intermediate=512, layers=4)


def _adapter_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def _pair(layer: int, module: str, r: int, fan_in: int, fan_out: int) -> dict[str, torch.Tensor]:
    kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
    return {
        f"{key}.lora_A.weight": torch.randn(r, fan_in),
        f"{key}.lora_B.weight": torch.randn(fan_out, r),
    }


def load(folder: Path) -> LoraAdapter:
    return LoraAdapter.load("t", folder, SHAPE, torch.float32, torch.device("cpu"))


def test_site_weights_fold_scaling(tmp_path):
    """k_proj alone at rank 2: the qkv site's A is k's, its B k's scaled by alpha / r, q
    and v have none; layers the adapter does not train have no site."""
    tensors = _pair(1, "k_proj", 2, 256, 128)
    adapter = load(_adapter_folder(tmp_path / "k", {"r": 2, "lora_alpha": 6}, tensors))
    assert set(adapter.sites) == {(1, "qkv")}
    site = adapter.sites[1, "qkv"]
    a = tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"]
    assert torch.equal(site.a, a)
    assert site.spans == ((0, 0), (0, 2), (2, 2)) and site.bs[0] is None and site.bs[2] is None
    assert torch.allclose(site.bs[1], b.t() * 3.0)
    assert adapter.rank == 2 and adapter.modules == ("k_proj",)


@pytest.mark.parametrize(
    "config, tensors, message",
    [
        ({"use_dora": True}, _pair(0, "q_proj", 2, 256, 256), "DoRA"),
        ({"bias": "all"}, _pair(0, "q_proj", 2, 256, 256), "biases"),
        ({"peft_type": "IA3"}, _pair(0, "q_proj", 2, 256, 256), "not LORA"),
        (
            {},
            {"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(2, 512)},
            "embedding",
        ),
        ({}, _pair(7, "q_proj", 2, 256, 256), "layer 7"),
        ({}, _pair(0, "q_proj", 2, 256, 384), "trained for another model"),
        (
            {},
            {k: v for k, v in _pair(0, "o_proj", 2, 256, 256).items() if "lora_A" in k},
            "no lora_B",
        ),
        ({"lora_alpha": "abc"}, _pair(0, "q_proj", 2, 256, 256), "lora_alpha must be a number"),
        ({"lora_alpha": 10**400}, _pair(0, "q_proj", 2, 256, 256), "lora_alpha must be a number"),
        ({}, _pair(0, "q_proj", 0, 256, 256), "rank 0"),
        (
            {},
            {
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(
                    2, 256, dtype=torch.int32
                )
            },
            "not floating point",
        ),
        (
            {},
            {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": torch.ones(256)},
            "bias adapters",
        ),
    ],
)
def test_refused_adapters_say_why(tmp_path, config, tensors, message):
    folder = _adapter_folder(tmp_path / "bad", {"r": 2, "lora_alpha": 4, **config}, tensors)
    with pytest.raises(LoraError, match=message):
        load(folder)


def test_unreadable_files_say_why(tmp_path):
    not_object = _adapter_folder(tmp_path / "list", {}, _pair(0, "q_proj", 2, 256, 256))
    (not_object / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(LoraError, match="not a JSON object"):
        load(not_object)
    corrupt = _adapter_folder(tmp_path / "corrupt", {"r": 2}, _pair(0, "q_proj", 2, 256, 256))
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(LoraError, match="not a readable safetensors file"):
        load(corrupt)


def test_a_pipe_is_not_read(tmp_path):
    """A FIFO in place of a file would block the scheduler's read forever."""
    folder = tmp_path / "fifo"
    folder.mkdir()
    os.mkfifo(folder / "adapter_config.json")
    with pytest.raises(LoraError, match="not a regular file"):
        load(folder)


def test_only_safetensors_weights_are_read(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 2}))
    (folder / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(LoraError, match="only safetensors"):
        load(folder)


def test_peft_key_layout_is_what_the_loader_reads(llama):
    """The keys PEFT writes (the format this loader follows) name every trained module."""
    case, _, _ = llama
    keys = load_file(case.adapters["a"] / "adapter_model.safetensors")
    assert all(".lora_A." in k or ".lora_B." in k for k in keys)
    assert len(keys) == 2 * len(EVERY_MODULE) * 4  # A and B, every module, 4 layers


def test_embeddings_run_with_the_adapter(llama):
    """Engine.encode under an adapter: PEFT's final-norm hidden states, mean-pooled and
    normalized."""
    case, engine, _ = llama
    engine.load_lora_adapter("e", str(case.adapters["b"]))
    try:
        prompt = PROMPTS[0]
        out = engine.encode(prompt, pooling="mean", lora_path="e")
        base = engine.encode(prompt, pooling="mean")
    finally:
        engine.unload_lora_adapter("e")
    case.peft.set_adapter("b")
    with torch.no_grad():
        ids = torch.tensor([case.ids(prompt)])
        hidden = case.peft(ids, output_hidden_states=True).hidden_states[-1][0]
    expected = torch.nn.functional.normalize(hidden.mean(0), dim=0)
    assert torch.allclose(torch.tensor(out["embedding"]), expected, atol=1e-4)
    assert not torch.allclose(torch.tensor(base["embedding"]), expected, atol=1e-3)


def test_a_load_that_fails_unexpectedly_fails_alone(llama, monkeypatch):
    """A fault while loading (here a RuntimeError no check foresaw) fails that load; the
    scheduler serves on."""
    case, engine, _ = llama

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(LoraAdapter, "load", broken)
    answer = engine.load_lora_adapter("r", str(case.adapters["a"]))
    assert answer["success"] is False and "RuntimeError: out of memory" in answer["error_message"]
    assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == case.greedy(PROMPTS[0], None)


def _until(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_slow_load_leaves_serving_going(llama, monkeypatch):
    """The folder is read off the scheduler's thread: requests run while it is read; the
    adapter serves once the load is answered. A load not read in time (a hung file system)
    is undone: the read is abandoned at once (its slot free, its load failed, the undo
    answered), and what it reads once it ends is dropped."""
    case, engine, _ = llama
    release, read = threading.Event(), LoraAdapter.load

    def slow(*args, **kwargs):
        assert release.wait(60)
        return read(*args, **kwargs)

    monkeypatch.setattr(LoraAdapter, "load", slow)
    try:  # a failed check never leaves a read blocked on the module's engine
        adapters = engine.scheduler.adapters
        done: dict[str, object] = {}
        loading = threading.Thread(
            target=lambda: done.setdefault(
                "load", engine.load_lora_adapter("slow", str(case.adapters["a"]))
            )
        )
        loading.start()
        _until(lambda: adapters.loading)
        assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == case.greedy(PROMPTS[0], None)
        assert "load" not in done
        release.set()
        loading.join(60)
        assert done["load"]["success"] and "slow" in done["load"]["loaded_adapters"]
        out = engine.generate(PROMPTS[0], GREEDY, lora_path="slow")
        assert out["output_ids"] == case.greedy(PROMPTS[0], "a")
        assert engine.unload_lora_adapter("slow")["success"]

        release.clear()
        monkeypatch.setattr(lora_registry, "LOAD_TIMEOUT_S", 0.5)
        loaded = set(engine.runner.lora.adapters)
        started = time.monotonic()
        answer = engine.load_lora_adapter("hung", str(case.adapters["b"]))
        assert time.monotonic() - started < 30  # not waiting on the read
        assert not answer["success"] and "not read in 0.5 s" in answer["error_message"]
        assert "hung" not in answer["loaded_adapters"] and not adapters.loading
        assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == case.greedy(PROMPTS[0], None)
        release.set()  # the read ends: nothing of it is installed
        time.sleep(0.3)
        engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 1})  # a few loop turns
        assert set(engine.runner.lora.adapters) == loaded and not adapters.unloading
        engine.check_kv_accounting()
    finally:
        release.set()


def test_an_unload_serves_requests_queued_behind_a_weight_update(llama):
    """A request sent before an unload, held behind a weight update, runs under the
    adapter once the update is done; the unload then goes ahead."""
    case, engine, _ = llama
    engine.load_lora_adapter("u", str(case.adapters["a"]))
    loop, prompt = engine._loop, PROMPTS[1]
    long = {"temperature": 0, "max_new_tokens": 1900, "ignore_eos": True}  # seconds
    stream = engine.generate(prompt, long, lora_path="u", stream=True)
    next(stream)  # running
    done: dict[str, object] = {}

    def in_thread(key, call):
        thread = threading.Thread(target=lambda: done.__setitem__(key, call()))
        thread.start()
        return thread

    def until(condition):
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    update = in_thread("update", lambda: engine.update_weights_from_disk(str(case.folder)))
    until(lambda: loop._update is not None)
    held = in_thread("held", lambda: engine.generate(prompt, GREEDY, lora_path="u"))
    until(lambda: loop._after_update)
    unload = in_thread("unload", lambda: engine.unload_lora_adapter("u"))
    until(lambda: engine.scheduler.adapters.unloading)
    for _ in stream:
        pass
    for thread in (update, held, unload):
        thread.join(60)
    assert done["update"]["success"] and done["unload"]["success"]
    assert done["held"]["output_ids"] == case.greedy(prompt, "a")


def test_registry_names():
    from radixserve.config import LoraConfig
    from radixserve.lora.registry import LoraNotFound, LoraRef, LoraRegistry

    with pytest.raises(ValueError, match="served model's name"):
        LoraRegistry(LoraConfig(lora_paths=("llama3:8b=/a",)), reserved=("llama3:8b",))
    registry = LoraRegistry(LoraConfig(lora_paths=("8b=/a",)), reserved=("llama3:8b",))
    assert registry.model_uid("llama3:8b") == 0  # the served model, though 8b is an adapter
    assert registry.model_uid("8b") == registry.model_uid("any:8b") == 1
    assert registry.model_uid("gpt-4o") == registry.model_uid("gpt:zzz") == 0
    with pytest.raises(LoraNotFound, match="'typo' is not loaded"):
        registry.model_uid("llama3:8b:typo")
    registry.remove("8b")
    with pytest.raises(LoraNotFound, match="was unloaded"):
        registry.model_uid("8b")
    assert registry.model_uid("other:8b") == 0  # not the served model's NAME form
    registry.pending.add("9b")
    with pytest.raises(LoraNotFound, match="being loaded"):
        registry.model_uid("9b")
    registry.pending.clear()
    registry.add(LoraRef("8b", "/b", 7))
    assert registry.model_uid("8b") == 7 and registry.retired == set()


def test_adapters_per_batch_and_the_limits_of_what_loads(llama):
    """--max-loras-per-batch 1: requests under two adapters and the base model, sent
    together, each step uses one adapter at most (the base model's rows beside it), requests
    of the adapter in use wait behind one that found no slot, and each output is still
    PEFT's. --max-lora-rank and --lora-target-modules refuse, with the
    reason, an adapter past them (here at the start: --lora-paths)."""
    case, _, _ = llama
    paths = [f"{name}={path}" for name, path in case.adapters.items()]

    def one_adapter_a_batch(policy: str = "fcfs") -> Engine:
        return Engine(
            str(case.folder), progress=False, dtype=FP32, lora_paths=paths,
            max_loras_per_batch=1, schedule_policy=policy,
        )  # fmt: skip

    with one_adapter_a_batch() as engine:
        steps: list[set[int]] = []
        first_batch: list[int] = []
        forward = engine.runner.forward

        def spy(batch):
            if not steps:
                first_batch.extend(batch.lora_ids or ())
            steps.append(set(batch.lora_ids or ()) - {0})
            return forward(batch)

        engine.runner.forward = spy
        names = ["a", "b", "a", None]
        prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]]  # (no prefix held back)
        outs = engine.generate(prompts, GREEDY, lora_path=names)
        expected = [case.greedy(p, n) for p, n in zip(prompts, names, strict=True)]
        assert [o["output_ids"] for o in outs] == expected
        assert all(len(used) <= 1 for used in steps) and {1, 2} <= set().union(*steps)
        # the second "a" waits behind "b" (which found no slot), the base model's does not:
        # a steady stream of "a" would otherwise keep "b" waiting for good
        assert first_batch == [1, 0], first_batch
        engine.check_kv_accounting()

    # lpm puts the requests sharing the running adapter's cached prefix first: the one that
    # found no slot still goes next, not behind them
    with one_adapter_a_batch("lpm") as engine:
        prefills: list[set[int]] = []  # per step: the adapters of rows that prefill
        forward = engine.runner.forward

        def prefill_spy(batch):
            owners = batch.lora_ids or [0] * len(batch.extend_lens)
            prefills.append({u for u, n in zip(owners, batch.extend_lens) if n > 1 and u})
            return forward(batch)

        engine.runner.forward = prefill_spy
        shared = PROMPTS[2] * 3
        prompts = [shared + " one", PROMPTS[0], shared + " two", shared + " three"]
        names = ["a", "b", "a", "a"]
        outs = engine.generate(prompts, GREEDY, lora_path=names)
        assert [o["output_ids"] for o in outs] == [
            case.greedy(p, n) for p, n in zip(prompts, names, strict=True)
        ]
        b_first = next(i for i, used in enumerate(prefills) if 2 in used)
        assert all(1 not in used for used in prefills[1:b_first]), prefills
        engine.check_kv_accounting()

    # the priority policy: a request of the adapter in use that outranks the one waiting
    # for a slot still goes; one that does not waits behind it
    with one_adapter_a_batch("priority") as engine:
        prefilled: list[list[tuple[int, int]]] = []  # per step: (adapter, length) prefilled
        streams = []
        forward = engine.runner.forward

        def send(ids: list[int], name: str, priority: int, tokens: int = 4) -> None:
            params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
            streams.append(
                engine.generate(
                    input_ids=ids,
                    sampling_params=params,
                    lora_path=name,
                    priority=priority,
                    stream=True,
                )  # fmt: skip
            )

        def arrivals_spy(batch):
            owners = batch.lora_ids or [0] * len(batch.extend_lens)
            prefilled.append([(u, n) for u, n in zip(owners, batch.extend_lens) if n > 1])
            if len(prefilled) == 1:  # "a" runs: "b" finds no slot
                send([21, 22, 23, 24, 25, 26], "b", priority=1)
            if len(prefilled) == 3:  # while "b" waits: "a" above it, "a" below it
                send([31, 32, 33, 34, 35, 36, 37], "a", priority=9)
                send([41, 42, 43, 44, 45, 46, 47, 48, 49], "a", priority=0)
            return forward(batch)

        engine.runner.forward = arrivals_spy
        send([11, 12, 13, 14, 15], "a", priority=0, tokens=24)
        for stream in list(streams):
            for _ in stream:
                pass
        for stream in streams[1:]:
            for _ in stream:
                pass
        order = [entry for step in prefilled for entry in step]
        assert order.index((1, 7)) < order.index((2, 6)) < order.index((1, 9)), prefilled
        engine.check_kv_accounting()

    with pytest.raises(LoraError, match="rank 8 is above --max-lora-rank 4"):
        Engine(str(case.folder), progress=False, dtype=FP32, lora_paths=paths, max_lora_rank=4)
    narrow = ["q_proj", "v_proj", "down_proj"]  # adapter b's modules, not a's
    with pytest.raises(LoraError, match="trains gate_proj, k_proj, o_proj, up_proj, outside"):
        Engine(
            str(case.folder),
            progress=False,
            dtype=FP32,
            lora_paths=paths,
            lora_target_modules=narrow,
        )
    with Engine(
        str(case.folder),
        progress=False,
        dtype=FP32,
        lora_paths=[paths[1]],
        max_lora_rank=4,
        lora_target_modules=["qkv_proj", "down_proj"],  # SGLang's name of q, k and v
    ) as engine:
        out = engine.generate(PROMPTS[1], GREEDY, lora_path="b")
        assert out["output_ids"] == case.greedy(PROMPTS[1], "b")


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"max_loras_per_batch": 0}, "--max-loras-per-batch must be at least 1"),
        ({"max_lora_rank": 0}, "--max-lora-rank must be at least 1"),
        ({"lora_target_modules": ["q_proj", "lm_head"]}, "lm_head is not one of q_proj"),
        ({"lora_target_modules": ["embed_tokens"]}, "embed_tokens or lm_head are not served"),
    ],
)
def test_lora_flags_are_checked(flags, message):
    from radixserve.config import LORA_MODULES
    from radixserve.lora.adapter import SITE_OF

    assert set(LORA_MODULES) == set(SITE_OF)  # what the flags name is what adapters train
    with pytest.raises(ValueError, match=message):
        Config.from_flat(enable_lora=True, **flags)


def _one_adapter_a_batch_scheduler(case: Case, per_batch: int = 1, rows: int = 3, **config):
    """A scheduler over the tiny llama with its adapters (and `a` again as `c`), one adapter
    a batch, 3 rows (or as given)."""
    from radixserve.model.runner import ModelRunner
    from radixserve.scheduler.scheduler import Scheduler

    paths = [f"{name}={path}" for name, path in case.adapters.items()]
    paths.append(f"c={case.adapters['a']}")
    cfg = Config.from_flat(
        model_path=str(case.folder), dtype=FP32, lora_paths=paths,
        max_loras_per_batch=per_batch, max_running_requests=rows, max_total_tokens=4096,
        **config,
    )  # fmt: skip
    return Scheduler(ModelRunner(cfg, progress=False), cfg.scheduler, cfg.cache.page_size)


def test_the_flex_tier_under_one_adapter_a_batch(llama):
    """--max-loras-per-batch 1 with flex requests: an interactive request of the running
    adapter is not held behind a flex one waiting for its adapter's slot, and an interactive
    request whose adapter finds no slot takes no flex request's row (nothing is preempted
    step after step for it)."""
    from tests.test_scheduler import req

    sched = _one_adapter_a_batch_scheduler(llama[0])
    a, b = sorted(sched.runner.lora.adapters)[:2]
    sched.add_request(req("a0", [20 + i for i in range(10)], 40, lora_id=a))
    sched.step()
    sched.add_request(req("flex-b", [40 + i for i in range(10)], 40, deferred=True, lora_id=b))
    sched.step()
    sched.add_request(req("a1", [60 + i for i in range(10)], 4, lora_id=a))
    sched.step()
    assert {"a0", "a1"} <= {r.rid for r in sched.running}  # not behind flex-b's claim
    assert "flex-b" in {r.rid for r in sched.waiting}

    sched.add_request(req("flex-base", [80 + i for i in range(10)], 40, deferred=True))
    sched.step()
    assert len(sched.running) == 3
    sched.add_request(req("b1", [90 + i for i in range(10)], 4, lora_id=b))
    for _ in range(20):
        sched.step()
        sched.check_kv_accounting()
    assert sched.stats.preemptions == 0


def test_an_interactive_request_takes_the_slot_of_an_adapter_only_flex_requests_hold(llama):
    """One adapter a batch, rows to spare: flex requests of adapter a hold its slot; an
    interactive request of adapter b takes them back (their KV kept) and starts at once,
    and they resume after it. No greedy output changes, no KV slot is lost."""
    from tests.test_scheduler import _tokens, req, run_to_end

    case = llama[0]
    prompts = {f"fa{i}": [20 + 3 * i + j for j in range(10)] for i in range(2)}
    prompts["b1"] = [90 + j for j in range(10)]
    sched = _one_adapter_a_batch_scheduler(case)
    a, b = sorted(sched.runner.lora.adapters)[:2]
    adapter = {"fa0": a, "fa1": a, "b1": b}
    for rid in ("fa0", "fa1"):
        sched.add_request(req(rid, prompts[rid], 30, deferred=True, lora_id=a))
    trace = [sched.step() for _ in range(3)]
    assert {r.rid for r in sched.running} == {"fa0", "fa1"}
    sched.add_request(req("b1", prompts["b1"], 6, lora_id=b))
    trace.append(sched.step())
    assert {r.rid for r in sched.running} == {"b1"} and sched.stats.preemptions == 2
    trace += run_to_end(sched)
    alone = _one_adapter_a_batch_scheduler(case)
    for rid, ids in prompts.items():
        alone.add_request(req(rid, ids, 6 if rid == "b1" else 30, lora_id=adapter[rid]))
    assert _tokens(trace) == _tokens(run_to_end(alone))


def _uids(sched, *names: str) -> list[int]:
    by_name = {adapter.name: uid for uid, adapter in sched.runner.lora.adapters.items()}
    return [by_name[name] for name in names]


def test_no_adapter_slot_is_freed_that_a_more_urgent_request_counts_on(llama):
    """Two slots, held by flex requests of a and an interactive one of b: w1 (a) counts on
    a's slot, so w2 (c) takes no holder of a back (w1 would get the slot, w2 none)."""
    from tests.test_scheduler import req

    sched = _one_adapter_a_batch_scheduler(llama[0], per_batch=2, rows=4)
    a, b, c = _uids(sched, "a", "b", "c")
    prompt = lambda k: [20 + 7 * k + j for j in range(10)]  # noqa: E731
    sched.add_request(req("f1", prompt(1), 60, deferred=True, lora_id=a))
    sched.add_request(req("f2", prompt(2), 60, deferred=True, lora_id=a))
    sched.add_request(req("x1", prompt(3), 60, lora_id=b))
    for _ in range(3):
        sched.step()
    sched.add_request(req("w1", prompt(4), 30, lora_id=a))
    sched.add_request(req("w2", prompt(5), 30, lora_id=c))
    sched.step()
    assert {r.rid for r in sched.running} == {"f1", "f2", "w1", "x1"}
    assert sched.stats.preemptions == 0


def test_a_flex_request_without_an_adapter_slot_takes_no_flex_row(llama):
    """Cap 1, one adapter a batch, priority policy: a more urgent flex request of another
    adapter than the running ones' would not start, so it takes no flex row."""
    from tests.test_scheduler import req

    sched = _one_adapter_a_batch_scheduler(
        llama[0], flex_max_running_requests=1, schedule_policy="priority"
    )
    a, b = _uids(sched, "a", "b")
    sched.add_request(req("n0", [20 + j for j in range(10)], 40, lora_id=a))
    sched.add_request(req("lo", [40 + j for j in range(10)], 40, deferred=True, lora_id=a))
    for _ in range(3):
        sched.step()
    sched.add_request(req("hi", [60 + j for j in range(10)], 40, deferred=True, priority=20,
                          lora_id=b))  # fmt: skip
    for _ in range(4):
        sched.step()
        assert {r.rid for r in sched.running} == {"n0", "lo"}
    assert sched.stats.preemptions == 0


def test_no_preemption_for_a_request_another_adapters_claim_holds_back(llama):
    """One adapter a batch: with b1 waiting for adapter b's slot (its claim), a request of
    the running adapter a cannot start either (the claim holds it back), so it takes no
    flex request's row, step after step."""
    from tests.test_scheduler import req

    sched = _one_adapter_a_batch_scheduler(llama[0])
    a, b = sorted(sched.runner.lora.adapters)[:2]
    sched.add_request(req("a0", [20 + i for i in range(10)], 60, lora_id=a))
    sched.step()
    sched.add_request(req("flex1", [40 + i for i in range(10)], 60, deferred=True))
    sched.step()
    sched.add_request(req("b1", [60 + i for i in range(10)], 4, lora_id=b))
    sched.step()
    sched.add_request(req("flex2", [80 + i for i in range(10)], 60, deferred=True))
    sched.step()
    sched.add_request(req("a2", [100 + i for i in range(10)], 4, lora_id=a))
    for _ in range(12):
        sched.step()
        sched.check_kv_accounting()
    assert sched.stats.preemptions == 0
