"""A client that disconnects mid-stream aborts its generation: nothing keeps running and
the KV pool accounting holds (checked here and by the ``api`` fixture)."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from conftest import assert_pool_clean

pytestmark = pytest.mark.timeout(120)


def _aborted(http_server) -> float:  # noqa: ANN001
    status, text = http_server.request("GET", "/metrics")
    assert status == 200
    match = re.search(r"^radixlm_http_streams_aborted_total (\S+)$", text, re.M)
    assert match, text
    return float(match.group(1))


def _open_stream(http_server, path: str, body: dict) -> socket.socket:  # noqa: ANN001
    """Send a streaming request on a raw socket and read until its first event."""
    host, port = http_server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    payload = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {http_server.api_key}\r\nContent-Length: {len(payload)}\r\n\r\n"
        .encode() + payload)
    seen = b""
    while b"data:" not in seen:
        data = sock.recv(65536)
        assert data, "the server closed the stream before its first event"
        seen += data
    assert seen.startswith(b"HTTP/1.1 200"), seen[:200]
    return sock


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"n": 8, "max_tokens": 230,
                              "messages": [{"role": "user", "content": "Go"}]}),
    ("/v1/responses", {"input": "Go", "max_output_tokens": 230}),
])
def test_disconnect_mid_stream_aborts(http_server, api, path, body) -> None:  # noqa: ANN001
    before = _aborted(http_server)
    body = {**body, "model": http_server.model, "stream": True, "ignore_eos": True,
            "temperature": 0}
    sock = _open_stream(http_server, path, body)
    sock.close()
    deadline = time.monotonic() + 20
    while _aborted(http_server) < before + 1:
        assert time.monotonic() < deadline, "the stream was not aborted"
        time.sleep(0.05)
    with http_server.server.client(timeout_s=60) as raw:
        stats = assert_pool_clean(raw, timeout_s=10)
    assert stats.running == 0
