"""Prometheus metrics of the main process (served at /metrics).

Latencies are observed where the client sees them (the main process); the scheduler's
gauges come from its periodic `SchedulerState`. The cache hit rate is
`rate(radixserve_cached_tokens_total) / rate(radixserve_prompt_tokens_total)`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from radixserve.core.output import SchedulerStats

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160,
)  # fmt: skip


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "radixserve_time_to_first_token_seconds",
            "Time from request arrival to its first output token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "radixserve_inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "radixserve_e2e_request_latency_seconds",
            "Time from request arrival to its last output.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "radixserve_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generated_tokens = Counter(
            "radixserve_generation_tokens", "Generated tokens.", registry=r
        )
        self.cached_tokens = Counter(
            "radixserve_cached_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.requests = Counter(
            "radixserve_requests", "Finished requests by finish reason.", ["reason"], registry=r
        )
        self.running = Gauge("radixserve_num_running_reqs", "Requests decoding.", registry=r)
        self.waiting = Gauge("radixserve_num_waiting_reqs", "Requests queued.", registry=r)
        self.kv_usage = Gauge(
            "radixserve_kv_usage", "Share of the KV pool in use (0..1).", registry=r
        )

    def set_scheduler_state(self, state: SchedulerStats) -> None:
        self.running.set(state.num_running)
        self.waiting.set(state.num_waiting)
        total = state.kv_total
        self.kv_usage.set((total - state.kv_free) / total if total else 0.0)
