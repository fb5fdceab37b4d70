"""The GPU check: the runner against transformers on CUDA, the host KV tier, then speed.

On a lent GPU machine, from the repository root (the device tool's `run`):
    bash benchmarks/gpu/run.sh        # timeout 540 python3 benchmarks/gpu/check.py --out $OUT
As a dry run on CPU (float32, small sizes):
    python benchmarks/gpu/check.py --device cpu --quick --out /tmp/gpu_check

Parts:
  fidelity    the tests' tiny random-weight Llama and Qwen2 (tests/conftest.py): logits of
              prefill and of 8 teacher-forced decode steps against transformers on the same
              weights (max-abs difference), and 32 greedy tokens for the 8 prompts of
              tests/test_fidelity.py in one batch. float32 is held to the CPU tests' bar
              (1e-4, identical tokens); bfloat16 (CUDA only) is reported, not judged.
  hicache     the host tier (radixserve.cache.host_pool.HostKVPool, pinned on CUDA) next to a
              KVPool of SmolLM2-135M's KV shape, float32 and bfloat16 pools, host storage of
              the same dtype or int8: random rows backed up to host slots (one run, and
              scattered), loaded back into other device slots by `load`, by `load_async` +
              `wait()` and by `load_async` + `wait_layer(i)` before reading layer i, each
              checked bit for bit (int8: within amax/254 and the pool's rounding); GB/s.
  tensor_parallel  --tp-size 2 (rank 1 in a process of its own) on the tiny Llama: the
              fidelity part's logits and greedy tokens against transformers; NCCL on CUDA,
              which takes two GPUs (skipped with fewer), shared memory on CPU.
  throughput  random weights in SmolLM2-135M's shape, bfloat16 (float32 on CPU): prefill
              and decode tokens/s through radixserve.bench.one_batch's workloads, each next
              to transformers (`generate` for decode) in the same run; peak GPU memory.

Figures, or a part's traceback, go to OUT/gpu_check.json and OUT/gpu_check.md, rewritten
after every part so that a run cut short still leaves what it measured. Parts (and decode
batch sizes) still to run once --budget-s has passed are skipped.

Only the runner level of radixserve is imported (model, cache, core, scheduler.batch_builder,
tests' static_generator, bench.one_batch): it needs torch and transformers, plus msgspec,
which radixserve.core.sampling_params imports for request parsing only. The GPU image has no
msgspec, so where it is missing a stand-in that fails on use takes its place
(`provide_missing_modules`); the JSON lists it under "stand_ins".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import transformers

REPO = Path(__file__).resolve().parents[2]
EAGER = "radixserve eager"  # the throughput part's runner with its decode graphs set aside
TEACHER_FORCED_STEPS = 8  # decode steps fed the reference's own tokens, as in the CPU tests

# SmolLM2-135M's shape; the weights are random (they do not change the speed).
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SMOLLM2_ROPE_THETA = 100000.0


@dataclass(frozen=True)
class Sizes:
    greedy_steps: int  # greedy tokens compared per prompt
    layers: int  # of the SmolLM2-shaped model
    prefill_len: int
    batch_sizes: tuple[int, ...]
    context_len: int  # prompt length before the timed decode steps
    output_len: int  # decode steps timed
    repeats: int  # median of this many runs, after one warm-up
    hicache_tokens: int  # per host-tier transfer; its device and host pools hold twice that

    @property
    def kv_tokens(self) -> int:
        """KV pool for the largest decode batch (prompt, warm-up token, timed steps)."""
        return max(self.batch_sizes) * (self.context_len + self.output_len + 2) + self.prefill_len


FULL = Sizes(32, 30, 512, (1, 32, 64, 256), 128, 32, 5, 2048)
QUICK = Sizes(8, 2, 64, (1, 4), 16, 4, 1, 128)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    stand_ins = provide_missing_modules()
    transformers.logging.disable_progress_bar()  # keeps the log (and the device's tail) short
    device = torch.device(args.device)
    sizes = QUICK if args.quick else FULL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "environment": environment(device),
        "stand_ins": stand_ins,
        "sizes": asdict(sizes),
        "parts": {},
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        for name in args.parts:
            if time.monotonic() > deadline:
                report["parts"][name] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
            else:
                print(f"== {name}", flush=True)
                run_part = PARTS[name]
                report["parts"][name] = guarded(run_part, device, sizes, Path(work), deadline)
            report["elapsed_s"] = round(time.monotonic() - started, 1)
            write_report(report, out)
    print((out / "gpu_check.md").read_text())
    return 1 if has_error(report) else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json and .md")
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for CPU dry runs")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="skip what is still to run past this many seconds (run.sh kills at 540)",
    )
    return parser.parse_args(argv)


def provide_missing_modules() -> list[str]:
    """Stand-ins for modules that the runner level imports but this check never uses.

    radixserve.core.sampling_params imports msgspec at module level for
    SamplingParams.from_dict (parsing a request), which nothing here calls. Any use of the
    stand-in raises, so it cannot change a figure silently."""
    provided = []
    for name in ("msgspec",):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = _stand_in(name)
            provided.append(name)
    return provided


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"stand-in for the missing {name} (benchmarks/gpu/check.py)")

    def missing(attr: str) -> Any:
        raise AttributeError(f"{name} is not installed here; {name}.{attr} was used")

    module.__getattr__ = missing
    return module


def environment(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": str(device),
        "cuda_graphs": "decode steps replayed from CUDA graphs (model/cuda_graph.py) "
        "on CUDA; each figure says whether they ran",
        "gpu": None,
    }
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "compute_capability": f"{props.major}.{props.minor}",
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }
    else:
        info["cpu_threads"] = torch.get_num_threads()
    return info


def _git_commit() -> str | None:
    """HEAD of the checkout, with "+dirty" for local changes; None where there is no .git.
    (The device machine's .git is the session's first commit, under a newer tree.)"""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def guarded(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """fn's figures, or its traceback: one failure must not lose the other parts' figures,
    and every failure is reported (the JSON, the markdown and the exit status)."""
    try:
        return fn(*args)
    except Exception:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        return {"error": tb}


def has_error(node: Any) -> bool:
    if isinstance(node, dict):
        return "error" in node or any(has_error(v) for v in node.values())
    if isinstance(node, list):
        return any(has_error(v) for v in node)
    return False


# -- fidelity ----------------------------------------------------------------------------


def fidelity(device: torch.device, sizes: Sizes, work: Path, deadline: float) -> dict[str, Any]:
    from tests.conftest import build_tiny_model

    dtypes = ["float32", "bfloat16"] if device.type == "cuda" else ["float32"]
    cases: dict[str, Any] = {}
    for arch in ("llama", "qwen2"):
        folder = build_tiny_model(work / arch, arch)
        for dtype in dtypes:
            key = f"{arch}/{dtype}"
            if time.monotonic() > deadline:
                cases[key] = {"skipped": "past the time budget"}
                continue
            print(f"   {key}", flush=True)
            cases[key] = guarded(fidelity_case, folder, device, dtype, sizes.greedy_steps)
            _free(device)
    return {"cases": cases}


def fidelity_case(
    folder: Path, device: torch.device, dtype: str, steps: int, runner=None
) -> dict[str, Any]:
    """The runner (by default a new one; else `runner`, e.g. tensor-parallel rank 0) vs
    transformers on one model folder, both on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM

    from radixserve.config import Config
    from tests.reference import reference_logits
    from tests.static_generator import StaticGenerator
    from tests.test_fidelity import ATOL, TEXTS, encode, greedy

    graph_error = None
    if runner is None:
        config = Config.from_flat(
            model_path=str(folder), device=str(device), dtype=dtype, max_total_tokens=8192
        )
        runner, graph_error = _runner_with_graphs(config)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=runner.dtype)
    reference = reference.to(runner.device).eval()
    prompts = [encode(runner, t) for t in TEXTS]
    with torch.device(runner.device):  # tests.reference builds its inputs with torch.tensor
        continuations = [recompute_greedy(reference, p, TEACHER_FORCED_STEPS) for p in prompts]
        refs = [reference_logits(reference, p + c) for p, c in zip(prompts, continuations)]
        expected = [recompute_greedy(reference, p, steps) for p in prompts]
    prefill_diff, decode_diff = teacher_forced_diffs(runner, prompts, continuations, refs)

    results = StaticGenerator(runner).generate(prompts, [greedy(steps) for _ in prompts])
    agreeing = [_common_prefix(r.output_ids, e) for r, e in zip(results, expected)]
    identical = sum(n == steps for n in agreeing)
    judged = dtype == "float32"
    passed = max(prefill_diff, decode_diff) <= ATOL and identical == len(prompts)
    graphs = {"decode_graphs": _graph_sizes(runner), "graph_error": graph_error}
    if runner.decode_graphs is not None:  # the same steps once more, eagerly
        with _eager(runner):
            _, eager_diff = teacher_forced_diffs(runner, prompts, continuations, refs)
            eager = StaticGenerator(runner).generate(prompts, [greedy(steps) for _ in prompts])
        same = sum(a.output_ids == b.output_ids for a, b in zip(results, eager))
        graphs |= {"eager_decode_max_abs": eager_diff, "graph_eager_greedy_identical": same}
        passed = passed and same == len(prompts)
    return graphs | {
        "prefill_max_abs": prefill_diff,
        "decode_max_abs": decode_diff,
        "reference_logits_max_abs": max(r.abs().max().item() for r in refs),
        "greedy_identical": identical,
        "greedy_prompts": len(prompts),
        "greedy_tokens_agreeing": sum(agreeing),  # before each prompt's first difference
        "greedy_tokens": steps * len(prompts),
        "first_difference": [None if n == steps else n for n in agreeing],
        "atol": ATOL,
        "passed": passed if judged else None,  # bfloat16: reported, not judged
    }


def _runner_with_graphs(config) -> tuple[Any, str | None]:
    """A runner, with its decode graphs where the device has them (on CPU, the dry run,
    their steps uncaptured); if capturing them fails, one without them and without the
    Triton kernel they replay (and the error, so that the other figures are still
    measured)."""
    import dataclasses

    from radixserve.model.runner import ModelRunner

    try:
        runner = ModelRunner(config, progress=False)
        if runner.device.type == "cpu" and runner.attention.decode_kernel is not None:
            # the dry run: the graphs' static-buffer steps, run uncaptured
            from radixserve.model.cuda_graph import DecodeGraphs

            runner.decode_graphs = DecodeGraphs(runner.model, runner.attention, 8, capture=False)
        return runner, None
    except Exception:  # noqa: BLE001 - reported in the JSON; the eager runner still measures
        error = traceback.format_exc()
        _free(torch.device(config.model.device))
    model = dataclasses.replace(config.model, disable_cuda_graph=True)
    runner = ModelRunner(dataclasses.replace(config, model=model), progress=False)
    runner.attention.decode_kernel = None  # the Triton kernel may be what failed: SDPA
    return runner, error


def _graph_sizes(runner) -> list[int] | None:
    graphs = runner.decode_graphs
    return None if graphs is None else list(graphs.sizes)


@contextlib.contextmanager
def _eager(runner) -> Iterator[None]:
    """`with _eager(runner):` its decode steps run eagerly (its graphs set aside)."""
    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        yield
    finally:
        runner.decode_graphs = graphs


class EagerWorkload:
    """A RunnerWorkload timed with its runner's decode graphs set aside."""

    def __init__(self, workload) -> None:
        self.workload = workload

    def prefill_seconds(self, prompt: list[int]) -> float:
        with _eager(self.workload.runner):
            return self.workload.prefill_seconds(prompt)

    def decode_seconds(self, prompts: list[list[int]], steps: int) -> float:
        with _eager(self.workload.runner):
            return self.workload.decode_seconds(prompts, steps)


def recompute_greedy(reference, ids: list[int], steps: int) -> list[int]:
    """Argmax decoding by transformers, each step one full forward pass over all tokens so
    far (no cache: tests.reference.reference_greedy passes `cache=`, a keyword newer than the
    GPU image's transformers). eos is just another token, as with ignore_eos."""
    from tests.reference import reference_logits

    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(reference_logits(reference, ids + tokens)[-1].argmax()))
    return tokens


def teacher_forced_diffs(
    runner, prompts: list[list[int]], continuations: list[list[int]], refs: list[torch.Tensor]
) -> tuple[float, float]:
    """Max-abs logit differences of one prefill batch (every position) and of each decode
    step fed the reference's tokens, as tests/test_fidelity.py checks them on CPU."""
    from radixserve.core.req import Req
    from radixserve.scheduler.batch_builder import BatchBuilder
    from tests.test_fidelity import greedy

    builder = BatchBuilder(runner.allocator, runner.req_to_token, runner.device)
    reqs = [Req(f"tf{i}", p, greedy()) for i, p in enumerate(prompts)]
    prefill = decode = 0.0
    try:
        batch = builder.extend(reqs, prompts, all_logits=[True] * len(reqs))
        logits = runner.forward(batch).logits
        offset = 0
        for p, ref in zip(prompts, refs):
            prefill = max(prefill, _max_abs(logits[offset : offset + len(p)], ref[: len(p)]))
            offset += len(p)
        for step in range(len(continuations[0])):
            for req, c in zip(reqs, continuations):
                req.output_ids.append(c[step])
            logits = runner.forward(builder.decode(reqs)).logits
            for i, (p, ref) in enumerate(zip(prompts, refs)):
                decode = max(decode, _max_abs(logits[i], ref[len(p) + step]))
    finally:
        for req in reqs:
            builder.release(req)
    return prefill, decode


def _max_abs(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours.float() - ref.float()).abs().max().item()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- decode attention's drift in bf16 ----------------------------------------------------


def attention_drift(
    device: torch.device, sizes: Sizes, work: Path, deadline: float
) -> dict[str, Any]:
    """bf16 decode logits (float32 on CPU) with each decode attention the runner can take,
    teacher-forced, against transformers on the same weights in float32 and in the
    runner's dtype: which one drifts from the exact result, and how far."""
    from transformers import AutoModelForCausalLM

    from radixserve.config import Config
    from radixserve.model.runner import ModelRunner
    from tests.conftest import build_tiny_model
    from tests.reference import reference_logits
    from tests.test_fidelity import TEXTS, encode

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    folder = build_tiny_model(work / "llama-drift", "llama")
    config = Config.from_flat(
        model_path=str(folder), device=str(device), dtype=dtype, max_total_tokens=8192,
        disable_cuda_graph=True,
    )  # fmt: skip
    runner = ModelRunner(config, progress=False)
    prompts = [encode(runner, t) for t in TEXTS]
    refs: dict[str, list[torch.Tensor]] = {}
    continuations: list[list[int]] = []
    with torch.device(runner.device):
        for ref_dtype in ("float32", dtype):
            reference = AutoModelForCausalLM.from_pretrained(
                folder, dtype=getattr(torch, ref_dtype)
            )
            reference = reference.to(runner.device).eval()
            if not continuations:  # the exact model's greedy tokens feed every run
                continuations = [
                    recompute_greedy(reference, p, TEACHER_FORCED_STEPS) for p in prompts
                ]
            refs[ref_dtype] = [
                reference_logits(reference, p + c) for p, c in zip(prompts, continuations)
            ]
            del reference
    kernels = {"torch SDPA (gathered K/V)": None}
    if runner.attention.decode_kernel is not None:
        kernel = runner.attention.decode_kernel
        kernels = {type(kernel).__name__: kernel} | kernels
    rows = {}
    for name, kernel in kernels.items():
        runner.attention.decode_kernel = kernel
        rows[name] = {
            f"decode_max_abs_vs_{ref_dtype}": teacher_forced_diffs(
                runner, prompts, continuations, ref
            )[1]
            for ref_dtype, ref in refs.items()
        }
    return {"dtype": dtype, "references": list(refs), "kernels": rows}


# -- throughput --------------------------------------------------------------------------


def throughput(device: torch.device, sizes: Sizes, work: Path, deadline: float) -> dict[str, Any]:
    from radixserve.bench.one_batch import Figure, RunnerWorkload, TransformersWorkload
    from radixserve.config import Config

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    folder = build_smollm2_shaped(work / "smollm2-shape", sizes.layers, getattr(torch, dtype))
    config = Config.from_flat(
        model_path=str(folder), device=str(device), dtype=dtype, max_total_tokens=sizes.kv_tokens
    )
    before = _allocated(device)
    start = time.perf_counter()
    runner, graph_error = _runner_with_graphs(config)
    runner_start_s = time.perf_counter() - start
    runner_resident = _allocated(device) - before
    before = _allocated(device)
    workloads: dict[str, Any] = {"radixserve": RunnerWorkload(runner)}
    if runner.decode_graphs is not None:
        workloads[EAGER] = EagerWorkload(workloads["radixserve"])
    workloads["transformers"] = TransformersWorkload(
        runner.model_folder, runner.dtype, runner.device
    )
    transformers_resident = _allocated(device) - before
    peaks = {name: 0 for name in workloads}
    gen = torch.Generator().manual_seed(0)

    def prompts(batch: int, length: int) -> list[list[int]]:
        return torch.randint(100, runner.vocab_size, (batch, length), generator=gen).tolist()

    def figure(name: str, measure: Callable[[Any], float]) -> dict[str, Any]:
        samples = _alternate(workloads, measure, sizes.repeats, device, peaks)
        ours, theirs = (statistics.median(samples[w]) for w in ("radixserve", "transformers"))
        fig = Figure(name, ours, theirs)
        eager = statistics.median(samples[EAGER]) if EAGER in samples else None
        return asdict(fig) | {"ratio": fig.ratio, "eager": eager, "samples": samples}

    def decode_rate(workload: Any, batch_prompts: list[list[int]]) -> float:
        steps = sizes.output_len
        return len(batch_prompts) * steps / workload.decode_seconds(batch_prompts, steps)

    figures = []
    [prefill] = prompts(1, sizes.prefill_len)
    print(f"   prefill {sizes.prefill_len}", flush=True)
    figures.append(
        guarded(
            figure,
            f"prefill {sizes.prefill_len} tokens (tok/s)",
            lambda w: sizes.prefill_len / w.prefill_seconds(prefill),
        )
    )
    for batch in sizes.batch_sizes:
        name = f"decode batch {batch} (tok/s)"
        if time.monotonic() > deadline:
            figures.append({"name": name, "skipped": "past the time budget"})
            continue
        print(f"   decode batch {batch}", flush=True)
        batch_prompts = prompts(batch, sizes.context_len)
        figures.append(guarded(figure, name, lambda w, p=batch_prompts: decode_rate(w, p)))
    return {
        "model": f"random weights, SmolLM2-135M shape ({sizes.layers} layers)",
        "dtype": dtype,
        "kv_pool_tokens": runner.max_total_tokens,
        "decode_graphs": _graph_sizes(runner),
        "graph_error": graph_error,
        "graph_capture_s": None
        if runner.decode_graphs is None
        else runner.decode_graphs.capture_seconds,
        "runner_start_s": runner_start_s,
        "decode_context_len": sizes.context_len,
        "decode_steps_timed": sizes.output_len,
        "repeats": sizes.repeats,
        "figures": figures,
        "memory_gib": _memory_gib(device, runner_resident, transformers_resident, peaks),
    }


def build_smollm2_shaped(folder: Path, layers: int, dtype: torch.dtype) -> Path:
    """A model folder of SmolLM2-135M's shape with seeded random weights in `dtype` and the
    tests' tokenizer (the prompts are random token ids; the tokenizer is only loaded)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.conftest import TINY_TOKENIZER

    config = LlamaConfig(**(SMOLLM2_SHAPE | {"num_hidden_layers": layers}))
    config.rope_parameters = {"rope_type": "default", "rope_theta": SMOLLM2_ROPE_THETA}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    for file in TINY_TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def _alternate(
    workloads: dict[str, Any],
    measure: Callable[[Any], float],
    repeats: int,
    device: torch.device,
    peaks: dict[str, int],
) -> dict[str, list[float]]:
    """`repeats` samples of each workload after one warm-up each, alternating so that drifts
    of the machine's speed hit all alike; peaks[name] keeps the most memory allocated during
    any of that workload's calls (resident tensors of both models included)."""
    samples: dict[str, list[float]] = {name: [] for name in workloads}
    for round_ in range(repeats + 1):
        for name, workload in workloads.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            value = measure(workload)
            if device.type == "cuda":
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
            if round_ > 0:
                samples[name].append(value)
    return samples


def _memory_gib(
    device: torch.device, runner_resident: int, transformers_resident: int, peaks: dict[str, int]
) -> dict[str, float] | None:
    if device.type != "cuda":
        return None
    gib = 2**30
    return {
        "radixserve_resident": round(runner_resident / gib, 3),  # weights + KV pool
        "transformers_resident": round(transformers_resident / gib, 3),  # weights
        "peak_during_radixserve": round(peaks["radixserve"] / gib, 3),
        "peak_during_transformers": round(peaks["transformers"] / gib, 3),
    }


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- hicache -----------------------------------------------------------------------------

HICACHE_CASES = (  # (device pool dtype, host storage dtype)
    ("float32", "float32"),
    ("float32", "int8"),
    ("bfloat16", "bfloat16"),
    ("bfloat16", "int8"),
)


def hicache(device: torch.device, sizes: Sizes, work: Path, deadline: float) -> dict[str, Any]:
    """The host tier's transfers (radixserve.cache.host_pool) between a device KV pool and a
    host pool, pinned on CUDA: round trips, the per-layer waits of `load_async`, bandwidth."""
    cases: dict[str, Any] = {}
    for device_dtype, host_dtype in HICACHE_CASES:
        key = f"{device_dtype} pool / {host_dtype} host"
        if time.monotonic() > deadline:
            cases[key] = {"skipped": "past the time budget"}
            continue
        print(f"   {key}", flush=True)
        cases[key] = guarded(hicache_case, device, device_dtype, host_dtype, sizes)
        _free(device)
    return {
        "shape": "SmolLM2-135M's KV: "
        f"{SMOLLM2_SHAPE['num_hidden_layers']} layers, {SMOLLM2_SHAPE['num_key_value_heads']} "
        f"KV heads, head dim {SMOLLM2_SHAPE['head_dim']}",
        "tokens_per_transfer": sizes.hicache_tokens,
        "repeats": sizes.repeats,
        "cases": cases,
    }


def hicache_case(
    device: torch.device, device_dtype: str, host_dtype: str, sizes: Sizes
) -> dict[str, Any]:
    """Random rows of a device pool backed up to host slots laid out two ways (one
    contiguous run, read in place when pinned; scattered, gathered into pinned staging),
    cleared, then loaded into other device slots three ways: `load`; `load_async` then
    `wait()`; `load_async` then `wait_layer(i)` before comparing layer i on the current
    stream, for each layer in order. `load` must give back the original rows bit for bit
    (within the int8 bound for int8 storage); both async paths, exactly what `load` gave."""
    from radixserve.cache.host_pool import HostKVPool
    from radixserve.cache.kv_pool import KVPool

    n = sizes.hicache_tokens
    layers, heads, head_dim = (
        SMOLLM2_SHAPE[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")
    )
    dtype = getattr(torch, device_dtype)
    pool = KVPool(2 * n, layers, heads, head_dim, dtype, device, prefault=False)
    host = HostKVPool(
        2 * n, layers, heads, head_dim, host_dtype, dtype, pin_memory=device.type == "cuda"
    )
    gen = torch.Generator(device=device).manual_seed(0)
    perm = torch.randperm(2 * n, generator=gen, device=device) + 1
    source, target = perm[:n], perm[n:]  # device slots, interleaved at random
    layouts = {  # host slots: the first n as one run; the last n in random order
        "contiguous": torch.arange(1, n + 1),
        "scattered": torch.randperm(n, generator=torch.Generator().manual_seed(1)) + n + 1,
    }
    for buf in (*pool.k, *pool.v):
        buf[source] = torch.randn(n, heads, head_dim, generator=gen, device=device, dtype=dtype)
    original = _pool_rows(pool, source).clone()  # (2, layers, n, heads, head_dim)
    for host_slots in layouts.values():
        host.backup(pool, source, host_slots)
    for buf in (*pool.k, *pool.v):
        buf[source] = 0

    moved = n * host.bytes_per_token(layers, heads, head_dim, host_dtype)  # host bytes
    results: dict[str, Any] = {}
    for layout, host_slots in layouts.items():
        results[layout] = _hicache_round_trips(host, pool, host_slots, target, original)
        load_s = _median_seconds(
            lambda s=host_slots: host.load(s, pool, target), device, sizes.repeats
        )
        backup_s = _median_seconds(  # the loaded rows, back to the same host slots
            lambda s=host_slots: host.backup(pool, target, s), device, sizes.repeats
        )
        results[layout] |= {
            "load_gb_s": moved / load_s / 1e9,
            "backup_gb_s": moved / backup_s / 1e9,
        }
    passed = all(
        r["load_matches"] and r["async_matches_load"] and not r["wait_layer_mismatched_layers"]
        for r in results.values()
    )
    return {
        "device_dtype": device_dtype,
        "host_dtype": host_dtype,
        "load_bar": "int8 bound" if host.quantized else "bit-exact",
        "pinned": host.pinned,
        "host_bytes_per_transfer": moved,
        "layouts": results,
        "passed": passed,
    }


def _hicache_round_trips(
    host, pool, host_slots: torch.Tensor, target: torch.Tensor, original: torch.Tensor
) -> dict[str, Any]:
    """Host rows `host_slots` (a backup of `original`) into device rows `target`, each time
    after filling them with NaN, so that a copy not done (or not yet done) shows."""

    def poison() -> None:
        for buf in (*pool.k, *pool.v):
            buf.index_fill_(0, target, float("nan"))

    poison()
    host.load(host_slots, pool, target)
    loaded = _pool_rows(pool, target).clone()
    error = (loaded.float() - original.float()).abs()
    error_over_bound = None
    if host.quantized:
        error_over_bound = (error / _int8_bound(original)).max().item()
        matches = error_over_bound <= 1  # False for NaN too
    else:
        matches = torch.equal(_bits(loaded), _bits(original))

    poison()
    host.load_async(host_slots, pool, target).wait()
    async_matches = torch.equal(_bits(_pool_rows(pool, target)), _bits(loaded))

    poison()
    handle = host.load_async(host_slots, pool, target)
    # Every comparison is queued on the current stream, right after its layer's wait, and
    # read only at the end: the host does not wait, so later layers are still in flight.
    mismatched = torch.zeros(len(pool.k), dtype=torch.int64, device=target.device)
    for layer, (k, v) in enumerate(zip(pool.k, pool.v)):
        handle.wait_layer(layer)
        for kv, buf in enumerate((k, v)):
            rows = buf.index_select(0, target)
            mismatched[layer] += (_bits(rows) != _bits(loaded[kv, layer])).sum()
    return {
        "load_matches": matches,
        "load_max_abs_error": error.max().item(),
        "load_error_over_int8_bound": error_over_bound,
        "async_matches_load": async_matches,
        "wait_layer_mismatched_layers": [i for i, m in enumerate(mismatched.tolist()) if m],
        "load_async_events": len(handle.events),  # one per layer on CUDA, none on CPU
    }


def _int8_bound(original: torch.Tensor) -> torch.Tensor:
    """The int8 storage error bound per element: half a scale (amax / 254, amax over
    head_dim of each token and head), plus rounding of the dequantized value to the pool's
    dtype (half an ulp of at most amax) and float32 slack, as tests/test_host_pool.py."""
    amax = original.float().abs().amax(dim=-1, keepdim=True)
    rounding = 0.0 if original.dtype == torch.float32 else torch.finfo(original.dtype).eps / 2
    return amax * (1 / 254 + rounding) * (1 + 1e-5) + 1e-12


def _pool_rows(pool, slots: torch.Tensor) -> torch.Tensor:
    """(2, layers, T, heads, head_dim): K then V of `slots` for every layer."""
    return torch.stack([torch.stack([buf[slots] for buf in bufs]) for bufs in (pool.k, pool.v)])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that equality is bit-exactness (NaN and -0.0 included)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median wall time of `repeats` calls after one warm-up, the device idle around each."""
    fn()
    samples = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tensor_parallel(
    device: torch.device, sizes: Sizes, work: Path, deadline: float
) -> dict[str, Any]:
    """--tp-size 2 on the tiny Llama (4 heads, 2 KV heads): the fidelity case's logits and
    greedy tokens with rank 0 here and rank 1 in a process of its own (NCCL on CUDA, one GPU
    per rank; shared memory / gloo on CPU)."""
    import multiprocessing

    from radixserve.config import Config, free_loopback_addr
    from radixserve.model.runner import ModelRunner
    from tests.conftest import build_tiny_model

    if device.type == "cuda" and torch.cuda.device_count() < 2:
        gpus = torch.cuda.device_count()
        return {"skipped": f"tensor parallelism takes one GPU per rank; this machine has {gpus}"}
    folder = build_tiny_model(work / "tp-llama", "llama")
    config = Config.from_flat(
        model_path=str(folder), device=device.type, dtype="float32", max_total_tokens=8192,
        tp_size=2, dist_init_addr=free_loopback_addr(),
    )  # fmt: skip
    follower = multiprocessing.get_context("spawn").Process(
        target=_tp_follower, args=(str(REPO), config), daemon=True
    )
    follower.start()
    start = time.perf_counter()
    runner = ModelRunner(config, progress=False)
    try:
        case = fidelity_case(folder, device, "float32", sizes.greedy_steps, runner)
        case["comm"] = runner.tp.comm  # before close: it leaves the group
    finally:
        runner.close()
        follower.join(30)
        if follower.is_alive():
            follower.kill()
    return {**case, "seconds": round(time.perf_counter() - start, 1),
            "weight_bytes_per_rank": runner.weight_bytes}  # fmt: skip


def _tp_follower(repo: str, config) -> None:
    """Tensor-parallel rank 1 of the check (a spawned process: the stand-ins again)."""
    if repo not in sys.path:
        sys.path.insert(0, repo)
    provide_missing_modules()
    from radixserve.model.runner import run_follower

    run_follower(config, 1)


PARTS: dict[str, Callable[..., dict[str, Any]]] = {
    "fidelity": fidelity,
    "tensor_parallel": tensor_parallel,
    "hicache": hicache,
    "attention_drift": attention_drift,
    "throughput": throughput,
}


# -- report ------------------------------------------------------------------------------


def write_report(report: dict[str, Any], out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    where = env["gpu"] or f"CPU ({env.get('cpu_threads')} threads)"
    if env["gpu"]:
        where += f" ({env['gpu_memory_gib']} GiB, {env['multiprocessors']} SMs)"
    lines = [
        f"# GPU check — {env['date']}",
        "",
        f"- device: {where}",
        f"- torch {env['torch']} (CUDA {env['torch_cuda']}), transformers "
        f"{env['transformers']}, Python {env['python']}",
        f"- command: `{env['command']}`; commit: {env['git_commit'] or 'not recorded'}",
        f"- CUDA graphs: {env['cuda_graphs']}; stand-ins: {report['stand_ins'] or 'none'}",
        f"- elapsed: {report.get('elapsed_s', '?')} s",
    ]
    parts = report["parts"]
    if "fidelity" in parts:
        lines += ["", "## Fidelity against transformers (same weights, same device)", ""]
        lines += _fidelity_table(parts["fidelity"])
    if "hicache" in parts:
        lines += ["", "## Host tier of the KV cache (HostKVPool)", ""]
        lines += _hicache_table(parts["hicache"])
    if "attention_drift" in parts:
        lines += ["", "## Decode attention's drift", ""]
        lines += _drift_table(parts["attention_drift"])
    if "throughput" in parts:
        lines += ["", "## Throughput against transformers", ""]
        lines += _throughput_table(parts["throughput"])
    lines += _problems(parts)
    return "\n".join(lines) + "\n"


def _fidelity_table(part: dict[str, Any]) -> list[str]:
    if "cases" not in part:
        return [_not_measured(part)]
    lines = [
        "Max-abs logit differences (prefill: every position of 8 prompts; decode: "
        f"{TEACHER_FORCED_STEPS} teacher-forced steps) next to the reference's largest |logit|; "
        "greedy: the 8 prompts in one batch, tokens agreeing before each first difference.",
        "",
        "Decode steps replayed from CUDA graphs where 'graphs' says so; 'eager decode' is the "
        "same runner's teacher-forced steps without them, 'graph = eager' its greedy outputs "
        "both ways (judged with the rest in float32).",
        "",
        "| model | prefill max-abs | decode max-abs | logit scale | greedy identical "
        "| greedy tokens agreeing | graphs | eager decode max-abs | graph = eager | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, case in part["cases"].items():
        if "prefill_max_abs" not in case:
            lines.append(f"| {key} | {_not_measured(case)} |||||||||")
            continue
        verdict = {True: "pass", False: "FAIL", None: "reported"}[case["passed"]]
        sizes = case.get("decode_graphs")
        graphs = f"{len(sizes)} sizes" if sizes else ("FAILED" if case.get("graph_error") else "no")
        eager = case.get("eager_decode_max_abs")
        eager = "-" if eager is None else f"{eager:.2e}"
        same = case.get("graph_eager_greedy_identical")
        same = "-" if same is None else f"{same}/{case['greedy_prompts']}"
        lines.append(
            f"| {key} | {case['prefill_max_abs']:.2e} | {case['decode_max_abs']:.2e} "
            f"| {case['reference_logits_max_abs']:.2f} "
            f"| {case['greedy_identical']}/{case['greedy_prompts']} "
            f"| {case['greedy_tokens_agreeing']}/{case['greedy_tokens']} | {graphs} "
            f"| {eager} | {same} "
            f"| {verdict} (bar {case['atol']:g}) |"
        )
    return lines


def _throughput_table(part: dict[str, Any]) -> list[str]:
    if "figures" not in part:
        return [_not_measured(part)]
    graphs = part.get("decode_graphs")
    lines = [
        f"{part['model']}, {part['dtype']}; decode after a {part['decode_context_len']}-token "
        f"prompt, {part['decode_steps_timed']} steps timed; median of {part['repeats']}. "
        + (
            f"radixserve replays decode steps from CUDA graphs ({len(graphs)} batch sizes "
            f"captured in {part['graph_capture_s']:.1f} s; runner start "
            f"{part['runner_start_s']:.1f} s); 'eager' is the same runner without them."
            if graphs
            else "No CUDA graphs: every step eager."
            + (
                " Capturing them failed (graph_error in the JSON)."
                if part.get("graph_error")
                else ""
            )
        ),
        "",
        "| figure | radixserve | eager | transformers | vs transformers | graphs vs eager |",
        "|---|---|---|---|---|---|",
    ]
    for fig in part["figures"]:
        if "radixserve" not in fig:
            lines.append(f"| {fig.get('name', '?')} | {_not_measured(fig)} |||||")
            continue
        eager = fig.get("eager")
        eager_rate, speedup = (
            (f"{eager:.1f}", f"{fig['radixserve'] / eager:.2f}x") if eager else ("-", "-")
        )
        lines.append(
            f"| {fig['name']} | {fig['radixserve']:.1f} | {eager_rate} | {fig['baseline']:.1f} "
            f"| {fig['ratio']:.2f}x | {speedup} |"
        )
    memory = part["memory_gib"]
    if memory:
        lines.append(
            f"| peak GPU memory allocated (GiB) | {memory['peak_during_radixserve']:.2f} "
            f"| - | {memory['peak_during_transformers']:.2f} | | |"
        )
        lines += [
            "",
            f"Resident: radixserve {memory['radixserve_resident']:.2f} GiB (weights + KV pool of "
            f"{part['kv_pool_tokens']} tokens), transformers {memory['transformers_resident']:.2f}"
            " GiB (weights); both models stay loaded, so each peak includes both.",
        ]
    return lines


def _drift_table(part: dict[str, Any]) -> list[str]:
    if "kernels" not in part:
        return [_not_measured(part)]
    refs = part["references"]
    lines = [
        f"The tiny Llama in {part['dtype']}, {TEACHER_FORCED_STEPS} teacher-forced decode steps "
        "of 8 prompts, each decode attention against transformers on the same weights: "
        "max-abs logit difference.",
        "",
        "| decode attention | " + " | ".join(f"vs transformers {r}" for r in refs) + " |",
        "|---|" + "---|" * len(refs),
    ]
    for name, row in part["kernels"].items():
        cells = " | ".join(f"{row[f'decode_max_abs_vs_{r}']:.2e}" for r in refs)
        lines.append(f"| {name} | {cells} |")
    return lines


def _hicache_table(part: dict[str, Any]) -> list[str]:
    if "cases" not in part:
        return [_not_measured(part)]
    lines = [
        f"{part['shape']}; {part['tokens_per_transfer']} tokens per transfer between random "
        "device slots and host slots in one run (contiguous) or scattered. Each load is checked "
        "against the original rows (bit-exact; int8: within amax/254), `load_async` + `wait()` "
        "and `load_async` + `wait_layer(i)` before reading layer i against `load` (bit-exact). "
        f"GB/s of host bytes, median of {part['repeats']}.",
        "",
        "| pool / host | host slots | pinned | load | load_async + wait | wait_layer(i) "
        "| load GB/s | backup GB/s | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, case in part["cases"].items():
        if "layouts" not in case:
            lines.append(f"| {key} | {_not_measured(case)} ||||||||")
            continue
        for layout, r in case["layouts"].items():
            if r["load_error_over_int8_bound"] is None:
                load = "exact" if r["load_matches"] else "DIFFERS"
            else:
                load = f"{r['load_error_over_int8_bound']:.3f} of the bound"
                load += "" if r["load_matches"] else " (OVER)"
            bad = r["wait_layer_mismatched_layers"]
            lines.append(
                f"| {key} | {layout} | {'yes' if case['pinned'] else 'no'} | {load} "
                f"| {'exact' if r['async_matches_load'] else 'DIFFERS'} "
                f"| {f'layers {bad} DIFFER' if bad else 'exact'} "
                f"| {r['load_gb_s']:.2f} | {r['backup_gb_s']:.2f} "
                f"| {'pass' if case['passed'] else 'FAIL'} |"
            )
    return lines


def _not_measured(node: dict[str, Any]) -> str:
    if "skipped" in node:
        return f"skipped: {node['skipped']}"
    if "error" in node:
        return f"error: {node['error'].strip().splitlines()[-1]}"
    return "not measured"


def _problems(parts: dict[str, Any]) -> list[str]:
    """The last line of every traceback, with where it happened (full ones: the JSON)."""
    found: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if "error" in node:
                found.append(f"- {path}: {node['error'].strip().splitlines()[-1]}")
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(parts, "parts")
    return ["", "## Errors (tracebacks in gpu_check.json)", "", *found] if found else []


if __name__ == "__main__":
    sys.exit(main())
