"""A client that disconnects mid-stream aborts its generation: nothing keeps running and
the KV pool accounting holds.

The tiny test model decodes a 230-token reply in tens of milliseconds, faster than a
disconnect may be noticed; so each test runs beside a big "ballast" request (48 branches)
that makes every engine step slower, on a server of its own with room for both."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import assert_pool_clean, start_test_server

pytestmark = pytest.mark.timeout(180)
KEY = "disconnect-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[tuple]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with start_test_server(tmp_path_factory.mktemp("http-disconnect"), tiny_model_dir,
                           "--http", f"127.0.0.1:{port}", "--api-key", KEY,
                           "--kv-tokens", "16384") as handle:
        yield handle, port, tiny_model_dir.name


def _post(port: int, path: str, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    payload = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload)
    return sock


def _metrics(port: int) -> str:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n"
                 "Connection: close\r\n\r\n".encode())
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data.decode()


def _aborted(port: int) -> float:
    match = re.search(r"^radixlm_http_streams_aborted_total (\S+)$", _metrics(port), re.M)
    assert match
    return float(match.group(1))


def _ballast(port: int, model: str) -> tuple[threading.Thread, socket.socket]:
    """The ballast request, read to its end in a thread; its socket, to end it early."""
    sock = _post(port, "/v1/chat/completions", {
        "model": model, "n": 48, "max_tokens": 230, "ignore_eos": True,
        "messages": [{"role": "user", "content": "ballast"}]})

    def run() -> None:
        with contextlib.suppress(OSError), sock:
            while sock.recv(65536):
                pass

    thread = threading.Thread(target=run)
    thread.start()
    return thread, sock


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"n": 4, "max_tokens": 230,
                              "messages": [{"role": "user", "content": "Go"}]}),
    ("/v1/responses", {"input": "Go", "max_output_tokens": 230}),
])
def test_disconnect_mid_stream_aborts(server, path, body) -> None:  # noqa: ANN001
    handle, port, model = server
    before = _aborted(port)
    ballast, ballast_sock = _ballast(port, model)
    time.sleep(0.2)  # let the ballast start decoding
    sock = _post(port, path, {**body, "model": model, "stream": True, "ignore_eos": True,
                              "temperature": 0})
    seen = b""
    while b"data:" not in seen:
        data = sock.recv(65536)
        assert data, "the server closed the stream before its first event"
        seen += data
    assert seen.startswith(b"HTTP/1.1 200"), seen[:200]
    sock.close()
    deadline = time.monotonic() + 20
    while _aborted(port) < before + 1:
        assert time.monotonic() < deadline, "the stream was not aborted"
        time.sleep(0.05)
    # Its work done, the ballast goes too (a disconnect as well: the pool must still be
    # clean after both), rather than decoding its 48 x 230 tokens to the end.
    ballast_sock.shutdown(socket.SHUT_RDWR)
    ballast.join(60)
    with handle.client(timeout_s=60) as raw:
        stats = assert_pool_clean(raw, timeout_s=30)
    assert stats.running == 0 and stats.sessions == 0  # the aborted response stored nothing
