"""Prometheus metrics of the HTTP frontend (one registry per app, no global state).

Two sources:
- the engine's own counters, gauges and per-request latency histograms (queue time,
  time to first token, end to end, ...), read from its stats at each scrape: they count
  all traffic, every protocol, streamed or not (a ZeroMQ ``generate`` moves them as an
  HTTP one does);
- what this process sees of its own requests: HTTP status codes, the time between the
  tokens of streams, aborted streams, stored objects.

Names follow vLLM's where it has a counterpart, with the ``radixlm:`` prefix (the
mapping is in docs/http.md), each with a ``model_name`` label.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from radixlm.runtime.protocol import Histogram as WireHistogram
from radixlm.runtime.protocol import StatsReply

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)


class _EngineCollector:
    """The engine's stats (of the last scrape) as Prometheus families."""

    def __init__(self) -> None:
        self.stats: StatsReply | None = None
        self.model = ""

    def describe(self) -> list[object]:
        return []

    def collect(self) -> Iterator[object]:
        s = self.stats
        if s is None:
            return
        label = [self.model]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        yield counter("radixlm:prompt_tokens", "Prompt tokens, session history included "
                      "(engine, every protocol)", s.prompt_tokens_total)
        yield counter("radixlm:generation_tokens", "Generated tokens (engine)",
                      s.generated_tokens_total)
        yield counter("radixlm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache (engine)", s.prompt_tokens_total)
        yield counter("radixlm:prefix_cache_hits", "Prompt tokens served from the prefix "
                      "cache (engine)", s.cached_tokens_total)
        yield counter("radixlm:num_preemptions", "Running requests retracted to the queue "
                      "(their KV kept as cache)", s.retractions)
        yield counter("radixlm:fair_preemptions", "Retractions that gave another client its "
                      "share of running slots", s.fair_preemptions)
        yield gauge("radixlm:num_requests_running", "Requests decoding", s.running)
        yield gauge("radixlm:num_requests_waiting", "Requests waiting to start", s.waiting)
        used = s.capacity - s.free - s.evictable
        yield gauge("radixlm:kv_cache_usage_perc", "KV pool in use, 0-1 (held by running "
                    "requests, sessions and pins; evictable cache counts as free)",
                    used / s.capacity if s.capacity else 0.0)
        yield gauge("radixlm:prefix_cache_hit_rate", "Cached / prompt tokens", s.hit_rate)
        yield gauge("radixlm:engine_sessions", "Open engine sessions", s.sessions)
        pool = GaugeMetricFamily("radixlm:kv_pool_tokens", "KV pool tokens by state",
                                 labels=["model_name", "state"])
        for state in ("free", "evictable", "protected", "private"):
            pool.add_metric([self.model, state], getattr(s, state))
        yield pool
        success = CounterMetricFamily("radixlm:request_success", "Finished generations (each "
                                      "branch) by finish reason (engine, every protocol)",
                                      labels=["model_name", "finished_reason"])
        for reason, n in sorted(s.finish_reasons.items()):
            success.add_metric([self.model, reason], n)
        yield success
        yield from _tool_families(s, self.model)
        for name, h in sorted(s.latency.items()):
            yield _histogram(f"radixlm:{name}_seconds", _LATENCY_DOCS.get(name, name), label, h)


def _tool_families(s: StatsReply, model: str) -> Iterator[object]:
    """Sessions waiting on tools (by tier), tools' round trips, prefetches."""
    waits = GaugeMetricFamily("radixlm:tool_waiting_sessions", "Sessions waiting on tool "
                              "results, by where their history is", labels=["model_name", "tier"])
    for tier in ("device", "host", "disk", "recompute"):
        waits.add_metric([model, tier], s.tool_waits.get(tier, 0))
    yield waits
    trips = GaugeMetricFamily("radixlm:tool_round_trip_seconds", "The engine's estimate of "
                              "each tool's round trip (turn end to result appended)",
                              labels=["model_name", "tool"])
    for tool, t in sorted(s.tool_round_trip_s.items()):
        trips.add_metric([model, tool], t)
    yield trips
    prefetch = CounterMetricFamily("radixlm:tool_prefetches", "Tool-paused histories brought "
                                   "back into the KV pool: started, hinted, hits, misses",
                                   labels=["model_name", "outcome"])
    for outcome in ("started", "hinted", "hits", "misses"):
        prefetch.add_metric([model, outcome], s.prefetch.get(outcome, 0))
    yield prefetch


_LATENCY_DOCS = {
    "request_queue_time": "Requests, from the engine's intake to their first scheduling",
    "time_to_first_token": "Requests, from arrival to their first output token",
    "e2e_request_latency": "Requests, from arrival to their end",
    "request_prefill_time": "Requests, from their first scheduling to their first token",
    "request_decode_time": "Requests, from their first token to their end",
    "request_time_per_output_token": "Requests' decode time over their output tokens after "
                                     "the first",
}


def _histogram(name: str, doc: str, labels: list[str], h: WireHistogram) -> HistogramMetricFamily:
    """An engine histogram (counts per bucket) as Prometheus' cumulative buckets."""
    family = HistogramMetricFamily(name, doc + " (engine, every protocol; seconds)",
                                   labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, n in zip([*map(_le, h.bounds), "+Inf"], h.counts, strict=True):
        cumulative += n
        buckets.append((bound, cumulative))
    family.add_metric(labels, buckets, sum_value=h.sum)
    return family


def _le(bound: float) -> str:
    return repr(float(bound))


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.engine = _EngineCollector()
        r.register(self.engine)  # type: ignore[arg-type]
        self.requests = Counter("radixlm_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.itl = Histogram("radixlm:inter_token_latency_seconds",
                             "Streamed requests: time between streamed tokens (HTTP)",
                             ["model_name"], registry=r, buckets=_LATENCY_BUCKETS)
        self.aborted = Counter("radixlm_http_streams_aborted",
                               "Streams whose client left before the end (aborted in the engine)",
                               registry=r)
        self.stored = Gauge("radixlm_http_stored_objects",
                            "Stored responses, chat sessions and conversations, all tenants",
                            registry=r)

    def render(self, stats: StatsReply | None, stored: int, model_name: str) -> bytes:
        self.engine.stats, self.engine.model = stats, model_name
        self.stored.set(stored)
        return generate_latest(self.registry)
