"""`rl.Engine(http=...)` serves the HTTP API beside the SDK; /metrics in Prometheus form."""

from __future__ import annotations

import re
import socket
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


def test_metrics(http_server, api) -> None:  # noqa: ANN001
    _, before = http_server.request("GET", "/metrics")
    messages = [{"role": "user", "content": f"Metrics {uuid.uuid4().hex[:6]}"}]
    r = api.chat.completions.create(model=http_server.model, messages=messages, max_tokens=5,
                                    temperature=0)
    list(api.chat.completions.create(model=http_server.model, messages=messages, max_tokens=5,
                                     temperature=0, stream=True))
    http_server.request("POST", "/v1/chat/completions", b"{")
    status, after = http_server.request("GET", "/metrics")
    assert status == 200
    ok = '{route="chat",status="200"}'
    assert _metric(after, "radixlm_http_requests_total", ok) == _metric(
        before, "radixlm_http_requests_total", ok) + 2 if ok in before else True
    assert _metric(after, "radixlm_http_requests_total", '{route="chat",status="400"}') >= 1
    grown = _metric(after, "radixlm_completion_tokens_total") - _metric(
        before, "radixlm_completion_tokens_total")
    assert grown == 2 * r.usage.completion_tokens
    assert _metric(after, "radixlm_prompt_tokens_total") - _metric(
        before, "radixlm_prompt_tokens_total") == 2 * r.usage.prompt_tokens
    assert _metric(after, "radixlm_time_to_first_token_seconds_count") >= 1
    assert _metric(after, "radixlm_inter_token_latency_seconds_count") >= 1
    pool = {s: _metric(after, "radixlm_kv_pool_tokens", f'{{state="{s}"}}')
            for s in ("free", "evictable", "protected", "private")}
    assert sum(pool.values()) == http_server.server.welcome.kv_capacity
    for name in ("radixlm_cache_hit_rate", "radixlm_engine_sessions", "radixlm_requests_running",
                 "radixlm_requests_waiting", "radixlm_http_stored_conversations"):
        _metric(after, name)


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
