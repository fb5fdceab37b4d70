"""The `radixserve` command line."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from radixserve.config import (
    CacheConfig,
    EmbeddingConfig,
    HiCacheConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    add_config_args,
    config_from_args,
)

RUNNER_PARTS = (ModelConfig, CacheConfig)
SERVER_PARTS = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    HiCacheConfig,
    SpeculativeConfig,
    EmbeddingConfig,
    ParallelConfig,
    ServerConfig,
    LoraConfig,
)


def main(argv: list[str] | None = None) -> int:
    log_help = "debug, info, warning, error (default: info for serve, warning otherwise)"
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    parser.add_argument("--log-level", default=None, help=log_help)
    # also after the command (`radixserve serve --log-level debug`, as SGLang's flag is given)
    logs = argparse.ArgumentParser(add_help=False)
    logs.add_argument("--log-level", default=argparse.SUPPRESS, help=log_help)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", parents=[logs], help="serve a model over HTTP (native + OpenAI API)"
    )
    add_config_args(serve, SERVER_PARTS)

    gen = commands.add_parser(
        "generate", parents=[logs], help="generate a completion for one prompt"
    )
    gen.add_argument("--prompt", required=True, help="the prompt (a user message for chat models)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    add_config_args(gen, RUNNER_PARTS)

    batch = commands.add_parser(
        "run-batch",
        parents=[logs],
        help="run a file of OpenAI batch requests offline (as vLLM's run_batch)",
    )
    batch.add_argument("-i", "--input-file", required=True, help="the requests, one per line")
    batch.add_argument("-o", "--output-file", required=True, help="where the results go")
    add_config_args(batch, SERVER_PARTS)

    kernels = commands.add_parser(
        "build-kernels",
        parents=[logs],
        help="compile the C++ kernels a server with these flags uses on this CPU (else its "
        "first start does)",
    )
    add_config_args(kernels, RUNNER_PARTS)

    argv = sys.argv[1:] if argv is None else argv
    bench = commands.add_parser(
        "bench", parents=[logs], help="benchmarks (radixserve bench --help lists them)"
    )
    # the benchmark modules import torch: only a bench command loads them, so that
    # `radixserve --help` and `radixserve serve --help` answer at once
    benches = _add_bench_parsers(bench) if "bench" in argv else {}
    args = parser.parse_args(argv)
    level = args.log_level or ("info" if args.command == "serve" else "warning")
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        return _serve(args, level)
    if args.command == "generate":
        return _generate(args)
    if args.command == "run-batch":
        return _run_batch(args, level)
    if args.command == "build-kernels":
        return _build_kernels(args)
    return _run_bench(benches[args.bench], args)


def _run_bench(bench: Any, args: argparse.Namespace) -> int:
    """A benchmark stopped (SIGTERM: `timeout`, a job runner) unwinds, so that the servers
    it started are stopped as on its own exit, not left running."""
    if threading.current_thread() is not threading.main_thread():
        return bench.run(args)
    previous = signal.signal(signal.SIGTERM, _unwind_on_sigterm)
    try:
        return bench.run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _unwind_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _add_bench_parsers(bench: argparse.ArgumentParser) -> dict[str, Any]:
    """`radixserve bench <name>`: one subcommand per benchmark module."""
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    from radixserve.bench import (
        batch,
        dp,
        hicache,
        http_shared_prefix,
        json_schema,
        offline,
        one_batch,
        perplexity,
        programs,
        server_vs_engine,
        serving,
        soak,
        speculative,
        step_breakdown,
        streaming,
        tp,
        vs_vllm,
    )

    benches = {
        "one-batch": one_batch,
        "offline": offline,
        "server-vs-engine": server_vs_engine,
        "http-shared-prefix": http_shared_prefix,
        "serving": serving,
        "vs-vllm": vs_vllm,
        "step-breakdown": step_breakdown,
        "json": json_schema,
        "perplexity": perplexity,
        "streaming": streaming,
        "soak": soak,
        "speculative": speculative,
        "programs": programs,
        "hicache": hicache,
        "dp": dp,
        "batch": batch,
        "tp": tp,
    }
    for name, module in benches.items():
        module.add_args(
            bench_kinds.add_parser(name, help=(module.__doc__ or "").replace("%", "%%"))
        )
    return benches


def _run_batch(args: argparse.Namespace, log_level: str) -> int:
    from radixserve.model.loader import ModelLoadError
    from radixserve.run_batch import run

    try:
        config = config_from_args(args, SERVER_PARTS)
        return run(config, args.input_file, args.output_file, log_level)
    except (ModelLoadError, ValueError, OSError) as e:
        print(f"radixserve run-batch: error: {e}", file=sys.stderr)
        return 2


def _build_kernels(args: argparse.Namespace) -> int:
    """Build the kernels of the plan a model runner with these flags chooses on this CPU,
    one compiler per core; 1 where one of them did not build."""
    from radixserve.hardware import KernelPlan, resolve_device_and_dtype, resolve_kv_dtype
    from radixserve.model.cpu_kernels import build_kernels, plan_kernels

    try:
        config = config_from_args(args, RUNNER_PARTS)
        device, dtype = resolve_device_and_dtype(config.model)
    except ValueError as e:
        print(f"radixserve build-kernels: error: {e}", file=sys.stderr)
        return 2
    kv_dtype = resolve_kv_dtype(config.cache, dtype)
    plan = KernelPlan.choose(config.model.kernels, device, dtype, kv_dtype)
    builds = plan_kernels(plan, dtype, config.model.quantization)
    folder = config.model.cache_dir / "kernels"
    paths = build_kernels(builds, folder)
    print(f"{len(builds)} kernels for {device}/{dtype} on this CPU, in {folder}:")
    for (name, isa), path in zip(builds, paths):
        print(f"  {name} ({isa}): {path.name if path else 'not built (see the warning above)'}")
    return 0 if all(paths) else 1


def _serve(args: argparse.Namespace, log_level: str) -> int:
    from radixserve.server.children import prestart

    try:
        config = config_from_args(args, SERVER_PARTS)
        # the scheduler starts on the model before this process imports the HTTP side
        prestarted = prestart(config, log_level) if config.parallel.node_rank == 0 else None
        try:
            from radixserve.server.launch import launch_server
        except BaseException:  # (Ctrl-C meanwhile): nothing is left behind
            if prestarted is not None:
                prestarted.undo()
            raise
        return launch_server(config, log_level, prestarted=prestarted)
    except (ValueError, OSError) as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    import dataclasses

    from radixserve.core.sampling_params import SamplingParams
    from radixserve.engine import Engine
    from radixserve.model.loader import ModelLoadError

    try:
        config = config_from_args(args, RUNNER_PARTS)
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            sampling_seed=args.seed,
        )
        flat = {
            k: v
            for part in (config.model, config.cache)
            for k, v in dataclasses.asdict(part).items()
        }
        with Engine(**flat) as engine:
            tok = engine.tokenizer
            prompt = args.prompt
            templated = not args.no_chat_template and bool(tok.chat_template)
            if templated:
                prompt = tok.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
            # the template writes the special tokens itself; raw text (a base model, e.g.
            # Gemma 3, which has no template) gets the tokenizer's own (its bos)
            ids = tok.encode(prompt, add_special_tokens=not templated)
            out = engine.generate(input_ids=ids, sampling_params=dataclasses.asdict(params))
    except (ModelLoadError, ValueError) as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2
    print(out["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
