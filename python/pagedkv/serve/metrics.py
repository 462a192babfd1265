"""GET /metrics: the serving engine's state and latencies in Prometheus text
format (prometheus_client, one registry per server).

Gauges are read from the engine's published `EngineStats` when scraped;
histograms and counters are fed by the engine thread as tokens are chosen.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds: decode steps of a small model to a long queue behind a burst."""

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
"""Seconds of one engine call: a one-token decode to a long prompt's prefill."""


class ServeMetrics:
    """The server's Prometheus metrics; also the engine's observer.

    Examples
    --------
    >>> metrics = ServeMetrics()
    >>> metrics.first_token(0.2)
    >>> b"pagedkv_time_to_first_token_seconds_count 1.0" in metrics.render()
    True
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "pagedkv_time_to_first_token_seconds",
            "Arrival to first token of each request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagedkv_inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.steps = Histogram(
            "pagedkv_step_seconds",
            "Time of each engine call (a step's prefill, or its decode)",
            ["phase"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.sequences = Counter(
            "pagedkv_sequences_finished",
            "Sequences (samples) ended, by finish reason",
            ["reason"],
            registry=r,
        )
        self.http_rejections = Counter(
            "pagedkv_http_rejections",
            "Requests refused before reaching the engine, by HTTP status",
            ["status"],
            registry=r,
        )

    def bind(self, engine) -> None:
        """Adds the gauges and counters read from `engine.stats` when scraped."""
        self.registry.register(_EngineCollector(engine.stats))

    # The engine's observer interface (called from its thread).

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def step(self, phase: str, seconds: float) -> None:
        self.steps.labels(phase).observe(seconds)

    def finished(self, reason: str) -> None:
        self.sequences.labels(reason).inc()

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


GAUGES = {
    "pagedkv_requests_running": ("Requests holding KV pages", "running"),
    "pagedkv_requests_waiting": ("Requests waiting for admission", "waiting"),
    "pagedkv_requests_prefilling": (
        "Running requests still prefilling in chunks",
        "prefilling",
    ),
    "pagedkv_sequences_running": ("Samples decoding each step", "running_sequences"),
    "pagedkv_kv_pages_total": ("Pages in the KV pool", "pages_total"),
    "pagedkv_kv_pages_used": ("Pages owned by running requests", "pages_used"),
    "pagedkv_kv_pages_free": ("Pages holding nothing", "pages_free"),
    "pagedkv_kv_pages_cached": ("Unowned pages kept for prefix hits", "pages_cached"),
}
COUNTERS = {
    "pagedkv_generated_tokens": ("Tokens generated", "generated_tokens"),
    "pagedkv_prompt_tokens": ("Prompt tokens of admitted requests", "prompt_tokens"),
    "pagedkv_prompt_tokens_cached": (
        "Prompt tokens served from the prefix cache",
        "prompt_tokens_cached",
    ),
    "pagedkv_preemptions": ("Requests preempted for recompute", "preemptions"),
    "pagedkv_engine_steps": ("Scheduler steps", "steps"),
    "pagedkv_step_faults": ("Steps that raised (their requests failed)", "step_faults"),
}


class _EngineCollector:
    """Reads the engine's published stats at scrape time (the engine thread
    alone touches the page manager)."""

    def __init__(self, stats) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats
        for name, (doc, attr) in GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=getattr(s, attr))
        looked_up = s.prefix_hits + s.prefix_misses
        yield GaugeMetricFamily(
            "pagedkv_prefix_cache_hit_rate",
            "Full prompt pages served from the prefix cache over those looked up",
            value=s.prefix_hits / looked_up if looked_up else 0.0,
        )
        for name, (doc, attr) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(s, attr))
