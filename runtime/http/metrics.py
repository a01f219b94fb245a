"""Prometheus metrics of the HTTP frontend (one registry per app, no global state).

Counters and latency histograms are updated as requests run; the engine's pool, session
and queue gauges are read from its stats at each scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from radixlm.runtime.protocol import StatsReply, Usage

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("radixlm_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("radixlm_prompt_tokens", "Prompt tokens (history included)",
                                     registry=r)
        self.cached_tokens = Counter("radixlm_cached_tokens",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.completion_tokens = Counter("radixlm_completion_tokens", "Generated tokens",
                                         registry=r)
        self.ttft = Histogram("radixlm_time_to_first_token_seconds",
                              "Time from request to first streamed token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("radixlm_inter_token_latency_seconds",
                             "Time between streamed tokens", registry=r, buckets=_LATENCY_BUCKETS)
        self.aborted = Counter("radixlm_http_streams_aborted",
                               "Streams whose client left before the end (aborted in the engine)",
                               registry=r)
        self.hit_rate = Gauge("radixlm_cache_hit_rate",
                              "Engine prefix-cache hit rate (cached / prompt tokens)", registry=r)
        self.pool = Gauge("radixlm_kv_pool_tokens", "KV pool tokens by state", ["state"],
                          registry=r)
        self.sessions = Gauge("radixlm_engine_sessions", "Open engine sessions", registry=r)
        self.stored = Gauge("radixlm_http_stored_conversations",
                            "Stored responses and chat sessions held by this frontend",
                            registry=r)
        self.running = Gauge("radixlm_requests_running", "Requests decoding", registry=r)
        self.waiting = Gauge("radixlm_requests_waiting", "Requests waiting to start", registry=r)

    def count_usage(self, usage: Usage, completion_tokens: int) -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.completion_tokens.inc(completion_tokens)

    def render(self, stats: StatsReply | None, stored: int, model_name: str = "") -> bytes:
        if stats is not None:
            self.hit_rate.set(stats.hit_rate)
            for state in ("free", "evictable", "protected", "private"):
                self.pool.labels(state).set(getattr(stats, state))
            self.sessions.set(stats.sessions)
            self.running.set(stats.running)
            self.waiting.set(stats.waiting)
        self.stored.set(stored)
        return generate_latest(self.registry)
