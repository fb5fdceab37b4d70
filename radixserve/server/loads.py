"""GET /v1/loads: each data-parallel replica's load as SGLang's route reports it (its model
gateway's load-aware routing polls it; monitoring and capacity planning read it), from the
scheduler states the replicas publish.

    {"timestamp", "version", "dp_rank_count",
     "loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs",
                "num_used_tokens", "num_total_tokens", "max_total_num_tokens",
                "token_usage", "gen_throughput", "cache_hit_rate", "utilization",
                "max_running_requests", ["speculative": {...}], ["lora": {...}],
                ["queues": {...}]}, ...],
     "aggregate": {"total_running_reqs", ...}}

`?dp_rank=N` keeps one replica, `?include=core,spec,lora,queues` (or `all`, the default)
picks the optional sections, `?format=prometheus` gives the same figures as Prometheus text
(`sglang_<field>{dp_rank="N"}`, SGLang's names). SGLang's `memory` and `disagg` sections
are accepted and left out: this engine has no figures for them (no prefill/decode
disaggregation; its memory is in /get_server_info).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from radixserve.server.errors import bad_request

SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"  # the format SGLang's answer has
# a replica counts as fully used at this share of its KV tokens (SGLang's utilization)
FULL_TOKEN_USAGE = 0.9
# (field, Prometheus help) of a load's figures, in the order reported
CORE = (
    ("num_running_reqs", "Number of running requests"),
    ("num_waiting_reqs", "Number of waiting requests"),
    ("num_used_tokens", "Number of tokens in use"),
    ("num_total_tokens", "Used tokens plus pending prefill tokens"),
    ("max_total_num_tokens", "Maximum token capacity"),
    ("token_usage", "Token pool usage ratio"),
    ("gen_throughput", "Generation throughput (tokens/s)"),
    ("cache_hit_rate", "Prefix cache hit rate"),
    ("utilization", "Overall utilization"),
    ("max_running_requests", "Maximum running requests"),
)
SECTION_HELP = {
    "speculative": (
        "spec",
        (("accept_length", "Mean tokens committed per verify step"),
         ("accept_rate", "Share of drafted tokens accepted")),
    ),
    "lora": (
        "lora",
        (("slots_used", "LoRA adapters the running requests use"),
         ("slots_total", "Most adapters the running requests may use (--max-loras-per-batch)"),
         ("utilization", "slots_used / slots_total")),
    ),
    "queues": (
        "queues",
        (("waiting", "Requests waiting to run"),
         ("grammar", "Requests waiting for their grammar to compile"),
         ("paused", "Requests waiting for a weight update"),
         ("retracted", "Waiting requests retracted from running")),
    ),
}  # fmt: skip


def parse_include(include: str | None) -> set[str]:
    """The sections `?include=` asks for (all by default); a 400 naming an unknown one."""
    names = {s.strip() for s in include.split(",") if s.strip()} if include else {"all"}
    unknown = sorted(names - set(SECTIONS))
    if unknown:
        raise bad_request(
            f"include: {', '.join(unknown)} is not a section; sections: {', '.join(SECTIONS)}",
            param="include",
        )
    return set(SECTIONS) if "all" in names else names


def kv_in_use(stats: dict[str, Any]) -> int:
    """KV tokens requests hold or the tree protects for them (the cache's evictable K/V
    are not in use): what /get_load and /v1/loads count."""
    return stats["kv_tree_protected"] + stats["kv_held_by_requests"]


def replica_load(
    stats: dict[str, Any], max_running: int, lora_slots: int | None, include: set[str]
) -> dict[str, Any]:
    """One replica's load from its published state (`SchedulerStats.as_dict`)."""
    used = kv_in_use(stats)
    usage = used / stats["kv_total"] if stats["kv_total"] else 0.0
    if stats["swa_total"]:  # hybrid window memory: the fuller of the two pools
        usage = max(usage, 1 - stats["swa_free"] / stats["swa_total"])
    running = stats["num_running"]
    waiting = stats["num_waiting"] + stats["num_grammar_queue"] + stats["num_held_for_update"]
    prompt = stats["prompt_tokens"]
    load: dict[str, Any] = {
        "dp_rank": stats["dp_rank"],
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": used,
        "num_total_tokens": used + stats["num_waiting_tokens"],
        "max_total_num_tokens": stats["kv_total"],
        "token_usage": round(usage, 4),
        "gen_throughput": round(stats["gen_throughput"], 2),
        "cache_hit_rate": round(stats["cached_tokens"] / prompt if prompt else 0.0, 4),
        "utilization": round(max(running / max_running, usage / FULL_TOKEN_USAGE), 4),
        "max_running_requests": max_running,
    }
    if "spec" in include and stats["spec_verify_steps"]:
        drafted = stats["spec_draft_tokens"]
        load["speculative"] = {
            "accept_length": round(stats["avg_spec_accept_length"], 4),
            "accept_rate": round(stats["spec_accepted_tokens"] / drafted if drafted else 0.0, 4),
        }
    if "lora" in include and lora_slots is not None:
        slots = stats["lora_adapters_running"]
        load["lora"] = {
            "slots_used": slots,
            "slots_total": lora_slots,
            "utilization": round(slots / lora_slots, 4),
        }
    if "queues" in include:
        load["queues"] = {
            "waiting": stats["num_waiting"],
            "grammar": stats["num_grammar_queue"],
            "paused": stats["num_held_for_update"],
            "retracted": stats["num_retracted_waiting"],
        }
    return load


def loads_json(loads: list[dict[str, Any]], version: str) -> dict[str, Any]:
    """The JSON answer: the loads and their sums and means over the replicas."""
    n = max(len(loads), 1)
    total = lambda key: sum(load[key] for load in loads)  # noqa: E731
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": version,
        "dp_rank_count": len(loads),
        "loads": loads,
        "aggregate": {
            "total_running_reqs": total("num_running_reqs"),
            "total_waiting_reqs": total("num_waiting_reqs"),
            "total_reqs": total("num_total_reqs"),
            "total_used_tokens": total("num_used_tokens"),
            "total_tokens": total("num_total_tokens"),
            "avg_token_usage": round(total("token_usage") / n, 4),
            "avg_throughput": round(total("gen_throughput") / n, 2),
            "avg_utilization": round(total("utilization") / n, 4),
        },
    }


def loads_prometheus(loads: list[dict[str, Any]]) -> str:
    """The figures as Prometheus text, a gauge per field, one sample per replica."""
    lines: list[str] = []

    def gauge(name: str, help_text: str, samples: list[tuple[int, Any]]) -> None:
        if not samples:
            return
        lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} gauge"))
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in samples)

    for field, help_text in CORE:
        gauge(f"sglang_{field}", help_text, [(load["dp_rank"], load[field]) for load in loads])
    for section, (prefix, fields) in SECTION_HELP.items():
        for field, help_text in fields:
            samples = [(ld["dp_rank"], ld[section][field]) for ld in loads if section in ld]
            gauge(f"sglang_{prefix}_{field}", help_text, samples)
    return "\n".join(lines) + "\n"
