"""`rl.Engine(http=...)` serves the HTTP API beside the SDK; /metrics in Prometheus form."""

from __future__ import annotations

import re
import socket
import time
import uuid

import pytest

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_with_http(tiny_model_dir) -> None:  # noqa: ANN001
    import openai
    import radixlm as rl

    port = _free_port()
    with rl.Engine(str(tiny_model_dir), device="cpu", dtype="float32", kv_tokens=1024,
                   threads=1, http=f"127.0.0.1:{port}") as engine:
        assert engine.http_url == f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=engine.http_url, api_key="unused", max_retries=0)
        r = client.chat.completions.create(model=tiny_model_dir.name, max_tokens=4,
                                           temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}])
        sdk = engine.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                              temperature=0)
        assert r.choices[0].message.content == sdk.text
        client.close()
    with socket.socket() as s:  # the HTTP process stopped with the engine
        assert s.connect_ex(("127.0.0.1", port)) != 0


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert match, f"{name}{labels} not in:\n{text}"
    return float(match.group(1))


def _buckets(text: str, name: str, model: str) -> list[tuple[float, float]]:
    """A histogram's (le, cumulative count) pairs, in order."""
    pattern = rf'^{re.escape(name)}_bucket{{le="([^"]+)",model_name="{re.escape(model)}"}} (\S+)$'
    return [(float(le), float(n)) for le, n in re.findall(pattern, text, re.M)]


LATENCIES = ("request_queue_time", "time_to_first_token", "e2e_request_latency",
             "request_prefill_time", "request_decode_time", "request_time_per_output_token")


def test_metrics(http_server, api) -> None:  # noqa: ANN001
    model = f'{{model_name="{http_server.model}"}}'
    _, before = http_server.request("GET", "/metrics")
    t0 = time.monotonic()
    messages = [{"role": "user", "content": f"Metrics {uuid.uuid4().hex[:6]}"}]
    # (ignore_eos: each request has more than one output token, or it has no time per
    # output token to observe; the random model may end a reply at once)
    r = api.chat.completions.create(model=http_server.model, messages=messages, max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    list(api.chat.completions.create(model=http_server.model, messages=messages, max_tokens=5,
                                     temperature=0, stream=True, extra_body={"ignore_eos": True}))
    # The counters and latencies are the engine's: ZeroMQ traffic moves them as HTTP does.
    with http_server.server.client(timeout_s=60) as raw:
        zmq_done = raw.generate(f"Over ZeroMQ {uuid.uuid4().hex[:6]}", max_tokens=3,
                                temperature=0, ignore_eos=True)
    window = time.monotonic() - t0
    http_server.request("POST", "/v1/chat/completions", b"{")
    status, after = http_server.request("GET", "/metrics")
    assert status == 200

    def grown(name: str, labels: str = model) -> float:
        return _metric(after, name, labels) - (_metric(before, name, labels)
                                                if name + labels in before else 0.0)

    assert grown("radixlm_http_requests_total", '{route="chat",status="200"}') == 2
    assert grown("radixlm_http_requests_total", '{route="chat",status="400"}') == 1
    assert grown("radixlm:prompt_tokens_total") == 2 * r.usage.prompt_tokens + zmq_done.usage.prompt_tokens
    assert grown("radixlm:generation_tokens_total") == (2 * r.usage.completion_tokens
                                                        + zmq_done.usage.completion_tokens)
    assert grown("radixlm:prefix_cache_hits_total") == (
        r.usage.prompt_tokens_details.cached_tokens + r.usage.prompt_tokens - 1
        + zmq_done.usage.cached_tokens)  # the repeat hits all but its last token
    # Every request, streamed or not, over either protocol, is timed in the engine, inside
    # the window the test's own clock saw.
    for name in LATENCIES:
        metric = f"radixlm:{name}_seconds"
        assert grown(metric + "_count") == 3, name
        assert 0 <= grown(metric + "_sum") <= window, name
        buckets = _buckets(after, metric, http_server.model)
        assert buckets[-1] == (float("inf"), _metric(after, metric + "_count", model))
        assert [le for le, _ in buckets] == sorted(le for le, _ in buckets)
        assert [n for _, n in buckets] == sorted(n for _, n in buckets)  # cumulative
    assert grown("radixlm:time_to_first_token_seconds_sum") <= grown(
        "radixlm:e2e_request_latency_seconds_sum")
    assert grown("radixlm:inter_token_latency_seconds_count") >= 1
    reasons = [r.choices[0].finish_reason] * 2 + [zmq_done.finish_reason]
    for reason in set(reasons):
        assert grown("radixlm:request_success_total", f'{{finished_reason="{reason}",model_name='
                     f'"{http_server.model}"}}') == reasons.count(reason)
    pool = {s: _metric(after, "radixlm:kv_pool_tokens", f'{{model_name="{http_server.model}",state="{s}"}}')
            for s in ("free", "evictable", "protected", "private")}
    assert sum(pool.values()) == http_server.server.welcome.kv_capacity
    usage = _metric(after, "radixlm:kv_cache_usage_perc", model)
    assert usage == pytest.approx((pool["protected"] + pool["private"]) / sum(pool.values()))
    for name in ("radixlm:prefix_cache_hit_rate", "radixlm:engine_sessions",
                 "radixlm:num_requests_running", "radixlm:num_requests_waiting",
                 "radixlm:num_preemptions_total"):
        _metric(after, name, model)
    _metric(after, "radixlm_http_stored_objects")


def test_openai_example_runs(http_server) -> None:  # noqa: ANN001
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "openai_client.py"
    done = subprocess.run(
        [sys.executable, str(example), "--base-url", http_server.base_url, "--api-key",
         http_server.api_key, "--max-tokens", "4", "--turn", "One", "--turn", "Two"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cached = re.findall(r"\[input (\d+) tokens, (\d+) cached\]", done.stdout)
    assert len(cached) == 2 and int(cached[1][1]) > 0, done.stdout
