"""Prometheus metrics of the main process (served at /metrics).

Latencies are observed where the client sees them (the main process); the scheduler's
gauges come from its periodic `SchedulerState`. The cache hit rate is
`rate(radixserve_cached_tokens_total) / rate(radixserve_prompt_tokens_total)`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

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
        self.grammar_queue = Gauge(
            "radixserve_num_grammar_queue_reqs",
            "Requests waiting for their grammar to compile.",
            registry=r,
        )
        self.gen_throughput = Gauge(
            "radixserve_gen_throughput",
            "Output tokens a second over the last ~10 s (summed over the replicas).",
            registry=r,
        )
        self.kv_usage = Gauge(
            "radixserve_kv_usage", "Share of the KV pool in use (0..1).", registry=r
        )
        self.speculative = SpeculativeCollector()
        r.register(self.speculative)
        self.tiers = TierCollector()
        r.register(self.tiers)
        self.replicas: dict[int, SchedulerStats] = {}  # dp rank → its latest state
        r.register(RequeueCollector(self.replicas))

    def set_scheduler_state(self, state: SchedulerStats) -> None:
        """A replica's latest state; the gauges sum the replicas' (data parallelism)."""
        self.replicas[state.dp_rank] = state
        self.speculative.state = state
        self.tiers.state = state
        states = self.replicas.values()
        self.running.set(sum(s.num_running for s in states))
        self.waiting.set(sum(s.num_waiting for s in states))
        self.grammar_queue.set(sum(s.num_grammar_queue for s in states))
        self.gen_throughput.set(sum(s.gen_throughput for s in states))
        total = sum(s.kv_total for s in states)
        used = sum(s.kv_total - s.kv_free for s in states)
        self.kv_usage.set(used / total if total else 0.0)


class RequeueCollector:
    """Running requests taken back to the queue, summed over the replicas: for memory
    (retractions) and for a more urgent request (preemptions: the flex tier, priorities)."""

    def __init__(self, replicas: dict[int, SchedulerStats]) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        states = list(self.replicas.values())
        for name, help_text in (
            ("retractions", "Running requests taken back to the queue to free KV memory."),
            ("preemptions", "Running requests taken back to the queue for a more urgent one."),
        ):
            value = sum(getattr(s, name) for s in states)
            yield CounterMetricFamily(f"radixserve_{name}", help_text, value=value)


class SpeculativeCollector:
    """Speculative decoding's counters, as the scheduler last reported them (nothing while
    speculation is off)."""

    def __init__(self) -> None:
        self.state: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.state
        if s is None or not s.spec_drafted_by_position:
            return
        for name, help_text, value in (
            (
                "spec_verify_steps",
                "Request-steps that verified drafted tokens.",
                s.spec_verify_steps,
            ),
            ("spec_draft_tokens", "Drafted tokens verified.", s.spec_draft_tokens),
            ("spec_accepted_tokens", "Drafted tokens accepted.", s.spec_accepted_tokens),
        ):
            yield CounterMetricFamily(f"radixserve_{name}", help_text, value=value)
        for name, values in (
            ("drafted", s.spec_drafted_by_position),
            ("accepted", s.spec_accepted_by_position),
        ):
            family = CounterMetricFamily(
                f"radixserve_spec_{name}_tokens_by_position",
                f"Drafted tokens {name} at each draft position (1 = the first).",
                labels=["position"],
            )
            for position, value in enumerate(values, 1):
                family.add_metric([str(position)], value)
            yield family
        yield GaugeMetricFamily(
            "radixserve_spec_accept_length",
            "Mean tokens committed per request-step that verified a draft.",
            value=s.avg_spec_accept_length,
        )


class TierCollector:
    """The hierarchical cache's figures, as the scheduler last reported them (nothing
    while it is off): cached prompt tokens by tier, tier use, and what moved between
    tiers (tokens, bytes, seconds)."""

    def __init__(self) -> None:
        self.state: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        h = self.state.hicache if self.state is not None else None
        if not h:
            return
        cached = CounterMetricFamily(
            "radixserve_cached_tokens_by_tier",
            "Prompt tokens served from the prefix cache, by the tier they were found in.",
            labels=["tier"],
        )
        for tier in ("device", "host", "disk"):
            cached.add_metric([tier], h.get(f"cached_tokens_{tier}", 0))
        yield cached
        s = self.state
        assert s is not None
        usage = GaugeMetricFamily(
            "radixserve_hicache_used_tokens", "Tokens held by each cache tier.", labels=["tier"]
        )
        usage.add_metric(["device"], s.kv_tree_evictable + s.kv_tree_protected)
        usage.add_metric(["host"], h["host_used"])
        if "disk_pages" in h:
            usage.add_metric(["disk"], h["disk_pages"] * h.get("disk_page_tokens", 0))
        yield usage
        yield GaugeMetricFamily(
            "radixserve_hicache_host_capacity_tokens",
            "Tokens the host tier holds at most.",
            value=h["host_total"],
        )
        if "disk_used_bytes" in h:
            yield GaugeMetricFamily(
                "radixserve_hicache_disk_used_bytes",
                "Bytes of the disk tier's page files.",
                value=h["disk_used_bytes"],
            )
        for move, help_text in (
            ("load_back", "from the host tier back to the device"),
            ("write_back", "from the device to the host tier"),
            ("disk_write", "from the device to the disk tier"),
            ("disk_read", "from the disk tier to the host tier"),
        ):
            for unit, key in _MOVE_KEYS[move]:
                if key in h:
                    yield CounterMetricFamily(
                        f"radixserve_hicache_{move}_{unit}",
                        f"KV {unit} moved {help_text}.",
                        value=h[key],
                    )


_MOVE_KEYS = {
    "load_back": (
        ("tokens", "load_back_tokens"),
        ("bytes", "load_back_bytes"),
        ("seconds", "load_back_seconds"),
    ),
    "write_back": (
        ("tokens", "write_back_tokens"),
        ("bytes", "write_back_bytes"),
        ("seconds", "write_back_seconds"),
    ),
    "disk_write": (
        ("pages", "disk_pages_written"),
        ("bytes", "disk_bytes_written"),
        ("seconds", "disk_write_seconds"),
    ),
    "disk_read": (
        ("pages", "disk_pages_read"),
        ("bytes", "disk_bytes_read"),
        ("seconds", "disk_read_seconds"),
    ),
}


class BatchCollector:
    """The Batch API's figures, read from its store when scraped: batches kept by status,
    requests of unfinished batches still to answer, and those in flight now."""

    def __init__(self, store: Any) -> None:
        self.store = store  # batches.BatchStore

    def collect(self) -> Iterator[Metric]:
        batches = list(self.store.batches.values())
        if not batches:
            return
        by_status = GaugeMetricFamily(
            "radixserve_batches", "Batches kept, by status.", labels=["status"]
        )
        for status, count in sorted(collections.Counter(b.status for b in batches).items()):
            by_status.add_metric([status], count)
        yield by_status
        yield GaugeMetricFamily(
            "radixserve_batch_requests_pending",
            "Requests of unfinished batches not answered yet.",
            value=sum(b.total - b.completed - b.failed for b in batches if not b.ended),
        )
        window = self.store.window
        yield GaugeMetricFamily(
            "radixserve_batch_sequences_in_flight",
            "Sequences of batch requests sent to the engine and not answered yet.",
            value=0 if window is None else window.size - window.free,
        )
