"""ServerMetrics: the Prometheus counters and histograms behind GET /metrics (prometheus_client).

Each app gets its own CollectorRegistry, so several servers (tests) never share counts. Request
and token counts, time to first token and per-token latency are recorded as requests finish;
engine gauges (KV pages, prefix-cache hit rate, running/waiting requests) are read from
engine.stats() at scrape time. It never decides anything about a request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from northcode.engine.request import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
_ENGINE_GAUGES = {  # engine.stats() key -> (metric name, help)
    "pages_used": ("northcode_kv_pages_used", "KV cache pages in use"),
    "pages_total": ("northcode_kv_pages_total", "KV cache pages in the pool"),
    "prefix_cache_hit_rate": ("northcode_prefix_cache_hit_rate",
                              "prompt tokens served from the prefix cache / prompt tokens, since start"),
    "requests_running": ("northcode_requests_running", "requests in the running batch"),
    "requests_waiting": ("northcode_requests_waiting", "requests admitted by the engine, waiting for a batch slot"),
}


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("northcode_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("northcode_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("northcode_cached_prompt_tokens", "prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("northcode_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("northcode_time_to_first_token_seconds", "request arrival to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.token_latency = Histogram("northcode_time_per_output_token_seconds", "gap between consecutive output tokens",
                                       buckets=_TOKEN_BUCKETS, registry=r)
        self.engine = {key: Gauge(name, help_, registry=r) for key, (name, help_) in _ENGINE_GAUGES.items()}
        self.queued = Gauge("northcode_requests_in_server", "requests the server holds (running or queued)", registry=r)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def record_finished(self, final: RequestOutput) -> None:
        usage = final.usage
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        if final.timings is not None:
            if final.timings.time_to_first_token_s is not None:
                self.ttft.observe(final.timings.time_to_first_token_s)
            for gap in final.timings.token_latencies_s:
                self.token_latency.observe(gap)

    def render(self, engine_stats: dict | None) -> bytes:
        for key, gauge in self.engine.items():
            value = (engine_stats or {}).get(key)
            if isinstance(value, (int, float)):
                gauge.set(value)
        return generate_latest(self.registry)
