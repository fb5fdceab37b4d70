"""Tensor parallelism (`--tp-size`, gloo on CPU): how a model is split, that the split
model computes what the whole one does, and what happens when a rank dies.

- Each rank's slice of every weight, put back together, is the checkpoint (KV heads
  replicated where there are fewer than ranks), and each rank holds ~1/N of the weights.
- Greedy outputs with --tp-size 2 (tiny Llama: 4 heads, 2 KV heads) and 3 (SmolLM2: 9 heads,
  3 KV heads) are identical to --tp-size 1, batched, with the radix cache and chunked
  prefill; the full-vocabulary log-softmax of every prompt and output position within 1e-4.
- Two "nodes" on loopback (`--nnodes 2`) serve requests; killing either side makes the other
  exit. A server whose tensor-parallel rank dies fails its streams with a 503 and exits.
"""

from __future__ import annotations

import time

import psutil
import pytest
import requests
import torch
from openai import OpenAI
from transformers import AutoConfig

import radixserve
from radixserve.config import Config, ParallelConfig, parse_host_port, rank_addr
from radixserve.model.loader import iter_checkpoint
from radixserve.model.parallel import TensorParallel
from radixserve.model.runner import build_model
from tests.conftest import FP32
from tests.reference import greedy_of_folder, greedy_params
from tests.server_utils import ServerProcess, alive, assert_all_gone, free_port

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 9, 10, 11, 40, 41], [30, 31], [100] * 20]
STEPS = 12


# -- configuration ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(tp_size=0), "tp_size must be >= 1"),
        (dict(tp_size=3, nnodes=2, dist_init_addr="h:1"), "multiple of nnodes"),
        (dict(tp_size=2, nnodes=2), "needs --dist-init-addr"),
        (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank must be"),
        (dict(tp_size=2, dist_init_addr="no-port"), "must be host:port"),
        (dict(tp_size=2, dist_init_addr="h:99999"), "must be host:port"),
        (dict(tp_size=2, nnodes=2, dp_size=2, dist_init_addr="h:1"), "one machine"),
        (dict(dist_timeout=0), "dist_timeout"),
    ],
)
def test_parallel_flags_are_checked(flags, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**flags)


def test_hierarchical_cache_is_refused_with_tp():
    with pytest.raises(ValueError, match="tp-size"):
        Config.from_flat(tp_size=2, enable_hierarchical_cache=True)


def test_addresses():
    assert parse_host_port("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert parse_host_port("[::1]:5000") == ("::1", 5000)
    parallel = ParallelConfig(tp_size=2, dp_size=2, dist_init_addr="10.0.0.1:5000")
    assert [rank_addr(parallel, d) for d in (0, 1)] == ["10.0.0.1:5000", "10.0.0.1:5001"]
    loopback = rank_addr(ParallelConfig(tp_size=2), 0)
    assert loopback.startswith("127.0.0.1:") and parse_host_port(loopback)[1] > 0


def test_shapes_that_do_not_split_are_refused(tiny_model_dirs):
    folder = tiny_model_dirs["llama"]  # 4 heads, 2 KV heads
    config = AutoConfig.from_pretrained(folder)
    with pytest.raises(Exception, match="does not divide the 4 attention heads"):
        build_model(folder, config, torch.float32, torch.device("cpu"), tp=TensorParallel(0, 3))


# -- the split ----------------------------------------------------------------------------
def rank_models(folder, size: int) -> list[torch.nn.Module]:
    """Each rank's model, built and loaded as that rank does (no group needed for that)."""
    config = AutoConfig.from_pretrained(folder)
    cpu = torch.device("cpu")
    return [
        build_model(folder, config, torch.float32, cpu, tp=TensorParallel(r, size))
        for r in range(size)
    ]


@pytest.mark.parametrize("size", [2, 4])
def test_rank_slices_put_together_are_the_checkpoint(tiny_model_dirs, size):
    folder = tiny_model_dirs["llama"]
    config = AutoConfig.from_pretrained(folder)
    full = {name: t.read() for name, t in iter_checkpoint(folder)}
    ranks = [dict(m.named_parameters()) for m in rank_models(folder, size)]
    layer = "layers.1."
    for name, dim in (("self_attn.q_proj", 0), ("self_attn.o_proj", 1), ("mlp.down_proj", 1)):
        parts = [r[layer + name + ".weight"] for r in ranks]
        assert torch.equal(torch.cat(parts, dim), full[f"model.{layer}{name}.weight"]), name
    gate_up = [r[layer + "mlp.gate_up_proj.weight"] for r in ranks]
    gates = torch.cat([g[: g.shape[0] // 2] for g in gate_up])
    assert torch.equal(gates, full[f"model.{layer}mlp.gate_proj.weight"])
    k = full[f"model.{layer}self_attn.k_proj.weight"]
    head_dim = config.hidden_size // config.num_attention_heads
    for rank, params in enumerate(ranks):  # 2 KV heads: one each, or shared by 2 ranks
        kv_head = rank * config.num_key_value_heads // size
        mine = k[kv_head * head_dim : (kv_head + 1) * head_dim]
        assert torch.equal(params[layer + "self_attn.k_proj.weight"], mine)
    vocab = torch.cat([r["embed_tokens.weight"] for r in ranks])
    assert torch.equal(vocab[: config.vocab_size], full["model.embed_tokens.weight"])
    norm = layer + "input_layernorm.weight"  # replicated
    assert all(torch.equal(r[norm], full["model." + norm]) for r in ranks)


def test_each_rank_holds_its_share_of_the_weights(tiny_model_dirs):
    def size_of(model):
        return sum(p.numel() for p in model.parameters())

    whole = size_of(rank_models(tiny_model_dirs["llama"], 1)[0])
    shares = [size_of(m) / whole for m in rank_models(tiny_model_dirs["llama"], 2)]
    print(f"\ntiny Llama, --tp-size 2: each rank holds {shares} of the weights")
    assert all(0.5 <= s < 0.52 for s in shares), shares  # norms are replicated


# -- fidelity: the same outputs as one rank -------------------------------------------------
def run_engine(folder, tp_size: int, **flags) -> tuple[list[list[int]], list, dict]:
    """Greedy outputs of PROMPTS (batched, then again with their prefixes cached) and each
    position's full-vocabulary logprobs."""
    vocab = AutoConfig.from_pretrained(folder).vocab_size if folder else 0
    with radixserve.Engine(
        str(folder) if folder else None, progress=False, tp_size=tp_size, dtype=FP32, **flags
    ) as engine:
        args = dict(input_ids=PROMPTS, sampling_params=greedy_params(STEPS))
        first = engine.generate(**args, return_logprob=True, logprob_start_len=0,
                                top_logprobs_num=vocab or 0)  # fmt: skip
        again = engine.generate(**args)
        info = engine.get_server_info()
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in first]
    assert sum(r["meta_info"]["cached_tokens"] for r in again) > 0  # the cache was used
    return [r["output_ids"] for r in first], first, info


def logprob_table(result: dict) -> torch.Tensor:
    """(positions, vocab) log-softmax from the full top-logprob lists of one result."""
    meta = result["meta_info"]
    rows = [r for r in meta["input_top_logprobs"] + meta["output_top_logprobs"] if r]
    table = torch.full((len(rows), len(rows[0])), float("nan"))
    for i, row in enumerate(rows):
        for logprob, token, *_ in row:
            table[i, token] = logprob
    return table


@pytest.mark.parametrize("chunk", [None, 6])
def test_tp2_matches_tp1_and_transformers(tiny_model_dirs, chunk):
    folder = tiny_model_dirs["llama"]
    flags = dict(max_total_tokens=2048)
    if chunk:
        flags["chunked_prefill_size"] = chunk
    one, one_results, _ = run_engine(folder, 1, **flags)
    two, two_results, info = run_engine(folder, 2, **flags)
    assert two == one == greedy_of_folder(folder, PROMPTS, STEPS)
    worst = max(
        float((logprob_table(a) - logprob_table(b)).abs().max())
        for a, b in zip(one_results, two_results, strict=True)
    )
    print(f"\ntiny Llama --tp-size 2 vs 1: max |log-softmax diff| {worst:.2e}")
    assert worst < 1e-4
    assert info["tp_size"] == 2 and len(set(info["tp_pids"])) == 2


def test_tp3_matches_tp1_on_smollm2():
    """SmolLM2: 9 heads and 3 KV heads over 3 ranks, a vocabulary of 49152 split in 3."""
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    outputs, infos = {}, {}
    for tp_size in (1, 3):
        with radixserve.Engine(
            None, progress=False, tp_size=tp_size, dtype=FP32, max_total_tokens=2048
        ) as engine:
            results = engine.generate(texts, greedy_params(16), return_logprob=True)
            info = engine.get_server_info()
        outputs[tp_size], infos[tp_size] = results, info
    assert [r["output_ids"] for r in outputs[3]] == [r["output_ids"] for r in outputs[1]]
    drift = max(
        abs(a[0] - b[0])
        for x, y in zip(outputs[1], outputs[3], strict=True)
        for a, b in zip(
            x["meta_info"]["output_token_logprobs"], y["meta_info"]["output_token_logprobs"]
        )
    )
    whole = infos[1]["weight_bytes"][0]
    shares = [b / whole for b in infos[3]["weight_bytes"]]  # of the one-rank model
    print(f"\nSmolLM2 --tp-size 3 vs 1: max logprob diff {drift:.2e}; weight shares {shares}")
    assert drift < 1e-4
    assert all(0.33 <= s < 0.34 for s in shares), shares


# -- processes ------------------------------------------------------------------------------
def tp_server(folder, log, *flags: str) -> ServerProcess:
    return ServerProcess(
        "--model-path", str(folder), "--max-total-tokens", "4000", "--tp-size", "2",
        "--cpu-threads", "1", *flags, log=log,
    ).wait_ready()  # fmt: skip


def test_a_dead_rank_fails_the_streams_and_stops_the_server(tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs["llama"]
    server = tp_server(folder, tmp_path / "server.log")
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        done = client.completions.create(  # EOS ignored: a sampled EOS would end it early
            model="m", prompt="hello there", max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert done.choices[0].finish_reason == "length"
        info = requests.get(server.url + "/get_server_info", timeout=30).json()
        follower = psutil.Process(info["tp_pids"][1])
        assert follower in server.children
        stream = client.completions.create(
            model="m", prompt="hi", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        )
        first = next(iter(stream))
        assert first.choices[0].text is not None
        follower.kill()
        with pytest.raises(Exception, match="tensor-parallel|stopped|503"):  # noqa: PT011
            for _ in stream:
                pass
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.proc.returncode == 1, "the server outlived a dead rank"
        assert_all_gone(server.children)
        assert "a collective failed" in server.logs()
    finally:
        server.stop()


def start_nodes(folder, tmp_path) -> tuple[ServerProcess, ServerProcess]:
    """Node 0 (HTTP, rank 0) and node 1 (rank 1) of --nnodes 2 on loopback."""
    addr = f"127.0.0.1:{free_port()}"
    flags = ("--nnodes", "2", "--dist-init-addr", addr, "--dist-timeout", "20")
    node1 = ServerProcess(
        "--model-path", str(folder), "--max-total-tokens", "4000", "--tp-size", "2",
        "--cpu-threads", "1", *flags, "--node-rank", "1", log=tmp_path / "node1.log",
    )  # fmt: skip
    node0 = tp_server(folder, tmp_path / "node0.log", *flags, "--node-rank", "0")
    node1.children = psutil.Process(node1.proc.pid).children(recursive=True)
    return node0, node1


def wait_exit(proc: ServerProcess, timeout: float) -> float:
    start = time.monotonic()
    while proc.proc.poll() is None and time.monotonic() - start < timeout:
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.parametrize("killed", ["node1", "node0"])
def test_two_nodes_on_loopback(tiny_model_dirs, tmp_path, killed):
    folder = tiny_model_dirs["llama"]
    node0, node1 = start_nodes(folder, tmp_path)
    try:
        assert node0.children and all(alive(c) for c in node1.children)
        if killed == "node1":  # serve 20 requests, equal to transformers' greedy tokens
            expected = greedy_of_folder(folder, PROMPTS, STEPS)
            for i in range(20):
                body = {"input_ids": PROMPTS[i % 4], "sampling_params": greedy_params(STEPS)}
                r = requests.post(node0.url + "/generate", json=body, timeout=120)
                assert r.status_code == 200, r.text
                assert r.json()["output_ids"] == expected[i % 4]
        victim, survivor = (node1, node0) if killed == "node1" else (node0, node1)
        psutil.Process(victim.proc.pid).kill()  # the launcher; its ranks die with it
        took = wait_exit(survivor, 30)
        print(f"\n{killed} killed: the other node exited {took:.1f}s later")
        assert survivor.proc.returncode == 1, f"{survivor.logs()}"
        assert_all_gone(node0.children + node1.children)
    finally:
        node0.stop()
        node1.stop()
